//! weir's container image, run as deploy/weir.yaml's DaemonSet runs it: the archive `cargo xtask
//! image` writes is imported into a containerd of the test's own and run with what the manifest
//! gives the container (image, args, env, privileged, the node's network and PID namespaces, its
//! host paths mounted at the same paths) on a test node. The agent must become ready on the
//! manifest's readiness probe, chain the weir-cni it carries into the node's CNI config, and
//! enroll a pod that the runtime's CNI chain makes, whose traffic then reaches ztunnel.
//!
//! The node's own directories that the manifest mounts (CNI config and plugins, weir's and
//! ztunnel's run directories) are the test node's, under a temporary directory: each is mounted at
//! its own path, as the manifest mounts the host's at the same path, and the agent is pointed at
//! it with the flag that has the host path as its default. The kernel's filesystems (bpffs,
//! cgroup2) and the network namespaces are the machine's; the datapath is pinned under a pin root
//! of the test node's.
//!
//! The weir-cni and kubectl-weir the image carries are also run alone in an empty root, as on a
//! node or a workstation without glibc.
//!
//! Needs root, containerd and runc (Debian's `containerd`, which `cargo xtask test` installs), and
//! the archive: `WEIR_IMAGE_ARCHIVE` (`cargo xtask test` builds it and passes it on), else
//! `image/weir-agent.tar` in cargo's target directory (`cargo xtask image`). Under `CI=true` a
//! missing one fails the test.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::{fs::PermissionsExt, process::CommandExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Deserialize;
use tempfile::TempDir;
use weir_tests::{
    agent::{http_status, NodeFiles},
    chain::{ambient_policy, assert_through_ztunnel, CniChainNode},
    ids,
    zds_client::ZdsZtunnel,
    DatapathNode, NodeOptions,
};
use weir_tests::{skip_or_fail, try_wait_until};

/// Where `cargo xtask test` says the archive is.
const ARCHIVE_ENV: &str = "WEIR_IMAGE_ARCHIVE";
/// The archive in cargo's target directory, where `cargo xtask image` writes it.
const ARCHIVE_IN_TARGET_DIR: &str = "image/weir-agent.tar";

/// The agent's flags whose defaults are host paths that the DaemonSet mounts (agent/src/main.rs):
/// the test points each at the test node's copy of its path.
const HOST_PATH_FLAGS: &[(&str, &str)] = &[
    ("--cni-bin-dir", "/opt/cni/bin"),
    ("--cni-net-dir", "/etc/cni/net.d"),
    ("--cni-socket", "/var/run/weir/cni.sock"),
    ("--verdict-cache", "/var/run/weir/verdicts.json"),
    ("--state-file", "/var/run/weir/pods.json"),
    ("--zds-socket", "/var/run/ztunnel/ztunnel.sock"),
];
/// Host paths the manifest mounts that stay the machine's own: the kernel's filesystems, and the
/// network namespaces, where the test's pods are.
const MACHINE_PATHS: &[&str] = &["/sys/fs/bpf", "/sys/fs/cgroup", "/var/run/netns"];

/// How long the agent may take to become ready: it loads and verifies the programs first.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long containerd may take to serve, and the agent to stop on SIGTERM.
const CONTAINERD_TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn the_image_runs_as_the_daemonset_and_enrolls_a_pod_made_through_the_cni_chain() {
    weir_tests::privileged!();
    let Some(archive) = image_archive() else {
        return;
    };
    if !containerd_installed() {
        return;
    }
    let daemonset = daemonset();
    let pod_spec = daemonset.spec.template.spec.as_ref().unwrap();
    let container = &pod_spec.containers[0];

    let node = TestNodeWithHostPaths::new();
    let containerd = Containerd::start().expect("containerd serves");
    let imported = containerd.import(&archive).expect("the archive imports");
    let image = container
        .image
        .as_deref()
        .expect("the DaemonSet names an image");
    assert!(
        imported.iter().any(|name| name == image),
        "the archive holds {imported:?}, the DaemonSet runs {image}"
    );

    let mut agent = containerd
        .run_agent(&node, &daemonset, pod_spec, container)
        .expect("the agent's container starts");
    let readiness = readiness_probe(container);
    let ready = try_wait_until(READY_TIMEOUT, || {
        agent.assert_running();
        node.chain
            .netns()
            .run(|| http_status(readiness.0, &readiness.1).ok())
            == Some(200)
    });
    assert!(
        ready.is_some(),
        "not ready on {readiness:?} within {READY_TIMEOUT:?}"
    );

    // The plugin it installed is the one the image carries next to the agent, chained after the
    // node's primary CNI.
    let installed = std::fs::read(node.host_path("/opt/cni/bin").join("weir-cni"))
        .expect("weir-cni installed in the node's CNI bin dir");
    assert!(
        installed == agent.file_next_to_agent("weir-cni"),
        "the installed weir-cni is the image's"
    );
    let chain = node.chain.test_node().runtime_network().unwrap();
    assert_eq!(chain.plugins[0]["type"], "bridge", "the primary CNI first");
    assert_eq!(chain.plugins.last().unwrap()["type"], "weir-cni");

    let ztunnel = ZdsZtunnel::connect(node.host_path("/var/run/ztunnel/ztunnel.sock"))
        .expect("ztunnel connects to the agent");
    let (server, echo, client, stand_in) = node.chain.server_and_ambient_pod(&ztunnel, "client");
    assert_through_ztunnel(&client, &stand_in, &server, &echo, "from the image");

    let status = agent.stop().expect("the agent stops on SIGTERM");
    assert!(status.success(), "the agent exited with {status}");
}

/// The DaemonSet of deploy/weir.yaml.
fn daemonset() -> DaemonSet {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/weir.yaml");
    let text = std::fs::read_to_string(&file).unwrap();
    let daemonset = serde_norway::Deserializer::from_str(&text)
        .map(|document| serde_json::Value::deserialize(document).unwrap())
        .find(|object| object["kind"] == "DaemonSet")
        .unwrap_or_else(|| panic!("no DaemonSet in {}", file.display()));
    serde_json::from_value(daemonset).unwrap()
}

/// The runtime runs weir-cni on the node, whatever its libc: the image's copy, alone in an empty
/// root (no loader, no libc, no /proc), answers the runtime's VERSION and turns a malformed ADD
/// into a CNI error, as it does on a glibc node. The image's kubectl-weir, copied out onto any
/// Linux workstation, runs there the same way.
#[test]
fn the_images_static_binaries_run_in_a_root_without_libc() {
    weir_tests::privileged!();
    let Some(archive) = image_archive() else {
        return;
    };
    let root = TempDir::new().unwrap();
    for binary in ["weir-cni", "kubectl-weir"] {
        let path = root.path().join(binary);
        fs::write(&path, native_binary(&archive, binary)).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    }

    let out = chrooted(root.path(), "/kubectl-weir")
        .arg("--version")
        .output()
        .expect("kubectl-weir runs with no libc in its root");
    assert_prints_its_version(&out, "kubectl-weir");

    let (succeeded, version) = run_chrooted(root.path(), "VERSION", br#"{"cniVersion":"1.1.0"}"#);
    assert!(succeeded, "{version}");
    assert_eq!(version["cniVersion"], "1.1.0", "{version}");
    assert!(
        version["supportedVersions"]
            .as_array()
            .is_some_and(|versions| versions.contains(&"0.3.1".into())),
        "{version}"
    );

    let (succeeded, error) = run_chrooted(root.path(), "ADD", b"{\"cniVersion\": ");
    assert!(!succeeded, "{error}");
    assert_eq!(error["code"], 6, "a decoding failure: {error}");
    assert!(
        error["msg"].as_str().is_some_and(|msg| !msg.is_empty()),
        "{error}"
    );
}

/// The files (path → mode and content) of the image's layer for `architecture`, found as a
/// runtime finds them: the OCI layout's index names the image index, which names each platform's
/// manifest.
fn layer_files(archive: &Path, architecture: &str) -> BTreeMap<String, (u32, Vec<u8>)> {
    let blobs = tar_files(File::open(archive).unwrap());
    let blob = |descriptor: &serde_json::Value| -> &[u8] {
        let digest = descriptor["digest"].as_str().unwrap();
        &blobs[&format!("blobs/{}", digest.replacen(':', "/", 1))].1
    };
    let json = |bytes: &[u8]| -> serde_json::Value { serde_json::from_slice(bytes).unwrap() };
    let layout = json(&blobs["index.json"].1);
    let index = json(blob(&layout["manifests"][0]));
    let descriptor = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|descriptor| descriptor["platform"]["architecture"] == architecture)
        .unwrap_or_else(|| panic!("no {architecture} image in the index: {index}"));
    let manifest = json(blob(descriptor));
    tar_files(flate2::read::GzDecoder::new(blob(&manifest["layers"][0])))
}

/// A tar's regular files: path → mode and content.
fn tar_files(tar: impl Read) -> BTreeMap<String, (u32, Vec<u8>)> {
    let mut files = BTreeMap::new();
    for entry in tar::Archive::new(tar).entries().unwrap() {
        let mut entry = entry.unwrap();
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let path = entry.path().unwrap().to_string_lossy().into_owned();
        let mode = entry.header().mode().unwrap();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).unwrap();
        files.insert(path, (mode, bytes));
    }
    files
}

/// This machine's architecture, as OCI names it.
fn native_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "aarch64" => "arm64",
        _ => "amd64",
    }
}

/// The image's binary `name`, for this machine's architecture.
fn native_binary(archive: &Path, name: &str) -> Vec<u8> {
    let mut files = layer_files(archive, native_architecture());
    files
        .remove(&format!("usr/local/bin/{name}"))
        .unwrap_or_else(|| panic!("no {name} in the image"))
        .1
}

/// The image is for arm64 nodes too: its index has an arm64 image whose binaries are arm64's,
/// and they run (under qemu): weir-cni and kubectl-weir alone, and weir-agent with the loader
/// and libraries of its own layer, nothing of this machine's.
#[test]
fn the_images_arm64_binaries_are_arm64s_and_run_with_their_own_layer() {
    let Some(archive) = image_archive() else {
        return;
    };
    const EM_AARCH64: u16 = 183;
    let root = TempDir::new().unwrap();
    for (path, (mode, bytes)) in layer_files(&archive, "arm64") {
        let file = root.path().join(&path);
        fs::create_dir_all(file.parent().unwrap()).unwrap();
        fs::write(&file, &bytes).unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(mode)).unwrap();
        if path.starts_with("usr/local/bin/") {
            let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
            assert_eq!(machine, EM_AARCH64, "{path} is an arm64 ELF");
        }
    }
    let Some(qemu) = qemu_aarch64() else {
        return;
    };
    let bin = root.path().join("usr/local/bin");
    let mut plugin = Command::new(&qemu);
    plugin
        .arg(bin.join("weir-cni"))
        .env_clear()
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut plugin = plugin.spawn().unwrap();
    plugin
        .stdin
        .take()
        .unwrap()
        .write_all(br#"{"cniVersion":"1.1.0"}"#)
        .unwrap();
    let out = plugin.wait_with_output().unwrap();
    assert!(out.status.success());
    let version: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(version["cniVersion"], "1.1.0");

    let out = Command::new(&qemu)
        .arg(bin.join("kubectl-weir"))
        .arg("--version")
        .env_clear()
        .output()
        .unwrap();
    assert_prints_its_version(&out, "kubectl-weir");

    // -L: the loader named in the binary, and the libraries, are looked up under the layer.
    let out = Command::new(&qemu)
        .arg("-L")
        .arg(root.path())
        .arg(bin.join("weir-agent"))
        .arg("--version")
        .output()
        .unwrap();
    assert_prints_its_version(&out, "weir-agent");
}

/// `program --version` succeeded and printed the workspace's version, as clap prints it.
fn assert_prints_its_version(out: &std::process::Output, program: &str) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{program} {}", env!("CARGO_PKG_VERSION"))
    );
}

/// qemu's user-mode emulator for arm64 (Debian's qemu-user-static, which `cargo xtask test`
/// installs); `None` after a skip line when missing, which under CI fails the test instead.
fn qemu_aarch64() -> Option<PathBuf> {
    let qemu = PathBuf::from("/usr/bin/qemu-aarch64-static");
    if qemu.exists() {
        return Some(qemu);
    }
    skip_or_fail("qemu-aarch64-static is needed: apt-get install qemu-user-static");
    None
}

/// `program` (a path under `root`) to be run with `root` as its root and no environment.
fn chrooted(root: &Path, program: &str) -> Command {
    let root = root.to_owned();
    let mut command = Command::new(program);
    command.env_clear();
    // SAFETY: between fork and exec, only async-signal-safe calls (chroot, chdir).
    unsafe {
        command.pre_exec(move || {
            std::os::unix::fs::chroot(&root)?;
            std::env::set_current_dir("/")
        });
    }
    command
}

/// Runs `/weir-cni` with `root` as its root, as the runtime runs a plugin for `command` (on a
/// pod that does not exist); returns whether it succeeded and what it printed.
fn run_chrooted(root: &Path, command: &str, config: &[u8]) -> (bool, serde_json::Value) {
    let mut child = chrooted(root, "/weir-cni");
    child
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", "0123456789abcdef")
        .env("CNI_NETNS", "/var/run/netns/none")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = child
        .spawn()
        .expect("weir-cni runs with no libc in its root");
    child.stdin.take().unwrap().write_all(config).unwrap();
    let out = child.wait_with_output().unwrap();
    let printed = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "weir-cni printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), printed)
}

/// The archive `cargo xtask image` wrote; `None` (after a skip line) when there is none, which
/// under CI fails the test instead.
fn image_archive() -> Option<PathBuf> {
    let archive = match std::env::var_os(ARCHIVE_ENV) {
        Some(path) => PathBuf::from(path),
        // This test executable is target/<profile>/deps/image-<hash>.
        None => std::env::current_exe()
            .unwrap()
            .ancestors()
            .map(|dir| dir.join(ARCHIVE_IN_TARGET_DIR))
            .find(|archive| archive.exists())
            .unwrap_or_else(|| PathBuf::from(ARCHIVE_IN_TARGET_DIR)),
    };
    if archive.exists() {
        return Some(archive);
    }
    skip_or_fail(&format!(
        "no image archive at {}: build it with `cargo xtask image` (`cargo xtask test` does)",
        archive.display()
    ));
    None
}

fn containerd_installed() -> bool {
    let found = ["containerd", "ctr", "runc"].iter().all(|program| {
        Command::new(program)
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    });
    if !found {
        skip_or_fail("containerd, ctr and runc are needed: apt-get install containerd");
    }
    found
}

/// The readiness probe's address on the node (the agent shares the node's network) and path.
fn readiness_probe(container: &Container) -> (SocketAddr, String) {
    let get = container
        .readiness_probe
        .as_ref()
        .and_then(|probe| probe.http_get.as_ref())
        .expect("an HTTP readiness probe");
    let port = match &get.port {
        IntOrString::Int(port) => *port,
        IntOrString::String(name) => {
            container
                .ports
                .iter()
                .flatten()
                .find(|port| port.name.as_deref() == Some(name))
                .unwrap_or_else(|| panic!("no container port named {name}"))
                .container_port
        }
    };
    let addr = SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap()));
    (addr, get.path.clone().unwrap_or_else(|| "/".to_owned()))
}

/// A test node (a [`CniChainNode`], with the ambient policy) whose host directories are under a
/// directory of its own: the runtime reads its CNI config and plugins from there, as the agent
/// writes them there.
struct TestNodeWithHostPaths {
    chain: CniChainNode,
}

impl TestNodeWithHostPaths {
    fn new() -> Self {
        let files = NodeFiles::new().unwrap();
        files.write_policy(&ambient_policy()).unwrap();
        let net_dir = host_path(&files, "/etc/cni/net.d");
        let bin_dir = host_path(&files, "/opt/cni/bin");
        for dir in [&net_dir, &bin_dir] {
            std::fs::create_dir_all(dir).unwrap();
        }
        let node = DatapathNode::with_options(NodeOptions {
            plugin_dirs: vec![bin_dir],
            conflist_dir: Some(net_dir),
            ..NodeOptions::default()
        })
        .expect("the test node");
        Self {
            chain: CniChainNode { files, node },
        }
    }

    /// Where the host's `path` is on this node.
    fn host_path(&self, path: &str) -> PathBuf {
        host_path(&self.chain.files, path)
    }
}

/// The node's host paths live in its run directory, under `host/`.
fn host_path(files: &NodeFiles, path: &str) -> PathBuf {
    files
        .run_dir()
        .join("host")
        .join(path.trim_start_matches('/'))
}

/// A containerd of the test's own: its socket, state and content under a temporary directory, no
/// CRI, its images and containers in a namespace of the test's.
struct Containerd {
    dir: TempDir,
    namespace: String,
    process: Child,
}

impl Containerd {
    fn start() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(&ids::unique_name("containerd"))
            .tempdir()?;
        let path = |name: &str| dir.path().join(name);
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"#,
            root = path("root").display(),
            state = path("state").display(),
            socket = path("containerd.sock").display(),
            opt = path("opt").display(),
        );
        std::fs::write(path("config.toml"), config)?;
        let log = File::create(path("containerd.log"))?;
        let process = Command::new("containerd")
            .arg("--config")
            .arg(path("config.toml"))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let containerd = Self {
            dir,
            namespace: ids::unique_name("image"),
            process,
        };
        let serving = try_wait_until(CONTAINERD_TIMEOUT, || {
            containerd
                .ctr()
                .arg("version")
                .output()
                .is_ok_and(|out| out.status.success())
        });
        if serving.is_none() {
            anyhow::bail!(
                "containerd did not serve within {CONTAINERD_TIMEOUT:?}:\n{}",
                containerd.log()
            );
        }
        Ok(containerd)
    }

    /// `ctr` for this containerd and namespace.
    fn ctr(&self) -> Command {
        let mut ctr = Command::new("ctr");
        ctr.arg("--address")
            .arg(self.dir.path().join("containerd.sock"))
            .arg("--namespace")
            .arg(&self.namespace);
        ctr
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// `ctr images import` (which also unpacks it); returns the names of the images it holds then.
    fn import(&self, archive: &Path) -> anyhow::Result<Vec<String>> {
        run(self.ctr().args(["images", "import"]).arg(archive))?;
        let names = run(self.ctr().args(["images", "list", "--quiet"]))?;
        Ok(names.lines().map(str::to_owned).collect())
    }

    /// The entrypoint in the configuration of `image`, as containerd holds it: `ctr run` takes a
    /// command line whole, where kubelet puts a container's args after the image's entrypoint.
    fn entrypoint(&self, image: &str) -> anyhow::Result<Vec<String>> {
        // REF TYPE DIGEST ...: the digest of its index (or of its one manifest).
        let listed = run(self.ctr().args(["images", "list"]))?;
        let digest = listed
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|columns| columns.first() == Some(&image))
            .and_then(|columns| columns.get(2).map(|digest| digest.to_string()))
            .ok_or_else(|| anyhow::anyhow!("no image {image} in\n{listed}"))?;
        let mut manifest = self.content(&digest)?;
        if let Some(manifests) = manifest["manifests"].as_array() {
            let own = manifests
                .iter()
                .find(|descriptor| descriptor["platform"]["architecture"] == native_architecture())
                .and_then(|descriptor| descriptor["digest"].as_str())
                .ok_or_else(|| anyhow::anyhow!("{image}: no image for this machine"))?;
            manifest = self.content(own)?;
        }
        let config_digest = manifest["config"]["digest"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("{image}: a manifest without a config"))?;
        let config = self.content(config_digest)?;
        Ok(serde_json::from_value(
            config["config"]["Entrypoint"].clone(),
        )?)
    }

    /// A JSON blob of the content store.
    fn content(&self, digest: &str) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::from_str(&run(self
            .ctr()
            .args(["content", "get", digest]))?)?)
    }

    /// The DaemonSet's container on `node`, as kubelet would run it there: its image, args and
    /// env; privileged; the node's network and PID namespaces; each host path volume mounted at
    /// its mount path with the mount's propagation. The agent is pointed at the node's copies of
    /// the host paths, given its policy file (no API server) and a pin root of the node's.
    fn run_agent(
        &self,
        node: &TestNodeWithHostPaths,
        daemonset: &DaemonSet,
        pod: &PodSpec,
        container: &Container,
    ) -> anyhow::Result<AgentContainer<'_>> {
        let id = ids::unique_name("agent");
        let netns = node.chain.netns();
        let mut ctr = self.ctr();
        // No cgroup of its own, so none is left behind: where the agent runs does not matter,
        // it attaches to the root cgroup.
        ctr.args(["run", "--rm", "--cgroup", ""]);
        if container
            .security_context
            .as_ref()
            .and_then(|context| context.privileged)
            == Some(true)
        {
            ctr.arg("--privileged");
        }
        assert_eq!(
            pod.host_network,
            Some(true),
            "the test runs the agent on the node's network"
        );
        ctr.arg("--with-ns")
            .arg(format!("network:{}", netns.path().display()));
        if pod.host_pid == Some(true) {
            // The node's PID namespace is this test's (the machine's init may be out of reach).
            ctr.arg("--with-ns")
                .arg(format!("pid:/proc/{}/ns/pid", std::process::id()));
        }
        for mount in container.volume_mounts.iter().flatten() {
            let volume = pod
                .volumes
                .iter()
                .flatten()
                .find(|volume| volume.name == mount.name)
                .unwrap_or_else(|| panic!("no volume {}", mount.name));
            let host_path = (volume.host_path.as_ref())
                .unwrap_or_else(|| panic!("volume {} is not a host path", volume.name));
            let host = &host_path.path;
            let (source, target) = if MACHINE_PATHS.contains(&host.as_str()) {
                (PathBuf::from(host), PathBuf::from(&mount.mount_path))
            } else {
                // The same path inside and out, as the manifest mounts the host's.
                assert_eq!(
                    host, &mount.mount_path,
                    "{} is mounted at its own path",
                    host
                );
                let on_node = node.host_path(host);
                if host_path.type_.as_deref() == Some("FileOrCreate") {
                    std::fs::create_dir_all(on_node.parent().expect("an absolute path"))?;
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&on_node)?;
                } else {
                    std::fs::create_dir_all(&on_node)?;
                }
                (on_node.clone(), on_node)
            };
            let propagation = match mount.mount_propagation.as_deref() {
                Some("Bidirectional") => "rshared",
                Some("HostToContainer") => "rslave",
                _ => "rprivate",
            };
            ctr.arg("--mount").arg(format!(
                "type=bind,src={},dst={},options=rbind:{propagation}",
                source.display(),
                target.display()
            ));
        }
        let policy = node.chain.files.policy_file();
        ctr.arg("--mount").arg(format!(
            "type=bind,src={0},dst={0},options=rbind:ro",
            policy.display()
        ));
        let daemonset_namespace = daemonset.metadata.namespace.as_deref().unwrap();
        for env in container.env.iter().flatten() {
            let value = match (&env.value, &env.value_from) {
                (Some(value), None) => value.clone(),
                (None, Some(from)) => {
                    let field = &from.field_ref.as_ref().expect("a fieldRef").field_path;
                    match field.as_str() {
                        "spec.nodeName" => netns.name().to_owned(),
                        "metadata.name" => id.clone(),
                        "metadata.namespace" => daemonset_namespace.to_owned(),
                        other => panic!("env {}: the test has no value for {other}", env.name),
                    }
                }
                _ => panic!("env {}: neither a value nor a fieldRef", env.name),
            };
            ctr.arg("--env").arg(format!("{}={value}", env.name));
        }
        let image = container.image.as_deref().unwrap();
        ctr.arg(image).arg(&id);
        assert_eq!(container.command, None, "the image's entrypoint runs");
        ctr.args(self.entrypoint(image)?);
        ctr.args(container.args.iter().flatten());
        let pin_root = node.chain.test_node().datapath_config().pin_root;
        ctr.arg("--pin-root").arg(pin_root);
        ctr.arg("--policy-file").arg(&policy);
        for (flag, default) in HOST_PATH_FLAGS {
            ctr.arg(flag).arg(node.host_path(default));
        }
        let log_path = self.dir.path().join(format!("{id}.log"));
        let log = File::create(&log_path)?;
        let process = ctr
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        Ok(AgentContainer {
            containerd: self,
            id,
            process,
            log_path,
        })
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.process.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.process.wait();
        if std::thread::panicking() {
            eprintln!("containerd's log:\n{}", self.log());
        }
    }
}

/// The agent's container, with `ctr run` attached to it (its output in a log file).
struct AgentContainer<'a> {
    containerd: &'a Containerd,
    id: String,
    process: Child,
    log_path: PathBuf,
}

impl AgentContainer<'_> {
    /// Fails the test, with the agent's output, if the container has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.process.try_wait().unwrap() {
            panic!("the agent's container exited ({status}):\n{}", self.log());
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// The file `name` in the container, in the directory of the agent's executable.
    fn file_next_to_agent(&self, name: &str) -> Vec<u8> {
        // TASK PID STATUS
        let tasks = run(self.containerd.ctr().args(["tasks", "list"])).unwrap();
        let pid = tasks
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|columns| columns.first() == Some(&self.id.as_str()))
            .and_then(|columns| columns.get(1).map(|pid| pid.to_string()))
            .unwrap_or_else(|| panic!("no task {} in\n{tasks}", self.id));
        // The executable's path as the container sees it, under the container's root.
        let proc = Path::new("/proc").join(pid);
        let executable = std::fs::read_link(proc.join("exe")).unwrap();
        let file = executable.with_file_name(name);
        std::fs::read(proc.join("root").join(file.strip_prefix("/").unwrap())).unwrap()
    }

    /// SIGTERM, as kubelet stops it; waits for it to exit (`ctr run --rm` then removes the
    /// container) and returns how it exited.
    fn stop(mut self) -> anyhow::Result<ExitStatus> {
        self.kill("SIGTERM")?;
        self.wait()
    }

    fn kill(&self, signal: &str) -> anyhow::Result<()> {
        run(self
            .containerd
            .ctr()
            .args(["tasks", "kill", "--signal", signal, &self.id]))?;
        Ok(())
    }

    fn wait(&mut self) -> anyhow::Result<ExitStatus> {
        let exited = try_wait_until(CONTAINERD_TIMEOUT, || self.process.try_wait().transpose());
        match exited {
            Some(status) => Ok(status?),
            None => anyhow::bail!(
                "the agent did not exit within {CONTAINERD_TIMEOUT:?}:\n{}",
                self.log()
            ),
        }
    }
}

impl Drop for AgentContainer<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the agent's output:\n{}", self.log());
        }
        if let Ok(None) = self.process.try_wait() {
            let _ = self.kill("SIGKILL");
            if self.wait().is_err() {
                let _ = self.process.kill();
                let _ = self.process.wait();
            }
        }
    }
}

/// Runs `command`; its stdout, or an error with its stderr.
fn run(command: &mut Command) -> anyhow::Result<String> {
    let out = command.stdin(Stdio::null()).output()?;
    if !out.status.success() {
        anyhow::bail!(
            "{command:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
