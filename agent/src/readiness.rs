//! Whether the agent serves its node, and why not when it does not: what `/readyz` answers, and
//! what the node condition tells the cluster ([`crate::cluster::node_condition`]).
use crate::install::InstallStatus;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// The policy source has not synced, or the first reconcile pass is not done: pods may be
    /// enrolled that should not be, or missing.
    Starting,
    /// weir's plugin is not in the node's CNI config (the primary CNI has written none yet, or
    /// installing failed), or nothing watches that it stays there.
    PluginNotInstalled,
    /// Every pod the runtime starts goes through weir's plugin, and the agent answers it.
    Ready,
}

impl Readiness {
    /// Once started: as the installer's status tells.
    pub fn of(install: &InstallStatus) -> Self {
        if install.ready() {
            Self::Ready
        } else {
            Self::PluginNotInstalled
        }
    }

    pub fn is_ready(self) -> bool {
        self == Self::Ready
    }
}
