//! A pod as the agent knows it: its name, the [`Workload`] the enrollment path hands the datapath
//! and ztunnel (also what the state file remembers of it across agent restarts), its redirection
//! options and its enrollment [`Status`].
use std::{fmt, net::IpAddr, path::PathBuf};

use serde::{Deserialize, Serialize};
use weir_cni::protocol::Attachment;

/// A pod by namespace and name, as the runtime and the API server both name it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
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
    /// Flattened: the state file keeps `namespace` and `name` beside the uid.
    #[serde(flatten)]
    pub pod: PodName,
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
    /// Set for a sidecar pod: its traffic goes to its own istio-proxy, as istio-cni's sidecar
    /// rules send it, and ztunnel never hears of it. `None` for an ambient pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar: Option<SidecarRedirect>,
}

impl Workload {
    /// How the pod is in the mesh, for listings and metrics.
    pub fn mode(&self) -> Mode {
        if self.sidecar.is_some() {
            Mode::Sidecar
        } else {
            Mode::Ambient
        }
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

/// How a pod is in the mesh: through ztunnel, or through its own istio-proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Ambient,
    Sidecar,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Ambient => "ambient",
            Mode::Sidecar => "sidecar",
        }
    }
}

/// `sidecar.istio.io/interceptionMode`: how inbound traffic reaches the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum InterceptionMode {
    Redirect,
    Tproxy,
}

/// A list istio lets be `*`: everything, or only what is listed (possibly nothing).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllOr<T> {
    All,
    Only(Vec<T>),
}

/// A sidecar pod's redirection, istio-cni's `Redirect` (`sidecar_redirect.go`) with every
/// default applied: what its annotations and its istio-proxy container ask for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SidecarRedirect {
    pub mode: InterceptionMode,
    /// The proxy's identity (container `runAsUser`/`runAsGroup`, 0 or unset meaning 1337):
    /// its sockets are never redirected outbound.
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    /// `traffic.sidecar.istio.io/includeOutboundIPRanges` (default `*`; empty: none).
    pub include_outbound_ranges: AllOr<ipnet::IpNet>,
    /// `traffic.sidecar.istio.io/excludeOutboundIPRanges`.
    pub exclude_outbound_ranges: Vec<ipnet::IpNet>,
    /// `traffic.sidecar.istio.io/includeInboundPorts` (default `*`; empty: no inbound capture).
    pub include_inbound_ports: AllOr<u16>,
    /// `traffic.sidecar.istio.io/excludeInboundPorts` with 15020, 15021 and 15090 always added;
    /// only read when every inbound port is included.
    pub exclude_inbound_ports: Vec<u16>,
    /// `traffic.sidecar.istio.io/includeOutboundPorts`: TCP to these goes to the proxy whatever
    /// the IP ranges say (but not to excluded ranges).
    pub include_outbound_ports: Vec<u16>,
    /// `traffic.sidecar.istio.io/excludeOutboundPorts` (default 15020 when absent), TCP and UDP.
    pub exclude_outbound_ports: Vec<u16>,
    /// `traffic.sidecar.istio.io/excludeInterfaces`: neither captured inbound nor outbound.
    pub exclude_interfaces: Vec<String>,
    /// `istio.io/reroute-virtual-interfaces` (or the older `kubevirtInterfaces`): TCP arriving
    /// there goes to the outbound listener.
    pub reroute_interfaces: Vec<String>,
    /// istio-proxy's `ISTIO_META_DNS_CAPTURE`: every port-53 query to the proxy's 15053.
    pub dns_capture: bool,
    /// istio-proxy's `ISTIO_DUAL_STACK`: IPv6 is captured when the pod has an IPv6 address, not
    /// only when its first address is IPv6.
    pub dual_stack: bool,
}

impl SidecarRedirect {
    /// The pod options a sidecar pod is recorded with: DNS capture as its proxy says, and its
    /// rerouted interfaces but `lo` (a rule for TCP "arriving" on `lo` would take all of the
    /// pod's own TCP); the ambient annotations do not apply.
    pub fn options(&self) -> PodOptions {
        PodOptions {
            inbound_bypass: false,
            dns_capture: self.dns_capture,
            reroute_interfaces: self
                .reroute_interfaces
                .iter()
                .filter(|name| *name != "lo")
                .cloned()
                .collect(),
        }
    }
}

impl Default for SidecarRedirect {
    /// A pod as istio's injector writes it with every default: REDIRECT, everything captured
    /// but the proxy's own ports.
    fn default() -> Self {
        Self {
            mode: InterceptionMode::Redirect,
            proxy_uid: 1337,
            proxy_gid: 1337,
            include_outbound_ranges: AllOr::All,
            exclude_outbound_ranges: Vec::new(),
            include_inbound_ports: AllOr::All,
            exclude_inbound_ports: vec![15020, 15021, 15090],
            include_outbound_ports: Vec::new(),
            exclude_outbound_ports: vec![15020],
            exclude_interfaces: Vec::new(),
            reroute_interfaces: Vec::new(),
            dns_capture: false,
            dual_stack: false,
        }
    }
}
