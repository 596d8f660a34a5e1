//! What a pod's netns holds of weir besides the map entries: the reply path and weir's tc
//! programs, put in place and taken out through the rtnetlink socket made in the pod.
use anyhow::{anyhow, Context, Result};
use aya::{programs::SchedClassifier, Ebpf};
use ipnet::IpNet;
use tracing::{debug, warn};

use weir_common::{PodConfig, POD_SIDECAR_IPV6};

use crate::datapath::kernel::{
    handoff::Handoff,
    netlink::{self, Link, PodSetup, Reroute, ReturnPath, Rtnl, WeirFilter},
    netns::ReplyMarkSysctls,
    programs,
};
use crate::workload::{AllOr, InterceptionMode, Workload};

/// Per-pod setup of a pod whose map entries are in place already (a recovered pod): the reply
/// path, and this agent's programs in place of the previous ones, rerouting as `record` (what
/// the pod was enrolled with, and its entry) says, else as the pod's routing rules say. The
/// calling thread is in the pod's netns.
pub(in crate::datapath) fn prepare_pod_netns(
    rtnl: &mut Rtnl,
    sysctls: &mut ReplyMarkSysctls,
    ebpf: &mut Ebpf,
    handoff: Option<(&Handoff, u64)>,
    (interfaces, slot): (&[Link], u32),
    record: Option<(&Workload, &PodConfig)>,
) -> Result<()> {
    let (names, ranges): (Vec<String>, Vec<IpNet>);
    let rerouted = match record {
        Some((workload, config)) => reroute(workload, config),
        None => {
            // Kept as they are: every rerouted interface has the same destinations.
            let rules = netlink::reroute_rules().context("reading the rerouted interfaces")?;
            let (mut unique_names, mut unique_ranges): (Vec<String>, Vec<IpNet>) =
                rules.into_iter().unzip();
            unique_names.dedup();
            unique_ranges.sort();
            unique_ranges.dedup();
            (names, ranges) = (unique_names, unique_ranges);
            Reroute {
                interfaces: &names,
                ranges: Some(&ranges),
                ipv6: true,
                translated: false,
            }
        }
    };
    // Its IPs are not known here: both families.
    sysctls.set(true, true).context("reply-mark sysctls")?;
    // What was put in its netns before the restart is still there (the passthrough address).
    let setup = PodNetnsSetup {
        interfaces,
        rerouted,
        passthrough_v6: false,
        slot,
    };
    setup.load_programs(ebpf)?;
    set_up_pod_netns(rtnl, ebpf, handoff, &setup, |_| {})
}

/// What a pod's netns is set up with.
pub(in crate::datapath) struct PodNetnsSetup<'a> {
    /// The pod's interfaces but loopback.
    pub(super) interfaces: &'a [Link],
    /// Those whose incoming TCP goes to the outbound listener, and for which destinations.
    pub(super) rerouted: Reroute<'a>,
    /// `::6` on `lo`, the IPv6 passthrough source of a sidecar pod whose IPv6 is captured.
    pub(super) passthrough_v6: bool,
    /// The pod's slot (see [`super::slots`]).
    pub(super) slot: u32,
}

impl PodNetnsSetup<'_> {
    /// Loads the tc programs the pod's interfaces get, those not loaded yet (see
    /// [`programs::load_tc_programs`]): before [`set_up_pod_netns`] or an audit of the pod.
    pub(in crate::datapath) fn load_programs(&self, ebpf: &mut Ebpf) -> Result<()> {
        programs::load_tc_programs(ebpf, &self.rerouted.programs(self.interfaces))
    }
}

/// The return path, the socket lookup hand-off where the kernel needs it (before the tc program
/// can hand anything to it), then the tc programs and the rerouting rules (see
/// [`Rtnl::set_up_return_path`] and [`Rtnl::attach_programs`]); `step_done` is told after each,
/// as `routing` and `tc`. The pod's programs are loaded ([`PodNetnsSetup::load_programs`]).
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
        slot,
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
        programs: &programs::loaded_tc_programs(ebpf),
        slot,
    };
    rtnl.attach_programs(&setup)
        .context("tc programs and rerouting rules")?;
    step_done("tc");
    Ok(())
}

/// The ids of weir's loaded tc programs, one of which the slot of weir's filter should hold.
pub(in crate::datapath) struct TcProgramIds(Vec<(&'static str, u32)>);

impl TcProgramIds {
    pub(in crate::datapath) fn of(ebpf: &Ebpf) -> Result<Self> {
        let mut ids = Vec::new();
        for name in weir_common::programs::TC {
            let program: &SchedClassifier = ebpf
                .program(name)
                .ok_or_else(|| anyhow!("program {name} missing"))?
                .try_into()?;
            if program.fd().is_ok() {
                ids.push((name, program.info()?.id()));
            }
        }
        Ok(Self(ids))
    }

    /// The id of program `name`, if loaded.
    fn of_program(&self, name: &str) -> Option<u32> {
        (self.0.iter()).find_map(|(loaded, id)| (*loaded == name).then_some(*id))
    }
}

/// How a pod's netns differs from its setup.
#[derive(Debug)]
pub(in crate::datapath) enum Drift {
    /// weir's filter is not on the interface, or its slot holds another program: attached
    /// again.
    FilterMissing(String),
    /// Another filter runs before weir's on the interface, or holds its priority so that it
    /// cannot be attached again: reported only (see [`restore_pod_netns`]).
    FilterPreceded(String),
    /// A rule or route of the return path is missing: added again.
    ReturnPathMissing(String),
}

/// Compares a pod's netns with its setup, `pod`, and sets it up again, as it was enrolled, when
/// any of it is missing; returns what differed. The calling thread is in the pod's netns.
/// `families`: the IPv4 and IPv6 return paths are looked for where the pod has addresses of the
/// family, since ztunnel dials a pod at its IPs (and an IPv6 return path is absent where IPv6 is
/// off). Interfaces the pod no longer has are left to the interface watch, which enrolls the pod
/// again.
///
/// A filter that runs before weir's is not removed, nor is weir's put ahead of it again. weir's
/// is at priority 1, the first there is, so what runs before it is a filter added at that
/// priority after it (the kernel puts a new cls_bpf filter at the head; classic BPF needs no more
/// than CAP_NET_ADMIN). A pod's own filters may be what its workload needs, and a hostile one
/// cannot be told from the filter, so weir leaves them alone. Going ahead again would take a
/// second handle, added before the first is deleted (deleting and adding would leave a moment
/// uncaptured), and the pod that put its filter there once can do it again right after: the
/// contest would only hide it. It is reported, for the operator to act on the pod.
///
/// The pod's programs are loaded ([`PodNetnsSetup::load_programs`]).
pub(in crate::datapath) fn restore_pod_netns(
    rtnl: &mut Rtnl,
    ebpf: &Ebpf,
    handoff: Option<(&Handoff, u64)>,
    pod: &PodNetnsSetup,
    (program_ids, families): (&TcProgramIds, (bool, bool)),
) -> Result<Vec<Drift>> {
    let present = rtnl
        .non_loopback_interfaces()
        .context("listing the pod's interfaces")?;
    let interfaces: Vec<Link> = pod
        .interfaces
        .iter()
        .filter(|interface| present.contains(interface))
        .cloned()
        .collect();
    let filter_of = |rtnl: &mut Rtnl, link: &Link| {
        // Not loaded: no filter of this agent's can hold it.
        let Some(program) = program_ids.of_program(pod.rerouted.ingress_program(link)) else {
            return Ok(WeirFilter::Missing);
        };
        rtnl.weir_filter(link.index, program)
            .with_context(|| format!("reading the tc filters on {}", link.name))
    };
    let mut drifts = Vec::new();
    let mut filters_missing = Vec::new();
    for interface in &interfaces {
        match filter_of(rtnl, interface)? {
            WeirFilter::First => {}
            WeirFilter::Preceded => drifts.push(Drift::FilterPreceded(interface.name.clone())),
            WeirFilter::Missing => filters_missing.push(interface),
        }
    }
    let (ipv4, ipv6) = families;
    let return_path_missing = rtnl
        .missing_return_path(ipv4, ipv6)
        .context("reading the pod's return path")?;
    if filters_missing.is_empty() && return_path_missing.is_empty() {
        return Ok(drifts);
    }
    drifts.extend(
        return_path_missing
            .into_iter()
            .map(Drift::ReturnPathMissing),
    );
    let setup = PodNetnsSetup {
        interfaces: &interfaces,
        ..*pod
    };
    if let Err(error) = set_up_pod_netns(rtnl, ebpf, handoff, &setup, |_| {}) {
        warn!(
            error = format!("{error:#}"),
            "setting the pod's netns up again"
        );
    }
    for interface in filters_missing {
        drifts.push(Drift::FilterMissing(interface.name.clone()));
        // Even put back it may run after another filter, or be kept out by one at its priority.
        if filter_of(rtnl, interface).is_ok_and(|filter| filter != WeirFilter::First) {
            drifts.push(Drift::FilterPreceded(interface.name.clone()));
        }
    }
    Ok(drifts)
}

/// Best effort: called on rollback and unenroll, where the pod may be half set up or gone, and
/// when a pod is handed back to istio's rules (its return path kept).
pub(super) fn undo_pod_netns(rtnl: &mut Rtnl, return_path: ReturnPath) {
    let undone = rtnl
        .non_loopback_interfaces()
        .and_then(|interfaces| rtnl.tear_down_pod(&interfaces, return_path));
    if let Err(error) = undone {
        debug!(%error, "removing the pod's tc programs and routing");
    }
}

/// Where the TCP arriving on the pod's rerouted interfaces goes to the outbound listener: every
/// destination for an ambient pod; for a sidecar pod its included outbound ranges, IPv6 only
/// where it is captured (istio's `-i <interface> [-d <range>] -j ISTIO_REDIRECT` rules).
/// In REDIRECT mode the proxy's listener is not transparent: the connections are translated.
pub(in crate::datapath) fn reroute<'a>(pod: &'a Workload, config: &PodConfig) -> Reroute<'a> {
    let interfaces = &pod.options.reroute_interfaces[..];
    match &pod.sidecar {
        None => Reroute {
            interfaces,
            ranges: None,
            ipv6: true,
            translated: false,
        },
        Some(sidecar) => Reroute {
            interfaces,
            ranges: match &sidecar.include_outbound_ranges {
                AllOr::All => None,
                AllOr::Only(ranges) => Some(ranges),
            },
            ipv6: config.has(POD_SIDECAR_IPV6),
            translated: sidecar.mode == InterceptionMode::Redirect,
        },
    }
}
