//! The installer against real files in temp dirs, and real inotify watching.
use std::{
    fs,
    os::unix::fs::{symlink, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    time::Duration,
};

use base64::Engine;
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::{sync::oneshot, task::JoinHandle, time::Instant};

use super::*;

const PLUGIN: &str = "weir-cni";

/// A node's CNI dirs, with a weir-cni binary to install.
struct Node {
    _root: TempDir,
    net: PathBuf,
    bin: PathBuf,
    plugin: PathBuf,
}

impl Node {
    fn new() -> Self {
        let root = TempDir::new().unwrap();
        let net = root.path().join("net.d");
        let bin = root.path().join("bin");
        fs::create_dir(&net).unwrap();
        fs::create_dir(&bin).unwrap();
        let plugin = root.path().join("weir-cni.src");
        fs::write(&plugin, b"#!/bin/sh\necho weir\n").unwrap();
        Self {
            _root: root,
            net,
            bin,
            plugin,
        }
    }

    fn installer(&self) -> Installer {
        Installer::new(InstallConfig {
            cni_bin_dir: self.bin.clone(),
            cni_net_dir: self.net.clone(),
            plugin_binary: self.plugin.clone(),
            plugin_name: PLUGIN.into(),
            plugin_config: plugin_config(),
            service_account: None,
        })
    }

    /// An installer that also writes the plugin's kubeconfig, from a service account whose
    /// token and CA are files under the node's root (as the kubelet mounts them in a pod).
    fn installer_with_service_account(&self) -> Installer {
        let account = self._root.path().join("serviceaccount");
        fs::create_dir_all(&account).unwrap();
        fs::write(account.join("token"), "token-1\n").unwrap();
        fs::write(account.join("ca.crt"), CA_PEM).unwrap();
        Installer::new(InstallConfig {
            service_account: Some(ServiceAccount::for_service("10.96.0.1", "443", &account)),
            ..self.installer().inner.config.clone()
        })
    }

    fn rotate_token(&self, token: &str) {
        fs::write(self._root.path().join("serviceaccount/token"), token).unwrap();
    }

    fn kubeconfig(&self) -> PathBuf {
        self.path("weir-kubeconfig")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.net.join(name)
    }

    fn write(&self, name: &str, config: &Value) -> PathBuf {
        let path = self.path(name);
        fs::write(&path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
        path
    }

    fn read(&self, name: &str) -> Value {
        serde_json::from_slice(&fs::read(self.path(name)).unwrap()).unwrap()
    }

    fn binary(&self) -> PathBuf {
        self.bin.join(PLUGIN)
    }

    fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(&self.net)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }
}

fn plugin_config() -> Value {
    json!({"agent_socket": "/var/run/istio-cni/pluginevent.sock",
           "log_file": "/var/run/weir/cni.log",
           "exclude_namespaces": ["kube-system"]})
}

const CA_PEM: &str =
    "-----BEGIN CERTIFICATE-----\nMIIBdTCCARugAwIBAgIUWeir\n-----END CERTIFICATE-----\n";

fn weir_entry() -> Value {
    json!({"name": PLUGIN, "type": PLUGIN,
           "agent_socket": "/var/run/istio-cni/pluginevent.sock",
           "log_file": "/var/run/weir/cni.log",
           "exclude_namespaces": ["kube-system"],
           "capabilities": {"io.kubernetes.cri.pod-annotations": true}})
}

fn with_weir(mut list: Value) -> Value {
    list["plugins"].as_array_mut().unwrap().push(weir_entry());
    list
}

/// As written by the reference bridge setup (kind-like).
fn bridge_conflist() -> Value {
    json!({"cniVersion": "1.0.0", "name": "bridge-net", "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true,
         "hairpinMode": true, "mtu": 1450,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]],
                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "/run/cni-ipam-state"}},
        {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true}]})
}

fn calico_conflist() -> Value {
    json!({"name": "k8s-pod-network", "cniVersion": "0.3.1", "plugins": [
        {"type": "calico", "log_level": "info", "log_file_path": "/var/log/calico/cni/cni.log",
         "datastore_type": "kubernetes", "nodename": "node-1", "mtu": 0,
         "ipam": {"type": "calico-ipam", "assign_ipv4": "true"}, "policy": {"type": "k8s"},
         "kubernetes": {"kubeconfig": "/etc/cni/net.d/calico-kubeconfig"}},
        {"type": "bandwidth", "capabilities": {"bandwidth": true}},
        {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}]})
}

fn cilium_conflist() -> Value {
    json!({"cniVersion": "0.3.1", "name": "cilium", "plugins": [
        {"type": "cilium-cni", "enable-debug": false,
         "log-file": "/var/run/cilium/cilium-cni.log", "weight": 1.5}]})
}

fn lone_bridge_conf() -> Value {
    json!({"cniVersion": "0.4.0", "name": "mynet", "type": "bridge", "bridge": "cni0",
           "ipam": {"type": "host-local", "subnet": "10.22.0.0/16"}})
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().mode() & 0o7777
}

fn installed(file: PathBuf) -> InstallOutcome {
    InstallOutcome::Installed {
        file,
        config_changed: true,
        binary_changed: true,
        reinstated: false,
    }
}

#[test]
fn inserts_weir_last_keeping_every_other_field_and_the_order() {
    for (name, original) in [
        ("10-bridge.conflist", bridge_conflist()),
        ("10-calico.conflist", calico_conflist()),
        ("05-cilium.conflist", cilium_conflist()),
    ] {
        let node = Node::new();
        let path = node.write(name, &original);
        assert_eq!(node.installer().install().unwrap(), installed(path));
        assert_eq!(node.read(name), with_weir(original), "{name}");
    }
}

#[test]
fn keeps_fields_libcni_gives_meaning_to() {
    let node = Node::new();
    let mut original = bridge_conflist();
    original["disableCheck"] = json!("true");
    original["disableGC"] = json!(true);
    original["cniVersions"] = json!(["0.4.0", "1.0.0"]);
    original["x-vendor"] = json!({"anything": [1, 2.5, null]});
    node.write("10-bridge.conflist", &original);
    node.installer().install().unwrap();
    assert_eq!(node.read("10-bridge.conflist"), with_weir(original));
}

#[test]
fn wraps_a_lone_conf_into_a_conflist() {
    let node = Node::new();
    let conf = lone_bridge_conf();
    node.write("10-bridge.conf", &conf);
    let outcome = node.installer().install().unwrap();
    assert_eq!(outcome, installed(node.path("10-bridge.conflist")));
    assert_eq!(node.entries(), ["10-bridge.conflist"]);
    assert_eq!(
        node.read("10-bridge.conflist"),
        json!({"cniVersion": "0.4.0", "name": "mynet", "plugins": [conf, weir_entry()]})
    );
}

#[test]
fn wraps_a_json_config_into_a_conflist() {
    let node = Node::new();
    node.write(
        "99-loopback.json",
        &json!({"cniVersion": "1.0.0", "type": "loopback"}),
    );
    node.installer().install().unwrap();
    assert_eq!(node.entries(), ["99-loopback.conflist"]);
    assert_eq!(
        node.read("99-loopback.conflist"),
        json!({"cniVersion": "1.0.0", "name": "",
               "plugins": [{"cniVersion": "1.0.0", "type": "loopback"}, weir_entry()]})
    );
}

#[test]
fn install_is_idempotent() {
    let node = Node::new();
    let path = node.write("10-calico.conflist", &calico_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let first = fs::read(&path).unwrap();
    let inode = fs::metadata(&path).unwrap().ino();
    assert_eq!(
        installer.install().unwrap(),
        InstallOutcome::AlreadyInstalled { file: path.clone() }
    );
    assert_eq!(fs::read(&path).unwrap(), first);
    assert_eq!(fs::metadata(&path).unwrap().ino(), inode, "not rewritten");
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn moves_a_misplaced_entry_last_and_updates_a_stale_one() {
    let node = Node::new();
    let mut config = calico_conflist();
    let stale = json!({"type": PLUGIN, "agent_socket": "/old.sock"});
    config["plugins"].as_array_mut().unwrap().insert(1, stale);
    node.write("10-calico.conflist", &config);
    node.installer().install().unwrap();
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn installs_into_the_first_file_in_lexical_order() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let calico_bytes = fs::read(node.path("10-calico.conflist")).unwrap();
    node.write("05-cilium.conflist", &cilium_conflist());
    node.write("README", &json!("not a config"));
    let outcome = node.installer().install().unwrap();
    assert_eq!(outcome.file(), node.path("05-cilium.conflist"));
    assert_eq!(
        node.read("05-cilium.conflist"),
        with_weir(cilium_conflist())
    );
    assert_eq!(
        fs::read(node.path("10-calico.conflist")).unwrap(),
        calico_bytes
    );
}

#[test]
fn leaves_an_invalid_file_alone_and_uses_the_next() {
    let node = Node::new();
    let broken = node.path("00-broken.conflist");
    fs::write(&broken, b"{\"name\": \"half-writ").unwrap();
    let not_a_list = node.write("01-list-in-a.conf", &calico_conflist());
    let before = fs::read(&not_a_list).unwrap();
    node.write("10-bridge.conflist", &bridge_conflist());
    let outcome = node.installer().install().unwrap();
    assert_eq!(outcome.file(), node.path("10-bridge.conflist"));
    assert_eq!(fs::read(&broken).unwrap(), b"{\"name\": \"half-writ");
    assert_eq!(fs::read(&not_a_list).unwrap(), before);
}

#[test]
fn fails_while_there_is_no_config() {
    let node = Node::new();
    fs::write(node.path("00-broken.conflist"), b"garbage").unwrap();
    let installer = node.installer();
    let error = installer.install().unwrap_err();
    assert!(error.is::<NoNetworkConfig>(), "{error:#}");
    assert!(!installer.status().borrow().installed);
    assert_eq!(
        fs::read(node.path("00-broken.conflist")).unwrap(),
        b"garbage"
    );
}

#[test]
fn a_missing_net_dir_means_no_config_yet() {
    let node = Node::new();
    fs::remove_dir(&node.net).unwrap();
    let error = node.installer().install().unwrap_err();
    assert!(error.is::<NoNetworkConfig>(), "{error:#}");
    node.installer().uninstall().unwrap();
}

#[test]
fn keeps_the_file_mode() {
    let node = Node::new();
    let path = node.write("10-bridge.conflist", &bridge_conflist());
    fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
    let conf = node.write("20-lone.conf", &lone_bridge_conf());
    fs::set_permissions(&conf, fs::Permissions::from_mode(0o600)).unwrap();
    node.installer().install().unwrap();
    assert_eq!(mode(&path), 0o640);

    fs::remove_file(&path).unwrap();
    node.installer().install().unwrap();
    assert_eq!(mode(&node.path("20-lone.conflist")), 0o600);
}

#[test]
fn follows_a_symlinked_conflist() {
    let node = Node::new();
    let real_dir = node.net.parent().unwrap().join("real");
    fs::create_dir(&real_dir).unwrap();
    let target = real_dir.join("calico.conflist");
    fs::write(&target, calico_conflist().to_string()).unwrap();
    let link = node.path("10-calico.conflist");
    symlink(&target, &link).unwrap();
    node.installer().install().unwrap();
    assert!(fs::symlink_metadata(&link).unwrap().is_symlink());
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn copies_the_binary_executable_only_when_it_differs() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let binary = node.binary();
    assert_eq!(fs::read(&binary).unwrap(), fs::read(&node.plugin).unwrap());
    assert_eq!(mode(&binary), 0o755);
    let inode = fs::metadata(&binary).unwrap().ino();

    installer.install().unwrap();
    assert_eq!(fs::metadata(&binary).unwrap().ino(), inode);

    fs::write(&node.plugin, b"#!/bin/sh\necho weir v2\n").unwrap();
    let outcome = installer.install().unwrap();
    assert!(matches!(
        outcome,
        InstallOutcome::Installed {
            binary_changed: true,
            config_changed: false,
            ..
        }
    ));
    assert_eq!(fs::read(&binary).unwrap(), b"#!/bin/sh\necho weir v2\n");

    // Compared chunk by chunk: a change of the same length, or past the first chunk, counts.
    let mut large = vec![b'#'; 200 * 1024];
    for version in [b"#!/bin/sh\necho weir v3\n".to_vec(), large.clone(), {
        *large.last_mut().unwrap() = b'\n';
        large
    }] {
        fs::write(&node.plugin, &version).unwrap();
        let outcome = installer.install().unwrap();
        assert!(matches!(
            outcome,
            InstallOutcome::Installed {
                binary_changed: true,
                ..
            }
        ));
        assert_eq!(fs::read(&binary).unwrap(), version);
        let unchanged = installer.install().unwrap();
        assert!(matches!(unchanged, InstallOutcome::AlreadyInstalled { .. }));
    }
}

#[test]
fn uninstall_restores_the_original_config() {
    let node = Node::new();
    let mut original = calico_conflist();
    original["disableCheck"] = json!(true);
    node.write("10-calico.conflist", &original);
    let installer = node.installer();
    installer.install().unwrap();

    installer.uninstall().unwrap();
    assert_eq!(node.read("10-calico.conflist"), original);
    assert!(!node.binary().exists());
    assert!(!installer.status().borrow().installed);

    installer.uninstall().unwrap();
    assert_eq!(node.read("10-calico.conflist"), original);
}

#[test]
fn uninstall_leaves_a_wrapped_conf_as_an_equivalent_conflist() {
    let node = Node::new();
    node.write("10-bridge.conf", &lone_bridge_conf());
    let installer = node.installer();
    installer.install().unwrap();
    installer.uninstall().unwrap();
    assert_eq!(
        node.read("10-bridge.conflist"),
        json!({"cniVersion": "0.4.0", "name": "mynet", "plugins": [lone_bridge_conf()]})
    );
}

#[test]
fn uninstall_cleans_every_file_and_drops_a_list_left_empty() {
    let node = Node::new();
    node.write("05-cilium.conflist", &with_weir(cilium_conflist()));
    node.write(
        "10-only-weir.conflist",
        &json!({"name": "n", "plugins": [weir_entry()]}),
    );
    fs::write(node.path("20-broken.conflist"), b"{").unwrap();
    node.installer().uninstall().unwrap();
    assert_eq!(node.entries(), ["05-cilium.conflist", "20-broken.conflist"]);
    assert_eq!(node.read("05-cilium.conflist"), cilium_conflist());
}

#[test]
fn metrics_use_istio_names() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer();
    let mut registry = Registry::default();
    installer.register_metrics(&mut registry);
    installer.install().unwrap();
    installer.install().unwrap();
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("istio_cni_installs_total{result=\"SUCCESS\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("istio_cni_install_ready 0\n"),
        "not watched: {text}"
    );
    assert!(
        text.contains("weir_cni_config_rewrites_total 0\n"),
        "{text}"
    );
}

/// `installer.watch` running on a task.
struct Watched {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<()>>,
}

impl Watched {
    async fn start(installer: &Installer) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let watcher = installer.clone();
        let task = tokio::spawn(async move {
            watcher
                .watch(async {
                    let _ = stopped.await;
                })
                .await
        });
        let mut status = installer.status();
        tokio::time::timeout(Duration::from_secs(5), status.wait_for(|s| s.watching))
            .await
            .expect("watching within 5 s")
            .unwrap();
        Self { stop, task }
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

/// Polls `condition` until it holds; panics after `within`.
async fn eventually(within: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn holds_weir_last(node: &Node, name: &str) -> bool {
    let Ok(bytes) = fs::read(node.path(name)) else {
        return false;
    };
    let Ok(config) = serde_json::from_slice::<Value>(&bytes) else {
        return false;
    };
    config["plugins"].as_array().and_then(|p| p.last()) == Some(&weir_entry())
}

#[tokio::test]
async fn watch_puts_weir_back_after_a_rewrite() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    // Calico restarting rewrites its config, in place and without weir.
    node.write("10-calico.conflist", &calico_conflist());
    eventually(Duration::from_secs(1), "weir back", || {
        holds_weir_last(&node, "10-calico.conflist")
    })
    .await;
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
    eventually(Duration::from_secs(1), "counted", || {
        installer.status().borrow().reinstalls == 1
    })
    .await;
    assert_eq!(installer.inner.metrics.config_rewrites.get(), 1);
    assert!(installer.status().borrow().ready());
    assert_eq!(installer.inner.metrics.ready.get(), 1);

    watched.stop().await;
    assert!(!installer.status().borrow().watching);
    assert_eq!(installer.inner.metrics.ready.get(), 0);
}

#[tokio::test]
async fn watch_follows_a_new_higher_priority_file() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    // Written as careful CNIs write: a temp file renamed into place.
    node.write("tmp-cilium", &cilium_conflist());
    fs::rename(node.path("tmp-cilium"), node.path("05-cilium.conflist")).unwrap();
    eventually(Duration::from_secs(1), "weir in the new file", || {
        holds_weir_last(&node, "05-cilium.conflist")
    })
    .await;
    // The status is published after the file is written.
    let new_file = Some(node.path("05-cilium.conflist"));
    eventually(
        Duration::from_secs(1),
        "the status names the new file",
        || installer.status().borrow().config_file == new_file,
    )
    .await;
    assert!(installer.status().borrow().installed);
    watched.stop().await;
}

#[tokio::test]
async fn watch_restores_a_deleted_binary() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    fs::remove_file(node.binary()).unwrap();
    eventually(Duration::from_secs(1), "binary back", || {
        fs::read(node.binary()).ok() == fs::read(&node.plugin).ok()
    })
    .await;
    assert_eq!(mode(&node.binary()), 0o755);
    eventually(Duration::from_secs(1), "counted", || {
        installer.status().borrow().reinstalls == 1
    })
    .await;
    assert_eq!(installer.inner.metrics.config_rewrites.get(), 0);
    watched.stop().await;
}

#[tokio::test]
async fn watch_waits_for_the_primary_cni() {
    let node = Node::new();
    let installer = node.installer();
    let watched = Watched::start(&installer).await;
    assert!(!installer.status().borrow().installed);

    node.write("10-bridge.conf", &lone_bridge_conf());
    eventually(Duration::from_secs(2), "installed", || {
        holds_weir_last(&node, "10-bridge.conflist")
    })
    .await;
    eventually(Duration::from_secs(1), "status", || {
        installer.status().borrow().ready()
    })
    .await;
    assert_eq!(node.entries(), ["10-bridge.conflist"]);
    assert_eq!(installer.status().borrow().reinstalls, 0, "a first install");
    watched.stop().await;
}

#[tokio::test]
async fn watch_keeps_up_with_repeated_rewrites() {
    let node = Node::new();
    node.write("05-cilium.conflist", &cilium_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    for round in 1..=4 {
        node.write("05-cilium.conflist", &cilium_conflist());
        eventually(Duration::from_secs(2), "repaired", || {
            installer.status().borrow().reinstalls == round
        })
        .await;
        assert!(holds_weir_last(&node, "05-cilium.conflist"));
    }
    assert_eq!(installer.inner.metrics.config_rewrites.get(), 4);
    watched.stop().await;
}

#[test]
fn writes_the_plugins_kubeconfig_0600_and_names_it_in_the_entry() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    node.installer_with_service_account().install().unwrap();

    let kubeconfig = node.kubeconfig();
    assert_eq!(mode(&kubeconfig), 0o600, "it holds the agent's token");
    let written: Value = serde_json::from_slice(&fs::read(&kubeconfig).unwrap()).unwrap();
    assert_eq!(
        written,
        json!({"apiVersion": "v1", "kind": "Config",
               "clusters": [{"name": "local", "cluster": {
                   "server": "https://10.96.0.1:443",
                   "certificate-authority-data": base64_of(CA_PEM)}}],
               "users": [{"name": "weir-cni", "user": {"token": "token-1"}}],
               "contexts": [{"name": "weir-cni",
                             "context": {"cluster": "local", "user": "weir-cni"}}],
               "current-context": "weir-cni"})
    );
    let mut entry = weir_entry();
    entry["kubeconfig"] = json!(kubeconfig);
    let mut expected = bridge_conflist();
    expected["plugins"].as_array_mut().unwrap().push(entry);
    assert_eq!(node.read("10-bridge.conflist"), expected);
    // Not a network config: libcni never loads it, and weir never takes it for one.
    assert_eq!(
        node.installer_with_service_account().install().unwrap(),
        InstallOutcome::AlreadyInstalled {
            file: node.path("10-bridge.conflist")
        }
    );
}

fn base64_of(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[test]
fn rewrites_the_kubeconfig_when_the_token_rotates() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer_with_service_account();
    installer.install().unwrap();
    let inode = fs::metadata(node.kubeconfig()).unwrap().ino();
    installer.install().unwrap();
    assert_eq!(
        fs::metadata(node.kubeconfig()).unwrap().ino(),
        inode,
        "unchanged: not rewritten"
    );

    node.rotate_token("token-2");
    installer.install().unwrap();
    let written: Value = serde_json::from_slice(&fs::read(node.kubeconfig()).unwrap()).unwrap();
    assert_eq!(written["users"][0]["user"]["token"], "token-2");
    assert_eq!(mode(&node.kubeconfig()), 0o600);

    // Loosened by someone: made 0600 again.
    fs::set_permissions(node.kubeconfig(), fs::Permissions::from_mode(0o644)).unwrap();
    installer.install().unwrap();
    assert_eq!(mode(&node.kubeconfig()), 0o600);
}

#[test]
fn a_missing_token_holds_back_the_kubeconfig_not_the_entry() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer_with_service_account();
    fs::remove_file(node._root.path().join("serviceaccount/token")).unwrap();
    installer.install().unwrap();
    assert!(!node.kubeconfig().exists());
    assert!(holds_weir_last_with_kubeconfig(&node, "10-bridge.conflist"));
}

fn holds_weir_last_with_kubeconfig(node: &Node, name: &str) -> bool {
    let config = node.read(name);
    let last = config["plugins"].as_array().and_then(|p| p.last()).cloned();
    last.is_some_and(|last| {
        last["type"] == PLUGIN && last["kubeconfig"] == json!(node.kubeconfig())
    })
}

#[test]
fn uninstall_removes_the_kubeconfig() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    node.installer_with_service_account().install().unwrap();
    assert!(node.kubeconfig().exists());
    // `weir-agent uninstall` knows no service account, and removes it all the same.
    node.installer().uninstall().unwrap();
    assert!(!node.kubeconfig().exists());
    assert_eq!(node.entries(), ["10-bridge.conflist"]);
    assert_eq!(node.read("10-bridge.conflist"), bridge_conflist());
}

#[tokio::test]
async fn watch_restores_a_deleted_kubeconfig() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer_with_service_account();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    fs::remove_file(node.kubeconfig()).unwrap();
    eventually(Duration::from_secs(2), "kubeconfig back", || {
        node.kubeconfig().exists()
    })
    .await;
    assert_eq!(mode(&node.kubeconfig()), 0o600);
    watched.stop().await;
}
