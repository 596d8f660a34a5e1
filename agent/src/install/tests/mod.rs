//! The installer against real files in temp dirs, and real inotify watching: the fixtures here,
//! the tests by topic.
mod conflist;
mod kubeconfig;
mod owned;
mod standalone;
mod watch;

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
            placement: CniPlacement::default(),
            service_account: None,
        })
    }

    /// An installer that chains weir in its own file, `02-weir-cni.conflist`.
    fn owning_installer(&self) -> Installer {
        self.placed_installer(Placement::Owned)
    }

    /// An installer that writes weir-cni as a standalone network, `YYY-istio-cni.conf`.
    fn standalone_installer(&self) -> Installer {
        self.placed_installer(Placement::Standalone)
    }

    fn placed_installer(&self, placement: Placement) -> Installer {
        let config = self.installer().inner.config.clone();
        Installer::new(InstallConfig {
            placement: CniPlacement {
                placement,
                ..config.placement.clone()
            },
            ..config
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
        entry_restored: true,
        reinstated: false,
    }
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
