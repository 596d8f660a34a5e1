//! The traffic of the connection, bulk and cost sections: a request/response server, the
//! minimal relay that stands for ztunnel's 15001 or a sidecar's istio-proxy's (reads
//! `SO_ORIGINAL_DST`, dials, copies), and the load that drives them. Each runs a fixed pool of
//! threads, so that no variant pays for thread creation per connection (the ztunnel stand-in of
//! the tests does, which is what made the old sequential figure mostly a measure of thread
//! spawns and scheduling).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};
use weir_common::{OUTBOUND_PORT, ZTUNNEL_MARK};
use weir_tests::sidecar::PROXY_ID;
use weir_tests::{sockopt, NetNs};

/// Request and response size of a short connection.
const MESSAGE: usize = 64;
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Threads serving connections in the server and in each relay: more than the load's
/// concurrency, so no connection waits for a free thread.
const POOL: usize = 12;

/// Threads blocked in `accept()` on one listener; stopped (and joined) on drop by shutting the
/// listener down, which wakes every `accept()`.
pub struct Pool {
    listener: TcpListener,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// `identity`: the uid and gid each thread takes once in the namespace, for the sockets it
    /// makes (else root's).
    fn start(
        netns: &NetNs,
        listener: TcpListener,
        identity: Option<u32>,
        serve: impl Fn(TcpStream) -> io::Result<()> + Send + Sync + Clone + 'static,
    ) -> io::Result<Self> {
        let threads = (0..POOL)
            .map(|_| {
                let (listener, serve) = (listener.try_clone()?, serve.clone());
                netns.spawn("bench-pool", move || {
                    if let Some(id) = identity {
                        take_identity(id).expect("a thread of root's can take any identity");
                    }
                    while let Ok((stream, _)) = listener.accept() {
                        // A failed connection is the load's to count; the pool goes on.
                        let _ = stream
                            .set_read_timeout(Some(IO_TIMEOUT))
                            .and_then(|()| serve(stream));
                    }
                })
            })
            .collect::<io::Result<_>>()?;
        Ok(Self { listener, threads })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: shutdown(2) on a socket this pool owns; it only changes the socket's state.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Gives the calling thread alone uid and gid `id` (the raw syscalls: libc's wrappers change
/// every thread of the process). The gid first, while the thread may still change it.
fn take_identity(id: u32) -> io::Result<()> {
    let id = libc::c_long::from(id);
    for call in [libc::SYS_setresgid, libc::SYS_setresuid] {
        // SAFETY: a syscall on this thread's credentials, with plain integer arguments.
        if unsafe { libc::syscall(call, id, id, id) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The app server: reads a request, answers, closes.
pub fn server(netns: &NetNs, addr: SocketAddr) -> io::Result<Pool> {
    let listener = netns.run(|| TcpListener::bind(addr))?;
    Pool::start(netns, listener, None, |mut stream| {
        let mut request = [0; MESSAGE];
        stream.read_exact(&mut request)?;
        stream.write_all(&request)
    })
}

/// Sends `bytes` to every connection, then closes: the far end of the bulk section.
pub fn bulk_source(netns: &NetNs, addr: SocketAddr, bytes: usize) -> io::Result<Pool> {
    let listener = netns.run(|| TcpListener::bind(addr))?;
    Pool::start(netns, listener, None, move |mut stream| {
        let chunk = vec![0x5a; 256 * 1024];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            stream.write_all(&chunk[..n])?;
            left -= n;
        }
        Ok(())
    })
}

/// A UDP socket nobody reads: the datagram section's destination (full, it drops silently).
pub fn udp_sink(netns: &NetNs, addr: SocketAddr) -> io::Result<UdpSocket> {
    netns.run(|| UdpSocket::bind(addr))
}

/// Whose 15001 a [`relay`] stands for, which says how its dials leave the pod without being
/// redirected back to it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Proxy {
    /// ztunnel: its listener made as ztunnel makes it (marked, transparent), its dials from
    /// sockets with ztunnel's mark.
    Ztunnel,
    /// A sidecar's istio-proxy (Envoy): a plain listener, its dials made by threads with the
    /// proxy's uid and gid, the identity istio's rules (`--uid-owner`) and weir's policy exempt.
    Sidecar,
}

/// The minimal in-pod relay on `[::]:15001` (port reuse, dual-stack), made as `proxy` makes it:
/// takes each connection to its `SO_ORIGINAL_DST` (else to `fallback`: an app that connects to
/// the relay's port directly), dialing so that the redirection leaves the dial alone.
pub fn relay(netns: &NetNs, fallback: SocketAddr, proxy: Proxy) -> io::Result<Pool> {
    let listener = netns.run(|| {
        let socket = stream_socket(Domain::IPV6, proxy)?;
        socket.set_reuse_port(true)?;
        socket.set_only_v6(false)?;
        socket.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, OUTBOUND_PORT)).into())?;
        socket.listen(1024)?;
        if proxy == Proxy::Ztunnel {
            sockopt::set_transparent(&socket)?;
        }
        io::Result::Ok(TcpListener::from(socket))
    })?;
    let identity = (proxy == Proxy::Sidecar).then_some(PROXY_ID);
    Pool::start(netns, listener, identity, move |mut client| {
        let target = sockopt::original_dst(&client).unwrap_or(fallback);
        let mut upstream = dial(target, proxy)?;
        let mut request = [0; MESSAGE];
        client.read_exact(&mut request)?;
        upstream.write_all(&request)?;
        io::copy(&mut upstream, &mut client)?;
        Ok(())
    })
}

/// A TCP socket, with ztunnel's mark for [`Proxy::Ztunnel`] (a sidecar's identity is the
/// thread's).
fn stream_socket(domain: Domain, proxy: Proxy) -> io::Result<Socket> {
    let socket = Socket::new(domain, Type::STREAM, Some(Protocol::TCP))?;
    if proxy == Proxy::Ztunnel {
        socket.set_mark(ZTUNNEL_MARK)?;
    }
    Ok(socket)
}

fn dial(target: SocketAddr, proxy: Proxy) -> io::Result<TcpStream> {
    let socket = stream_socket(Domain::for_address(target), proxy)?;
    socket.connect_timeout(&target.into(), IO_TIMEOUT)?;
    let stream = TcpStream::from(socket);
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    Ok(stream)
}

/// What a load run saw.
pub struct Run {
    /// Completed connections (or datagrams) per second.
    pub rate: f64,
    /// Latency of each connection (empty for datagrams).
    pub latencies: Vec<Duration>,
}

/// `concurrency` threads opening short connections to `target` (connect, request, response,
/// close) for `duration`. Runs in the calling thread's network namespace.
pub fn connections(target: SocketAddr, concurrency: usize, duration: Duration) -> io::Result<Run> {
    let start = Instant::now();
    let deadline = start + duration;
    let per_thread: Vec<io::Result<Vec<Duration>>> = thread::scope(|scope| {
        let workers: Vec<_> = (0..concurrency)
            .map(|_| {
                scope.spawn(move || {
                    let mut latencies = Vec::new();
                    while Instant::now() < deadline {
                        let begin = Instant::now();
                        request(target)?;
                        latencies.push(begin.elapsed());
                    }
                    Ok(latencies)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("load thread panicked"))
            .collect()
    });
    let elapsed = start.elapsed();
    let latencies: Vec<Duration> = per_thread
        .into_iter()
        .collect::<io::Result<Vec<_>>>()?
        .concat();
    Ok(Run {
        rate: latencies.len() as f64 / elapsed.as_secs_f64(),
        latencies,
    })
}

fn request(target: SocketAddr) -> io::Result<()> {
    let mut stream = TcpStream::connect_timeout(&target, IO_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.write_all(&[0x61; MESSAGE])?;
    let mut response = Vec::with_capacity(MESSAGE);
    stream.read_to_end(&mut response)?;
    if response.len() != MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{} of {MESSAGE} response bytes", response.len()),
        ));
    }
    Ok(())
}

/// Datagrams per second one unconnected socket sends to `target` (`sendto`, the path weir's
/// sendmsg programs see) for `duration`.
pub fn datagrams(target: SocketAddr, duration: Duration) -> io::Result<Run> {
    let any: IpAddr = match target {
        SocketAddr::V4(_) => [0, 0, 0, 0].into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind((any, 0))?;
    let payload = [0x75; MESSAGE];
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < duration {
        for _ in 0..64 {
            socket.send_to(&payload, target)?;
        }
        sent += 64;
    }
    Ok(Run {
        rate: sent as f64 / start.elapsed().as_secs_f64(),
        latencies: Vec::new(),
    })
}

/// Bytes per second received over one marked connection from a [`bulk_source`].
pub fn download(source: SocketAddr) -> io::Result<f64> {
    let start = Instant::now();
    let mut stream = dial(source, Proxy::Ztunnel)?;
    let received = io::copy(&mut stream, &mut io::sink())?;
    Ok(received as f64 / start.elapsed().as_secs_f64())
}
