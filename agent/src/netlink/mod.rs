//! A tiny synchronous rtnetlink client for the few routing objects weir owns.
//!
//! Each call opens its own `NETLINK_ROUTE` socket, and a netlink socket acts on the network
//! namespace of the thread that created it: called on the datapath thread after
//! [`crate::netns::enter`], these functions change the pod's namespace, not the node's. The requests
//! of one call go out in a single datagram; each carries `NLM_F_ACK`, and the kernel answers every
//! one of them, in order, even after an earlier one failed.
//!
//! Everything is idempotent: adds use `NLM_F_EXCL`, so an object already there is reported as
//! `EEXIST` (this is what makes a rerun not duplicate a rule: without `NLM_F_EXCL` the kernel
//! happily adds the same rule twice), and deleting what is not there is success too.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
    NLM_F_DUMP_INTR, NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_route::{
    address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, CacheInfo},
    link::LinkMessage,
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
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

/// Room for one datagram of a dump: the kernel fills at most 32 KiB per `recv`.
const RECV_BUFFER: usize = 32 * 1024;

/// Makes `RETURN_MARK`-marked replies in the current netns take the `local` route in table
/// `RETURN_ROUTE_TABLE`, for IPv4 and IPv6:
/// `ip rule add fwmark 0x1000/0x1000 lookup 100 priority 32764`,
/// `ip route add local 0.0.0.0/0 dev lo table 100` and `ip -6 route add local ::/0 dev lo table 100`.
/// Needs `lo` up, as it is in every pod. Idempotent. Where IPv6 is disabled (the namespace's
/// `disable_ipv6` sysctl, or no IPv6 in the kernel) its half is skipped: there is no IPv6 traffic
/// to return.
pub fn install_return_path() -> io::Result<()> {
    // Routes before rules: the rule never points at an empty table.
    apply(Op::Add, return_path())
}

/// Undoes [`install_return_path`]; what is already gone is success.
pub fn remove_return_path() -> io::Result<()> {
    apply(Op::Delete, return_path().into_iter().rev())
}

/// Makes the TCP arriving on each of `interfaces` in the current netns take the `local` route of
/// table `RETURN_ROUTE_TABLE` (installed by [`install_return_path`]), so that it is delivered to
/// ztunnel's outbound listener (the tc program assigns it) instead of being forwarded:
/// `ip rule add iif <interface> ipproto tcp lookup 100 priority 32764`, IPv4 and IPv6. Rules of
/// this shape for other interfaces are removed, so the set is exactly `interfaces`. A rule names
/// its interface, so it applies as soon as an interface of that name appears.
pub fn set_reroute_rules(interfaces: &[String]) -> io::Result<()> {
    let stale: Vec<Object> = installed_reroute_rules()?
        .into_iter()
        .filter(|rule| !reroute_interface(rule).is_some_and(|name| interfaces.contains(name)))
        .map(Object::Rule)
        .collect();
    apply(Op::Delete, stale)?;
    apply(
        Op::Add,
        interfaces.iter().flat_map(|interface| {
            [Ipv4Addr::UNSPECIFIED.into(), Ipv6Addr::UNSPECIFIED.into()]
                .map(|any| Object::Rule(reroute_rule(any, interface)))
        }),
    )
}

/// The interfaces [`set_reroute_rules`] made rerouted in the current netns, sorted.
pub fn reroute_rules() -> io::Result<Vec<String>> {
    let mut names: Vec<String> = installed_reroute_rules()?
        .iter()
        .filter_map(reroute_interface)
        .cloned()
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// The rerouted interfaces' rules in the current netns (by their shape, see [`set_reroute_rules`]).
fn installed_reroute_rules() -> io::Result<Vec<RuleMessage>> {
    let replies = Rtnl::new()?.dump(RouteNetlinkMessage::GetRule(RuleMessage::default()))?;
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
    apply(Op::Add, probe_source())
}

/// Undoes [`install_probe_source`]; what is already gone is success.
pub fn remove_probe_source() -> io::Result<()> {
    apply(Op::Delete, probe_source())
}

/// A non-blocking socket in the current netns that receives every link and address change there
/// (`RTNLGRP_LINK`, `RTNLGRP_IPV4_IFADDR`, `RTNLGRP_IPV6_IFADDR`). Its messages only say that
/// something changed; an overflow (`ENOBUFS`) says the same.
pub fn subscribe_interface_changes() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    let groups = libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR;
    socket.bind(&SocketAddr::new(0, groups as u32))?;
    socket.set_non_blocking(true)?;
    Ok(socket)
}

/// All links of the current netns (`RTM_GETLINK` dump).
pub(crate) fn links() -> io::Result<Vec<LinkMessage>> {
    let replies = Rtnl::new()?.dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))?;
    Ok(replies
        .into_iter()
        .filter_map(|reply| match reply {
            RouteNetlinkMessage::NewLink(link) => Some(link),
            _ => None,
        })
        .collect())
}

/// `(ifindex, address)` of every address in the current netns (`RTM_GETADDR` dump), tentative
/// ones included.
pub(crate) fn addresses() -> io::Result<Vec<(u32, IpAddr)>> {
    let replies = Rtnl::new()?.dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()))?;
    Ok(replies
        .into_iter()
        .filter_map(|reply| match reply {
            RouteNetlinkMessage::NewAddress(address) => {
                // IFA_LOCAL is the address itself; IFA_ADDRESS is the peer's on a point-to-point
                // link, and the only one given otherwise.
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

/// `iif <interface> ipproto tcp lookup RETURN_ROUTE_TABLE`, for the family of `any`.
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
    fn flags(self) -> u16 {
        match self {
            Op::Add => NLM_F_CREATE | NLM_F_EXCL,
            Op::Delete => 0,
        }
    }

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
        }
    }

    fn family(&self) -> AddressFamily {
        match self {
            Object::Rule(m) => m.header.family,
            Object::Route(m) => m.header.address_family,
            Object::Address(m) => m.header.family,
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
        let kind = match self {
            Object::Rule(_) => "rule",
            Object::Route(_) => "route",
            Object::Address(_) => "address",
        };
        write!(f, "{family} {kind}")
    }
}

/// Applies `op` to every object, in order, in one round trip.
fn apply(op: Op, objects: impl IntoIterator<Item = Object>) -> io::Result<()> {
    let objects: Vec<Object> = objects.into_iter().collect();
    if objects.is_empty() {
        return Ok(());
    }
    let messages = objects.iter().map(|object| object.message(op));
    let errnos = Rtnl::new()?.execute(messages, op.flags())?;
    for (object, errno) in objects.iter().zip(errnos) {
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

struct Rtnl {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl Rtnl {
    /// A socket in the calling thread's current network namespace.
    fn new() -> io::Result<Self> {
        let socket = Socket::new(NETLINK_ROUTE)?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// Sends all `messages` in one datagram, each with `NLM_F_REQUEST | NLM_F_ACK | flags`, and
    /// returns each one's errno (0 for success), in order.
    fn execute(
        &mut self,
        messages: impl IntoIterator<Item = RouteNetlinkMessage>,
        flags: u16,
    ) -> io::Result<Vec<i32>> {
        let first = self.sequence.wrapping_add(1);
        let mut datagram = Vec::new();
        let mut count = 0;
        for message in messages {
            self.append(&mut datagram, message, NLM_F_REQUEST | NLM_F_ACK | flags);
            count += 1;
        }
        self.socket.send(&datagram, 0)?;

        let mut errnos = vec![None; count];
        let mut pending = count;
        while pending > 0 {
            for reply in self.recv()? {
                let NetlinkPayload::Error(error) = reply.payload else {
                    continue;
                };
                let index = reply.header.sequence_number.wrapping_sub(first) as usize;
                if let Some(slot @ None) = errnos.get_mut(index) {
                    // The kernel reports -errno; 0 is the plain ACK.
                    *slot = Some(-error.raw_code());
                    pending -= 1;
                }
            }
        }
        Ok(errnos.into_iter().flatten().collect())
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
