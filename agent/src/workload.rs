//! A pod as the agent knows it: its name, the [`Workload`] the enrollment path hands the datapath
//! and ztunnel (also what the state file remembers of it across agent restarts), its redirection
//! options and its enrollment [`Status`].
use std::{fmt, net::IpAddr, path::PathBuf};

use serde::{Deserialize, Serialize};
use weir_cni::protocol::Attachment;

/// A pod by namespace and name, as the runtime and the API server both name it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodName {
    pub namespace: String,
    pub name: String,
}

impl PodName {
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }
}

impl fmt::Display for PodName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Where an enrolled pod stands, as istio's `ambient.istio.io/redirection` annotation says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Redirected, waiting for ztunnel's Ack (istio's `ambient.istio.io/redirection=pending`).
    Pending,
    /// Redirected and acked by ztunnel (`enabled`).
    Enabled,
}

impl Status {
    /// The annotation's value, and the metrics' label.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Enabled => "enabled",
        }
    }
}

/// A pod the agent enrolls.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// metadata.uid
    pub uid: String,
    pub name: String,
    pub namespace: String,
    /// `None` where nothing tells it (ztunnel then gets none).
    #[serde(default)]
    pub service_account: Option<String>,
    /// Path of the pod's network namespace (e.g. `/var/run/netns/cni-…`).
    pub netns: PathBuf,
    pub ips: Vec<IpAddr>,
    #[serde(default)]
    pub options: PodOptions,
    /// The runtime's attachment (container id, ifname) when the pod came in through a CNI ADD:
    /// what CNI GC names. `None` for pods enrolled otherwise, and in older state files.
    #[serde(default)]
    pub attachment: Option<Attachment>,
}

impl Workload {
    /// The name its status and warnings are published under.
    pub fn pod_name(&self) -> PodName {
        PodName::new(&self.namespace, &self.name)
    }
}

/// How a pod's traffic is redirected, from its annotations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PodOptions {
    /// `ambient.istio.io/bypass-inbound-capture=true`
    pub inbound_bypass: bool,
    /// DNS to port 53 goes to ztunnel's DNS proxy (the node default is on).
    pub dns_capture: bool,
    /// `istio.io/reroute-virtual-interfaces`: interfaces in the pod (a VM's tap or bridge) whose
    /// incoming TCP goes to ztunnel's outbound listener, as if the pod had sent it. Sorted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reroute_interfaces: Vec<String>,
}

impl Default for PodOptions {
    fn default() -> Self {
        Self {
            inbound_bypass: false,
            dns_capture: true,
            reroute_interfaces: Vec::new(),
        }
    }
}
