//! What weir needs of the node and the cluster, checked one requirement at a time:
//! `weir-agent check` prints a line for each (`✓ <requirement>: <what was found>`, or
//! `✗ <requirement>: <what was found> — <what to do>`), and the agent runs the same checks at
//! start, so that a node without what weir needs is told so in its terms, not by a verifier log or
//! an errno from deep in the datapath.
//!
//! The node: the kernel release (the floor in `datapath::kernel::support`), every BPF program and
//! map type weir's object uses, probed by loading a trivial one (and whether bpf() is allowed at
//! all), the cgroup v2 hierarchy the socket programs attach to, whether containers get cgroups of
//! their own in it (ztunnel's sockets are known by its cgroup), bpffs at the pin root, the primary
//! CNI network config weir chains into, and the directory of ztunnel's socket. The cluster, when
//! the agent follows one: the API server answers, the Node is readable, and every access in
//! [`REQUIRED_ACCESS`] is granted, each asked with a SelfSubjectAccessReview.
//!
//! At start ([`before_start`]) an unmet requirement that only the operator can meet stops the
//! agent, with its line, before anything is loaded. Two can be met later with no change by the
//! operator, and the agent goes on with a warning: an API server it
//! cannot reach yet (its watches retry until it answers), and no primary CNI config yet (the
//! installer waits for the primary CNI to write one). Without cgroups of their own for
//! containers only ambient pods cannot work (ztunnel is refused), so the agent warns and goes on
//! for sidecar pods. A denied access refuses: it stays denied
//! until someone grants it, and an agent without it would half work. An access that cannot be
//! reviewed (the API server answers the review 404, 405 or 501: it does not serve them) is no
//! denial: the agent warns that its access is not verified and goes on.
//!
//! The node's checks are in [`node`], the cluster's in [`cluster`].
mod cluster;
mod node;

use std::{fmt, path::PathBuf};

use anyhow::{bail, Result};
use tracing::warn;

use crate::{
    cluster::ClusterConfig,
    config::{AgentConfig, SourceConfig},
    install::CniPlacement,
    policy::OwnPods,
};
pub use cluster::{Access, AccessScope, REQUIRED_ACCESS};

/// One requirement and what was found of it.
#[derive(Clone, Debug)]
pub struct Finding {
    pub requirement: String,
    pub found: String,
    /// What to do about it; `None` when the requirement is met.
    pub remedy: Option<String>,
    /// Not known to be met, yet no reason to refuse the start: met later with no change by the
    /// operator (the agent starts and waits), or not verifiable (the agent starts and warns).
    pub starts_anyway: bool,
}

impl Finding {
    fn met(requirement: impl Into<String>, found: impl Into<String>) -> Self {
        Self {
            requirement: requirement.into(),
            found: found.into(),
            remedy: None,
            starts_anyway: false,
        }
    }

    fn unmet(
        requirement: impl Into<String>,
        found: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Self {
        Self {
            remedy: Some(remedy.into()),
            ..Self::met(requirement, found)
        }
    }

    /// Unmet now, but met later with no change by the operator.
    fn pending(
        requirement: impl Into<String>,
        found: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Self {
        Self {
            starts_anyway: true,
            ..Self::unmet(requirement, found, remedy)
        }
    }

    /// Unmet, but only a part of weir needs it (that part refuses, with its own error, while
    /// the rest works): the agent starts and warns.
    fn partly_unmet(
        requirement: impl Into<String>,
        found: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Self {
        Self::pending(requirement, found, remedy)
    }

    /// Not known either way: what would tell cannot be asked. The agent starts, as for a
    /// pending requirement.
    fn unverified(
        requirement: impl Into<String>,
        found: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Self {
        Self::pending(requirement, found, remedy)
    }

    pub fn is_met(&self) -> bool {
        self.remedy.is_none()
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.remedy {
            None => write!(f, "✓ {}: {}", self.requirement, self.found),
            Some(remedy) => write!(f, "✗ {}: {} — {remedy}", self.requirement, self.found),
        }
    }
}

/// What is checked: the paths and the cluster the agent is given.
#[derive(Clone, Debug)]
pub struct CheckConfig {
    pub pin_root: PathBuf,
    /// `--cgroup`; `None`: the cgroup2 mount's root.
    pub cgroup: Option<PathBuf>,
    pub cni_net_dir: PathBuf,
    /// Where weir-cni goes there: a standalone network needs no primary config beside it.
    pub cni_placement: CniPlacement,
    pub zds_socket: PathBuf,
    /// The cluster the agent follows, and its own DaemonSet there; `None`: a node without an API
    /// server (a policy file), whose checks are the node's alone.
    pub cluster: Option<(ClusterConfig, OwnPods)>,
}

impl CheckConfig {
    /// What the agent configured by `config` needs.
    pub fn of(config: &AgentConfig) -> Self {
        Self {
            pin_root: config.datapath.pin_root.clone(),
            cgroup: config.datapath.cgroup.clone(),
            cni_net_dir: config.cni_net_dir.clone(),
            cni_placement: config.cni_placement.clone(),
            zds_socket: config.zds_socket.clone(),
            cluster: match &config.source {
                SourceConfig::Cluster(cluster) => {
                    Some((cluster.clone(), config.policy.own.clone()))
                }
                SourceConfig::File(_) => None,
            },
        }
    }
}

/// At start: stops with the lines of every unmet requirement the operator has to meet, and warns
/// about those that can be met later (see the module's comment).
pub async fn before_start(config: &CheckConfig) -> Result<()> {
    let mut refused = Vec::new();
    for finding in all(config).await.iter().filter(|finding| !finding.is_met()) {
        if finding.starts_anyway {
            warn!("{finding}");
        } else {
            refused.push(finding.to_string());
        }
    }
    if !refused.is_empty() {
        bail!(
            "this node lacks what weir needs (`weir-agent check` lists every requirement):\n{}",
            refused.join("\n")
        );
    }
    Ok(())
}

/// `weir-agent check`: prints every finding; fails when one is unmet.
pub async fn print(config: &CheckConfig) -> Result<()> {
    let findings = all(config).await;
    for finding in &findings {
        println!("{finding}");
    }
    let unmet = findings.iter().filter(|finding| !finding.is_met()).count();
    if unmet > 0 {
        bail!("{unmet} requirement(s) not met");
    }
    Ok(())
}

/// Every finding: the node's, then the cluster's.
pub async fn all(config: &CheckConfig) -> Vec<Finding> {
    let mut findings = node::findings(config);
    if let Some((cluster, own)) = &config.cluster {
        findings.extend(cluster::findings(cluster, own).await);
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_says_what_was_found_and_what_to_do() {
        assert_eq!(
            Finding::met("cgroup v2", "mounted at /sys/fs/cgroup").to_string(),
            "✓ cgroup v2: mounted at /sys/fs/cgroup"
        );
        assert_eq!(
            Finding::unmet("cgroup v2", "no cgroup2 mount", "boot with it").to_string(),
            "✗ cgroup v2: no cgroup2 mount — boot with it"
        );
    }
}
