//! deploy/'s manifests against the agent they deploy. Every YAML document in deploy/ must parse
//! into its k8s-openapi type and serialize back to the same document (a misspelt or misplaced
//! field is lost on the way and fails), and the DaemonSet, its ServiceAccount and RBAC must agree
//! with the agent's command line (`weir_agent::cli::Cli`: `weir-agent run`'s flags, their envs
//! and defaults) and with `expected` below. Nothing here needs privileges or a cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::CommandFactory;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Container, HostPathVolumeSource, PodSpec, Probe, ServiceAccount, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use weir_agent::cli::Cli;

/// What the agent expects of its deployment, in one place, each value with where the agent
/// defines it. `expected_values_are_the_agents_flag_defaults_and_envs` checks every flag
/// default and env name here against the agent's command line, so a change in the agent fails
/// that test first; the other tests check the manifests against these values.
mod expected {
    /// `--health-addr` default (agent/src/cli.rs `RunArgs::health_addr`): /healthz and /readyz.
    pub const HEALTH_ADDR: &str = "0.0.0.0:8000";
    /// `--metrics-addr` default (agent/src/cli.rs `RunArgs::metrics_addr`): /metrics.
    pub const METRICS_ADDR: &str = "0.0.0.0:15014";
    /// The routes of agent/src/http.rs `serve` (served on both addresses above).
    pub const LIVENESS_PATH: &str = "/healthz";
    pub const READINESS_PATH: &str = "/readyz";
    pub const METRICS_PATH: &str = "/metrics";

    /// Host paths the agent uses by flag default: (flag, its env, default, the host directory
    /// that must be mounted at the same path). Same path inside and out, because the agent writes
    /// the socket and verdict cache paths into the host's CNI config for the plugin, which runs on
    /// the host. The DaemonSet keeps these defaults (sets none of these envs).
    pub const HOST_PATH_FLAGS: &[(&str, &str, &str, &str)] = &[
        // cni/src/protocol.rs DEFAULT_AGENT_SOCKET, via agent/src/cli.rs `--cni-socket`.
        (
            "--cni-socket",
            "WEIR_CNI_SOCKET",
            "/var/run/weir/cni.sock",
            "/var/run/weir",
        ),
        // cni/src/protocol.rs DEFAULT_VERDICT_CACHE, via `--verdict-cache`.
        (
            "--verdict-cache",
            "WEIR_VERDICT_CACHE",
            "/var/run/weir/verdicts.json",
            "/var/run/weir",
        ),
        // agent/src/cli.rs `--state-file`.
        (
            "--state-file",
            "WEIR_STATE_FILE",
            "/var/run/weir/pods.json",
            "/var/run/weir",
        ),
        // agent/src/cli.rs `--zds-socket` (agent/src/zds/mod.rs DEFAULT_SOCKET_PATH).
        (
            "--zds-socket",
            "WEIR_ZDS_SOCKET",
            "/var/run/ztunnel/ztunnel.sock",
            "/var/run/ztunnel",
        ),
        // agent/src/cli.rs `CniDirs`.
        (
            "--cni-bin-dir",
            "WEIR_CNI_BIN_DIR",
            "/opt/cni/bin",
            "/opt/cni/bin",
        ),
        (
            "--cni-net-dir",
            "WEIR_CNI_NET_DIR",
            "/etc/cni/net.d",
            "/etc/cni/net.d",
        ),
        // agent/src/cli.rs `DatapathArgs::pin_root`; agent/src/datapath/mounts.rs
        // `ensure_bpffs` mounts a bpffs at /sys/fs/bpf when the host has none there.
        (
            "--pin-root",
            "WEIR_PIN_ROOT",
            "/sys/fs/bpf/weir",
            "/sys/fs/bpf",
        ),
    ];
    /// The bpffs directory: its mount must be Bidirectional (`ensure_bpffs` may mount it).
    pub const BPFFS: &str = "/sys/fs/bpf";
    /// `--cgroup` unset: agent/src/datapath/mounts.rs `cgroup2_root`, the cgroup2 mount point.
    pub const CGROUP: &str = "/sys/fs/cgroup";
    /// agent/src/datapath/recovery.rs `named_namespaces`, and the netns paths the CNI plugin
    /// passes on from containerd (`/var/run/netns/cni-<uuid>`). Created by the
    /// runtime after the agent starts: the mount must let host mounts propagate in.
    pub const NETNS: &str = "/var/run/netns";
    /// agent/src/datapath/recovery.rs `process_namespaces` walks `/proc` for
    /// `/proc/<pid>/ns/net`: the pod must share the host's PID namespace.
    pub const PROC: &str = "/proc";

    /// The Downward API envs (flag, env, fieldPath) of the cluster policy source (their flags
    /// are in agent/src/cli.rs).
    pub const DOWNWARD_ENV: &[(&str, &str, &str)] = &[
        ("--node-name", "WEIR_NODE_NAME", "spec.nodeName"),
        ("--pod-name", "WEIR_POD_NAME", "metadata.name"),
        (
            "--pod-namespace",
            "WEIR_POD_NAMESPACE",
            "metadata.namespace",
        ),
    ];
    /// The agent's own DaemonSet, checked on SIGTERM: `--daemonset-name` must be the
    /// DaemonSet's name, `--system-namespace` (agent/src/cli.rs `RunArgs::system_namespace`)
    /// its namespace.
    pub const DAEMONSET_NAME_FLAG: (&str, &str) = ("--daemonset-name", "WEIR_DAEMONSET_NAME");
    pub const SYSTEM_NAMESPACE_FLAG: (&str, &str) = ("--system-namespace", "WEIR_SYSTEM_NAMESPACE");
    pub const DAEMONSET: (&str, &str) = ("istio-system", "weir");
    /// `--repair-broken-pods` (agent/src/cluster/repair.rs `BrokenPodAction`): istio's default,
    /// repair in place only, so the DaemonSet does not set it.
    pub const REPAIR_FLAG: (&str, &str, &str) =
        ("--repair-broken-pods", "WEIR_REPAIR_BROKEN_PODS", "none");
    /// `--log-format` (agent/src/cli.rs `Cli::log_format`), set by the DaemonSet: a cluster's log
    /// pipeline reads one JSON object per line.
    pub const LOG_FORMAT_FLAG: (&str, &str, &str) = ("--log-format", "LOG_FORMAT", "json");

    /// Where a rule is granted: the ClusterRole, or the Role in the DaemonSet's namespace.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
    pub enum Scope {
        Cluster,
        Namespace,
    }
    use Scope::*;

    /// One RBAC rule: verbs on a resource, in a scope, limited to names when `names` is not empty.
    pub struct Rule {
        pub scope: Scope,
        pub group: &'static str,
        pub resource: &'static str,
        pub verbs: &'static [&'static str],
        pub names: &'static [&'static str],
    }

    const fn rule(
        scope: Scope,
        group: &'static str,
        resource: &'static str,
        verbs: &'static [&'static str],
    ) -> Rule {
        Rule {
            scope,
            group,
            resource,
            verbs,
            names: &[],
        }
    }

    /// Every request the agent makes of the API server with its defaults (its cluster policy
    /// source, status patches, events recorder, pod repair and shutdown check). Exactly these:
    /// no more, no less.
    pub const RBAC: &[Rule] = &[
        // Reflector over this node's pods (field selector spec.nodeName).
        rule(Cluster, "", "pods", &["get", "list", "watch"]),
        // ambient.istio.io/redirection, a merge patch on the status subresource; and the label
        // of --repair-broken-pods=label, the same way (`Repair::label`).
        rule(Cluster, "", "pods/status", &["patch"]),
        // Reflector over namespaces (istio.io/dataplane-mode).
        rule(Cluster, "", "namespaces", &["get", "list", "watch"]),
        // On SIGTERM: does the DaemonSet still select this node?
        rule(Cluster, "", "nodes", &["get"]),
        // The node condition weir.dev/RedirectionReady, a strategic merge patch on the status
        // subresource (agent/src/cluster/node_condition.rs).
        rule(Cluster, "", "nodes/status", &["patch"]),
        // kube-rs's events recorder (events.k8s.io/v1: create, patch for a series) ...
        rule(Cluster, "events.k8s.io", "events", &["create", "patch"]),
        // ... and core/v1 events for compatibility (create only).
        rule(Cluster, "", "events", &["create"]),
        // Its own DaemonSet, watched by name (field selector metadata.name=weir).
        Rule {
            names: &[DAEMONSET.1],
            ..rule(Namespace, "apps", "daemonsets", &["get", "list", "watch"])
        },
    ];
}

use expected::Scope;

// ---------------------------------------------------------------------------------------------
// The manifests

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every YAML file in deploy/, sorted.
fn manifest_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/")
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            )
        })
        .collect();
    files.sort();
    files
}

/// Every object in deploy/, typed.
#[derive(Default)]
struct Manifests {
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    daemonsets: Vec<DaemonSet>,
}

/// Parses every document of every manifest file, failing (with its file, index and the JSON paths
/// that differ) on any document that does not survive the trip through its k8s-openapi type.
fn manifests() -> Manifests {
    let mut all = Manifests::default();
    for file in manifest_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (index, document) in serde_norway::Deserializer::from_str(&text).enumerate() {
            let value = Value::deserialize(document)
                .unwrap_or_else(|e| panic!("{}: document {index}: {e}", file.display()));
            if value.is_null() {
                continue; // an empty document (`---` at the end)
            }
            let place = format!("{} document {index}", file.display());
            match value["kind"].as_str() {
                Some("ServiceAccount") => all.service_accounts.push(typed(&place, &value)),
                Some("ClusterRole") => all.cluster_roles.push(typed(&place, &value)),
                Some("ClusterRoleBinding") => all.cluster_role_bindings.push(typed(&place, &value)),
                Some("Role") => all.roles.push(typed(&place, &value)),
                Some("RoleBinding") => all.role_bindings.push(typed(&place, &value)),
                Some("DaemonSet") => all.daemonsets.push(typed(&place, &value)),
                other => panic!("{place}: kind {other:?} is not one this test knows: add it"),
            }
        }
    }
    all
}

/// `value` as `T`, and `T` serialized back must be `value`: k8s-openapi ignores unknown fields,
/// so this is how a typo (or a field at the wrong level) is caught.
fn typed<T: DeserializeOwned + Serialize + k8s_openapi::Resource>(place: &str, value: &Value) -> T {
    assert_eq!(
        value["apiVersion"].as_str(),
        Some(T::API_VERSION),
        "{place}: apiVersion"
    );
    let object: T = serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("{place}: not a valid {}: {e}", T::KIND));
    let back = serde_json::to_value(&object).unwrap();
    let mut differences = Vec::new();
    diff("", value, &back, &mut differences);
    assert!(
        differences.is_empty(),
        "{place} ({}): fields k8s-openapi does not know or reads differently:\n  {}",
        T::KIND,
        differences.join("\n  ")
    );
    object
}

/// The JSON paths where `written` and `read` differ.
fn diff(path: &str, written: &Value, read: &Value, out: &mut Vec<String>) {
    match (written, read) {
        (Value::Object(w), Value::Object(r)) => {
            for (key, wv) in w {
                match r.get(key) {
                    Some(rv) => diff(&format!("{path}.{key}"), wv, rv, out),
                    None => out.push(format!("{path}.{key}: unknown field (dropped)")),
                }
            }
            for key in r.keys().filter(|key| !w.contains_key(*key)) {
                out.push(format!("{path}.{key}: added on the way back"));
            }
        }
        (Value::Array(w), Value::Array(r)) if w.len() == r.len() => {
            for (i, (wv, rv)) in w.iter().zip(r).enumerate() {
                diff(&format!("{path}[{i}]"), wv, rv, out);
            }
        }
        _ if written == read => {}
        _ => out.push(format!("{path}: wrote {written}, read back {read}")),
    }
}

/// The one DaemonSet, its pod spec and its one container.
fn daemonset(all: &Manifests) -> (&DaemonSet, &PodSpec, &Container) {
    assert_eq!(all.daemonsets.len(), 1, "deploy/ has exactly one DaemonSet");
    let ds = &all.daemonsets[0];
    let pod = ds
        .spec
        .template
        .spec
        .as_ref()
        .expect("the DaemonSet has a pod spec");
    assert_eq!(pod.containers.len(), 1, "one container: weir-agent");
    (ds, pod, &pod.containers[0])
}

fn env_value<'a>(
    container: &'a Container,
    name: &str,
) -> Option<&'a k8s_openapi::api::core::v1::EnvVar> {
    container.env.iter().flatten().find(|env| env.name == name)
}

fn port_of(addr: &str) -> i32 {
    addr.rsplit_once(':').unwrap().1.parse().unwrap()
}

// ---------------------------------------------------------------------------------------------
// The agent's command line

/// One flag of `weir-agent run`.
#[derive(Debug, Default)]
struct Flag {
    env: Option<String>,
    default: Option<String>,
    /// The values it accepts, where they are a list.
    values: Vec<String>,
}

/// `weir-agent run`'s flags (by `--long` name, the global ones included, as its `--help` lists
/// them) with their env and default, and the flags it requires: read from the agent's own
/// definition of its command line.
struct AgentFlags {
    flags: BTreeMap<String, Flag>,
    required: Vec<String>,
}

impl AgentFlags {
    fn load() -> Self {
        let mut command = Cli::command();
        // Built, each subcommand holds the global flags too.
        command.build();
        let run = command
            .find_subcommand("run")
            .expect("weir-agent has a run subcommand");
        let mut flags = BTreeMap::new();
        let mut required = Vec::new();
        for arg in run.get_arguments() {
            let Some(long) = arg.get_long() else {
                continue;
            };
            let long = format!("--{long}");
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|value| value.to_string_lossy().into_owned())
                .collect();
            let flag = Flag {
                env: arg.get_env().map(|env| env.to_string_lossy().into_owned()),
                default: (!defaults.is_empty()).then(|| defaults.join(",")),
                values: arg
                    .get_possible_values()
                    .iter()
                    .map(|value| value.get_name().to_owned())
                    .collect(),
            };
            if arg.is_required_set() {
                required.push(long.clone());
            }
            flags.insert(long, flag);
        }
        Self { flags, required }
    }

    /// The env names the agent reads its flags from.
    fn envs(&self) -> BTreeSet<&str> {
        self.flags
            .values()
            .filter_map(|flag| flag.env.as_deref())
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// The tests

#[test]
fn every_manifest_in_deploy_parses_into_kubernetes_types_with_no_unknown_or_lost_field() {
    let files = manifest_files();
    assert_eq!(
        files,
        vec![deploy_dir().join("weir.yaml")],
        "the manifests this test reads"
    );
    let all = manifests();
    assert_eq!(all.service_accounts.len(), 1);
    assert_eq!(all.cluster_roles.len(), 1);
    assert_eq!(all.cluster_role_bindings.len(), 1);
    assert_eq!(all.roles.len(), 1);
    assert_eq!(all.role_bindings.len(), 1);
    assert_eq!(all.daemonsets.len(), 1);
}

/// The check itself: a misspelt field and a field one level off are both reported.
#[test]
fn the_round_trip_reports_a_misspelt_or_misplaced_field() {
    let yaml = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: weir, namespce: x}\n\
                automountServiceAccountToken: true\nlabels: {a: b}\n";
    let value: Value = serde_norway::from_str(yaml).unwrap();
    let result = std::panic::catch_unwind(|| typed::<ServiceAccount>("inline", &value));
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(
        message.contains(".metadata.namespce: unknown field"),
        "{message}"
    );
    assert!(message.contains(".labels: unknown field"), "{message}");
    assert!(
        !message.contains("automountServiceAccountToken"),
        "{message}"
    );
}

#[test]
fn expected_values_are_the_agents_flag_defaults_and_envs() {
    let agent = AgentFlags::load();
    let flag = |long: &str| {
        agent
            .flags
            .get(long)
            .unwrap_or_else(|| panic!("weir-agent run has no {long}"))
    };
    let mut defaults = vec![
        ("--health-addr", expected::HEALTH_ADDR),
        ("--metrics-addr", expected::METRICS_ADDR),
        ("--system-namespace", expected::DAEMONSET.0),
    ];
    defaults.extend(
        expected::HOST_PATH_FLAGS
            .iter()
            .map(|(long, _, default, _)| (*long, *default)),
    );
    for (long, default) in defaults {
        assert_eq!(
            flag(long).default.as_deref(),
            Some(default),
            "{long} default"
        );
    }
    assert_eq!(
        flag("--cgroup").default,
        None,
        "--cgroup has no default: the cgroup2 mount point ({}) is used",
        expected::CGROUP
    );
    for (long, env, _, _) in expected::HOST_PATH_FLAGS {
        assert_eq!(flag(long).env.as_deref(), Some(*env), "{long} env");
    }
    let (long, env) = expected::SYSTEM_NAMESPACE_FLAG;
    assert_eq!(flag(long).env.as_deref(), Some(env), "{long} env");
    let (long, env, default) = expected::REPAIR_FLAG;
    assert_eq!(flag(long).env.as_deref(), Some(env), "{long} env");
    assert_eq!(
        flag(long).default.as_deref(),
        Some(default),
        "{long} default"
    );
}

/// Every env the DaemonSet sets is one the agent reads, for the flag `expected` says.
#[test]
fn every_env_var_the_daemonset_sets_is_a_flag_env_of_the_agent() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let agent = AgentFlags::load();
    let known = agent.envs();
    let unknown: Vec<&str> = container
        .env
        .iter()
        .flatten()
        .map(|env| env.name.as_str())
        .filter(|name| !known.contains(name))
        .collect();
    assert!(
        unknown.is_empty(),
        "the DaemonSet sets envs weir-agent run does not read: {unknown:?} (it reads {known:?})"
    );
    // And each of them belongs to the flag this test expects.
    let mut pairs: Vec<(&str, &str)> = expected::DOWNWARD_ENV
        .iter()
        .map(|(long, env, _)| (*long, *env))
        .collect();
    pairs.push(expected::DAEMONSET_NAME_FLAG);
    pairs.push(expected::SYSTEM_NAMESPACE_FLAG);
    let (long, env, _) = expected::LOG_FORMAT_FLAG;
    pairs.push((long, env));
    for (long, env) in pairs {
        assert_eq!(
            agent.flags.get(long).and_then(|flag| flag.env.as_deref()),
            Some(env),
            "{long}'s env"
        );
    }
}

/// The DaemonSet runs the cluster policy source (no policy file), and sets whatever flag
/// `weir-agent run` requires.
#[test]
fn the_daemonset_sets_every_flag_the_agent_requires() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let agent = AgentFlags::load();
    let args: Vec<&str> = container
        .args
        .iter()
        .flatten()
        .map(String::as_str)
        .collect();
    assert_eq!(args, ["run"], "the container runs `weir-agent run`");
    for long in &agent.required {
        let env = agent.flags[long].env.as_deref();
        let set = env.is_some_and(|env| env_value(container, env).is_some())
            || args.iter().any(|arg| arg.starts_with(long.as_str()));
        assert!(
            set,
            "weir-agent run requires {long} (env {env:?}), which the DaemonSet does not set"
        );
    }
}

#[test]
fn the_daemonset_has_the_agent_log_json() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let (long, env, format) = expected::LOG_FORMAT_FLAG;
    let var = env_value(container, env).unwrap_or_else(|| panic!("{env} is not set"));
    assert_eq!(var.value.as_deref(), Some(format), "{env}");
    let agent = AgentFlags::load();
    let values = &agent.flags[long].values;
    assert!(
        values.iter().any(|value| value == format),
        "{long} takes {format}: it takes {values:?}"
    );
}

#[test]
fn downward_api_env_tells_the_agent_its_node_pod_daemonset_and_namespace() {
    let all = manifests();
    let (ds, _, container) = daemonset(&all);
    for (_, env, field_path) in expected::DOWNWARD_ENV {
        let var = env_value(container, env).unwrap_or_else(|| panic!("{env} is not set"));
        assert_eq!(var.value, None, "{env} comes from the Downward API");
        let field = var
            .value_from
            .as_ref()
            .and_then(|from| from.field_ref.as_ref())
            .unwrap_or_else(|| panic!("{env} has no fieldRef"));
        assert_eq!(field.field_path, *field_path, "{env}");
    }
    let (namespace, name) = expected::DAEMONSET;
    assert_eq!(ds.metadata.namespace.as_deref(), Some(namespace));
    assert_eq!(ds.metadata.name.as_deref(), Some(name));
    for ((_, env), value) in [
        (expected::DAEMONSET_NAME_FLAG, name),
        (expected::SYSTEM_NAMESPACE_FLAG, namespace),
    ] {
        let var = env_value(container, env).unwrap_or_else(|| panic!("{env} is not set"));
        assert_eq!(var.value.as_deref(), Some(value), "{env}");
    }
}

#[test]
fn probes_and_ports_are_the_agents_health_and_metrics_addresses() {
    let all = manifests();
    let (ds, pod, container) = daemonset(&all);
    let ports: BTreeMap<&str, i32> = container
        .ports
        .iter()
        .flatten()
        .map(|port| (port.name.as_deref().unwrap_or(""), port.container_port))
        .collect();
    let health = port_of(expected::HEALTH_ADDR);
    let metrics = port_of(expected::METRICS_ADDR);
    assert_eq!(
        ports,
        BTreeMap::from([("health", health), ("metrics", metrics)])
    );
    assert_eq!(pod.host_network, Some(true), "the ports are the node's");

    let http_get = |probe: &Option<Probe>, which: &str| {
        let action = probe
            .as_ref()
            .and_then(|probe| probe.http_get.as_ref())
            .unwrap_or_else(|| panic!("no {which} httpGet probe"));
        let port = match &action.port {
            IntOrString::Int(port) => *port,
            IntOrString::String(name) => ports[name.as_str()],
        };
        (action.path.clone().unwrap_or_default(), port)
    };
    assert_eq!(
        http_get(&container.liveness_probe, "liveness"),
        (expected::LIVENESS_PATH.to_owned(), health)
    );
    assert_eq!(
        http_get(&container.readiness_probe, "readiness"),
        (expected::READINESS_PATH.to_owned(), health)
    );

    let annotations = ds
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|meta| meta.annotations.clone())
        .unwrap_or_default();
    let annotation = |key: &str| annotations.get(key).map(String::as_str);
    assert_eq!(annotation("prometheus.io/scrape"), Some("true"));
    assert_eq!(
        annotation("prometheus.io/port"),
        Some(metrics.to_string().as_str())
    );
    assert_eq!(
        annotation("prometheus.io/path"),
        Some(expected::METRICS_PATH)
    );
}

/// The probes' paths, asked of the agent's own HTTP server (agent/src/http.rs): /healthz answers
/// at once, /readyz only once the node is installed, /metrics is Prometheus text.
#[tokio::test]
async fn the_probe_paths_answer_on_the_agents_http_server() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let path = |probe: &Option<Probe>| {
        probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|get| get.path.clone())
            .unwrap()
    };
    let (liveness, readiness) = (
        path(&container.liveness_probe),
        path(&container.readiness_probe),
    );

    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (ready_tx, ready) = tokio::sync::watch::channel(false);
    let registry = Arc::new(Mutex::new(prometheus_client::registry::Registry::default()));
    let live = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let liveness_check: weir_agent::http::Liveness = {
        let live = live.clone();
        Arc::new(
            move || match live.load(std::sync::atomic::Ordering::Relaxed) {
                true => Ok(()),
                false => Err("the datapath thread has stopped".into()),
            },
        )
    };
    let server = tokio::spawn(weir_agent::http::serve(
        addr,
        ready,
        liveness_check,
        registry,
    ));

    assert_eq!(get(addr, &liveness).await, 200, "{liveness}");
    live.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        get(addr, &liveness).await,
        503,
        "{liveness} once a part died"
    );
    live.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(addr, &readiness).await, 503, "{readiness} before ready");
    ready_tx.send_replace(true);
    assert_eq!(get(addr, &readiness).await, 200, "{readiness} when ready");
    assert_eq!(get(addr, expected::METRICS_PATH).await, 200);
    assert_eq!(get(addr, "/nothing-here").await, 404);
    server.abort();
}

/// The status code of `GET path` (HTTP/1.1, retried while the server is not yet listening).
async fn get(addr: std::net::SocketAddr, path: &str) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut stream = loop {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("connecting to {addr}: {e}"),
        }
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .expect("response in time")
        .unwrap();
    response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"))
}

#[test]
fn every_host_path_the_agent_uses_is_mounted_from_the_same_host_path() {
    let all = manifests();
    let (_, pod, container) = daemonset(&all);
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    // Each mount names a volume, each volume is mounted.
    let mounted: BTreeSet<&str> = mounts.iter().map(|m| m.name.as_str()).collect();
    let declared: BTreeSet<&str> = volumes.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(mounted, declared, "volumes and volumeMounts");

    // The mount that holds `path` (the deepest one), and its hostPath.
    let mount_of = |path: &str| -> (&VolumeMount, &HostPathVolumeSource) {
        let mount = mounts
            .iter()
            .filter(|m| Path::new(path).starts_with(&m.mount_path))
            .max_by_key(|m| m.mount_path.len())
            .unwrap_or_else(|| panic!("nothing is mounted at {path} or above it"));
        let host = volumes
            .iter()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.host_path.as_ref())
            .unwrap_or_else(|| panic!("{} ({path}) is not a hostPath", mount.name));
        (mount, host)
    };
    let same_path = |path: &str, dir: &str| {
        let (mount, host) = mount_of(path);
        assert_eq!(mount.mount_path, dir, "{path} is under the mount of {dir}");
        assert_eq!(host.path, dir, "{dir} comes from the same host path");
        mount
    };

    for (long, env, default, dir) in expected::HOST_PATH_FLAGS {
        same_path(default, dir);
        assert!(
            env_value(container, env).is_none_or(|var| var.value.as_deref() == Some(*default)),
            "the DaemonSet keeps {long}'s default: {env}, when set, must name it"
        );
    }
    let privileged = container
        .security_context
        .as_ref()
        .and_then(|sc| sc.privileged)
        == Some(true);
    let bpffs = same_path(expected::BPFFS, expected::BPFFS);
    assert_eq!(
        bpffs.mount_propagation.as_deref(),
        Some("Bidirectional"),
        "a bpffs the agent mounts must be the host's"
    );
    assert!(
        privileged,
        "Bidirectional propagation needs a privileged container"
    );
    let netns = same_path(expected::NETNS, expected::NETNS);
    assert!(
        matches!(
            netns.mount_propagation.as_deref(),
            Some("HostToContainer" | "Bidirectional")
        ),
        "netns mounts made after the agent starts must reach it"
    );
    same_path(expected::CGROUP, expected::CGROUP);
    assert!(
        !mounts.iter().any(|m| m.mount_path == expected::PROC),
        "the runtime refuses a mount over /proc"
    );
    assert_eq!(
        pod.host_pid,
        Some(true),
        "{}/<pid>/ns/net of the node's processes needs the host PID namespace",
        expected::PROC
    );
}

#[test]
fn the_daemonsets_service_account_exists_and_is_bound_to_every_role() {
    let all = manifests();
    let (ds, pod, _) = daemonset(&all);
    let namespace = ds.metadata.namespace.as_deref().unwrap();
    let account = pod
        .service_account_name
        .as_deref()
        .expect("the DaemonSet names its ServiceAccount");
    assert!(
        all.service_accounts.iter().any(|sa| {
            sa.metadata.name.as_deref() == Some(account)
                && sa.metadata.namespace.as_deref() == Some(namespace)
        }),
        "ServiceAccount {namespace}/{account} is in deploy/"
    );
    let is_account = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == account
                && s.namespace.as_deref() == Some(namespace)
        })
    };
    for role in &all.cluster_roles {
        let name = role.metadata.name.as_deref().unwrap();
        assert!(
            all.cluster_role_bindings.iter().any(|b| {
                b.role_ref.kind == "ClusterRole"
                    && b.role_ref.name == name
                    && b.role_ref.api_group.as_deref() == Some("rbac.authorization.k8s.io")
                    && is_account(&b.subjects)
            }),
            "ClusterRole {name} is bound to {namespace}/{account} by a ClusterRoleBinding"
        );
    }
    for role in &all.roles {
        let name = role.metadata.name.as_deref().unwrap();
        assert_eq!(
            role.metadata.namespace.as_deref(),
            Some(namespace),
            "Role {name}"
        );
        assert!(
            all.role_bindings.iter().any(|b| {
                b.metadata.namespace.as_deref() == Some(namespace)
                    && b.role_ref.kind == "Role"
                    && b.role_ref.name == name
                    && b.role_ref.api_group.as_deref() == Some("rbac.authorization.k8s.io")
                    && is_account(&b.subjects)
            }),
            "Role {name} is bound to {namespace}/{account} by a RoleBinding in {namespace}"
        );
    }
    // And every binding binds a role that is here.
    for binding in &all.cluster_role_bindings {
        assert!(all
            .cluster_roles
            .iter()
            .any(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str())));
    }
    for binding in &all.role_bindings {
        assert!(all
            .roles
            .iter()
            .any(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str())));
    }
}

/// One verb on one resource: (scope, apiGroup, resource, verb, resourceNames).
type Grant = (Scope, String, String, String, Vec<String>);

fn grants(scope: Scope, rules: &[PolicyRule]) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for rule in rules {
        assert!(
            rule.non_resource_urls.is_none(),
            "no nonResourceURLs: {rule:?}"
        );
        let mut names = rule.resource_names.clone().unwrap_or_default();
        names.sort();
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    let grant = (
                        scope,
                        group.clone(),
                        resource.clone(),
                        verb.clone(),
                        names.clone(),
                    );
                    assert!(out.insert(grant.clone()), "granted twice: {grant:?}");
                }
            }
        }
    }
    out
}

#[test]
fn rbac_rules_are_exactly_the_requests_the_agent_makes() {
    let all = manifests();
    let (ds, _, container) = daemonset(&all);
    let mut granted = BTreeSet::new();
    for role in &all.cluster_roles {
        granted.extend(grants(
            Scope::Cluster,
            role.rules.as_deref().unwrap_or_default(),
        ));
    }
    for role in &all.roles {
        granted.extend(grants(
            Scope::Namespace,
            role.rules.as_deref().unwrap_or_default(),
        ));
    }
    let mut wanted = BTreeSet::new();
    for rule in expected::RBAC {
        for verb in rule.verbs {
            wanted.insert((
                rule.scope,
                rule.group.to_owned(),
                rule.resource.to_owned(),
                verb.to_string(),
                rule.names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            ));
        }
    }
    let extra: Vec<_> = granted.difference(&wanted).collect();
    let missing: Vec<_> = wanted.difference(&granted).collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "RBAC differs from what the agent uses:\n  granted, not used: {extra:?}\n  used, not granted: {missing:?}"
    );
    for grant in &granted {
        assert!(
            !grant.1.contains('*') && !grant.2.contains('*') && !grant.3.contains('*'),
            "no wildcards: {grant:?}"
        );
    }
    // The Role's resourceNames is the DaemonSet the agent is told to watch.
    let name = ds.metadata.name.clone().unwrap();
    let (_, env) = expected::DAEMONSET_NAME_FLAG;
    assert_eq!(
        env_value(container, env).and_then(|v| v.value.clone()),
        Some(name.clone())
    );
    for grant in granted.iter().filter(|g| g.2 == "daemonsets") {
        assert_eq!(
            grant.4,
            std::slice::from_ref(&name),
            "{grant:?} names the DaemonSet"
        );
    }
}

/// `delete` on pods, for `--repair-broken-pods=delete` alone (`Repair::delete` in
/// agent/src/cluster/repair.rs), comes from its own manifest, bound to the agent's account.
#[test]
fn pod_deletion_is_granted_only_by_the_repair_delete_manifest() {
    let text = std::fs::read_to_string(deploy_dir().join("repair-delete/rbac.yaml")).unwrap();
    let (mut roles, mut bindings) = (Vec::new(), Vec::new());
    for document in serde_norway::Deserializer::from_str(&text) {
        let value = Value::deserialize(document).unwrap();
        match value["kind"].as_str() {
            Some("ClusterRole") => roles.push(typed::<ClusterRole>("repair-delete", &value)),
            Some("ClusterRoleBinding") => {
                bindings.push(typed::<ClusterRoleBinding>("repair-delete", &value))
            }
            other => panic!("unexpected {other:?} in repair-delete/rbac.yaml"),
        }
    }
    let [role] = &roles[..] else {
        panic!("one ClusterRole")
    };
    let granted = grants(Scope::Cluster, role.rules.as_deref().unwrap_or_default());
    let delete = (
        Scope::Cluster,
        String::new(),
        "pods".to_owned(),
        "delete".to_owned(),
        vec![],
    );
    assert_eq!(granted, BTreeSet::from([delete]));
    let [binding] = &bindings[..] else {
        panic!("one ClusterRoleBinding")
    };
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    let all = manifests();
    let account = &all.service_accounts[0].metadata;
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    assert!(subjects
        .iter()
        .any(|subject| subject.kind == "ServiceAccount"
            && Some(&subject.name) == account.name.as_ref()
            && subject.namespace == account.namespace));
}

/// istiod removes a node's `cni.istio.io/not-ready` taint when a pod labelled
/// `k8s-app=istio-cni-node` in its own namespace is ready there: weir's pods carry the label, in
/// istiod's namespace, and are ready only when the agent's `/readyz` says it serves the node.
#[test]
fn istiod_lifts_the_not_ready_taint_once_weir_is_ready_on_the_node() {
    let all = manifests();
    let (ds, _pod, container) = daemonset(&all);
    assert_eq!(ds.metadata.namespace.as_deref(), Some("istio-system"));
    let labels = ds
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|meta| meta.labels.clone())
        .unwrap_or_default();
    assert_eq!(
        labels.get("k8s-app").map(String::as_str),
        Some("istio-cni-node")
    );
    let readiness = container
        .readiness_probe
        .as_ref()
        .and_then(|probe| probe.http_get.as_ref())
        .expect("a readiness probe over HTTP");
    assert_eq!(readiness.path.as_deref(), Some("/readyz"));
}

#[test]
fn the_daemonset_runs_on_every_node_before_other_pods_and_upgrades_one_node_at_a_time() {
    let all = manifests();
    let (ds, pod, container) = daemonset(&all);
    let spec = &ds.spec;
    let selector = spec.selector.match_labels.clone().unwrap_or_default();
    let labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|meta| meta.labels.clone())
        .unwrap_or_default();
    assert!(!selector.is_empty());
    for (key, value) in &selector {
        assert_eq!(
            labels.get(key),
            Some(value),
            "template carries selector {key}"
        );
    }

    let tolerations = pod.tolerations.as_deref().unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "tolerates every taint: {tolerations:?}"
    );
    assert_eq!(
        pod.node_selector,
        Some([("kubernetes.io/os".to_owned(), "linux".to_owned())].into()),
        "every Linux node, and only those"
    );
    assert_eq!(pod.affinity, None, "no node is left out");
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert!(pod.termination_grace_period_seconds.is_some_and(|s| s > 0));

    let strategy = spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().unwrap();
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(1)));
    assert_eq!(rolling.max_surge, None, "one agent per node at a time");

    // The image `cargo xtask image` builds, and its entrypoint.
    let image = concat!("localhost/weir-agent:", env!("CARGO_PKG_VERSION"));
    assert_eq!(container.image.as_deref(), Some(image));
    assert_eq!(container.command, None, "the image's ENTRYPOINT runs");
    let resources = container.resources.as_ref().unwrap();
    let requests = resources.requests.clone().unwrap_or_default();
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"));
    let limits = resources.limits.clone().unwrap_or_default();
    assert!(limits.contains_key("memory"), "a memory limit");
    assert!(
        !limits.contains_key("cpu"),
        "no CPU limit: pod starts come in bursts"
    );
}
