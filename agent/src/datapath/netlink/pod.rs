//! A pod's namespace, through the socket made in it: its interfaces and addresses, the return
//! path, weir's tc programs and rerouting rules, and their removal.
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use netlink_packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkExtentMask, LinkFlags, LinkLayerType, LinkMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType},
    rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage},
    tc::{TcAttribute, TcFilterBpf, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};
use weir_common::{PASSTHROUGH_SOURCE_V6, RETURN_ROUTE_TABLE};

use super::objects::Op;
use super::objects::{
    clsact, local_route, loopback_address, reroute_rule, return_rule, tc_filter, Direction, Object,
    TcProgram, LOOPBACK_IFINDEX, RETURN_RULE_PRIORITY, TC_HANDLE, TC_PRIORITY,
};
use super::transport::Rtnl;

/// An interface of a pod's (not loopback), as weir's programs go on it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// Its packets begin with an Ethernet header (veth, macvlan, tap); without one (tun,
    /// wireguard, ipip, gre, sit, netkit in L3 mode) they begin with the IP header.
    pub ethernet: bool,
}

/// weir's programs on a pod's interfaces, for [`Rtnl::attach_programs`].
pub struct PodSetup<'a> {
    /// The pod's interfaces but loopback.
    pub interfaces: &'a [Link],
    /// Those whose TCP goes to the outbound listener (`istio.io/reroute-virtual-interfaces`).
    pub rerouted: Reroute<'a>,
    /// The program for every other interface with an Ethernet header.
    pub inbound: TcProgram<'a>,
    /// The program for every other interface without one.
    pub inbound_l3: TcProgram<'a>,
    /// The program for the rerouted interfaces.
    pub reroute: TcProgram<'a>,
    /// The programs for the rerouted interfaces of a pod whose connections are translated, on
    /// their ingress and egress.
    pub nat_in: TcProgram<'a>,
    pub nat_out: TcProgram<'a>,
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

impl Reroute<'_> {
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

/// Where weir's filter stands among the filters on an interface's ingress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeirFilter {
    /// In its slot, with the program it should hold, and the first filter that runs.
    First,
    /// In its slot, with the program it should hold, but another filter runs before it.
    Preceded,
    /// Not on the interface, or its slot holds another program.
    Missing,
}

/// The rerouting rules ([`reroute_rule`]) in the current netns: each one's interface and
/// destination, sorted.
pub fn reroute_rules() -> io::Result<Vec<(String, IpNet)>> {
    installed_reroutes(&mut Rtnl::new()?)
}

/// See [`Rtnl::non_loopback_addresses`], for the calling thread's network namespace.
pub fn non_loopback_addresses() -> io::Result<Vec<IpAddr>> {
    Rtnl::new()?.non_loopback_addresses()
}

/// See [`Rtnl::non_loopback_interfaces`], for the calling thread's network namespace.
pub fn non_loopback_interfaces() -> io::Result<Vec<Link>> {
    Rtnl::new()?.non_loopback_interfaces()
}

/// The interface and destination of each rerouting rule in the netns (by their shape, see
/// [`reroute_rule`]), sorted.
fn installed_reroutes(rtnl: &mut Rtnl) -> io::Result<Vec<(String, IpNet)>> {
    let mut reroutes: Vec<(String, IpNet)> = rtnl
        .rules()?
        .into_iter()
        .filter_map(|rule| {
            let has = |wanted: &RuleAttribute| rule.attributes.contains(wanted);
            let ours = has(&RuleAttribute::Table(RETURN_ROUTE_TABLE))
                && has(&RuleAttribute::Priority(RETURN_RULE_PRIORITY))
                && has(&RuleAttribute::IpProtocol(IpProtocol::Tcp));
            if !ours {
                return None;
            }
            let mut interface = None;
            let mut destination = match rule.header.family {
                AddressFamily::Inet6 => IpAddr::from(Ipv6Addr::UNSPECIFIED),
                _ => Ipv4Addr::UNSPECIFIED.into(),
            };
            for attribute in &rule.attributes {
                match attribute {
                    RuleAttribute::Iifname(name) => interface = Some(name.clone()),
                    RuleAttribute::Destination(ip) => destination = *ip,
                    _ => {}
                }
            }
            let destination = IpNet::new(destination, rule.header.dst_len).ok()?;
            Some((interface?, destination))
        })
        .collect();
    reroutes.sort();
    reroutes.dedup();
    Ok(reroutes)
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

impl Rtnl {
    /// Every link but loopback (`RTM_GETLINK` dump; not `/sys/class/net`, which shows the
    /// namespace `/sys` was mounted in).
    pub fn non_loopback_interfaces(&mut self) -> io::Result<Vec<Link>> {
        let mut request = LinkMessage::default();
        // Without the interfaces' statistics: the kernel folds each one's per-CPU counters into
        // the reply and the parser walks them, on every enrollment, for nothing read here.
        request
            .attributes
            .push(LinkAttribute::ExtMask(vec![LinkExtentMask::SkipStats]));
        let replies = self.dump(RouteNetlinkMessage::GetLink(request))?;
        Ok(replies
            .into_iter()
            .filter_map(|reply| match reply {
                RouteNetlinkMessage::NewLink(link) => Some(link),
                _ => None,
            })
            .filter(|link| !link.header.flags.contains(LinkFlags::Loopback))
            .filter_map(|link| {
                let name = link
                    .attributes
                    .into_iter()
                    .find_map(|attribute| match attribute {
                        LinkAttribute::IfName(name) => Some(name),
                        _ => None,
                    })?;
                Some(Link {
                    index: link.header.index,
                    name,
                    ethernet: link.header.link_layer_type == LinkLayerType::Ether,
                })
            })
            .collect())
    }

    /// Every address on the namespace's interfaces but loopback (`RTM_GETADDR` dump), tentative
    /// ones included: the pod's CNI addresses, and also those no CNI result names, such as IPv6
    /// link-local ones, through which a neighbour on the same segment reaches the pod's
    /// listeners too.
    pub fn non_loopback_addresses(&mut self) -> io::Result<Vec<IpAddr>> {
        Ok(self
            .addresses()?
            .into_iter()
            .filter(|(ifindex, ip)| *ifindex != LOOPBACK_IFINDEX && !ip.is_loopback())
            .map(|(_, ip)| ip)
            .collect())
    }

    /// The addresses on the interface named `interface` but loopback and link-local ones
    /// (`fe80::/10`, `169.254.0.0/16`): those its network gave it, as a CNI result names them.
    /// None when there is no such interface.
    pub fn routable_addresses_of(&mut self, interface: &str) -> io::Result<Vec<IpAddr>> {
        let found = self
            .non_loopback_interfaces()?
            .into_iter()
            .find(|link| link.name == interface);
        let Some(Link { index: wanted, .. }) = found else {
            return Ok(Vec::new());
        };
        Ok(self
            .addresses()?
            .into_iter()
            .filter(|(ifindex, ip)| *ifindex == wanted && !ip.is_loopback() && !is_link_local(ip))
            .map(|(_, ip)| ip)
            .collect())
    }

    /// Every address of the namespace with its interface's index (`RTM_GETADDR` dump), in the
    /// kernel's order (a primary IPv4 address before its secondaries).
    fn addresses(&mut self) -> io::Result<Vec<(u32, IpAddr)>> {
        let replies = self.dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()))?;
        Ok(replies
            .into_iter()
            .filter_map(|reply| match reply {
                RouteNetlinkMessage::NewAddress(address) => {
                    // IFA_LOCAL is the address itself; IFA_ADDRESS is the peer's on a
                    // point-to-point link, and the only one given otherwise.
                    let find = |local: bool| {
                        address
                            .attributes
                            .iter()
                            .find_map(|attribute| match attribute {
                                AddressAttribute::Local(ip) if local => Some(*ip),
                                AddressAttribute::Address(ip) if !local => Some(*ip),
                                _ => None,
                            })
                    };
                    Some((address.header.index, find(true).or_else(|| find(false))?))
                }
                _ => None,
            })
            .collect())
    }

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

    /// weir's programs on the pod's interfaces, in one datagram and in this order: on every
    /// interface the clsact qdisc and weir's filter with the interface's program, replacing
    /// whatever program held the slot, and an egress filter where connections are translated
    /// (none elsewhere); then the rerouting rules (see [`reroute_rule`]): those
    /// no longer wanted go, the wanted ones come last, since until the tc program assigns a
    /// rerouted SYN to its listener local delivery would hand it to whatever listens on its
    /// port. A rule naming an interface the pod does not have yet stays inert until such an
    /// interface appears, which sets the pod up again. Idempotent.
    ///
    /// Apart from [`Self::set_up_return_path`] (one round trip more) so that a pod's enrollment
    /// times them apart: a clsact qdisc made on an interface that is up costs an RCU grace
    /// period (`qdisc_graft` deactivates the device), the largest single wait of an enrollment.
    pub fn attach_programs(&mut self, pod: &PodSetup) -> io::Result<()> {
        let tc = pod.interfaces.iter().flat_map(|link| {
            let rerouted = pod.rerouted.interfaces.contains(&link.name);
            let translated = rerouted && pod.rerouted.translated;
            let program = match (rerouted, link.ethernet) {
                (true, _) if translated => pod.nat_in,
                (true, _) => pod.reroute,
                (false, true) => pod.inbound,
                (false, false) => pod.inbound_l3,
            };
            let filter =
                |direction, program| Object::Filter(tc_filter(link.index, direction, program));
            let egress = match translated {
                true => (
                    Op::Add,
                    filter(Direction::Egress, Some((pod.nat_out, pod.slot))),
                ),
                false => (Op::Delete, filter(Direction::Egress, None)),
            };
            [
                (Op::Add, Object::Clsact(clsact(link.index))),
                (
                    Op::Add,
                    filter(Direction::Ingress, Some((program, pod.slot))),
                ),
                egress,
            ]
        });
        let wanted = pod.rerouted.rules();
        let stale: Vec<(Op, Object)> = installed_reroutes(self)?
            .into_iter()
            .filter(|rule| !wanted.contains(rule))
            .map(|(name, destination)| (Op::Delete, Object::Rule(reroute_rule(destination, &name))))
            .collect();
        let rerouted = wanted
            .iter()
            .map(|(name, destination)| (Op::Add, Object::Rule(reroute_rule(*destination, name))));
        self.apply(tc.chain(stale).chain(rerouted))
    }

    /// Undoes [`Self::set_up_return_path`] and [`Self::attach_programs`] on `interfaces`, in one
    /// datagram: weir's filters, every rerouting rule, the return path. Best effort: what is
    /// already gone is success.
    pub fn tear_down_pod(&mut self, interfaces: &[Link]) -> io::Result<()> {
        let filters = interfaces.iter().flat_map(|link| {
            [Direction::Ingress, Direction::Egress].map(|direction| {
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
        let return_path = return_path()
            .into_iter()
            .rev()
            .map(|object| (Op::Delete, object));
        self.apply(filters.chain(rules).chain(return_path))?;
        // The clsact qdisc goes too once no filter is left on it, weir's or another's: one that
        // still holds another tool's filters stays.
        let mut unused = Vec::new();
        for link in interfaces {
            if self
                .clsact_filters(link.index)
                .is_ok_and(|filters| filters == 0)
            {
                unused.push((Op::Delete, Object::Clsact(clsact(link.index))));
            }
        }
        self.apply(unused)
    }

    /// The filters on the interface's clsact qdisc, both directions.
    fn clsact_filters(&mut self, ifindex: u32) -> io::Result<usize> {
        let mut count = 0;
        for minor in [TcHandle::MIN_INGRESS, TcHandle::MIN_EGRESS] {
            count += self.filters(ifindex, minor, None)?.len();
        }
        Ok(count)
    }

    /// The filters under the interface's clsact qdisc in direction `minor`, of every chain or
    /// only `chain`, as the kernel lists them: by chain, then by priority, each priority's
    /// classifier itself (handle 0) before its filters, which come in the order they run.
    fn filters(
        &mut self,
        ifindex: u32,
        minor: u16,
        chain: Option<u32>,
    ) -> io::Result<Vec<TcMessage>> {
        let mut request = TcMessage::default();
        request.header.index = ifindex as i32;
        request.header.parent = TcHandle {
            major: TcHandle::CLSACT.major,
            minor,
        };
        request.attributes.extend(chain.map(TcAttribute::Chain));
        Ok(self
            .dump(RouteNetlinkMessage::GetTrafficFilter(request))?
            .into_iter()
            .filter_map(|reply| match reply {
                RouteNetlinkMessage::NewTrafficFilter(filter) => Some(filter),
                _ => None,
            })
            .collect())
    }

    /// Where weir's filter stands on the interface's ingress (see [`WeirFilter`]);
    /// `program_id` is the program its slot should hold. Only chain 0 counts: classification
    /// starts there, and another chain runs only when a filter of chain 0 jumps to it.
    pub fn weir_filter(&mut self, ifindex: u32, program_id: u32) -> io::Result<WeirFilter> {
        let filters = self.filters(ifindex, TcHandle::MIN_INGRESS, Some(0))?;
        let mut others_first = false;
        for filter in filters
            .iter()
            .filter(|filter| filter.header.handle != TcHandle::UNSPEC)
        {
            if !is_weir_slot(filter) {
                others_first = true;
                continue;
            }
            return Ok(
                match (bpf_program_id(filter) == Some(program_id), others_first) {
                    (false, _) => WeirFilter::Missing,
                    (true, false) => WeirFilter::First,
                    (true, true) => WeirFilter::Preceded,
                },
            );
        }
        Ok(WeirFilter::Missing)
    }

    /// The rules `fwmark <mark>/<mask> lookup RETURN_ROUTE_TABLE` of either family: another
    /// agent's return path to the same table (istio-cni's), not weir's.
    pub fn istio_return_rules(&mut self, mark: u32, mask: u32) -> io::Result<Vec<RuleMessage>> {
        Ok(self
            .rules()?
            .into_iter()
            .filter(|rule| {
                let has = |wanted: &RuleAttribute| rule.attributes.contains(wanted);
                has(&RuleAttribute::FwMark(mark))
                    && has(&RuleAttribute::FwMask(mask))
                    && has(&RuleAttribute::Table(RETURN_ROUTE_TABLE))
            })
            .collect())
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

    /// Every policy routing rule of the namespace (`RTM_GETRULE` dump).
    fn rules(&mut self) -> io::Result<Vec<RuleMessage>> {
        Ok(self
            .dump(RouteNetlinkMessage::GetRule(RuleMessage::default()))?
            .into_iter()
            .filter_map(|reply| match reply {
                RouteNetlinkMessage::NewRule(rule) => Some(rule),
                _ => None,
            })
            .collect())
    }

    /// Every route of the namespace, of every table (`RTM_GETROUTE` dump).
    fn routes(&mut self) -> io::Result<Vec<RouteMessage>> {
        Ok(self
            .dump(RouteNetlinkMessage::GetRoute(RouteMessage::default()))?
            .into_iter()
            .filter_map(|reply| match reply {
                RouteNetlinkMessage::NewRoute(route) => Some(route),
                _ => None,
            })
            .collect())
    }

    /// The main table's unicast routes, sorted: each one's destination and the interface it
    /// leaves by (a multipath route's first hop's).
    pub fn main_routes(&mut self) -> io::Result<Vec<(IpNet, u32)>> {
        let mut routes: Vec<(IpNet, u32)> = self
            .routes()?
            .into_iter()
            .filter(|route| {
                route.header.kind == RouteType::Unicast
                    && route.header.table == RouteHeader::RT_TABLE_MAIN
            })
            .filter_map(|route| {
                let mut destination = match route.header.address_family {
                    AddressFamily::Inet => IpAddr::from(Ipv4Addr::UNSPECIFIED),
                    AddressFamily::Inet6 => Ipv6Addr::UNSPECIFIED.into(),
                    _ => return None,
                };
                let mut interface = None;
                for attribute in &route.attributes {
                    match attribute {
                        RouteAttribute::Destination(RouteAddress::Inet(ip)) => {
                            destination = (*ip).into();
                        }
                        RouteAttribute::Destination(RouteAddress::Inet6(ip)) => {
                            destination = (*ip).into();
                        }
                        RouteAttribute::Oif(index) => interface = Some(*index),
                        RouteAttribute::MultiPath(hops) => {
                            interface = interface.or(hops.first().map(|hop| hop.interface_index));
                        }
                        _ => {}
                    }
                }
                let destination =
                    IpNet::new(destination, route.header.destination_prefix_length).ok()?;
                Some((destination, interface?))
            })
            .collect();
        routes.sort();
        Ok(routes)
    }

    /// The objects of the return path (see [`return_path`]) of the families asked for that the
    /// namespace lacks, described (`IPv4 rule`). Read with a rule and a route dump.
    pub fn missing_return_path(&mut self, ipv4: bool, ipv6: bool) -> io::Result<Vec<String>> {
        let rules = self.rules()?;
        let routes = self.routes()?;
        let wanted = |family| match family {
            AddressFamily::Inet => ipv4,
            AddressFamily::Inet6 => ipv6,
            _ => false,
        };
        Ok(return_path()
            .into_iter()
            .filter(|object| wanted(object.family()))
            .filter(|object| match object {
                Object::Rule(ours) => !rules.iter().any(|rule| is_return_rule(rule, ours)),
                Object::Route(ours) => !routes.iter().any(|route| is_return_route(route, ours)),
                _ => false,
            })
            .map(|object| object.to_string())
            .collect())
    }
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => ip.is_link_local(),
        IpAddr::V6(ip) => ip.is_unicast_link_local(),
    }
}

/// Whether a dumped filter is in weir's slot ([`tc_filter`]): its priority, handle and kind.
fn is_weir_slot(filter: &TcMessage) -> bool {
    filter.header.info >> 16 == u32::from(TC_PRIORITY)
        && filter.header.handle == TcHandle::from(TC_HANDLE)
        && filter
            .attributes
            .contains(&TcAttribute::Kind(TcFilterBpf::KIND.into()))
}

/// The eBPF program a dumped cls_bpf filter runs; `None` for a classic BPF one.
fn bpf_program_id(filter: &TcMessage) -> Option<u32> {
    filter
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            TcAttribute::Options(options) => options.iter().find_map(|option| match option {
                TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => Some(*id),
                _ => None,
            }),
            _ => None,
        })
}

/// Whether a dumped rule is `ours` (a [`return_rule`]): the same selector and table, and
/// nothing that narrows it to some packets, inverts it, or keeps its route from being used
/// (a suppressor). Attributes the kernel adds to every rule (the protocol) do not matter.
fn is_return_rule(rule: &RuleMessage, ours: &RuleMessage) -> bool {
    let header = &rule.header;
    let plain = header.family == ours.header.family
        && header.action == RuleAction::ToTable
        && (header.dst_len, header.src_len, header.tos) == (0, 0, 0)
        && !header.flags.contains(RuleFlags::Invert);
    let nothing_else = rule.attributes.iter().all(|attribute| match attribute {
        RuleAttribute::SuppressPrefixLen(value) | RuleAttribute::SuppressIfGroup(value) => {
            *value == u32::MAX
        }
        RuleAttribute::Protocol(_) | RuleAttribute::Realm(_) | RuleAttribute::Other(_) => true,
        other => ours.attributes.contains(other),
    });
    plain
        && nothing_else
        && ours
            .attributes
            .iter()
            .all(|wanted| rule.attributes.contains(wanted))
}

/// Whether a dumped route is `ours` (a [`local_route`] of the return path's table): a local
/// route of every destination through `lo` in that table, whoever added it.
fn is_return_route(route: &RouteMessage, ours: &RouteMessage) -> bool {
    let header = &route.header;
    header.address_family == ours.header.address_family
        && header.kind == RouteType::Local
        && header.destination_prefix_length == ours.header.destination_prefix_length
        && (header.source_prefix_length, header.tos) == (0, 0)
        && route
            .attributes
            .contains(&RouteAttribute::Table(RETURN_ROUTE_TABLE))
        && route
            .attributes
            .contains(&RouteAttribute::Oif(LOOPBACK_IFINDEX))
}
