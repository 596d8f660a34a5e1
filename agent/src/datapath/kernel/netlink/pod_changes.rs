//! What changes a pod's namespace, through the socket made in it: the return path, weir's tc
//! programs and rerouting rules, their removal, and the deletion of another agent's rules.
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use netlink_packet_route::{rule::RuleMessage, RouteNetlinkMessage};
use weir_common::{programs, PASSTHROUGH_SOURCE_V6, RETURN_ROUTE_TABLE};

use super::objects::Op;
use super::objects::{
    hook_qdisc, local_route, loopback_address, mark_rule, reroute_rule, return_rule, tc_filter,
    Direction, HookQdisc, Object, TcProgram,
};
use super::pod_state::{installed_reroutes, Link};
use super::transport::Rtnl;

/// weir's programs on a pod's interfaces, for [`Rtnl::attach_programs`].
pub struct PodSetup<'a> {
    /// The pod's interfaces but loopback.
    pub interfaces: &'a [Link],
    /// Those whose TCP goes to the outbound listener (`istio.io/reroute-virtual-interfaces`).
    pub rerouted: Reroute<'a>,
    /// The tc programs loaded, among them those [`Reroute::programs`] names for the pod.
    pub programs: &'a [TcProgram<'a>],
    /// The pod's slot, which its filters carry as their classid.
    pub slot: u32,
}

/// The interfaces whose incoming TCP goes to the outbound listener, and for which destinations.
#[derive(Clone, Copy, Debug)]
pub struct Reroute<'a> {
    pub interfaces: &'a [String],
    /// The destinations rerouted; `None`: every one (an ambient pod's, or a sidecar pod's that
    /// includes every outbound range).
    pub ranges: Option<&'a [IpNet]>,
    /// Whether IPv6 is rerouted at all.
    pub ipv6: bool,
    /// Whether the connections are translated to the listener at the pod's address and back
    /// (a sidecar pod in REDIRECT mode, whose proxy's listeners are not transparent), rather
    /// than handed to it with their destination.
    pub translated: bool,
}

impl PodSetup<'_> {
    fn program(&self, name: &str) -> io::Result<TcProgram<'_>> {
        (self.programs.iter())
            .find(|program| program.name == name)
            .copied()
            .ok_or_else(|| io::Error::other(format!("the tc program {name} is not loaded")))
    }
}

impl Reroute<'_> {
    /// The program on `link`'s ingress: the one for rerouted interfaces (translating where the
    /// connections are translated), else the inbound one for interfaces with an Ethernet
    /// header or the one for those without.
    pub fn ingress_program(&self, link: &Link) -> &'static str {
        let rerouted = self.interfaces.contains(&link.name);
        match (rerouted, link.ethernet) {
            (true, _) if self.translated => programs::NAT_IN,
            (true, _) => programs::REROUTE,
            (false, true) => programs::INBOUND,
            (false, false) => programs::INBOUND_L3,
        }
    }

    /// Every tc program `interfaces` get: [`Self::ingress_program`]s, and the translating
    /// program's egress twin.
    pub fn programs(&self, interfaces: &[Link]) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = (interfaces.iter())
            .map(|link| self.ingress_program(link))
            .collect();
        if names.contains(&programs::NAT_IN) {
            names.push(programs::NAT_OUT);
        }
        names.sort_unstable();
        names.dedup();
        names
    }

    /// No interface rerouted.
    pub const NONE: Reroute<'static> = Reroute {
        interfaces: &[],
        ranges: None,
        ipv6: false,
        translated: false,
    };

    /// Each rerouted interface with each rerouted destination, sorted. Translated connections
    /// are for the pod's address, local without a rule; the rules keep what the programs do
    /// not take yet (an interface that has just appeared) from being forwarded around the proxy.
    fn rules(&self) -> Vec<(String, IpNet)> {
        let everywhere = [
            IpNet::from(Ipv4Net::default()),
            IpNet::from(Ipv6Net::default()),
        ];
        let destinations: Vec<IpNet> = self
            .ranges
            .unwrap_or(&everywhere)
            .iter()
            .filter(|range| self.ipv6 || matches!(range, IpNet::V4(_)))
            .map(IpNet::trunc)
            .collect();
        let mut rules: Vec<(String, IpNet)> = self
            .interfaces
            .iter()
            .flat_map(|name| destinations.iter().map(|d| (name.clone(), *d)))
            .collect();
        rules.sort();
        rules.dedup();
        rules
    }
}

/// What makes `RETURN_MARK`-marked replies in a netns take the `local` route in table
/// `RETURN_ROUTE_TABLE`, for IPv4 and IPv6, routes before rules (so a rule never points at an
/// empty table): `ip route add local 0.0.0.0/0 dev lo table 100`,
/// `ip -6 route add local ::/0 dev lo table 100` and
/// `ip rule add fwmark 0x1000/0x1000 lookup 100 priority 32764`. Needs `lo` up, as it is in every
/// pod. Where IPv6 is disabled (the namespace's `disable_ipv6` sysctl, or no IPv6 in the kernel)
/// its half is skipped: there is no IPv6 traffic to return.
pub(super) fn return_path() -> [Object; 4] {
    let [v4, v6] = [Ipv4Addr::UNSPECIFIED.into(), Ipv6Addr::UNSPECIFIED.into()];
    [
        Object::Route(local_route(v4, 0, RETURN_ROUTE_TABLE)),
        Object::Route(local_route(v6, 0, RETURN_ROUTE_TABLE)),
        Object::Rule(return_rule(v4)),
        Object::Rule(return_rule(v6)),
    ]
}

/// What a pod's teardown does with weir's return path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReturnPath {
    /// Unenrollment: it goes with the rest.
    Remove,
    /// A pod handed back to istio's in-pod rules: it stays, for the connections ztunnel made
    /// under weir's path, and istio's return path shares its route in table 100.
    Keep,
}

impl Rtnl {
    /// The return path (see [`return_path`]), in one datagram, with the IPv6 passthrough
    /// source `::6` on `lo` when `passthrough_v6` (a sidecar pod whose IPv6 is captured: its
    /// proxy reaches the app from there, as istio adds it). Idempotent; the address stays after
    /// unenrollment, as istio leaves it.
    pub fn set_up_return_path(&mut self, passthrough_v6: bool) -> io::Result<()> {
        let passthrough =
            passthrough_v6.then(|| Object::Address(loopback_address(PASSTHROUGH_SOURCE_V6.into())));
        let objects = return_path().into_iter().chain(passthrough);
        self.apply(objects.map(|object| (Op::Add, object)))
    }

    /// istio's return path's routing rules (`fwmark <mark>/<mask> lookup 100`, both families),
    /// which istio-cni's agent adds after its netfilter rules: a pod handed back to it gets them
    /// first, so the replies to ztunnel's connections its rules mark never go without them.
    /// Idempotent.
    pub fn add_istio_return_rules(&mut self, mark: u32, mask: u32) -> io::Result<()> {
        let [v4, v6]: [IpAddr; 2] = [Ipv4Addr::UNSPECIFIED.into(), Ipv6Addr::UNSPECIFIED.into()];
        self.apply([v4, v6].map(|any| (Op::Add, Object::Rule(mark_rule(any, mark, mask)))))
    }

    /// weir's programs on the pod's interfaces, in one datagram and in this order: on every
    /// interface its qdisc (see [`HookQdisc`]; one already there serves if it has the hooks
    /// wanted) and weir's filter with the interface's program on ingress, replacing whatever
    /// program held the slot, and an egress filter where connections are translated (none
    /// elsewhere); then the rerouting rules (see [`reroute_rule`]): those
    /// no longer wanted go, the wanted ones come last, since until the tc program assigns a
    /// rerouted SYN to its listener local delivery would hand it to whatever listens on its
    /// port. A rule naming an interface the pod does not have yet stays inert until such an
    /// interface appears, which sets the pod up again. Idempotent.
    ///
    /// An interface that comes to need an egress filter while it holds an `ingress` qdisc (a
    /// rerouted interface renamed into a translated pod's list) has it replaced by a clsact in
    /// the same datagram, unless it holds another's filters, which weir does not drop.
    ///
    /// Apart from [`Self::set_up_return_path`] (one round trip more) so that a pod's enrollment
    /// times them apart: a qdisc made on an interface that is up costs an RCU grace period
    /// (`qdisc_graft` deactivates the device), the largest single wait of an enrollment.
    pub fn attach_programs(&mut self, pod: &PodSetup) -> io::Result<()> {
        let present = self.hook_qdiscs()?;
        let mut tc = Vec::new();
        for link in pod.interfaces {
            let rerouted = pod.rerouted.interfaces.contains(&link.name);
            let translated = rerouted && pod.rerouted.translated;
            let program = pod.program(pod.rerouted.ingress_program(link))?;
            let qdisc = |kind| Object::Qdisc(hook_qdisc(link.index, kind));
            let filter =
                |direction, program| Object::Filter(tc_filter(link.index, direction, program));
            let present = present.get(&link.index).copied();
            match present {
                None => tc.push((Op::Add, qdisc(HookQdisc::for_egress(translated)))),
                Some(HookQdisc::Ingress) if translated => {
                    if self.has_foreign_ingress_filters(link.index)? {
                        return Err(io::Error::other(format!(
                            "{} needs a clsact qdisc for weir's egress filter, and its ingress \
                             qdisc holds other filters",
                            link.name
                        )));
                    }
                    tc.push((Op::Delete, qdisc(HookQdisc::Ingress)));
                    tc.push((Op::Add, qdisc(HookQdisc::Clsact)));
                }
                Some(_) => {}
            }
            tc.push((
                Op::Add,
                filter(Direction::Ingress, Some((program, pod.slot))),
            ));
            if translated {
                tc.push((
                    Op::Add,
                    filter(
                        Direction::Egress,
                        Some((pod.program(programs::NAT_OUT)?, pod.slot)),
                    ),
                ));
            } else if present.is_some_and(HookQdisc::has_egress) {
                tc.push((Op::Delete, filter(Direction::Egress, None)));
            }
        }
        let wanted = pod.rerouted.rules();
        let stale: Vec<(Op, Object)> = installed_reroutes(self)?
            .into_iter()
            .filter(|rule| !wanted.contains(rule))
            .map(|(name, destination)| (Op::Delete, Object::Rule(reroute_rule(destination, &name))))
            .collect();
        let rerouted = wanted
            .iter()
            .map(|(name, destination)| (Op::Add, Object::Rule(reroute_rule(*destination, name))));
        self.apply(tc.into_iter().chain(stale).chain(rerouted))
    }

    /// Undoes [`Self::attach_programs`] on `interfaces` and, with [`ReturnPath::Remove`],
    /// [`Self::set_up_return_path`], in one datagram: weir's filters, every rerouting rule, the
    /// return path. Best effort: what is already gone is success.
    pub fn tear_down_pod(
        &mut self,
        interfaces: &[Link],
        return_path: ReturnPath,
    ) -> io::Result<()> {
        let present = self.hook_qdiscs()?;
        let filters = interfaces.iter().flat_map(|link| {
            let directions: &[Direction] = match present.get(&link.index) {
                Some(qdisc) if qdisc.has_egress() => &[Direction::Ingress, Direction::Egress],
                _ => &[Direction::Ingress],
            };
            directions.iter().map(|&direction| {
                (
                    Op::Delete,
                    Object::Filter(tc_filter(link.index, direction, None)),
                )
            })
        });
        let rules: Vec<(Op, Object)> = installed_reroutes(self)?
            .into_iter()
            .map(|(name, destination)| (Op::Delete, Object::Rule(reroute_rule(destination, &name))))
            .collect();
        let return_path = match return_path {
            ReturnPath::Remove => Vec::from(self::return_path()),
            ReturnPath::Keep => Vec::new(),
        };
        let return_path = return_path
            .into_iter()
            .rev()
            .map(|object| (Op::Delete, object));
        self.apply(filters.chain(rules).chain(return_path))?;
        // The qdisc goes too once no filter is left on it, weir's or another's: one that still
        // holds another tool's filters stays.
        let mut unused = Vec::new();
        for link in interfaces {
            let Some(&kind) = present.get(&link.index) else {
                continue;
            };
            if self
                .filter_count(link.index, kind)
                .is_ok_and(|filters| filters == 0)
            {
                unused.push((Op::Delete, Object::Qdisc(hook_qdisc(link.index, kind))));
            }
        }
        self.apply(unused)
    }

    /// Deletes `rules` (as a dump returned them); one already gone is no error.
    pub fn delete_rules(&mut self, rules: Vec<RuleMessage>) -> io::Result<()> {
        if rules.is_empty() {
            return Ok(());
        }
        let messages = rules
            .into_iter()
            .map(|rule| (RouteNetlinkMessage::DelRule(rule), 0))
            .collect();
        for errno in self.execute(messages)? {
            if errno != 0 && errno != libc::ENOENT {
                return Err(io::Error::from_raw_os_error(errno));
            }
        }
        Ok(())
    }
}
