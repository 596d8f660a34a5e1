//! What a pod's namespace holds, read through the socket made in it: its interfaces and
//! addresses, its main routes, weir's rerouting rules, where weir's tc filter stands, which parts
//! of the return path are missing, and another agent's return path rules.
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use netlink_packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkExtentMask, LinkFlags, LinkLayerType, LinkMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType},
    rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage},
    tc::{TcAttribute, TcFilterBpf, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};
use weir_common::RETURN_ROUTE_TABLE;

use super::objects::{
    HookQdisc, Object, LOOPBACK_IFINDEX, RETURN_RULE_PRIORITY, TC_HANDLE, TC_PRIORITY,
};
use super::pod_changes::return_path;
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

/// The rerouting rules ([`reroute_rule`](super::objects::reroute_rule)) in the current netns: each
/// one's interface and destination, sorted.
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
/// [`reroute_rule`](super::objects::reroute_rule)), sorted.
pub(super) fn installed_reroutes(rtnl: &mut Rtnl) -> io::Result<Vec<(String, IpNet)>> {
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

    /// The qdisc in each interface's ingress slot, where it is `ingress` or `clsact`, by
    /// interface index.
    pub(super) fn hook_qdiscs(&mut self) -> io::Result<HashMap<u32, HookQdisc>> {
        let replies = self.dump(RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()))?;
        Ok(replies
            .into_iter()
            .filter_map(|reply| match reply {
                RouteNetlinkMessage::NewQueueDiscipline(qdisc)
                    if qdisc.header.parent == TcHandle::INGRESS =>
                {
                    Some((qdisc.header.index as u32, HookQdisc::of(&qdisc)?))
                }
                _ => None,
            })
            .collect())
    }

    /// The filters on the interface's `qdisc`, on each of its hooks.
    pub(super) fn filter_count(&mut self, ifindex: u32, qdisc: HookQdisc) -> io::Result<usize> {
        let mut count = self.filters(ifindex, TcHandle::MIN_INGRESS, None)?.len();
        if qdisc.has_egress() {
            count += self.filters(ifindex, TcHandle::MIN_EGRESS, None)?.len();
        }
        Ok(count)
    }

    /// The filters under the interface's qdisc on hook `minor`, of every chain or
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

    /// Whether a filter not in weir's slot is on the interface's ingress, in any chain.
    pub(super) fn has_foreign_ingress_filters(&mut self, ifindex: u32) -> io::Result<bool> {
        let filters = self.filters(ifindex, TcHandle::MIN_INGRESS, None)?;
        Ok(filters
            .iter()
            .any(|filter| filter.header.handle != TcHandle::UNSPEC && !is_weir_slot(filter)))
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

/// Whether a dumped filter is in weir's slot ([`tc_filter`](super::objects::tc_filter)): its
/// priority, handle and kind.
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

/// Whether a dumped rule is `ours` (a [`return_rule`](super::objects::return_rule)): the same
/// selector and table, and nothing that narrows it to some packets, inverts it, or keeps its route
/// from being used (a suppressor). Attributes the kernel adds to every rule (the protocol) do not
/// matter.
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

/// Whether a dumped route is `ours` (a [`local_route`](super::objects::local_route) of the return
/// path's table): a local route of every destination through `lo` in that table, whoever added it.
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
