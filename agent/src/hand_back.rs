//! Leaving a node to istio-cni's node agent under traffic (`--hand-back-to-istio-cni`): the
//! reverse of a takeover, for an agent that is leaving the node for good (its DaemonSet no longer
//! selects it) while istio-cni's agent starts there. istio-cni's agent, with
//! `reconcileIptablesOnStartup` (istio's default since 1.29), writes istio's in-pod rules into
//! the ambient pods weir enrolled (they carry the same `ambient.istio.io/redirection`
//! annotation) and names them in its snapshot, so ztunnel keeps their proxies. Nothing runs
//! unredirected on the way:
//!
//! - weir's plugin stays in the chain until istio-cni's is there, and then leaves in one write;
//!   meanwhile, with this agent no longer answering, it fails closed for ambient pods, as
//!   istio-cni's own plugin does without its agent;
//! - ztunnel, whose connection closed with this agent's ZDS server, finds istio-cni's agent at
//!   the socket path it binds (this agent no longer binds the path again);
//! - each ambient pod keeps weir's programs until istio's rules redirect it, then they go; its
//!   return path stays, for the connections ztunnel made under weir's path.
//!
//! Once no pod is weir's, the caller removes the datapath. Pods still weir's when the time is up
//! (istio-cni's agent did not come or did not write its rules; a sidecar pod, which istio-cni
//! redirects only when it starts) stay redirected by weir's programs, left pinned.
use std::{path::Path, time::Duration};

use anyhow::Result;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{datapath::Datapath, install::Installer};

/// How often the CNI configuration and the pods are looked at again.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// Hands the node to istio-cni's agent within `within`; returns the pods still weir's then
/// (none: the caller uninstalls the datapath).
pub async fn run(
    installer: &Installer,
    datapath: &Datapath,
    net_dir: &Path,
    within: Duration,
) -> Result<Vec<String>> {
    let deadline = Instant::now() + within;
    info!(
        within = ?within,
        "handing the node to istio-cni's node agent: waiting for its plugin in the CNI config"
    );
    let mut plugin_handed = false;
    loop {
        if !plugin_handed && !crate::install::files::istio_cni_configs(net_dir).is_empty() {
            installer.uninstall()?;
            plugin_handed = true;
            info!("istio-cni's plugin is in the CNI config: weir's left it");
        }
        let mut left = Vec::new();
        for uid in datapath.enrolled().await? {
            if !datapath.hand_back(&uid).await? {
                left.push(uid);
            }
        }
        if plugin_handed && left.is_empty() {
            info!("every pod is istio-cni's");
            return Ok(left);
        }
        if Instant::now() >= deadline {
            if !plugin_handed {
                warn!(
                    "istio-cni's plugin did not come into the CNI config: weir's stays there, \
                     and fails the ambient pods' ADDs until `weir-agent uninstall` removes it"
                );
            }
            if !left.is_empty() {
                warn!(
                    pods = ?left,
                    "these pods were not redirected by istio's in-pod rules in time (a sidecar \
                     pod only is once it starts again): weir's programs stay pinned and redirect \
                     them; `weir-agent uninstall` removes them once they are gone"
                );
            }
            return Ok(left);
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}
