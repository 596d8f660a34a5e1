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
        // agent/src/cli.rs `DatapathArgs::pin_root`; agent/src/datapath/kernel/mounts.rs
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
    /// `--cgroup` unset: agent/src/datapath/kernel/mounts.rs `cgroup2_root`, the cgroup2 mount point.
    pub const CGROUP: &str = "/sys/fs/cgroup";
    /// agent/src/datapath/owner/recovery.rs `named_namespaces`, and the netns paths the CNI plugin
    /// passes on from containerd (`/var/run/netns/cni-<uuid>`). Created by the
    /// runtime after the agent starts: the mount must let host mounts propagate in.
    pub const NETNS: &str = "/var/run/netns";
    /// agent/src/datapath/owner/recovery.rs `held_namespaces` walks `/proc` for
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

mod flags;
mod node;
mod rbac;
mod round_trip;

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
