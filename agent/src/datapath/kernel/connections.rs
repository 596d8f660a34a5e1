//! The established TCP connections of the calling thread's netns, from the kernel's socket table
//! (sock_diag), as conntrack would hold them: one per connection, from the side that opened it.
//!
//! Read when conntrack is to follow connections it never saw (a pod handed back to istio's
//! rules): each is then given to conntrack as established, see [`super::nftables::Nft::follow`].

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr as NetlinkAddr};

use super::nftables::{error_code, netlink_messages, NLMSG_DONE, NLMSG_ERROR, RECV_BUFFER};

/// `SOCK_DIAG_BY_FAMILY`, and `struct inet_diag_req_v2`'s and `struct inet_diag_msg`'s sizes.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const REQUEST_LEN: usize = 56;
const MESSAGE_LEN: usize = 72;
/// `INET_DIAG_MARK`: the socket's mark, sent to a requester with `CAP_NET_ADMIN`.
const INET_DIAG_MARK: u16 = 15;
const TCP_ESTABLISHED: u32 = 1;
const TCP_LISTEN: u32 = 10;

/// One established TCP connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::datapath) struct TcpConnection {
    /// The side that opened it (the other side's socket is not a listener's child).
    pub(in crate::datapath) from: SocketAddr,
    pub(in crate::datapath) to: SocketAddr,
    /// Whether both ends are sockets of this netns.
    pub(in crate::datapath) local: bool,
    /// The marks of its sockets in this netns (one or two).
    pub(in crate::datapath) marks: [Option<u32>; 2],
}

/// A socket as sock_diag reports it.
struct DiagSocket {
    local: SocketAddr,
    remote: SocketAddr,
    mark: Option<u32>,
}

/// The netns's established TCP connections, both families.
pub(in crate::datapath) fn established_tcp() -> io::Result<Vec<TcpConnection>> {
    let mut established = Vec::new();
    let mut listening = HashSet::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        established.extend(dump(family as u8, TCP_ESTABLISHED)?);
        listening.extend(dump(family as u8, TCP_LISTEN)?.into_iter().map(|s| s.local));
    }
    let any_address_ports: HashSet<u16> = (listening.iter())
        .filter(|address| address.ip().is_unspecified())
        .map(SocketAddr::port)
        .collect();
    let listens = |address: SocketAddr| {
        listening.contains(&address) || any_address_ports.contains(&address.port())
    };
    let ends: HashSet<(SocketAddr, SocketAddr)> =
        established.iter().map(|s| (s.local, s.remote)).collect();
    // Both ends of a connection within the netns are two sockets: one connection, two marks.
    let mut connections: Vec<TcpConnection> = Vec::new();
    let mut index: HashMap<(SocketAddr, SocketAddr), usize> = HashMap::new();
    for socket in &established {
        let local = ends.contains(&(socket.remote, socket.local));
        let accepted = listens(socket.local);
        let (from, to) = match accepted {
            true => (socket.remote, socket.local),
            false => (socket.local, socket.remote),
        };
        if let Some(&known) = index.get(&(from, to)) {
            connections[known].marks[1] = socket.mark;
            continue;
        }
        index.insert((from, to), connections.len());
        connections.push(TcpConnection {
            from,
            to,
            local,
            marks: [socket.mark, None],
        });
    }
    Ok(connections)
}

/// The netns's TCP sockets of `family` in `state`.
fn dump(family: u8, state: u32) -> io::Result<Vec<DiagSocket>> {
    let socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    let mut request = Vec::with_capacity(16 + REQUEST_LEN);
    request.extend_from_slice(&((16 + REQUEST_LEN) as u32).to_ne_bytes());
    request.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    request.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes());
    request.extend_from_slice(&0u32.to_ne_bytes());
    // inet_diag_req_v2: family, protocol, extensions, padding, states, then a zero socket id.
    request.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    request.extend_from_slice(&(1u32 << state).to_ne_bytes());
    request.resize(16 + REQUEST_LEN, 0);
    socket.send(&request, 0)?;

    let mut sockets = Vec::new();
    let mut buffer = Vec::with_capacity(RECV_BUFFER);
    loop {
        buffer.clear();
        socket.recv(&mut buffer, 0)?;
        for (kind, _, payload) in netlink_messages(&buffer) {
            match kind {
                NLMSG_DONE => return Ok(sockets),
                NLMSG_ERROR => {
                    return Err(io::Error::from_raw_os_error(-error_code(payload)));
                }
                SOCK_DIAG_BY_FAMILY if payload.len() >= MESSAGE_LEN => {
                    sockets.extend(parse(payload));
                }
                _ => {}
            }
        }
    }
}

/// An `inet_diag_msg` and its attributes.
fn parse(message: &[u8]) -> Option<DiagSocket> {
    let family = i32::from(message[0]);
    let port = |at: usize| u16::from_be_bytes([message[at], message[at + 1]]);
    let address = |at: usize| -> Option<IpAddr> {
        let bytes = &message[at..at + 16];
        match family {
            libc::AF_INET => Some(Ipv4Addr::from(<[u8; 4]>::try_from(&bytes[..4]).ok()?).into()),
            // A dual-stack socket's IPv4 peer is v4-mapped: conntrack holds it as IPv4.
            libc::AF_INET6 => {
                Some(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?).to_canonical())
            }
            _ => None,
        }
    };
    // inet_diag_sockid, after family, state, timer, retransmits: ports, then addresses.
    let local = SocketAddr::new(address(8)?, port(4));
    let remote = SocketAddr::new(address(24)?, port(6));
    let mark = super::nftables::attrs(&message[MESSAGE_LEN..])
        .find(|(kind, _)| *kind == INET_DIAG_MARK)
        .and_then(|(_, value)| Some(u32::from_ne_bytes(value.get(..4)?.try_into().ok()?)));
    Some(DiagSocket {
        local,
        remote,
        mark,
    })
}
