//! What a pod's netns holds of weir besides the map entries: the reply path and weir's tc
//! programs, put in place and taken out through the rtnetlink socket made in the pod.
use anyhow::{Context, Result};
use aya::Ebpf;
use tracing::debug;

use super::{
    handoff::Handoff,
    netlink::{self, PodSetup, Rtnl},
    netns::ReplyMarkSysctls,
    programs,
};

/// Per-pod setup of a pod whose map entries are in place already (a recovered pod): the reply
/// path, and this agent's programs in place of the previous ones, on the interfaces the pod's
/// routing rules say are rerouted. The calling thread is in the pod's netns.
pub(super) fn prepare_pod_netns(
    rtnl: &mut Rtnl,
    sysctls: &mut ReplyMarkSysctls,
    ebpf: &Ebpf,
    handoff: Option<(&Handoff, u64)>,
    interfaces: &[(u32, String)],
) -> Result<()> {
    let rerouted = netlink::reroute_rules().context("reading the rerouted interfaces")?;
    // Its IPs are not known here: both families.
    sysctls.set(true, true).context("reply-mark sysctls")?;
    // What was put in its netns before the restart is still there (the passthrough address).
    let setup = PodNetnsSetup {
        interfaces,
        rerouted: &rerouted,
        passthrough_v6: false,
    };
    set_up_pod_netns(rtnl, ebpf, handoff, &setup, |_| {})
}

/// What a pod's netns is set up with.
pub(super) struct PodNetnsSetup<'a> {
    /// The pod's interfaces but loopback.
    pub(super) interfaces: &'a [(u32, String)],
    /// Those whose incoming TCP goes to the outbound listener.
    pub(super) rerouted: &'a [String],
    /// `::6` on `lo`, the IPv6 passthrough source of a sidecar pod whose IPv6 is captured.
    pub(super) passthrough_v6: bool,
}

/// The return path, the socket lookup hand-off where the kernel needs it (before the tc program
/// can hand anything to it), then the tc programs and the rerouting rules (see
/// [`Rtnl::set_up_return_path`] and [`Rtnl::attach_programs`]); `step_done` is told after each,
/// as `routing` and `tc`.
pub(super) fn set_up_pod_netns(
    rtnl: &mut Rtnl,
    ebpf: &Ebpf,
    handoff: Option<(&Handoff, u64)>,
    pod: &PodNetnsSetup,
    mut step_done: impl FnMut(&'static str),
) -> Result<()> {
    let PodNetnsSetup {
        interfaces,
        rerouted,
        passthrough_v6,
    } = *pod;
    rtnl.set_up_return_path(passthrough_v6)
        .context("return path")?;
    step_done("routing");
    if let Some((handoff, netns_cookie)) = handoff {
        handoff.attach(ebpf, netns_cookie)?;
    }
    let setup = PodSetup {
        interfaces,
        rerouted,
        inbound: programs::tc_program(ebpf, weir_common::programs::INBOUND)?,
        reroute: programs::tc_program(ebpf, weir_common::programs::REROUTE)?,
    };
    rtnl.attach_programs(&setup)
        .context("tc programs and rerouting rules")?;
    step_done("tc");
    Ok(())
}

/// Best effort: called on rollback and unenroll, where the pod may be half set up or gone.
pub(super) fn undo_pod_netns(rtnl: &mut Rtnl) {
    let undone = rtnl
        .non_loopback_interfaces()
        .and_then(|interfaces| rtnl.tear_down_pod(&interfaces));
    if let Err(error) = undone {
        debug!(%error, "removing the pod's tc programs and routing");
    }
}
