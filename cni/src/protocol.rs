//! The plugin ↔ agent protocol: one JSON request line, one JSON response line, over the agent's
//! unix socket (root only). Shared by both sides so the wire format is defined once.
//!
//! Both sides may be of different releases while a node upgrades (the agent installs its own
//! plugin only once it runs), so what a newer side adds, an older one must get by without: new
//! request fields are optional, and a new command is only sent where an agent that does not know
//! it (and answers it with an error) loses nothing. [`Command::Log`] is such a command: an agent
//! that answers it with an error leaves the plugin to write its lines itself, as it always has.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Default path of the agent's socket for plugin events.
pub const DEFAULT_AGENT_SOCKET: &str = "/var/run/weir/cni.sock";
/// Default path of the verdict cache the agent keeps for when it cannot be reached.
pub const DEFAULT_VERDICT_CACHE: &str = "/var/run/weir/verdicts.json";
/// Requests larger than this are refused: a CNI request is a few KiB.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Command {
    Add,
    Del,
    Check,
    /// CNI GC: every pod enrolled through an attachment not in `valid_attachments` goes.
    Gc,
    /// Not a CNI command: the plugin's log lines for a request the agent has answered, for the
    /// agent to log with its own (`plugin_log`). The agent answers `ok`.
    Log,
}

impl Command {
    /// The name on the wire, as `CNI_COMMAND` has it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
            Self::Gc => "GC",
            Self::Log => "LOG",
        }
    }
}

/// The pod as the runtime names it in `CNI_ARGS`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    /// `K8S_POD_UID`; empty when the runtime does not pass it.
    #[serde(default)]
    pub uid: String,
}

/// One address from the primary plugin's result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodIp {
    /// CIDR form, as in the CNI result (`10.244.1.5/24`).
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub command: Command,
    pub container_id: String,
    /// `CNI_NETNS`; empty on the runtime's second DEL (RemovePodSandbox).
    #[serde(default)]
    pub netns: String,
    pub ifname: String,
    pub pod: PodRef,
    /// From `prevResult` (ADD, CHECK); empty when there is none.
    #[serde(default)]
    pub ips: Vec<PodIp>,
    /// Pod annotations, when the runtime passes them (`io.kubernetes.cri.pod-annotations`).
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// GC: the runtime's `cni.dev/valid-attachments` for this network; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub valid_attachments: Vec<Attachment>,
    /// LOG: what the plugin logged while it ran the command; `None` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin_log: Option<PluginLog>,
}

/// The plugin's log lines for one of its runs, sent after the agent answered the run's request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginLog {
    /// The command the plugin ran.
    pub command: Command,
    pub records: Vec<LogRecord>,
}

/// One of the plugin's log lines.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRecord {
    pub level: LogLevel,
    pub msg: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
}

impl LogLevel {
    pub fn label(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
        }
    }
}

/// One attachment of a container to the network, as CNI 1.1's GC names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// The agent's verdict on a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    /// Done: the pod was enrolled (ADD), is not ambient, was removed (DEL) or checks out.
    Ok { enrolled: bool },
    /// Failed, with a CNI error code (spec: 11 = try again later, 999 = plugin-specific).
    Error {
        code: u32,
        msg: String,
        #[serde(default)]
        details: String,
    },
}

/// What the agent last knew of this node's pods, for the plugin to decide alone when neither the
/// agent nor the API server can be asked: only a pod it knows not to be ambient may start.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictCache {
    pub ambient_namespaces: Vec<String>,
    /// `namespace/name` of pods labelled ambient outside ambient namespaces.
    pub ambient_pods: Vec<String>,
    /// `namespace/name` of pods opted out inside ambient namespaces.
    pub opted_out_pods: Vec<String>,
    /// `namespace/name` of the node's other pods, none of them ambient: a pod outside ambient
    /// namespaces that no list names may carry the ambient label itself. A cache without the
    /// field knows none of them, so they wait for the agent rather than start unredirected.
    #[serde(default)]
    pub other_pods: Vec<String>,
}

/// What the verdict cache says of one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachedVerdict {
    Ambient,
    NotAmbient,
    /// The agent did not know the pod when it wrote the cache.
    Unknown,
}

impl VerdictCache {
    pub fn verdict(&self, pod: &PodRef) -> CachedVerdict {
        let key = format!("{}/{}", pod.namespace, pod.name);
        if self.ambient_pods.contains(&key) {
            CachedVerdict::Ambient
        } else if self.opted_out_pods.contains(&key) || self.other_pods.contains(&key) {
            CachedVerdict::NotAmbient
        } else if self.ambient_namespaces.contains(&pod.namespace) {
            // Known or not, a pod there is ambient unless opted out.
            CachedVerdict::Ambient
        } else {
            CachedVerdict::Unknown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_names_are_the_wire_names() {
        for command in [
            Command::Add,
            Command::Del,
            Command::Check,
            Command::Gc,
            Command::Log,
        ] {
            let wire = serde_json::to_string(&command).unwrap();
            assert_eq!(wire, format!("\"{}\"", command.name()));
        }
    }
}
