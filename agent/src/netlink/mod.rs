//! A tiny synchronous rtnetlink client for the few routing and tc objects weir owns.
//!
//! An [`Rtnl`] is one `NETLINK_ROUTE` socket, and a netlink socket acts on the network namespace
//! of the thread that created it: made on the datapath thread after [`crate::netns::enter`], it
//! changes the pod's namespace, not the node's. An enrollment makes one and does everything
//! through it: the netns cookie, one link and one address dump, then one datagram for the return
//! path and one for the tc objects (see [`Rtnl::attach_programs`]), since round trips and sockets
//! were much of a pod's enrollment time. The kernel handles every request of a datagram, in
//! order, even after an earlier one failed.
//!
//! Everything is idempotent: adds use `NLM_F_EXCL`, so an object already there is reported as
//! `EEXIST` (this is what makes a rerun not duplicate a rule: without `NLM_F_EXCL` the kernel
//! happily adds the same rule twice), and deleting what is not there is success too.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
    NLM_F_DUMP_INTR, NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_route::{
    address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, CacheInfo},
    link::{LinkAttribute, LinkExtentMask, LinkFlags, LinkMessage},
    nsid::{NsidAttribute, NsidMessage},
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
    tc::{TcAttribute, TcBpfFlags, TcFilterBpf, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use weir_common::{PROBE_SOURCE_V4, PROBE_SOURCE_V6, RETURN_MARK, RETURN_ROUTE_TABLE};

/// Priority of the return-path rule. Anything between the `local` table's rule (0) and `main`'s
/// (32766, whose routes would send the app's replies out of eth0 instead of back to ztunnel) works;
/// 32764 is the slot istio-cni's in-pod mode uses for its equivalent rule, so `ip rule` in a pod
/// looks the same under either, and a fixed priority is what lets `NLM_F_EXCL` see a duplicate.
pub const RETURN_RULE_PRIORITY: u32 = 32764;

/// The loopback device is ifindex 1 in every network namespace (`LOOPBACK_IFINDEX` in the kernel),
/// so no lookup is needed.
pub(crate) const LOOPBACK_IFINDEX: u32 = 1;

const RT_TABLE_LOCAL: u32 = 255;

/// weir's tc filter's place on a pod interface's ingress: fixed, so enrolling again replaces the
/// program in place (also another agent version's) and unenrolling removes exactly it.
pub const TC_PRIORITY: u16 = 1;
pub const TC_HANDLE: u32 = 0x5745;
/// `ETH_P_ALL` in network order, as `tcm_info`'s protocol half wants it.
const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Room for one datagram of a dump: the kernel fills at most 32 KiB per `recv`.
const RECV_BUFFER: usize = 32 * 1024;

/// A tc program weir attaches to pod interfaces, by its fd and name (the name `tc filter show`
/// prints).
#[derive(Clone, Copy)]
pub struct TcProgram<'a> {
    pub fd: BorrowedFd<'a>,
    pub name: &'a str,
}

/// weir's programs on a pod's interfaces, for [`Rtnl::attach_programs`].
pub struct PodSetup<'a> {
    /// The pod's interfaces but loopback, `(ifindex, name)`.
    pub interfaces: &'a [(u32, String)],
    /// Those whose TCP goes to ztunnel's outbound port (`istio.io/reroute-virtual-interfaces`).
    pub rerouted: &'a [String],
    /// The program for every other interface.
    pub inbound: TcProgram<'a>,
    /// The program for the rerouted interfaces.
    pub reroute: TcProgram<'a>,
}

/// The interfaces whose rerouting rules ([`reroute_rule`]) are in the current netns, sorted.
pub fn reroute_rules() -> io::Result<Vec<String>> {
    let mut names: Vec<String> = installed_reroute_rules(&mut Rtnl::new()?)?
        .iter()
        .filter_map(reroute_interface)
        .cloned()
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// `op` on an interface's rerouting rules, IPv4 and IPv6.
fn reroute_rules_of(op: Op, interface: &str) -> [(Op, Object); 2] {
    [Ipv4Addr::UNSPECIFIED.into(), Ipv6Addr::UNSPECIFIED.into()]
        .map(|any| (op, Object::Rule(reroute_rule(any, interface))))
}

/// The rerouted interfaces' rules in the current netns (by their shape, see [`reroute_rule`]).
fn installed_reroute_rules(rtnl: &mut Rtnl) -> io::Result<Vec<RuleMessage>> {
    let replies = rtnl.dump(RouteNetlinkMessage::GetRule(RuleMessage::default()))?;
    Ok(replies
        .into_iter()
        .filter_map(|reply| match reply {
            RouteNetlinkMessage::NewRule(rule) => Some(rule),
            _ => None,
        })
        .filter_map(|rule| {
            let has = |wanted: &RuleAttribute| rule.attributes.contains(wanted);
            let ours = has(&RuleAttribute::Table(RETURN_ROUTE_TABLE))
                && has(&RuleAttribute::Priority(RETURN_RULE_PRIORITY))
                && has(&RuleAttribute::IpProtocol(IpProtocol::Tcp));
            let any = match rule.header.family {
                AddressFamily::Inet6 => Ipv6Addr::UNSPECIFIED.into(),
                _ => Ipv4Addr::UNSPECIFIED.into(),
            };
            // Deleted as built, not as dumped: the dump carries attributes a delete must not
            // name.
            ours.then(|| reroute_interface(&rule).map(|name| reroute_rule(any, name)))?
        })
        .collect())
}

fn reroute_interface(rule: &RuleMessage) -> Option<&String> {
    rule.attributes
        .iter()
        .find_map(|attribute| match attribute {
            RuleAttribute::Iifname(name) => Some(name),
            _ => None,
        })
}

/// Makes the probe source addresses local in the current (the node's) netns, so that a socket, and
/// the connect programs' `bpf_bind`, can bind to them:
/// `ip route add local 169.254.7.127/32 dev lo table local`, and
/// `ip addr add fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 dev lo nodad preferred_lft 0`.
/// IPv4 needs only the route (an IPv4 socket binds to any address the `local` table has, and the
/// address never becomes a source candidate that way); IPv6 binds only to interface addresses.
/// The IPv6 address is deprecated from the start (`preferred_lft 0`) so source address selection
/// passes over it when the node has another global address: a ULA on `lo` would otherwise win the
/// longest-prefix rule for the node's own connections to other ULA destinations. Binding to a
/// deprecated address still works. Idempotent; IPv6 is skipped where it is disabled.
pub fn install_probe_source() -> io::Result<()> {
    Rtnl::new()?.apply(probe_source().map(|object| (Op::Add, object)))
}

/// Undoes [`install_probe_source`]; what is already gone is success.
pub fn remove_probe_source() -> io::Result<()> {
    Rtnl::new()?.apply(probe_source().map(|object| (Op::Delete, object)))
}

/// A non-blocking socket in the current netns (the node's) that receives every link and address
/// change (`RTNLGRP_LINK`, `RTNLGRP_IPV4_IFADDR`, `RTNLGRP_IPV6_IFADDR`) of every netns that has
/// an id here (`NETLINK_LISTEN_ALL_NSID`), each tagged with that id ([`recv_namespace_id`]).
/// Its messages only say that something changed; an overflow (`ENOBUFS`) says the same of
/// everything. One socket for every pod: every rtnetlink notification on the node walks every
/// socket subscribed to rtnetlink groups, in any netns, so a socket per pod made each of them
/// (and each of weir's own netlink changes) cost O(pods).
pub fn subscribe_interface_changes() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    let groups = libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR;
    socket.bind(&SocketAddr::new(0, groups as u32))?;
    socket.set_listen_all_namespaces(true)?;
    // A reboot storm's changes from thousands of pods at once: fewer overflows.
    socket.set_rx_buf_sz(CHANGES_RECV_BUFFER)?;
    socket.set_non_blocking(true)?;
    Ok(socket)
}

const CHANGES_RECV_BUFFER: usize = 4 << 20;

/// Receives one datagram from a [`subscribe_interface_changes`] socket, its content discarded
/// (only the wake-up matters): returns the id of the netns it came from, `None` for the
/// socket's own netns.
pub fn recv_namespace_id(socket: &impl AsRawFd) -> io::Result<Option<i32>> {
    let mut discard = [0u8; 16];
    let mut iov = libc::iovec {
        iov_base: discard.as_mut_ptr().cast(),
        iov_len: discard.len(),
    };
    // u64s: a control buffer aligned as `cmsghdr` wants.
    let mut control = [0u64; 8];
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = size_of_val(&control);
    // SAFETY: `header` points at live buffers of the sizes it states.
    if unsafe { libc::recvmsg(socket.as_raw_fd(), &mut header, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled `header`'s control buffer; the CMSG macros stay within it.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&header) };
    while !cmsg.is_null() {
        // SAFETY: non-null, within the control buffer.
        let (level, kind) = unsafe { ((*cmsg).cmsg_level, (*cmsg).cmsg_type) };
        if level == libc::SOL_NETLINK && kind == libc::NETLINK_LISTEN_ALL_NSID {
            // SAFETY: this message's data is the sender's netns id, an int.
            let id = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>()) };
            return Ok(Some(id));
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&header, cmsg) };
    }
    Ok(None)
}

/// What makes `RETURN_MARK`-marked replies in a netns take the `local` route in table
/// `RETURN_ROUTE_TABLE`, for IPv4 and IPv6, routes before rules (so a rule never points at an
/// empty table): `ip route add local 0.0.0.0/0 dev lo table 100`,
/// `ip -6 route add local ::/0 dev lo table 100` and
/// `ip rule add fwmark 0x1000/0x1000 lookup 100 priority 32764`. Needs `lo` up, as it is in every
/// pod. Where IPv6 is disabled (the namespace's `disable_ipv6` sysctl, or no IPv6 in the kernel)
/// its half is skipped: there is no IPv6 traffic to return.
fn return_path() -> [Object; 4] {
    let [v4, v6] = [Ipv4Addr::UNSPECIFIED.into(), Ipv6Addr::UNSPECIFIED.into()];
    [
        Object::Route(local_route(v4, 0, RETURN_ROUTE_TABLE)),
        Object::Route(local_route(v6, 0, RETURN_ROUTE_TABLE)),
        Object::Rule(return_rule(v4)),
        Object::Rule(return_rule(v6)),
    ]
}

fn probe_source() -> [Object; 2] {
    [
        Object::Route(local_route(PROBE_SOURCE_V4.into(), 32, RT_TABLE_LOCAL)),
        Object::Address(loopback_address(PROBE_SOURCE_V6.into())),
    ]
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
fn return_rule(any: IpAddr) -> RuleMessage {
    let mut rule = RuleMessage::default();
    rule.header.family = family_of(any);
    rule.header.table = header_table(RETURN_ROUTE_TABLE);
    rule.header.action = RuleAction::ToTable;
    rule.attributes = vec![
        RuleAttribute::Priority(RETURN_RULE_PRIORITY),
        RuleAttribute::FwMark(RETURN_MARK),
        RuleAttribute::FwMask(RETURN_MARK),
        RuleAttribute::Table(RETURN_ROUTE_TABLE),
    ];
    rule
}

/// `iif <interface> ipproto tcp lookup RETURN_ROUTE_TABLE priority 32764`, for the family of
/// `any`: the TCP arriving on `interface` takes the `local` route of the return path's table, so
/// it is delivered to ztunnel's outbound listener (the tc program assigns it) instead of being
/// forwarded. A rule names its interface, so it applies as soon as an interface of that name
/// appears.
fn reroute_rule(any: IpAddr, interface: &str) -> RuleMessage {
    let mut rule = RuleMessage::default();
    rule.header.family = family_of(any);
    rule.header.table = header_table(RETURN_ROUTE_TABLE);
    rule.header.action = RuleAction::ToTable;
    rule.attributes = vec![
        RuleAttribute::Iifname(interface.to_owned()),
        RuleAttribute::Priority(RETURN_RULE_PRIORITY),
        RuleAttribute::Table(RETURN_ROUTE_TABLE),
        RuleAttribute::IpProtocol(IpProtocol::Tcp),
    ];
    rule
}

/// `local <destination>/<prefix_len> dev lo table <table> proto static`. The protocol also scopes
/// deletes: a delete names it, so it never removes a kernel-made (`proto kernel`) local route for
/// the same prefix.
fn local_route(destination: IpAddr, prefix_len: u8, table: u32) -> RouteMessage {
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

/// `tc qdisc add dev <ifindex> clsact`.
fn clsact(ifindex: u32) -> TcMessage {
    let mut qdisc = TcMessage::default();
    qdisc.header.index = ifindex as i32;
    qdisc.header.handle = TcHandle {
        major: TcHandle::CLSACT.major,
        minor: 0,
    };
    qdisc.header.parent = TcHandle::CLSACT;
    qdisc.attributes = vec![TcAttribute::Kind("clsact".into())];
    qdisc
}

/// weir's filter on `ifindex`'s ingress: `tc filter add dev <ifindex> ingress prio 1 handle
/// 0x5745 bpf direct-action fd <program>`; without a program, the slot itself (to delete it).
fn tc_filter(ifindex: u32, program: Option<TcProgram>) -> TcMessage {
    let mut filter = TcMessage::default();
    filter.header.index = ifindex as i32;
    filter.header.handle = TC_HANDLE.into();
    filter.header.parent = TcHandle {
        major: TcHandle::CLSACT.major,
        minor: TcHandle::MIN_INGRESS,
    };
    filter.header.info = (u32::from(TC_PRIORITY) << 16) | u32::from(ETH_P_ALL_BE);
    filter.attributes = vec![TcAttribute::Kind(TcFilterBpf::KIND.into())];
    if let Some(program) = program {
        filter.attributes.push(TcAttribute::Options(vec![
            TcOption::Bpf(TcFilterBpfOption::ProgFd(program.fd.as_raw_fd() as u32)),
            TcOption::Bpf(TcFilterBpfOption::ProgName(program.name.into())),
            TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
        ]));
    }
    filter
}

/// `<address>/128 dev lo nodad preferred_lft 0`: no duplicate address detection (the address is
/// never tentative, so binding to it works at once) and deprecated (see [`install_probe_source`]).
fn loopback_address(address: Ipv6Addr) -> AddressMessage {
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

#[derive(Clone, Copy, Debug)]
enum Op {
    Add,
    Delete,
}

impl Op {
    /// Whether `errno` means the object is already in the wanted state. Rules say ENOENT when
    /// gone, routes ESRCH, IPv6 addresses EADDRNOTAVAIL.
    fn settled(self, errno: i32) -> bool {
        match self {
            Op::Add => errno == libc::EEXIST,
            Op::Delete => matches!(errno, libc::ENOENT | libc::ESRCH | libc::EADDRNOTAVAIL),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Add => "adding",
            Op::Delete => "deleting",
        })
    }
}

enum Object {
    Rule(RuleMessage),
    Route(RouteMessage),
    Address(AddressMessage),
    /// The clsact qdisc weir's filter hangs on.
    Clsact(TcMessage),
    /// weir's cls_bpf filter in its fixed slot.
    Filter(TcMessage),
}

impl Object {
    fn message(&self, op: Op) -> RouteNetlinkMessage {
        use RouteNetlinkMessage as M;
        match (self, op) {
            (Object::Rule(m), Op::Add) => M::NewRule(m.clone()),
            (Object::Rule(m), Op::Delete) => M::DelRule(m.clone()),
            (Object::Route(m), Op::Add) => M::NewRoute(m.clone()),
            (Object::Route(m), Op::Delete) => M::DelRoute(m.clone()),
            (Object::Address(m), Op::Add) => M::NewAddress(m.clone()),
            (Object::Address(m), Op::Delete) => M::DelAddress(m.clone()),
            (Object::Clsact(m), Op::Add) => M::NewQueueDiscipline(m.clone()),
            (Object::Clsact(m), Op::Delete) => M::DelQueueDiscipline(m.clone()),
            (Object::Filter(m), Op::Add) => M::NewTrafficFilter(m.clone()),
            (Object::Filter(m), Op::Delete) => M::DelTrafficFilter(m.clone()),
        }
    }

    fn flags(&self, op: Op) -> u16 {
        match (self, op) {
            // Without NLM_F_EXCL a filter already in the slot (ours, an earlier agent's, or the
            // other program's) has its program replaced in place: no moment without one.
            (Object::Filter(_), Op::Add) => NLM_F_CREATE,
            (_, Op::Add) => NLM_F_CREATE | NLM_F_EXCL,
            (_, Op::Delete) => 0,
        }
    }

    fn family(&self) -> AddressFamily {
        match self {
            Object::Rule(m) => m.header.family,
            Object::Route(m) => m.header.address_family,
            Object::Address(m) => m.header.family,
            Object::Clsact(_) | Object::Filter(_) => AddressFamily::Unspec,
        }
    }

    /// Whether `errno` says IPv6 is off here: `disable_ipv6` makes routes via and addresses on
    /// `lo` fail with EACCES; a kernel without IPv6 has no rules or routes for it (EAFNOSUPPORT).
    fn family_disabled(&self, errno: i32) -> bool {
        self.family() == AddressFamily::Inet6 && matches!(errno, libc::EACCES | libc::EAFNOSUPPORT)
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
            Object::Clsact(m) => write!(f, "clsact qdisc on ifindex {}", m.header.index),
            Object::Filter(m) => write!(f, "tc filter on ifindex {}", m.header.index),
        }
    }
}

/// One rtnetlink socket, in the network namespace of the thread that made it.
pub struct Rtnl {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl AsFd for Rtnl {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

impl Rtnl {
    /// A socket in the calling thread's current network namespace.
    pub fn new() -> io::Result<Self> {
        let socket = Socket::new(NETLINK_ROUTE)?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// The id this socket's netns has for the netns `netns` (an fd of it), assigned now if it
    /// has none yet (`RTM_GETNSID`, then `RTM_NEWNSID`). Ids are what
    /// [`subscribe_interface_changes`] tags other namespaces' changes with.
    pub fn namespace_id(&mut self, netns: BorrowedFd<'_>) -> io::Result<i32> {
        let fd = NsidAttribute::Fd(netns.as_raw_fd() as u32);
        for _ in 0..2 {
            let mut query = NsidMessage::default();
            query.attributes.push(fd.clone());
            if let RouteNetlinkMessage::NewNsId(reply) =
                self.request(RouteNetlinkMessage::GetNsId(query))?
            {
                let id = reply
                    .attributes
                    .iter()
                    .find_map(|attribute| match attribute {
                        NsidAttribute::Id(id) if *id >= 0 => Some(*id),
                        _ => None,
                    });
                if let Some(id) = id {
                    return Ok(id);
                }
            }
            let mut assign = NsidMessage::default();
            // -1: any free id.
            assign
                .attributes
                .extend([fd.clone(), NsidAttribute::Id(-1)]);
            let errno = self.execute(vec![(RouteNetlinkMessage::NewNsId(assign), 0)])?[0];
            if errno != 0 && errno != libc::EEXIST {
                return Err(io::Error::from_raw_os_error(errno));
            }
        }
        Err(io::Error::other("the netns got no id"))
    }

    /// `(ifindex, name)` of every link but loopback (`RTM_GETLINK` dump; not `/sys/class/net`,
    /// which shows the namespace `/sys` was mounted in).
    pub fn non_loopback_interfaces(&mut self) -> io::Result<Vec<(u32, String)>> {
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
                Some((link.header.index, name))
            })
            .collect())
    }

    /// Every address on the namespace's interfaces but loopback (`RTM_GETADDR` dump), tentative
    /// ones included: the pod's CNI addresses, and also those no CNI result names, such as IPv6
    /// link-local ones, through which a neighbour on the same segment reaches the pod's
    /// listeners too.
    pub fn non_loopback_addresses(&mut self) -> io::Result<Vec<IpAddr>> {
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
            .filter(|(ifindex, ip)| *ifindex != LOOPBACK_IFINDEX && !ip.is_loopback())
            .map(|(_, ip)| ip)
            .collect())
    }

    /// The return path (see [`return_path`]), in one datagram. Idempotent.
    pub fn set_up_return_path(&mut self) -> io::Result<()> {
        self.apply(return_path().map(|object| (Op::Add, object)))
    }

    /// weir's programs on the pod's interfaces, in one datagram and in this order: on every
    /// interface the clsact qdisc and weir's filter with the interface's program, replacing
    /// whatever program held the slot; then the rerouted interfaces' rules (see
    /// [`reroute_rule`]), last, since until the tc program assigns a rerouted SYN to ztunnel
    /// local delivery would hand it to whatever listens on its port. The pod's other interfaces
    /// lose any rerouting rule; one naming an interface the pod no longer has stays inert until
    /// such an interface appears, which sets the pod up again. Idempotent.
    ///
    /// Apart from [`Self::set_up_return_path`] (one round trip more) so that a pod's enrollment
    /// times them apart: a clsact qdisc made on an interface that is up costs an RCU grace
    /// period (`qdisc_graft` deactivates the device), the largest single wait of an enrollment.
    pub fn attach_programs(&mut self, pod: &PodSetup) -> io::Result<()> {
        let tc = pod.interfaces.iter().flat_map(|(ifindex, name)| {
            let program = match pod.rerouted.contains(name) {
                true => pod.reroute,
                false => pod.inbound,
            };
            [
                (Op::Add, Object::Clsact(clsact(*ifindex))),
                (Op::Add, Object::Filter(tc_filter(*ifindex, Some(program)))),
            ]
        });
        let unrouted = pod
            .interfaces
            .iter()
            .filter(|(_, name)| !pod.rerouted.contains(name))
            .flat_map(|(_, name)| reroute_rules_of(Op::Delete, name));
        let rerouted = pod
            .rerouted
            .iter()
            .flat_map(|name| reroute_rules_of(Op::Add, name));
        self.apply(tc.chain(unrouted).chain(rerouted))
    }

    /// Undoes [`Self::set_up_return_path`] and [`Self::attach_programs`] on `interfaces`, in one
    /// datagram: weir's filters, every rerouting rule, the return path. Best effort: what is
    /// already gone is success.
    pub fn tear_down_pod(&mut self, interfaces: &[(u32, String)]) -> io::Result<()> {
        let filters = interfaces
            .iter()
            .map(|(ifindex, _)| (Op::Delete, Object::Filter(tc_filter(*ifindex, None))));
        let rules: Vec<(Op, Object)> = installed_reroute_rules(self)?
            .into_iter()
            .map(|rule| (Op::Delete, Object::Rule(rule)))
            .collect();
        let return_path = return_path()
            .into_iter()
            .rev()
            .map(|object| (Op::Delete, object));
        self.apply(filters.chain(rules).chain(return_path))?;
        // The clsact qdisc goes too once no filter is left on it, weir's or another's: one that
        // still holds another tool's filters stays.
        let mut unused = Vec::new();
        for (ifindex, _) in interfaces {
            if self
                .clsact_filters(*ifindex)
                .is_ok_and(|filters| filters == 0)
            {
                unused.push((Op::Delete, Object::Clsact(clsact(*ifindex))));
            }
        }
        self.apply(unused)
    }

    /// The filters on the interface's clsact qdisc, both directions.
    fn clsact_filters(&mut self, ifindex: u32) -> io::Result<usize> {
        let mut count = 0;
        for minor in [TcHandle::MIN_INGRESS, TcHandle::MIN_EGRESS] {
            let mut request = TcMessage::default();
            request.header.index = ifindex as i32;
            request.header.parent = TcHandle {
                major: TcHandle::CLSACT.major,
                minor,
            };
            count += self
                .dump(RouteNetlinkMessage::GetTrafficFilter(request))?
                .into_iter()
                .filter(|reply| matches!(reply, RouteNetlinkMessage::NewTrafficFilter(_)))
                .count();
        }
        Ok(count)
    }

    /// Applies every `(op, object)`, in order, in one round trip.
    fn apply(&mut self, changes: impl IntoIterator<Item = (Op, Object)>) -> io::Result<()> {
        let changes: Vec<(Op, Object)> = changes.into_iter().collect();
        if changes.is_empty() {
            return Ok(());
        }
        let messages = changes
            .iter()
            .map(|(op, object)| (object.message(*op), object.flags(*op)))
            .collect();
        let errnos = self.execute(messages)?;
        for ((op, object), errno) in changes.iter().zip(errnos) {
            if errno == 0 || op.settled(errno) {
                continue;
            }
            if object.family_disabled(errno) {
                tracing::debug!("IPv6 is disabled in this network namespace: not {op} {object}");
                continue;
            }
            let err = io::Error::from_raw_os_error(errno);
            return Err(io::Error::new(err.kind(), format!("{op} {object}: {err}")));
        }
        Ok(())
    }

    /// Sends all `messages` in one datagram, each with `NLM_F_REQUEST` and its own flags, and
    /// returns each one's errno (0 for success), in order. Only the last asks for an ACK: the
    /// kernel answers every failed request anyway and handles a datagram's requests in order
    /// before the send returns, so the last one's answer comes after every other's. That saves
    /// a `recv` per successful request.
    fn execute(&mut self, messages: Vec<(RouteNetlinkMessage, u16)>) -> io::Result<Vec<i32>> {
        let first = self.sequence.wrapping_add(1);
        let mut datagram = Vec::new();
        let count = messages.len();
        for (index, (message, flags)) in messages.into_iter().enumerate() {
            let ack = if index + 1 == count { NLM_F_ACK } else { 0 };
            self.append(&mut datagram, message, NLM_F_REQUEST | ack | flags);
        }
        self.socket.send(&datagram, 0)?;

        let mut errnos = vec![0; count];
        loop {
            for reply in self.recv()? {
                let NetlinkPayload::Error(error) = reply.payload else {
                    continue;
                };
                let index = reply.header.sequence_number.wrapping_sub(first) as usize;
                if let Some(slot) = errnos.get_mut(index) {
                    // The kernel reports -errno; 0 is the plain ACK.
                    *slot = -error.raw_code();
                    if index + 1 == count {
                        return Ok(errnos);
                    }
                }
            }
        }
    }

    /// Every reply to a `NLM_F_DUMP` request. A dump that raced with a change (`NLM_F_DUMP_INTR`)
    /// may be inconsistent and is retried.
    fn dump(&mut self, request: RouteNetlinkMessage) -> io::Result<Vec<RouteNetlinkMessage>> {
        for _ in 0..3 {
            let mut datagram = Vec::new();
            self.append(&mut datagram, request.clone(), NLM_F_REQUEST | NLM_F_DUMP);
            self.socket.send(&datagram, 0)?;

            let mut replies = Vec::new();
            let mut interrupted = false;
            'dump: loop {
                for reply in self.recv()? {
                    if reply.header.sequence_number != self.sequence {
                        continue;
                    }
                    interrupted |= reply.header.flags & NLM_F_DUMP_INTR != 0;
                    match reply.payload {
                        NetlinkPayload::InnerMessage(message) => replies.push(message),
                        NetlinkPayload::Done(_) => break 'dump,
                        NetlinkPayload::Error(error) if error.code.is_some() => {
                            return Err(error.to_io())
                        }
                        _ => {}
                    }
                }
            }
            if !interrupted {
                return Ok(replies);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::Interrupted,
            "netlink dump kept changing underneath",
        ))
    }

    fn append(&mut self, datagram: &mut Vec<u8>, message: RouteNetlinkMessage, flags: u16) {
        self.sequence = self.sequence.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.sequence;
        let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
        message.finalize();
        let start = datagram.len();
        // Messages in one datagram start on 4-byte boundaries (NLMSG_ALIGN).
        datagram.resize(start + message.buffer_len().next_multiple_of(4), 0);
        message.serialize(&mut datagram[start..]);
    }

    /// Sends one request and returns its reply.
    fn request(&mut self, message: RouteNetlinkMessage) -> io::Result<RouteNetlinkMessage> {
        let mut datagram = Vec::new();
        self.append(&mut datagram, message, NLM_F_REQUEST);
        self.socket.send(&datagram, 0)?;
        loop {
            for reply in self.recv()? {
                if reply.header.sequence_number != self.sequence {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::InnerMessage(message) => return Ok(message),
                    NetlinkPayload::Error(error) if error.code.is_some() => {
                        return Err(error.to_io())
                    }
                    _ => {}
                }
            }
        }
    }

    /// The messages of the next datagram.
    fn recv(&mut self) -> io::Result<Vec<NetlinkMessage<RouteNetlinkMessage>>> {
        self.buffer.clear();
        // MSG_TRUNC: the return value is the datagram's full length, so truncation shows.
        let len = self.socket.recv(&mut self.buffer, libc::MSG_TRUNC)?;
        if len > self.buffer.len() {
            return Err(io::Error::other(format!(
                "netlink reply of {len} bytes truncated"
            )));
        }
        let mut messages = Vec::new();
        let mut rest = &self.buffer[..];
        while !rest.is_empty() {
            let message = NetlinkMessage::deserialize(rest)
                .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))?;
            let len = (message.header.length as usize).next_multiple_of(4);
            rest = rest.get(len..).unwrap_or_default();
            messages.push(message);
        }
        Ok(messages)
    }
}

#[cfg(test)]
mod tests;
