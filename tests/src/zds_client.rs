//! ztunnel's side of ZDS, for tests: [`ZdsZtunnel`] connects to the agent's socket as ztunnel
//! does (SOCK_SEQPACKET, [`ZdsHello`] V1 first), and for every `Add` takes the netns fd that
//! comes with it, starts a [`ZtunnelStandIn`] in that namespace and acks; `Keep` and
//! `SnapshotSent` are recorded and acked, `Del` stops the pod's stand-in and is acked. Everything
//! received is recorded in order ([`ZdsEvent`]) and can be waited for.
//!
//! Proxies are kept as ztunnel keeps them (istio/ztunnel `src/inpod/statemanager.rs`): an Add of
//! a uid whose stand-in already runs in the same network namespace keeps that stand-in, one in
//! another namespace replaces it. [`ZdsZtunnel::connect`] is one connection; a ztunnel made with
//! [`ZdsZtunnel::follow`] is ztunnel's whole life on the node (`src/inpod/workloadmanager.rs`): it
//! keeps its stand-ins when the connection ends, connects to the same path again until it is
//! dropped, and once a new connection's `SnapshotSent` arrives drains every stand-in whose uid
//! that snapshot did not name (in an Add or a Keep).
//!
//! It checks what ztunnel checks (istio/ztunnel `src/inpod/linux/protocol.rs`): exactly one fd
//! with an Add and none with anything else, whole datagrams of at most 1024 bytes, decodable
//! requests; a violation is answered with a nack and the connection is dropped, as ztunnel does.
//! It can also misbehave on purpose: nack the next Add, stop acking, answer with arbitrary bytes,
//! send datagrams unasked (garbage, oversized, carrying an fd).
//!
//! Blocking, with one reader thread. It shares the agent's message types and its datagram
//! plumbing ([`send_datagram`], [`recv_datagram`]), not its protocol logic: what it checks, it
//! checks independently of the agent.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    connect, shutdown, socket, AddressFamily, Shutdown, SockFlag, SockType, UnixAddr,
};
use prost::Message;
use weir_agent::zds::proto::{
    workload_request::Payload, workload_response, Ack, Version, WorkloadInfo, WorkloadRequest,
    WorkloadResponse, ZdsHello,
};
use weir_agent::zds::{recv_datagram, send_datagram, Datagram, MAX_DATAGRAM};

use crate::netns;
use crate::server::Log;
use crate::ztunnel::ZtunnelStandIn;

/// A network namespace's identity: the (device, inode) of its nsfs file, as `fstat` shows it on
/// any fd or bind mount of the namespace (and `readlink /proc/self/fd/N` shows `net:[inode]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

impl NetnsId {
    pub fn of(fd: impl AsFd) -> io::Result<Self> {
        let stat = nix::sys::stat::fstat(fd.as_fd().as_raw_fd())?;
        Ok(Self {
            dev: stat.st_dev,
            ino: stat.st_ino,
        })
    }
}

/// One thing the stand-in received, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZdsEvent {
    Add {
        uid: String,
        info: Option<WorkloadInfo>,
        /// The namespace of the fd that came with it (`None`: no fd came, a protocol error).
        netns: Option<NetnsId>,
        /// The pod's addresses as found inside that namespace (not loopback, not link-local).
        pod_ips: Vec<IpAddr>,
    },
    Keep {
        uid: String,
    },
    Del {
        uid: String,
    },
    SnapshotSent,
    /// A stand-in stopped because the snapshot of a connection after the first did not name its
    /// pod (the pod went away while ztunnel was disconnected). Recorded just before that
    /// snapshot's `SnapshotSent`, so a test that saw the snapshot sees its drains too.
    Drained {
        uid: String,
    },
    /// A datagram that is not a valid request: nacked, then the connection was dropped.
    Invalid(String),
    /// A following ztunnel ([`ZdsZtunnel::follow`]) connected and said hello: first or again.
    /// [`ZdsZtunnel::connect`] records none (it is connected once it returns).
    Connected,
    /// The connection ended (the agent closed it, or the stand-in dropped it).
    Closed,
}

impl ZdsEvent {
    /// The pod the event names, if any.
    pub fn uid(&self) -> Option<&str> {
        match self {
            ZdsEvent::Add { uid, .. }
            | ZdsEvent::Keep { uid }
            | ZdsEvent::Del { uid }
            | ZdsEvent::Drained { uid } => Some(uid),
            _ => None,
        }
    }
}

/// How the stand-in answers a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZdsReply {
    /// An Ack with an empty error (success).
    Ack,
    /// An Ack with this error.
    Nack(String),
    /// No answer at all.
    Silent,
    /// These bytes instead of an answer, with an fd attached when `with_fd`.
    Raw { bytes: Vec<u8>, with_fd: bool },
}

/// How long a following ztunnel waits before connecting again (ztunnel backs off from 10 ms up
/// to 15 s; a fixed short wait keeps tests quick and their timing plain).
const RECONNECT_INTERVAL: Duration = Duration::from_millis(100);

/// A ztunnel connected to the agent over ZDS; disconnects (and stops every stand-in) on drop.
pub struct ZdsZtunnel {
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    events: Log<ZdsEvent>,
    stand_ins: Mutex<HashMap<String, Proxy>>,
    replies: Mutex<Replies>,
    /// Adds are answered without a stand-in in the pod ([`ZdsZtunnel::ack_without_proxies`]).
    without_proxies: AtomicBool,
    /// The connection being served, if any.
    socket: Mutex<Option<Arc<OwnedFd>>>,
    /// Set when the ztunnel goes away: a following one stops connecting again.
    stopping: AtomicBool,
}

/// A pod's stand-in and the namespace it runs in, which decides whether an Add keeps it.
struct Proxy {
    stand_in: Arc<ZtunnelStandIn>,
    netns: Option<NetnsId>,
}

/// What one connection knows of its snapshot (ztunnel resets it on every connection).
#[derive(Default)]
struct Connection {
    snapshot_received: bool,
    /// Pods the snapshot named so far, in an Add or a Keep.
    snapshot_names: HashSet<String>,
}

struct Replies {
    next_add: Option<ZdsReply>,
    every: ZdsReply,
}

impl Default for Replies {
    fn default() -> Self {
        Self {
            next_add: None,
            every: ZdsReply::Ack,
        }
    }
}

impl ZdsZtunnel {
    /// Connects to the agent's ZDS socket and says hello (V1), as ztunnel does.
    pub fn connect(socket_path: impl AsRef<Path>) -> io::Result<Self> {
        let hello = ZdsHello {
            version: Version::V1 as i32,
        };
        Self::connect_with_hello(socket_path, Some(&hello.encode_to_vec()))
    }

    /// Connects and sends `hello` as the first datagram (`None`: nothing).
    pub fn connect_with_hello(
        socket_path: impl AsRef<Path>,
        hello: Option<&[u8]>,
    ) -> io::Result<Self> {
        let socket = Arc::new(dial(socket_path.as_ref(), hello)?);
        let shared = Arc::new(Shared::default());
        *shared.socket() = Some(socket.clone());
        let reader = thread::Builder::new().name("zds-ztunnel".into()).spawn({
            let shared = shared.clone();
            move || read_loop(&socket, &shared)
        })?;
        Ok(Self {
            shared,
            reader: Some(reader),
        })
    }

    /// A ztunnel that follows whichever node agent serves `socket_path`, as ztunnel does: it
    /// connects (trying again every 100 ms until something listens there), says hello (V1), and
    /// when the connection ends keeps its stand-ins and connects again, until dropped. Each
    /// connection records [`ZdsEvent::Connected`] once its hello is sent, and
    /// [`ZdsEvent::Closed`] when it ends; stand-ins a later snapshot does not name are drained
    /// ([`ZdsEvent::Drained`]).
    pub fn follow(socket_path: impl AsRef<Path>) -> io::Result<Self> {
        let path = socket_path.as_ref().to_owned();
        let shared = Arc::new(Shared::default());
        let reader = thread::Builder::new().name("zds-follower".into()).spawn({
            let shared = shared.clone();
            move || follow_loop(&path, &shared)
        })?;
        Ok(Self {
            shared,
            reader: Some(reader),
        })
    }

    /// Everything received so far, in order.
    pub fn events(&self) -> Vec<ZdsEvent> {
        self.shared.events.entries()
    }

    /// The first event matching `predicate`, waiting up to `timeout` for it.
    pub fn wait_for(
        &self,
        predicate: impl Fn(&ZdsEvent) -> bool,
        timeout: Duration,
    ) -> Option<ZdsEvent> {
        self.shared.events.wait_for(predicate, timeout)
    }

    /// Whether a `SnapshotSent` arrived within `timeout` (the connection is then in steady state).
    pub fn wait_for_snapshot(&self, timeout: Duration) -> bool {
        self.wait_for(|event| *event == ZdsEvent::SnapshotSent, timeout)
            .is_some()
    }

    /// Whether, within `timeout`, the events recorded so far satisfy `done` (e.g. "two
    /// snapshots"), which sees them all, in order.
    pub fn wait_for_events(&self, done: impl Fn(&[ZdsEvent]) -> bool, timeout: Duration) -> bool {
        self.shared.events.wait_until(done, timeout)
    }

    /// Whether `count` snapshots in all (one per connection that got that far) arrived within
    /// `timeout`: for a following ztunnel, `n + 1` is the snapshot of its `n`th reconnection.
    pub fn wait_for_snapshots(&self, count: usize, timeout: Duration) -> bool {
        self.wait_for_events(
            |events| {
                let snapshots = events.iter().filter(|e| **e == ZdsEvent::SnapshotSent);
                snapshots.count() >= count
            },
            timeout,
        )
    }

    /// Whether a stand-in for pod `uid` was drained within `timeout`.
    pub fn wait_for_drained(&self, uid: &str, timeout: Duration) -> bool {
        self.wait_for(
            |event| matches!(event, ZdsEvent::Drained { uid: drained } if drained == uid),
            timeout,
        )
        .is_some()
    }

    /// Whether the connection ended within `timeout`.
    pub fn wait_for_close(&self, timeout: Duration) -> bool {
        self.wait_for(|event| *event == ZdsEvent::Closed, timeout)
            .is_some()
    }

    /// The stand-in serving pod `uid`, while it is added.
    pub fn stand_in(&self, uid: &str) -> Option<Arc<ZtunnelStandIn>> {
        let stand_ins = self.shared.stand_ins();
        stand_ins.get(uid).map(|proxy| proxy.stand_in.clone())
    }

    /// Same as [`Self::stand_in`]: the pod as ztunnel has it.
    pub fn pod(&self, uid: &str) -> Option<Arc<ZtunnelStandIn>> {
        self.stand_in(uid)
    }

    /// The stand-in for pod `uid`, waiting up to `timeout` for an Add of it to be served (a
    /// nacked Add does not count).
    pub fn wait_for_pod(&self, uid: &str, timeout: Duration) -> Option<Arc<ZtunnelStandIn>> {
        // The stand-in is in place before its Add is recorded, so this sees both at once.
        self.wait_for(
            |event| {
                matches!(event, ZdsEvent::Add { uid: added, .. } if added == uid)
                    && self.shared.stand_ins().contains_key(uid)
            },
            timeout,
        )?;
        self.stand_in(uid)
    }

    /// Whether a Del of pod `uid` arrived within `timeout`.
    pub fn wait_for_del(&self, uid: &str, timeout: Duration) -> bool {
        self.wait_for(
            |event| matches!(event, ZdsEvent::Del { uid: deleted } if deleted == uid),
            timeout,
        )
        .is_some()
    }

    /// Answers the next Add with `reply` instead of the usual one (and starts no stand-in for
    /// it when that is a nack).
    pub fn reply_next_add(&self, reply: ZdsReply) {
        self.shared.replies().next_add = Some(reply);
    }

    /// Refuses the next Add with `error`, as ztunnel does when a proxy cannot start.
    pub fn nack_next_add(&self, error: &str) {
        self.reply_next_add(ZdsReply::Nack(error.to_owned()));
    }

    /// Answers every request from now on with `reply`.
    pub fn reply_always(&self, reply: ZdsReply) {
        self.shared.replies().every = reply;
    }

    /// From now on Adds are answered (as scripted) without starting a stand-in in the pod: ztunnel's
    /// side of ZDS at node scale (the bench's thousands of pods), where a polling thread per
    /// stand-in would load the machine whose agent is being measured.
    pub fn ack_without_proxies(&self) {
        self.shared.without_proxies.store(true, Ordering::Relaxed);
    }

    /// Stops answering (every request from now on goes unacked).
    pub fn never_ack(&self) {
        self.reply_always(ZdsReply::Silent);
    }

    /// Sends `bytes` as one datagram, unasked, on the current connection, with an fd (of
    /// `/dev/null`) when `with_fd`.
    pub fn send_raw(&self, bytes: &[u8], with_fd: bool) -> io::Result<()> {
        let socket = self.shared.socket().clone();
        let socket = socket.ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))?;
        send_raw(socket.as_fd(), bytes, with_fd)
    }

    /// Closes the connection (as a ztunnel that exits), stops every stand-in and waits for the
    /// reader to finish; a following ztunnel stops connecting again.
    pub fn disconnect(mut self) {
        self.close();
    }

    fn close(&mut self) {
        self.shared.stopping.store(true, Ordering::Relaxed);
        if let Some(socket) = self.shared.socket().as_ref() {
            // Wakes the reader's blocking recvmsg with an end of file.
            let _ = shutdown(socket.as_raw_fd(), Shutdown::Both);
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let stopped = std::mem::take(&mut *self.shared.stand_ins());
        drop(stopped);
    }
}

impl Drop for ZdsZtunnel {
    fn drop(&mut self) {
        self.close();
    }
}

impl Shared {
    fn stand_ins(&self) -> MutexGuard<'_, HashMap<String, Proxy>> {
        self.stand_ins
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn socket(&self) -> MutexGuard<'_, Option<Arc<OwnedFd>>> {
        self.socket.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn replies(&self) -> MutexGuard<'_, Replies> {
        self.replies.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A connected seqpacket socket to `path`, with `hello` sent on it when given.
fn dial(path: &Path, hello: Option<&[u8]>) -> io::Result<OwnedFd> {
    let socket = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    connect(socket.as_raw_fd(), &UnixAddr::new(path)?)?;
    if let Some(hello) = hello {
        send_datagram(socket.as_fd(), hello, None)?;
    }
    Ok(socket)
}

/// A following ztunnel's life: connect, serve, and again, until the ztunnel is dropped.
fn follow_loop(path: &Path, shared: &Shared) {
    let hello = ZdsHello {
        version: Version::V1 as i32,
    }
    .encode_to_vec();
    while !shared.stopping.load(Ordering::Relaxed) {
        let socket = match dial(path, Some(&hello)) {
            Ok(socket) => Arc::new(socket),
            Err(_) => {
                pause(shared);
                continue;
            }
        };
        {
            let mut current = shared.socket();
            *current = Some(socket.clone());
            // `close` sets the flag before it shuts the current socket down: one of the two
            // sees the other.
            if shared.stopping.load(Ordering::Relaxed) {
                break;
            }
        }
        shared.events.push(ZdsEvent::Connected);
        read_loop(&socket, shared);
        *shared.socket() = None;
        pause(shared);
    }
}

/// Waits [`RECONNECT_INTERVAL`], or less when the ztunnel is being dropped.
fn pause(shared: &Shared) {
    let until = Instant::now() + RECONNECT_INTERVAL;
    while !shared.stopping.load(Ordering::Relaxed) {
        let Some(left) = until.checked_duration_since(Instant::now()) else {
            return;
        };
        thread::sleep(left.min(Duration::from_millis(10)));
    }
}

/// Serves the connection until it ends: one request at a time, answered before the next is read.
fn read_loop(socket: &OwnedFd, shared: &Shared) {
    let mut connection = Connection::default();
    loop {
        let Datagram {
            bytes,
            fds,
            truncated,
        } = match recv_datagram(socket.as_fd()) {
            Ok(received) => received,
            // The agent closed with our datagram unread (it refused it): an end like any other.
            Err(err) if err.raw_os_error() == Some(libc::ECONNRESET) => break,
            Err(err) => {
                eprintln!("ZDS stand-in: recvmsg: {err}");
                break;
            }
        };
        if bytes.is_empty() && fds.is_empty() && !truncated {
            break; // End of file: the agent closed (or `close` shut the socket down).
        }
        match serve(&bytes, fds, truncated, shared, &mut connection) {
            Ok(reply) => {
                if let Err(err) = answer(socket.as_fd(), &reply) {
                    eprintln!("ZDS stand-in: answering: {err}");
                    break;
                }
            }
            Err(why) => {
                // ztunnel nacks what it cannot read, then drops the connection.
                shared.events.push(ZdsEvent::Invalid(why.clone()));
                let _ = answer(socket.as_fd(), &ZdsReply::Nack(why));
                let _ = shutdown(socket.as_raw_fd(), Shutdown::Both);
                break;
            }
        }
    }
    shared.events.push(ZdsEvent::Closed);
}

/// Handles one request and returns how to answer it; `Err` is a protocol violation.
fn serve(
    bytes: &[u8],
    mut fds: Vec<OwnedFd>,
    truncated: bool,
    shared: &Shared,
    connection: &mut Connection,
) -> Result<ZdsReply, String> {
    if truncated {
        return Err(format!("truncated datagram (over {MAX_DATAGRAM} bytes)"));
    }
    let request = WorkloadRequest::decode(bytes).map_err(|err| format!("undecodable: {err}"))?;
    let payload = request.payload.ok_or("a request without payload")?;
    let is_add = matches!(payload, Payload::Add(_));
    match (is_add, fds.len()) {
        (true, 1) | (false, 0) => {}
        (true, n) => return Err(format!("an Add with {n} fds instead of 1")),
        (false, n) => return Err(format!("{n} fds with a request other than Add")),
    }
    let scripted = {
        let mut replies = shared.replies();
        match is_add.then(|| replies.next_add.take()).flatten() {
            Some(reply) => reply,
            None => replies.every.clone(),
        }
    };
    let mut reply = scripted;
    match payload {
        Payload::Add(add) => {
            if !connection.snapshot_received {
                connection.snapshot_names.insert(add.uid.clone());
            }
            let netns = fds.pop().expect("one fd, checked above");
            let netns_id = NetnsId::of(&netns).ok();
            let pod_ips = pod_ips(netns.as_fd()).unwrap_or_default();
            let with_proxy = !shared.without_proxies.load(Ordering::Relaxed);
            if with_proxy {
                let kept = keep_or_replace(shared, &add.uid, netns_id);
                if !kept && !matches!(reply, ZdsReply::Nack(_)) {
                    match ZtunnelStandIn::start_in_netns(netns, &pod_ips) {
                        Ok(stand_in) => {
                            let proxy = Proxy {
                                stand_in: Arc::new(stand_in),
                                netns: netns_id,
                            };
                            shared.stand_ins().insert(add.uid.clone(), proxy);
                        }
                        // ztunnel nacks an Add whose proxy does not start, and stays connected.
                        Err(err) if reply == ZdsReply::Ack => {
                            reply = ZdsReply::Nack(format!("failure to start proxy: {err}"));
                        }
                        Err(err) => eprintln!("ZDS stand-in: starting a stand-in: {err}"),
                    }
                }
            }
            shared.events.push(ZdsEvent::Add {
                uid: add.uid,
                info: add.workload_info,
                netns: netns_id,
                pod_ips,
            });
        }
        Payload::Keep(keep) => {
            if !connection.snapshot_received {
                connection.snapshot_names.insert(keep.uid.clone());
            }
            shared.events.push(ZdsEvent::Keep { uid: keep.uid });
        }
        Payload::Del(del) => {
            // Dropping the last handle stops the stand-in (a test may still hold one).
            let removed = shared.stand_ins().remove(&del.uid);
            drop(removed);
            shared.events.push(ZdsEvent::Del { uid: del.uid });
        }
        Payload::SnapshotSent(_) => {
            drain_unnamed(shared, connection);
            shared.events.push(ZdsEvent::SnapshotSent);
        }
    }
    Ok(reply)
}

/// Whether pod `uid` already has a stand-in in the namespace `netns` (an Add of it then keeps
/// it, ztunnel's idempotent Add); a stand-in of it in another namespace (a sandbox made again)
/// is stopped, for the Add to start a new one.
fn keep_or_replace(shared: &Shared, uid: &str, netns: Option<NetnsId>) -> bool {
    let mut stand_ins = shared.stand_ins();
    match stand_ins.get(uid) {
        Some(proxy) if netns.is_some() && proxy.netns == netns => true,
        Some(_) => {
            let replaced = stand_ins.remove(uid);
            drop(stand_ins);
            drop(replaced);
            false
        }
        None => false,
    }
}

/// ztunnel's reconcile at `SnapshotSent`: the pods a snapshot does not name went away while it
/// was disconnected.
fn drain_unnamed(shared: &Shared, connection: &mut Connection) {
    let drained: Vec<(String, Proxy)> = {
        let mut stand_ins = shared.stand_ins();
        let unnamed: Vec<String> = stand_ins
            .keys()
            .filter(|uid| !connection.snapshot_names.contains(*uid))
            .cloned()
            .collect();
        unnamed
            .into_iter()
            .filter_map(|uid| stand_ins.remove(&uid).map(|proxy| (uid, proxy)))
            .collect()
    };
    for (uid, proxy) in drained {
        drop(proxy);
        shared.events.push(ZdsEvent::Drained { uid });
    }
    connection.snapshot_names.clear();
    connection.snapshot_received = true;
}

fn answer(socket: BorrowedFd<'_>, reply: &ZdsReply) -> io::Result<()> {
    let ack = |error: String| {
        WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack { error })),
        }
        .encode_to_vec()
    };
    match reply {
        ZdsReply::Ack => send_datagram(socket, &ack(String::new()), None),
        ZdsReply::Nack(error) => send_datagram(socket, &ack(error.clone()), None),
        ZdsReply::Silent => Ok(()),
        ZdsReply::Raw { bytes, with_fd } => send_raw(socket, bytes, *with_fd),
    }
}

fn send_raw(socket: BorrowedFd<'_>, bytes: &[u8], with_fd: bool) -> io::Result<()> {
    if with_fd {
        let extra = File::open("/dev/null")?;
        send_datagram(socket, bytes, Some(extra.as_fd()))
    } else {
        send_datagram(socket, bytes, None)
    }
}

/// The pod's addresses, read inside its namespace (ZDS carries none): every interface address
/// but loopback and IPv6 link-local.
fn pod_ips(netns: BorrowedFd<'_>) -> io::Result<Vec<IpAddr>> {
    thread::scope(|scope| {
        scope
            .spawn(|| {
                netns::enter(netns)?;
                let mut ips = Vec::new();
                for interface in nix::ifaddrs::getifaddrs()? {
                    let Some(address) = interface.address else {
                        continue;
                    };
                    let ip = if let Some(v4) = address.as_sockaddr_in() {
                        IpAddr::from(v4.ip())
                    } else if let Some(v6) = address.as_sockaddr_in6() {
                        IpAddr::from(v6.ip())
                    } else {
                        continue;
                    };
                    let link_local =
                        matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
                    if !ip.is_loopback() && !link_local && !ips.contains(&ip) {
                        ips.push(ip);
                    }
                }
                Ok(ips)
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}
