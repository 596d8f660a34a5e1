//! What the agent is told to do: `weir-agent run` fills it from flags and environment, the
//! checks read it, and `app::run` runs it.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use crate::{
    cluster::ClusterConfig,
    datapath::DatapathConfig,
    install::{CniPlacement, ServiceAccount},
    policy::PolicyConfig,
};

/// Everything the agent is told; `weir-agent run` fills it from flags and environment.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub datapath: DatapathConfig,
    pub policy: PolicyConfig,
    pub source: SourceConfig,
    pub cni_socket: PathBuf,
    pub verdict_cache: PathBuf,
    /// Enrolled pods' names and netns paths, for the next agent after a restart.
    pub state_file: PathBuf,
    /// Where `weir-agent trace` reads decisions.
    pub trace_socket: PathBuf,
    pub zds_socket: PathBuf,
    pub cni_bin_dir: PathBuf,
    pub cni_net_dir: PathBuf,
    /// Where weir-cni goes in the node's CNI configuration.
    pub cni_placement: CniPlacement,
    pub cni_plugin: PathBuf,
    pub cni_plugin_log: Option<PathBuf>,
    /// What the plugin reads the API server with while the agent is away (its kubeconfig);
    /// `None` writes none, and the plugin falls back to the verdict cache alone.
    pub service_account: Option<ServiceAccount>,
    pub health_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// Where `/logging` is served: loopback.
    pub admin_addr: SocketAddr,
    pub uninstall_on_exit: bool,
    /// When weir leaves the node: how long to wait for istio-cni's node agent to take its pods
    /// ([`crate::hand_back`]); `None` unenrolls them at once.
    pub hand_back_to_istio_cni: Option<Duration>,
    /// How often enrolled pods whose DEL never came are looked for.
    pub orphan_sweep_interval: Duration,
}

/// Where ambient policy comes from.
#[derive(Clone, Debug)]
pub enum SourceConfig {
    /// A local policy file: a node without an API server.
    File(PathBuf),
    Cluster(ClusterConfig),
}
