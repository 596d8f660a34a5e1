//! `weir-agent check`, the preflight: one line per requirement of the node and the cluster, `✓`
//! or `✗` with what to do, exit status 1 when one is unmet; and the agent refusing to start with
//! the failing lines. The binary runs in this machine's network namespace against the API
//! stand-in on loopback; its paths (CNI config, ZDS socket, pins) are private to each test.
//!
//! The tests run the built binary (`cargo build -p weir-agent` first) and need root: the BPF
//! probes load programs, and the refusal tests start the agent.
use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::Duration,
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::Node,
    rbac::v1::{ClusterRole, PolicyRule, Role},
};
use serde::Deserialize;
use serde_json::{json, Value};
use weir_agent::{
    check::{Access, AccessScope, REQUIRED_ACCESS},
    datapath::cgroup2_root,
};
use weir_tests::try_wait_until;
use weir_tests::{
    agent::{workspace_binary, NodeFiles},
    ids, ApiServer,
};

const NODE_NAME: &str = "node-a";

/// A node's files with a primary CNI config, a cluster that knows the node, and a pin root
/// nothing uses, all private to one test.
struct Setup {
    files: NodeFiles,
    api: ApiServer,
    kubeconfig: PathBuf,
    pin_root: PathBuf,
    runtime: tokio::runtime::Runtime,
}

impl Setup {
    fn new() -> Self {
        // As the agent's container is, on a node whose containers get cgroups of their own.
        weir_tests::cgroup::in_a_cgroup_of_its_own().unwrap();
        let files = NodeFiles::new().unwrap();
        std::fs::write(
            files.net_dir().join("10-bridge.conflist"),
            json!({
                "cniVersion": "1.0.0",
                "name": "pods",
                "plugins": [{ "type": "bridge", "bridge": "cni0" }],
            })
            .to_string(),
        )
        .unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let api = runtime.block_on(ApiServer::start()).unwrap();
        api.create(&Node {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(NODE_NAME.into()),
                ..Default::default()
            },
            ..Node::default()
        });
        let kubeconfig = files.kubeconfig(&api).unwrap();
        let pin_root = Path::new("/sys/fs/bpf").join(ids::unique_name("check"));
        Self {
            files,
            api,
            kubeconfig,
            pin_root,
            runtime,
        }
    }

    /// `weir-agent check` with this setup's paths and cluster, and `extra` flags.
    fn check(&self, extra: &[&str]) -> Output {
        self.check_from(Command::new(workspace_binary("weir-agent")), extra)
    }

    /// [`Setup::check`] with the agent in the root of the cgroup v2 hierarchy, as every process
    /// is on a node with the hybrid hierarchy, or whose runtime gives containers no cgroup v2.
    fn check_in_the_cgroup_root(&self) -> Output {
        let procs = cgroup2_root().unwrap().join("cgroup.procs");
        let mut agent = Command::new(workspace_binary("weir-agent"));
        // SAFETY: only a write(2) of a path prepared before the fork.
        unsafe {
            agent.pre_exec(move || std::fs::write(&procs, "0"));
        }
        self.check_from(agent, &[])
    }

    fn check_from(&self, mut agent: Command, extra: &[&str]) -> Output {
        let _serving = self.runtime.enter();
        let output = agent
            .arg("--pin-root")
            .arg(&self.pin_root)
            .arg("check")
            .arg("--cni-net-dir")
            .arg(self.files.net_dir())
            .arg("--zds-socket")
            .arg(self.files.run_dir().join("ztunnel.sock"))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--node-name", NODE_NAME])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .expect("running weir-agent check");
        assert!(
            !self.pin_root.exists(),
            "check makes nothing at the pin root"
        );
        output
    }
}

fn lines(output: &Output) -> Vec<String> {
    String::from_utf8(output.stdout.clone())
        .expect("UTF-8 output")
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The one line about `requirement` (the text before its `: `).
fn line<'a>(lines: &'a [String], requirement: &str) -> &'a str {
    let matching: Vec<&String> = lines
        .iter()
        .filter(|line| line[4..].starts_with(requirement))
        .collect();
    match matching[..] {
        [line] => line,
        _ => panic!(
            "not one line about {requirement:?} in:\n{}",
            lines.join("\n")
        ),
    }
}

#[test]
fn every_requirement_is_met_on_this_machine() {
    weir_tests::privileged!();
    let setup = Setup::new();
    let output = setup.check(&[]);
    let lines = lines(&output);
    let shown = lines.join("\n");
    assert!(output.status.success(), "{:?}:\n{shown}", output.status);
    assert!(
        lines.iter().all(|line| line.starts_with("✓ ")),
        "only ✓ lines:\n{shown}"
    );
    // Each requirement once: the node's, the API server, the Node, every access.
    for requirement in [
        "Linux 5.10 or later: ",
        "bpf() allowed: ",
        "BPF program type cgroup_sock_addr ",
        "BPF program type sock_ops ",
        "BPF program type cgroup_sockopt ",
        "BPF program type sched_cls ",
        "BPF program type sk_lookup ",
        "BPF map type sk_storage ",
        "BPF map type sockhash ",
        "cgroup v2: ",
        "containers have cgroups (v2) of their own: ",
        "bpffs at the pin root ",
        "primary CNI network config: ",
        "directory of the ZDS socket ",
        "no istio-cni node agent leftovers: none",
        "API server reachable: Kubernetes v1.34.0",
        "this node's Node object: node-a is readable",
    ] {
        line(&lines, requirement);
    }
    let config = line(&lines, "primary CNI network config");
    assert!(
        config.ends_with(&format!(
            ": {}",
            setup.files.net_dir().join("10-bridge.conflist").display()
        )),
        "names the file: {config}"
    );
    let access_lines = lines.iter().filter(|line| line.starts_with("✓ RBAC "));
    assert_eq!(access_lines.count(), REQUIRED_ACCESS.len(), "{shown}");
}

#[test]
fn an_empty_cni_config_dir_is_a_failed_line_with_what_to_do() {
    weir_tests::privileged!();
    let setup = Setup::new();
    std::fs::remove_file(setup.files.net_dir().join("10-bridge.conflist")).unwrap();
    let output = setup.check(&[]);
    let lines = lines(&output);
    assert_eq!(output.status.code(), Some(1), "{}", lines.join("\n"));
    assert_eq!(
        line(&lines, "primary CNI network config"),
        format!(
            "✗ primary CNI network config: none in {} — install the cluster's CNI (Calico, \
             Cilium, flannel, ...): it writes one; or give --cni-net-dir (WEIR_CNI_NET_DIR) the \
             directory the runtime reads",
            setup.files.net_dir().display()
        )
    );
    assert_only_failure(&lines, "primary CNI network config");
}

/// What istio-cni's node agent leaves on a node weir took over is listed, for the operator to
/// remove; the agent starts anyway.
#[test]
fn istio_cni_leftovers_are_a_failed_line_with_what_to_do() {
    weir_tests::privileged!();
    let setup = Setup::new();
    let primary = setup.files.net_dir().join("10-bridge.conflist");
    let mut list: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&primary).unwrap()).unwrap();
    list["plugins"]
        .as_array_mut()
        .unwrap()
        .push(weir_tests::istio_cni::plugin_entry());
    std::fs::write(&primary, list.to_string()).unwrap();
    let kubeconfig = setup.files.net_dir().join("ZZZ-istio-cni-kubeconfig");
    std::fs::write(&kubeconfig, "apiVersion: v1\n").unwrap();
    let output = setup.check(&[]);
    let lines = lines(&output);
    assert_eq!(output.status.code(), Some(1), "{}", lines.join("\n"));
    let leftovers = line(&lines, "no istio-cni node agent leftovers");
    assert!(
        leftovers.starts_with(&format!(
            "✗ no istio-cni node agent leftovers: istio-cni's plugin in {}, {} — once istio-cni's \
             node agent is off this node",
            primary.display(),
            kubeconfig.display()
        )),
        "{leftovers}"
    );
    assert_only_failure(&lines, "no istio-cni node agent leftovers");
}

#[test]
fn a_denied_permission_is_a_failed_line_with_what_to_do() {
    weir_tests::privileged!();
    let setup = Setup::new();
    setup.api.deny("patch", "", "pods/status");
    let output = setup.check(&[]);
    let lines = lines(&output);
    assert_eq!(output.status.code(), Some(1), "{}", lines.join("\n"));
    let denied = line(&lines, "RBAC patch pods/status ");
    assert!(
        denied.starts_with("✗ RBAC patch pods/status cluster-wide (")
            && denied.ends_with(
                "): patch denied — grant it to the agent's service account: \
                 deploy/weir.yaml's ClusterRole has every rule weir needs"
            ),
        "{denied}"
    );
    assert_only_failure(&lines, "RBAC patch pods/status ");
}

#[test]
fn an_access_review_the_api_server_does_not_serve_is_one_failed_line_with_what_to_do() {
    weir_tests::privileged!();
    let setup = Setup::new();
    setup.api.serve_no_access_reviews();
    let output = setup.check(&[]);
    let lines = lines(&output);
    assert_eq!(output.status.code(), Some(1), "{}", lines.join("\n"));
    assert_eq!(
        line(&lines, "RBAC of the agent's service account"),
        "✗ RBAC of the agent's service account: not verified, the API server does not serve \
         access reviews (404 NotFound: the server could not find the requested resource) — \
         make sure it has every rule of deploy/weir.yaml's ClusterRole and Role; the agent \
         starts without verifying them"
    );
    assert_only_failure(&lines, "RBAC of the agent's service account");
}

/// ztunnel is known by its cgroup: on a node that gives containers none of their own, check
/// says so (and the agent, which can still serve sidecar pods, only warns at start).
#[test]
fn a_node_without_cgroups_of_their_own_for_containers_is_a_failed_line_with_what_to_do() {
    weir_tests::privileged!();
    let setup = Setup::new();
    let output = setup.check_in_the_cgroup_root();
    let lines = lines(&output);
    assert_eq!(output.status.code(), Some(1), "{}", lines.join("\n"));
    let line = line(&lines, "containers have cgroups (v2) of their own");
    assert!(
        line.contains("is in the root of the cgroup v2 hierarchy")
            && line.ends_with(
                "ztunnel will be refused, and ambient pods wait — boot the node with the \
                 unified cgroup hierarchy (systemd.unified_cgroup_hierarchy=1) and a runtime \
                 that gives each container a cgroup v2 directory"
            ),
        "{line}"
    );
    assert_only_failure(&lines, "containers have cgroups (v2) of their own");
}

/// Every line but the one about `requirement` is met.
fn assert_only_failure(lines: &[String], requirement: &str) {
    let failed: Vec<&String> = lines.iter().filter(|line| line.starts_with("✗ ")).collect();
    assert!(
        failed.len() == 1 && failed[0][4..].starts_with(requirement),
        "only {requirement:?} fails:\n{}",
        lines.join("\n")
    );
}

/// A cgroup directory of its own: were the agent to start anyway, its programs would see only
/// this (empty) cgroup's sockets.
struct TestCgroup(PathBuf);

impl TestCgroup {
    fn new() -> Self {
        let dir = cgroup2_root().unwrap().join(ids::unique_name("check"));
        std::fs::create_dir(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `weir-agent run` as the DaemonSet runs it, with this setup's paths and `extra` flags, on the
/// loopback only and never touching the node's network namespace (no probe source address);
/// its exit status and stderr. Panics if it is still running after a minute: it started.
fn run_agent(setup: &Setup, global: &[&str], extra: &[&str]) -> (Output, String) {
    let _serving = setup.runtime.enter();
    let run = setup.files.run_dir();
    let mut child = Command::new(workspace_binary("weir-agent"))
        .arg("--pin-root")
        .arg(&setup.pin_root)
        .arg("--no-probe-bypass")
        .args(global)
        .arg("run")
        .arg("--cni-net-dir")
        .arg(setup.files.net_dir())
        .arg("--cni-bin-dir")
        .arg(setup.files.bin_dir())
        .arg("--cni-socket")
        .arg(run.join("cni.sock"))
        .arg("--verdict-cache")
        .arg(run.join("verdicts.json"))
        .arg("--state-file")
        .arg(run.join("pods.json"))
        .arg("--zds-socket")
        .arg(run.join("ztunnel.sock"))
        .args([
            "--health-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting weir-agent run");
    let exited = try_wait_until(Duration::from_secs(60), || {
        child.try_wait().unwrap().is_some()
    });
    if exited.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        // Unpinning the links detaches the programs, now that no process holds them.
        let _ = std::fs::remove_dir_all(&setup.pin_root);
        panic!("the agent started");
    }
    let output = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&setup.pin_root);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output, stderr)
}

#[test]
fn the_agent_refuses_to_start_in_a_cgroup_that_is_not_cgroup_v2() {
    weir_tests::privileged!();
    let setup = Setup::new();
    let not_a_cgroup = tempfile::tempdir().unwrap();
    let cgroup = not_a_cgroup.path().to_str().unwrap();
    let (output, stderr) = run_agent(
        &setup,
        &["--cgroup", cgroup],
        &["--policy-file", setup.files.policy_file().to_str().unwrap()],
    );
    assert!(!output.status.success(), "{stderr}");
    let root = cgroup2_root().unwrap();
    let expected = format!(
        "✗ cgroup v2: --cgroup {cgroup} is not a cgroup2 directory — give --cgroup (WEIR_CGROUP) \
         a directory under {}",
        root.display()
    );
    assert!(stderr.contains(&expected), "{expected:?} in:\n{stderr}");
    assert!(!setup.pin_root.exists(), "nothing loaded");
}

#[test]
fn the_agent_refuses_to_start_without_an_access_it_needs() {
    weir_tests::privileged!();
    let setup = Setup::new();
    setup.api.deny("watch", "", "namespaces");
    let cgroup = TestCgroup::new();
    let (output, stderr) = run_agent(
        &setup,
        &["--cgroup", cgroup.0.to_str().unwrap()],
        &[
            "--kubeconfig",
            setup.kubeconfig.to_str().unwrap(),
            "--node-name",
            NODE_NAME,
        ],
    );
    assert!(!output.status.success(), "{stderr}");
    let refusal = stderr
        .split_once("this node lacks what weir needs")
        .map(|(_, refusal)| refusal)
        .unwrap_or_else(|| panic!("a refusal in:\n{stderr}"));
    let failed: Vec<&str> = refusal
        .lines()
        .filter(|line| line.starts_with("✗ "))
        .collect();
    assert!(
        matches!(failed[..], [line] if line.starts_with("✗ RBAC get, list, watch namespaces ")
            && line.contains("): watch denied — grant it")),
        "the denied access alone:\n{stderr}"
    );
}

/// Every row of [`REQUIRED_ACCESS`] is granted by deploy/weir.yaml: the cluster-wide ones by its
/// ClusterRole, the DaemonSet's by its Role in the DaemonSet's namespace, naming the DaemonSet
/// when it names any. An access the agent starts to need fails here until the manifest has it.
#[test]
fn deploy_weir_yaml_grants_every_access_the_agent_checks() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/weir.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let (mut cluster_rules, mut namespace_rules, mut daemonsets) = (vec![], vec![], vec![]);
    let mut roles = vec![];
    for document in serde_norway::Deserializer::from_str(&text) {
        let value = Value::deserialize(document).unwrap();
        match value["kind"].as_str() {
            Some("ClusterRole") => {
                let role: ClusterRole = serde_json::from_value(value).unwrap();
                cluster_rules.extend(role.rules.unwrap_or_default());
            }
            Some("Role") => roles.push(serde_json::from_value::<Role>(value).unwrap()),
            Some("DaemonSet") => {
                daemonsets.push(serde_json::from_value::<DaemonSet>(value).unwrap())
            }
            _ => {}
        }
    }
    let [daemonset] = &daemonsets[..] else {
        panic!("one DaemonSet in {}", path.display())
    };
    let (namespace, name) = (
        daemonset.metadata.namespace.clone().unwrap(),
        daemonset.metadata.name.clone().unwrap(),
    );
    for role in roles {
        if role.metadata.namespace.as_deref() == Some(namespace.as_str()) {
            namespace_rules.extend(role.rules.unwrap_or_default());
        }
    }
    // A rule limited to names grants only those objects: none of a cluster-wide access, and of
    // the DaemonSet's, the DaemonSet.
    let grants = |rules: &[PolicyRule], object: Option<&str>, access: &Access, verb: &str| {
        let has = |list: &Option<Vec<String>>, item: &str| list.iter().flatten().any(|v| v == item);
        rules.iter().any(|rule| {
            let names = rule.resource_names.as_deref().unwrap_or_default();
            has(&rule.api_groups, access.group)
                && has(&rule.resources, access.resource)
                && rule.verbs.iter().any(|granted| granted == verb)
                && (names.is_empty()
                    || object.is_some_and(|object| names.iter().any(|n| n == object)))
        })
    };
    for access in REQUIRED_ACCESS {
        let (rules, object, role) = match access.scope {
            AccessScope::Cluster => (&cluster_rules, None, "the ClusterRole".to_owned()),
            AccessScope::OwnDaemonSet => (
                &namespace_rules,
                Some(name.as_str()),
                format!("a Role in {namespace}"),
            ),
        };
        for verb in access.verbs {
            assert!(
                grants(rules, object, access, verb),
                "{} grants {verb} on {:?} {} ({access:?})",
                role,
                access.group,
                access.resource
            );
        }
    }
}
