//! The objects weir puts in a network namespace (rules, routes, an address, the qdisc on an
//! interface's ingress and its filters), each built as the netlink message that adds or deletes it.
use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::os::fd::{AsRawFd, BorrowedFd};

use ipnet::IpNet;

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::{
    address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, CacheInfo},
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
    tc::{TcAttribute, TcBpfFlags, TcFilterBpf, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};
use weir_common::{RETURN_MARK, RETURN_ROUTE_TABLE};

/// Priority of the return-path rule. Anything between the `local` table's rule (0) and `main`'s
/// (32766, whose routes would send the app's replies out of eth0 instead of back to ztunnel) works;
/// 32764 is the slot istio-cni's in-pod mode uses for its equivalent rule, so `ip rule` in a pod
/// looks the same under either, and a fixed priority is what lets `NLM_F_EXCL` see a duplicate.
pub(super) const RETURN_RULE_PRIORITY: u32 = 32764;

/// The loopback device is ifindex 1 in every network namespace (`LOOPBACK_IFINDEX` in the kernel),
/// so no lookup is needed.
pub(super) const LOOPBACK_IFINDEX: u32 = 1;

pub(super) const RT_TABLE_LOCAL: u32 = 255;

/// weir's tc filter's place on a pod interface's ingress: fixed, so enrolling again replaces the
/// program in place (also another agent version's) and unenrolling removes exactly it.
/// Priority 1 is the first there is (0 asks the kernel to choose one): no filter of another
/// priority runs before weir's.
pub(super) const TC_PRIORITY: u16 = 1;
pub(super) const TC_HANDLE: u32 = 0x5745;
/// `ETH_P_ALL` in network order, as `tcm_info`'s protocol half wants it.
const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Which of an interface's tc hooks a filter is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direction {
    Ingress,
    Egress,
}

/// A tc program weir attaches to pod interfaces, by its fd and name (the name `tc filter show`
/// prints).
#[derive(Clone, Copy)]
pub struct TcProgram<'a> {
    pub fd: BorrowedFd<'a>,
    pub name: &'a str,
}

fn family_of(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

/// The table number as the 8-bit header field wants it; larger ones live only in the attribute.
fn header_table(table: u32) -> u8 {
    u8::try_from(table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC)
}

/// `fwmark RETURN_MARK/RETURN_MARK lookup RETURN_ROUTE_TABLE`, for the family of `any`.
pub(super) fn return_rule(any: IpAddr) -> RuleMessage {
    mark_rule(any, RETURN_MARK, RETURN_MARK)
}

/// `fwmark <mark>/<mask> lookup RETURN_ROUTE_TABLE priority 32764`, in the family of `any`:
/// weir's return rule, or istio's (`0x111/0xfff`, the same table and priority).
pub(super) fn mark_rule(any: IpAddr, mark: u32, mask: u32) -> RuleMessage {
    let mut rule = RuleMessage::default();
    rule.header.family = family_of(any);
    rule.header.table = header_table(RETURN_ROUTE_TABLE);
    rule.header.action = RuleAction::ToTable;
    rule.attributes = vec![
        RuleAttribute::Priority(RETURN_RULE_PRIORITY),
        RuleAttribute::FwMark(mark),
        RuleAttribute::FwMask(mask),
        RuleAttribute::Table(RETURN_ROUTE_TABLE),
    ];
    rule
}

/// `iif <interface> [to <destination>] ipproto tcp lookup RETURN_ROUTE_TABLE priority 32764`,
/// in the family of `destination` (a `/0` names none): the TCP arriving on `interface` for it
/// takes the `local` route of the return path's table, so it is delivered to the outbound
/// listener (the tc program assigns it) instead of being forwarded. A rule names its interface,
/// so it applies as soon as an interface of that name appears.
pub(super) fn reroute_rule(destination: IpNet, interface: &str) -> RuleMessage {
    let mut rule = RuleMessage::default();
    rule.header.family = family_of(destination.addr());
    rule.header.table = header_table(RETURN_ROUTE_TABLE);
    rule.header.action = RuleAction::ToTable;
    rule.attributes = vec![
        RuleAttribute::Iifname(interface.to_owned()),
        RuleAttribute::Priority(RETURN_RULE_PRIORITY),
        RuleAttribute::Table(RETURN_ROUTE_TABLE),
        RuleAttribute::IpProtocol(IpProtocol::Tcp),
    ];
    if destination.prefix_len() > 0 {
        rule.header.dst_len = destination.prefix_len();
        rule.attributes
            .push(RuleAttribute::Destination(destination.trunc().addr()));
    }
    rule
}

/// `local <destination>/<prefix_len> dev lo table <table> proto static`. The protocol also scopes
/// deletes: a delete names it, so it never removes a kernel-made (`proto kernel`) local route for
/// the same prefix.
pub(super) fn local_route(destination: IpAddr, prefix_len: u8, table: u32) -> RouteMessage {
    let mut route = RouteMessage::default();
    route.header.address_family = family_of(destination);
    route.header.destination_prefix_length = prefix_len;
    route.header.table = header_table(table);
    route.header.protocol = RouteProtocol::Static;
    route.header.scope = RouteScope::Host;
    route.header.kind = RouteType::Local;
    route.attributes = vec![
        RouteAttribute::Destination(destination.into()),
        RouteAttribute::Table(table),
        RouteAttribute::Oif(LOOPBACK_IFINDEX),
    ];
    route
}

/// The qdisc weir's filters hang on, in an interface's ingress slot: `ingress` where weir
/// filters only what arrives, `clsact` where it filters what leaves too. Each hook a qdisc has is
/// a tc block, and binding one (a veth offloads nothing) adds it to a list the kernel keeps for
/// the whole node and searches linearly on every bind: a clsact everywhere would make that list
/// twice as long and each enrollment search it twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HookQdisc {
    Ingress,
    Clsact,
}

impl HookQdisc {
    pub(super) fn for_egress(egress: bool) -> Self {
        match egress {
            true => HookQdisc::Clsact,
            false => HookQdisc::Ingress,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            HookQdisc::Ingress => "ingress",
            HookQdisc::Clsact => "clsact",
        }
    }

    /// The qdisc a dumped message describes, if it is one of the two.
    pub(super) fn of(message: &TcMessage) -> Option<Self> {
        message
            .attributes
            .iter()
            .find_map(|attribute| match attribute {
                TcAttribute::Kind(kind) if kind == "ingress" => Some(HookQdisc::Ingress),
                TcAttribute::Kind(kind) if kind == "clsact" => Some(HookQdisc::Clsact),
                _ => None,
            })
    }

    /// Whether its egress hook is its own: on an `ingress` qdisc the kernel takes a filter
    /// addressed to egress (`ffff:fff3`) to the one block it has, the ingress one.
    pub(super) fn has_egress(self) -> bool {
        self == HookQdisc::Clsact
    }
}

/// `tc qdisc add dev <ifindex> ingress` (or `clsact`).
pub(super) fn hook_qdisc(ifindex: u32, qdisc: HookQdisc) -> TcMessage {
    let mut message = TcMessage::default();
    message.header.index = ifindex as i32;
    message.header.handle = TcHandle {
        major: TcHandle::INGRESS.major,
        minor: 0,
    };
    message.header.parent = TcHandle::INGRESS;
    message.attributes = vec![TcAttribute::Kind(qdisc.kind().into())];
    message
}

/// weir's filter on `ifindex`'s ingress (or egress): `tc filter add dev <ifindex> ingress prio 1 handle
/// 0x5745 bpf direct-action fd <program> classid :<pod slot>` (the pod's slot, by which the
/// program knows the pod: see `weir_common::MAX_POD_SLOT`); without a program, the slot itself
/// (to delete it).
pub(super) fn tc_filter(
    ifindex: u32,
    direction: Direction,
    program: Option<(TcProgram, u32)>,
) -> TcMessage {
    let mut filter = TcMessage::default();
    filter.header.index = ifindex as i32;
    filter.header.handle = TC_HANDLE.into();
    filter.header.parent = TcHandle {
        major: TcHandle::CLSACT.major,
        minor: match direction {
            Direction::Ingress => TcHandle::MIN_INGRESS,
            Direction::Egress => TcHandle::MIN_EGRESS,
        },
    };
    filter.header.info = (u32::from(TC_PRIORITY) << 16) | u32::from(ETH_P_ALL_BE);
    filter.attributes = vec![TcAttribute::Kind(TcFilterBpf::KIND.into())];
    if let Some((program, pod_slot)) = program {
        filter.attributes.push(TcAttribute::Options(vec![
            TcOption::Bpf(TcFilterBpfOption::ClassId(pod_slot.into())),
            TcOption::Bpf(TcFilterBpfOption::ProgFd(program.fd.as_raw_fd() as u32)),
            TcOption::Bpf(TcFilterBpfOption::ProgName(program.name.into())),
            TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
        ]));
    }
    filter
}

/// `<address>/128 dev lo nodad preferred_lft 0`: no duplicate address detection (the address is
/// never tentative, so binding to it works at once) and deprecated (see [`super::install_probe_source`]).
pub(super) fn loopback_address(address: Ipv6Addr) -> AddressMessage {
    let mut lifetime = CacheInfo::default();
    lifetime.ifa_preferred = 0;
    lifetime.ifa_valid = u32::MAX; // forever
    let address = IpAddr::V6(address);
    let mut message = AddressMessage::default();
    message.header.family = AddressFamily::Inet6;
    message.header.prefix_len = 128;
    message.header.flags = AddressHeaderFlags::Nodad;
    message.header.index = LOOPBACK_IFINDEX;
    message.attributes = vec![
        AddressAttribute::Local(address),
        AddressAttribute::Address(address),
        AddressAttribute::Flags(AddressFlags::Nodad),
        AddressAttribute::CacheInfo(lifetime),
    ];
    message
}

/// What a change does to its object.
#[derive(Clone, Copy, Debug)]
pub(super) enum Op {
    Add,
    Delete,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Add => "adding",
            Op::Delete => "deleting",
        })
    }
}

pub(super) enum Object {
    Rule(RuleMessage),
    Route(RouteMessage),
    Address(AddressMessage),
    /// The qdisc weir's filters hang on.
    Qdisc(TcMessage),
    /// weir's cls_bpf filter in its fixed slot.
    Filter(TcMessage),
}

impl Object {
    pub(super) fn message(&self, op: Op) -> RouteNetlinkMessage {
        use RouteNetlinkMessage as M;
        match (self, op) {
            (Object::Rule(m), Op::Add) => M::NewRule(m.clone()),
            (Object::Rule(m), Op::Delete) => M::DelRule(m.clone()),
            (Object::Route(m), Op::Add) => M::NewRoute(m.clone()),
            (Object::Route(m), Op::Delete) => M::DelRoute(m.clone()),
            (Object::Address(m), Op::Add) => M::NewAddress(m.clone()),
            (Object::Address(m), Op::Delete) => M::DelAddress(m.clone()),
            (Object::Qdisc(m), Op::Add) => M::NewQueueDiscipline(m.clone()),
            (Object::Qdisc(m), Op::Delete) => M::DelQueueDiscipline(m.clone()),
            (Object::Filter(m), Op::Add) => M::NewTrafficFilter(m.clone()),
            (Object::Filter(m), Op::Delete) => M::DelTrafficFilter(m.clone()),
        }
    }

    pub(super) fn flags(&self, op: Op) -> u16 {
        match (self, op) {
            // Without NLM_F_EXCL a filter already in the slot (ours, an earlier agent's, or the
            // other program's) has its program replaced in place: no moment without one.
            (Object::Filter(_), Op::Add) => NLM_F_CREATE,
            (_, Op::Add) => NLM_F_CREATE | NLM_F_EXCL,
            (_, Op::Delete) => 0,
        }
    }

    pub(super) fn family(&self) -> AddressFamily {
        match self {
            Object::Rule(m) => m.header.family,
            Object::Route(m) => m.header.address_family,
            Object::Address(m) => m.header.family,
            Object::Qdisc(_) | Object::Filter(_) => AddressFamily::Unspec,
        }
    }
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let family = if self.family() == AddressFamily::Inet6 {
            "IPv6"
        } else {
            "IPv4"
        };
        match self {
            Object::Rule(_) => write!(f, "{family} rule"),
            Object::Route(_) => write!(f, "{family} route"),
            Object::Address(_) => write!(f, "{family} address"),
            Object::Qdisc(m) => {
                let kind = HookQdisc::of(m).map_or("tc", HookQdisc::kind);
                write!(f, "{kind} qdisc on ifindex {}", m.header.index)
            }
            Object::Filter(m) => write!(f, "tc filter on ifindex {}", m.header.index),
        }
    }
}
