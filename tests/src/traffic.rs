//! Small blocking servers and clients: one line (TCP) or one datagram (UDP) each way, every step
//! bounded by [`io_timeout`], so a broken datapath fails a test instead of hanging it; a
//! connection the test expects not to be made is [`tcp_attempt`]ed within [`IO_TIMEOUT`].
//!
//! Servers record what they saw, with addresses canonical (an IPv4 peer of a dual-stack socket is
//! recorded as IPv4). Clients report what the kernel told them, untouched: whether the app sees
//! the right peer is what the tests check.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};

use crate::server::{Listener, Log, Server, Tracker};
use crate::sockopt::canonical;
use crate::{io_timeout, NetNs, Pod, APP_PORT, IO_TIMEOUT};

/// One connection (TCP) or datagram (UDP) as a server saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    pub peer: SocketAddr,
    pub local: SocketAddr,
    /// The line (TCP, without the newline) or datagram (UDP) received.
    pub line: String,
}

/// What an echo server named `name` answers to `msg`.
fn echo(name: &str, msg: &str) -> String {
    format!("echo {msg} from {name}")
}

/// An echo server: over TCP, reads a line per connection and answers `echo <line> from <name>`;
/// over UDP ([`EchoServer::start_udp`]), answers each datagram the same way.
pub struct EchoServer {
    name: String,
    addr: SocketAddr,
    received: Arc<Log<Received>>,
    _server: Server,
}

impl EchoServer {
    /// Listens on `addr` inside `netns` (port 0 picks one; see [`EchoServer::addr`]).
    pub fn start(netns: &NetNs, name: &str, addr: SocketAddr) -> io::Result<Self> {
        let listener = netns.run(|| TcpListener::bind(addr))?;
        let addr = listener.local_addr()?;
        Self::serve(
            netns,
            &format!("echo-{name}"),
            name,
            addr,
            |name, received| {
                let handler = Arc::new(move |stream: TcpStream, _: &_| {
                    if let Err(err) = serve_echo(&stream, &name, &received) {
                        eprintln!("echo server {name}: {err}");
                    }
                });
                Listener::Tcp(listener, handler)
            },
        )
    }

    /// Serves the listener `listen` makes from the server's name and log, on a thread named
    /// `thread` inside `netns`, as the echo server `name` at `addr`.
    fn serve(
        netns: &NetNs,
        thread: &str,
        name: &str,
        addr: SocketAddr,
        listen: impl FnOnce(String, Arc<Log<Received>>) -> Listener,
    ) -> io::Result<Self> {
        let received = Arc::new(Log::default());
        let listener = listen(name.to_owned(), received.clone());
        let server = Server::start(netns.as_fd(), thread, vec![listener])?;
        Ok(Self {
            name: name.to_owned(),
            addr,
            received,
            _server: server,
        })
    }

    /// An echo server whose connections answer line after line for as long as their client
    /// keeps them open, however long it waits between lines: for a connection a test holds
    /// across something slow. Listens on `addr` inside `netns`.
    pub fn start_lasting(netns: &NetNs, name: &str, addr: SocketAddr) -> io::Result<Self> {
        let listener = netns.run(|| TcpListener::bind(addr))?;
        let addr = listener.local_addr()?;
        Self::serve(
            netns,
            &format!("lasting-echo-{name}"),
            name,
            addr,
            |name, received| {
                let handler = Arc::new(move |stream: TcpStream, tracker: &Tracker| {
                    if let Err(err) = serve_lines(&stream, &name, &received, tracker) {
                        eprintln!("lasting echo server {name}: {err}");
                    }
                });
                Listener::Tcp(listener, handler)
            },
        )
    }

    /// The pod's app: named after the pod, on [`APP_PORT`] of every address the pod has (one
    /// dual-stack wildcard socket).
    pub fn app(pod: &Pod) -> io::Result<Self> {
        Self::start(
            pod.netns(),
            pod.name(),
            (Ipv6Addr::UNSPECIFIED, APP_PORT).into(),
        )
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it answers to `msg`.
    pub fn reply_to(&self, msg: &str) -> String {
        echo(&self.name, msg)
    }

    /// Every connection so far.
    pub fn received(&self) -> Vec<Received> {
        self.received.entries()
    }

    /// The first connection matching `predicate`, waiting up to `timeout` for it.
    pub fn wait_for(
        &self,
        predicate: impl Fn(&Received) -> bool,
        timeout: Duration,
    ) -> Option<Received> {
        self.received.wait_for(predicate, timeout)
    }
}

fn serve_echo(stream: &TcpStream, name: &str, received: &Log<Received>) -> io::Result<()> {
    set_timeouts(stream)?;
    let peer = canonical(stream.peer_addr()?);
    let local = canonical(stream.local_addr()?);
    let line = read_line(stream);
    received.push(Received {
        peer,
        local,
        line: line.as_ref().cloned().unwrap_or_default(),
    });
    write_line(stream, &echo(name, &line?))
}

/// Answers each line on `stream` until its client closes it; stopping the server shuts it down.
fn serve_lines(
    stream: &TcpStream,
    name: &str,
    received: &Log<Received>,
    tracker: &Tracker,
) -> io::Result<()> {
    let _tracked = tracker.track(stream)?;
    let peer = canonical(stream.peer_addr()?);
    let local = canonical(stream.local_addr()?);
    for line in BufReader::new(stream).lines() {
        let line = line?;
        write_line(stream, &echo(name, &line))?;
        received.push(Received { peer, local, line });
    }
    Ok(())
}

impl EchoServer {
    /// The UDP flavour: answers each datagram `echo <datagram> from <name>`, to the sender.
    /// Binds `addr` inside `netns` (port 0 picks one). Bind a specific address, not a wildcard:
    /// `local` in the records is the bound address, and replies leave from it.
    pub fn start_udp(netns: &NetNs, name: &str, addr: SocketAddr) -> io::Result<Self> {
        let socket = netns.run(|| UdpSocket::bind(addr))?;
        let addr = socket.local_addr()?;
        Self::serve(
            netns,
            &format!("udp-echo-{name}"),
            name,
            addr,
            |name, received| {
                let handler = Box::new(
                    move |socket: &UdpSocket, datagram: &[u8], from: SocketAddr| {
                        let line = String::from_utf8_lossy(datagram).into_owned();
                        let reply = echo(&name, &line);
                        received.push(Received {
                            peer: canonical(from),
                            local: canonical(addr),
                            line,
                        });
                        if let Err(err) = socket.send_to(reply.as_bytes(), from) {
                            eprintln!("udp echo server {name}: {err}");
                        }
                    },
                );
                Listener::Udp(socket, handler)
            },
        )
    }
}

/// A TCP exchange as the client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// `getpeername()` of the client's socket: where the app believes it is connected.
    pub peer_seen_by_client: SocketAddr,
    /// `getsockname()` of the client's socket.
    pub local: SocketAddr,
    /// The line the server answered, without the newline.
    pub response: String,
}

/// Connects to `addr`, sends `msg` as a line and reads one line back. Run it inside a pod
/// (`pod.run(|| tcp_request(..))`). A connection closed without an answer is `UnexpectedEof`.
pub fn tcp_request(addr: SocketAddr, msg: &str) -> io::Result<Reply> {
    tcp_exchange(addr, msg, io_timeout(), io_timeout())
}

/// [`tcp_request`] with each read and write bounded by `timeout` instead of [`io_timeout`]: for
/// transfers large enough that an emulated, busy guest may stall one of them for seconds.
pub fn tcp_request_within(addr: SocketAddr, msg: &str, timeout: Duration) -> io::Result<Reply> {
    tcp_exchange(addr, msg, io_timeout(), timeout)
}

/// [`tcp_request`] for a connection the test expects to fail (dropped, refused, or never
/// answered): each step bounded by [`IO_TIMEOUT`] as on a node, not stretched for slow guests,
/// since every such wait is spent in full.
pub fn tcp_attempt(addr: SocketAddr, msg: &str) -> io::Result<Reply> {
    tcp_exchange(addr, msg, IO_TIMEOUT, IO_TIMEOUT)
}

fn tcp_exchange(
    addr: SocketAddr,
    msg: &str,
    connect_timeout: Duration,
    timeout: Duration,
) -> io::Result<Reply> {
    let stream = TcpStream::connect_timeout(&addr, connect_timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let peer_seen_by_client = stream.peer_addr()?;
    let local = stream.local_addr()?;
    write_line(&stream, msg)?;
    Ok(Reply {
        peer_seen_by_client,
        local,
        response: read_line(&stream)?,
    })
}

/// A TCP connection to `addr` from `port` of this netns's addresses, for a test that holds it
/// or chooses its tuple. Run it inside a pod.
pub fn tcp_connect_from(port: u16, addr: SocketAddr) -> io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    let any: SocketAddr = match addr {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, port).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, port).into(),
    };
    socket.bind(&any.into())?;
    socket.connect_timeout(&addr.into(), io_timeout())?;
    let stream: TcpStream = socket.into();
    set_timeouts(&stream)?;
    Ok(stream)
}

/// A UDP exchange as the client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdpReply {
    /// The answer datagram.
    pub response: String,
    /// Its source, from `recvfrom()`.
    pub from: SocketAddr,
    /// `getpeername()`, for a connected socket.
    pub peer: Option<SocketAddr>,
    /// `getsockname()` after sending.
    pub local: SocketAddr,
}

/// Sends `msg` to `addr` from an unconnected socket (`sendto`) and waits for one answer
/// (`recvfrom`).
pub fn udp_request(addr: SocketAddr, msg: &str) -> io::Result<UdpReply> {
    udp_exchange(addr, msg, false)
}

/// Same over a connected socket (`connect` + `send`), as glibc's resolver does.
pub fn udp_request_connected(addr: SocketAddr, msg: &str) -> io::Result<UdpReply> {
    udp_exchange(addr, msg, true)
}

fn udp_exchange(addr: SocketAddr, msg: &str, connected: bool) -> io::Result<UdpReply> {
    let any: SocketAddr = match addr {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(any)?;
    socket.set_read_timeout(Some(io_timeout()))?;
    if connected {
        socket.connect(addr)?;
        socket.send(msg.as_bytes())?;
    } else {
        socket.send_to(msg.as_bytes(), addr)?;
    }
    let mut buf = vec![0; 64 * 1024];
    let (len, from) = socket.recv_from(&mut buf)?;
    Ok(UdpReply {
        response: String::from_utf8_lossy(&buf[..len]).into_owned(),
        from,
        peer: connected.then(|| socket.peer_addr()).transpose()?,
        local: socket.local_addr()?,
    })
}

/// Bounds every read and write on `stream` by [`io_timeout`].
pub fn set_timeouts(stream: &TcpStream) -> io::Result<()> {
    stream.set_read_timeout(Some(io_timeout()))?;
    stream.set_write_timeout(Some(io_timeout()))
}

/// Reads one line, without its newline; EOF before any byte is `UnexpectedEof`.
pub fn read_line(stream: &TcpStream) -> io::Result<String> {
    let mut line = String::new();
    if BufReader::new(stream).read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed before a full line",
        ));
    }
    if line.ends_with('\n') {
        line.pop();
    }
    Ok(line)
}

/// Sends `line` on a connection held open and reads the answer, each bounded by [`io_timeout`].
pub fn exchange_line(stream: &TcpStream, line: &str) -> io::Result<String> {
    set_timeouts(stream)?;
    write_line(stream, line)?;
    read_line(stream)
}

/// Writes `line` and a newline.
pub fn write_line(mut stream: &TcpStream, line: &str) -> io::Result<()> {
    stream.write_all(format!("{line}\n").as_bytes())
}
