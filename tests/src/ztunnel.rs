//! A stand-in for ztunnel in in-pod mode: the same listeners in the pod's network namespace,
//! with the same socket options, the same original-destination lookup and the same dials, so
//! that whatever the datapath does to the pod's traffic, the stand-in observes (and can be
//! checked against) what a real ztunnel would. It is not a proxy with policy: no HBONE, no mTLS,
//! no xDS.
//!
//! What ztunnel does in a pod (istio/ztunnel: `config.rs`, `inpod/config.rs`, `proxy/*.rs`,
//! `dns/server.rs`), and so what this does:
//! - Every socket it makes in the pod, listening or dialing, carries `SO_MARK` 0x539: created,
//!   marked, then bound. Listeners also get `SO_REUSEPORT` (in-pod port reuse is on by default).
//! - 15001 (outbound), 15006 (inbound plaintext) and 15008 (HBONE) listen on `[::]`, dual-stack,
//!   and are transparent (`IP_TRANSPARENT`, and `IPV6_TRANSPARENT` as they are IPv6 sockets).
//! - The DNS proxy listens on **localhost**, not on the wildcard: TCP and UDP on `127.0.0.1:15053`
//!   and, when the pod has IPv6 on `lo`, `[::1]:15053` (`Address::Localhost(ipv6, 15053)`), with
//!   the mark and port reuse but not transparent. istio's iptables `REDIRECT` in `OUTPUT` sends
//!   DNS there (locally generated packets are redirected to 127.0.0.1 / ::1), and answers leave
//!   from that address.
//! - For 15001 and 15006 the destination is `SO_ORIGINAL_DST` (`SOL_IP`, then `SOL_IPV6`), else
//!   the accepted socket's local address, canonicalised ([`sockopt::original_dst`]).
//! - 15001 dials the destination from a marked, not transparent, socket: the pod's own address.
//! - 15006 refuses destinations that are not the pod's (ztunnel: unknown destination) and dials
//!   the app from the client's address: transparent + freebind, marked, bound to `client IP:0`.
//! - A destination on 15001/15006/15008 is a self-call and is refused (ztunnel refuses it for
//!   15006; for 15001 only on loopback, routing other cases through its workload logic, which
//!   the stand-in does not have: it refuses them too instead of dialing itself in a loop).

use std::io;
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket,
};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use weir_common::{DNS_PROXY_PORT, HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT, ZTUNNEL_MARK};

use crate::netns;
use crate::server::{Listener, Log, Server, Tracker};
use crate::sockopt::{self, canonical};
use crate::traffic::{read_line, set_timeouts, write_line};
use crate::{io_timeout, Pod};

/// What the stand-in's HBONE listener answers (then it closes).
pub const HBONE_REPLY: &str = "hbone-standin";
/// What the stand-in's DNS proxy puts before the query it echoes.
pub const DNS_REPLY_PREFIX: &str = "dns-standin:";

/// Ports ztunnel never forwards to: forwarding there would reach ztunnel again.
const ILLEGAL_PORTS: [u16; 3] = [OUTBOUND_PORT, INBOUND_PORT, HBONE_PORT];

/// One connection (TCP) or query datagram (UDP) that reached a listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// The listener's port.
    pub listener: u16,
    pub peer: SocketAddr,
    /// The accepted socket's (or DNS socket's) local address.
    pub local: SocketAddr,
    /// ztunnel's `SO_ORIGINAL_DST` lookup; always `None` for DNS.
    pub original_dst: Option<SocketAddr>,
}

impl Seen {
    /// Where ztunnel takes the connection: the original destination, else the local address.
    pub fn destination(&self) -> SocketAddr {
        self.original_dst.unwrap_or(self.local)
    }
}

/// One onward connection the stand-in made (or refused to make) for a 15001/15006 connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dial {
    pub listener: u16,
    /// The connection it serves, as accepted.
    pub peer: SocketAddr,
    pub target: SocketAddr,
    /// The dialing socket's local address once connected.
    pub source: Option<SocketAddr>,
    /// Why it failed or was refused.
    pub error: Option<String>,
}

/// ztunnel's listeners in one pod; stopped (listeners closed, connections shut down, threads
/// joined) by [`ZtunnelStandIn::stop`] or on drop.
pub struct ZtunnelStandIn {
    records: Arc<Records>,
    server: Server,
}

#[derive(Default)]
struct Records {
    seen: Log<Seen>,
    dials: Log<Dial>,
}

impl ZtunnelStandIn {
    /// Starts the stand-in in `pod`'s network namespace.
    pub fn start(pod: &Pod) -> io::Result<Self> {
        Self::start_in_netns(pod.netns().open()?, &pod.ips())
    }

    /// Starts the stand-in in the network namespace `netns` (a handle like the one ztunnel gets
    /// over ZDS) of a pod whose addresses are `pod_ips`.
    pub fn start_in_netns(netns: impl Into<OwnedFd>, pod_ips: &[IpAddr]) -> io::Result<Self> {
        let netns: OwnedFd = netns.into();
        let records = Arc::new(Records::default());
        let sockets = netns::run_in(netns.as_fd(), open_sockets)?;
        let pod_ips: Arc<[IpAddr]> = pod_ips
            .iter()
            .copied()
            .map(|ip| ip.to_canonical())
            .collect();
        let listeners = sockets
            .into_iter()
            .map(|socket| match socket {
                Opened::Tcp(port, listener) => {
                    let (records, pod_ips) = (records.clone(), pod_ips.clone());
                    let handler = move |stream: TcpStream, tracker: &Tracker| {
                        if let Err(err) = serve(port, stream, &records, &pod_ips, tracker) {
                            eprintln!("ztunnel stand-in :{port}: {err}");
                        }
                    };
                    Ok(Listener::Tcp(listener, Arc::new(handler)))
                }
                Opened::Dns(socket) => {
                    let records = records.clone();
                    let local = socket.local_addr().map(canonical)?;
                    let handler = move |socket: &UdpSocket, query: &[u8], from: SocketAddr| {
                        records.seen.push(Seen {
                            listener: DNS_PROXY_PORT,
                            peer: canonical(from),
                            local,
                            original_dst: None,
                        });
                        let answer = [DNS_REPLY_PREFIX.as_bytes(), query].concat();
                        if let Err(err) = socket.send_to(&answer, from) {
                            eprintln!("ztunnel stand-in DNS: {err}");
                        }
                    };
                    Ok(Listener::Udp(socket, Box::new(handler)))
                }
            })
            .collect::<io::Result<Vec<_>>>()?;
        let server = Server::start(netns.as_fd(), "ztunnel", listeners)?;
        Ok(Self { records, server })
    }

    /// Everything that reached a listener so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.records.seen.entries()
    }

    /// The first [`Seen`] matching `predicate`, waiting up to `timeout` for it.
    pub fn wait_for(&self, predicate: impl Fn(&Seen) -> bool, timeout: Duration) -> Option<Seen> {
        self.records.seen.wait_for(predicate, timeout)
    }

    /// Every onward connection so far.
    pub fn dials(&self) -> Vec<Dial> {
        self.records.dials.entries()
    }

    /// The first [`Dial`] matching `predicate`, waiting up to `timeout` for it.
    pub fn wait_for_dial(
        &self,
        predicate: impl Fn(&Dial) -> bool,
        timeout: Duration,
    ) -> Option<Dial> {
        self.records.dials.wait_for(predicate, timeout)
    }

    pub fn stop(mut self) {
        self.server.stop();
    }
}

enum Opened {
    Tcp(u16, TcpListener),
    Dns(UdpSocket),
}

/// ztunnel's in-pod sockets; runs inside the pod's namespace.
fn open_sockets() -> io::Result<Vec<Opened>> {
    let mut sockets = Vec::new();
    for port in [OUTBOUND_PORT, INBOUND_PORT, HBONE_PORT] {
        let listener = tcp_listener((Ipv6Addr::UNSPECIFIED, port).into(), true)?;
        sockets.push(Opened::Tcp(port, listener));
    }
    for ip in [
        IpAddr::from(Ipv4Addr::LOCALHOST),
        Ipv6Addr::LOCALHOST.into(),
    ] {
        let addr = SocketAddr::new(ip, DNS_PROXY_PORT);
        match tcp_listener(addr, false) {
            Ok(listener) => sockets.push(Opened::Tcp(DNS_PROXY_PORT, listener)),
            // ztunnel skips IPv6 localhost where `::1` cannot be bound (IPv6 off in the pod).
            Err(err) if ip.is_ipv6() && err.kind() == io::ErrorKind::AddrNotAvailable => continue,
            Err(err) => return Err(err),
        }
        sockets.push(Opened::Dns(in_pod_socket(addr, Type::DGRAM)?.into()));
    }
    Ok(sockets)
}

/// A socket as ztunnel's in-pod socket factory makes it: marked at creation, port reuse, bound.
fn in_pod_socket(addr: SocketAddr, kind: Type) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), kind, None)?;
    socket.set_mark(ZTUNNEL_MARK)?;
    socket.set_reuse_port(true)?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        // Dual-stack, as tokio's IPv6 sockets are (the `bindv6only=0` default, made explicit).
        socket.set_only_v6(false)?;
    }
    socket.bind(&addr.into())?;
    Ok(socket)
}

fn tcp_listener(addr: SocketAddr, transparent: bool) -> io::Result<TcpListener> {
    let socket = in_pod_socket(addr, Type::STREAM)?;
    socket.listen(128)?;
    if transparent {
        sockopt::set_transparent(&socket)?;
    }
    Ok(socket.into())
}

fn serve(
    port: u16,
    stream: TcpStream,
    records: &Records,
    pod_ips: &[IpAddr],
    tracker: &Tracker,
) -> io::Result<()> {
    let seen = Seen {
        listener: port,
        peer: canonical(stream.peer_addr()?),
        local: canonical(stream.local_addr()?),
        original_dst: match port {
            OUTBOUND_PORT | INBOUND_PORT => sockopt::original_dst(&stream),
            _ => None,
        },
    };
    records.seen.push(seen.clone());
    match port {
        OUTBOUND_PORT => relay(&seen, stream, None, records, tracker),
        INBOUND_PORT if !pod_ips.contains(&seen.destination().ip()) => {
            refuse(
                &seen,
                records,
                "unknown destination: not this pod's address",
            );
            Ok(())
        }
        INBOUND_PORT => relay(&seen, stream, Some(seen.peer.ip()), records, tracker),
        HBONE_PORT => write_line(&stream, HBONE_REPLY),
        DNS_PROXY_PORT => {
            set_timeouts(&stream)?;
            let query = read_line(&stream)?;
            write_line(&stream, &format!("{DNS_REPLY_PREFIX}{query}"))
        }
        _ => unreachable!("no listener on {port}"),
    }
}

/// Dials the connection's destination (from `source`, when given) and copies bytes both ways
/// until both sides are done.
fn relay(
    seen: &Seen,
    client: TcpStream,
    source: Option<IpAddr>,
    records: &Records,
    tracker: &Tracker,
) -> io::Result<()> {
    let target = seen.destination();
    if ILLEGAL_PORTS.contains(&target.port()) {
        refuse(
            seen,
            records,
            "self-call: the destination is a ztunnel port",
        );
        return Ok(());
    }
    let upstream = match dial(source, target) {
        Ok(upstream) => upstream,
        Err(err) => {
            refuse(seen, records, &format!("dial from {source:?}: {err}"));
            return Ok(());
        }
    };
    records.dials.push(Dial {
        listener: seen.listener,
        peer: seen.peer,
        target,
        source: upstream.local_addr().ok().map(canonical),
        error: None,
    });
    let _tracked = tracker.track(&upstream)?;
    thread::scope(|scope| {
        scope.spawn(|| pipe(&client, &upstream));
        pipe(&upstream, &client);
    });
    Ok(())
}

fn refuse(seen: &Seen, records: &Records, why: &str) {
    records.dials.push(Dial {
        listener: seen.listener,
        peer: seen.peer,
        target: seen.destination(),
        source: None,
        error: Some(why.to_owned()),
    });
}

/// ztunnel's `freebind_connect`: a marked socket of the target's family; with a source, made
/// transparent and freebind and bound to `source:0` first, so the app sees the original client.
fn dial(source: Option<IpAddr>, target: SocketAddr) -> io::Result<TcpStream> {
    let socket = Socket::new(
        Domain::for_address(target),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_mark(ZTUNNEL_MARK)?;
    if let Some(source) = source {
        if source.is_ipv4() != target.is_ipv4() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "source and destination families differ",
            ));
        }
        sockopt::set_transparent(&socket)?;
        sockopt::set_freebind(&socket)?;
        socket.bind(&SocketAddr::new(source, 0).into())?;
    }
    socket.connect_timeout(&target.into(), io_timeout())?;
    Ok(socket.into())
}

/// Copies `from` to `to` until EOF or an error, then passes the EOF on.
fn pipe(mut from: &TcpStream, mut to: &TcpStream) {
    let _ = io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NetNs;
    use socket2::SockRef;

    #[test]
    fn sockets_are_made_as_ztunnel_makes_them() {
        let netns = crate::privileged!({
            let netns = NetNs::create("zsock")?;
            netns::ip(&["-n", netns.name(), "link", "set", "lo", "up"])?;
            Ok(netns)
        });
        let sockets = netns.run(open_sockets).unwrap();
        let mut found: Vec<(&str, String)> = Vec::new();
        for socket in &sockets {
            let (socket, kind) = match socket {
                Opened::Tcp(_, listener) => (SockRef::from(listener), "tcp"),
                Opened::Dns(socket) => (SockRef::from(socket), "udp"),
            };
            let local = socket.local_addr().unwrap().as_socket().unwrap();
            assert_eq!(socket.mark().unwrap(), ZTUNNEL_MARK, "{kind} {local}");
            assert!(socket.reuse_port().unwrap(), "{kind} {local}");
            // The proxy listeners are dual-stack and transparent; the DNS proxy is neither.
            let proxy = local.ip().is_unspecified();
            assert_eq!(socket.ip_transparent_v4().unwrap(), proxy, "{kind} {local}");
            if proxy {
                assert!(socket.ip_transparent_v6().unwrap(), "{local}");
                assert!(!socket.only_v6().unwrap(), "{local}");
            }
            found.push((kind, local.to_string()));
        }
        found.sort();
        let expected = [
            ("tcp", "127.0.0.1:15053"),
            ("tcp", "[::1]:15053"),
            ("tcp", "[::]:15001"),
            ("tcp", "[::]:15006"),
            ("tcp", "[::]:15008"),
            ("udp", "127.0.0.1:15053"),
            ("udp", "[::1]:15053"),
        ]
        .map(|(kind, addr)| (kind, addr.to_owned()));
        assert_eq!(found, expected);
    }
}
