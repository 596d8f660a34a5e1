//! ztunnel's side of ZDS, for tests: [`ZdsZtunnel`] connects to the agent's socket as ztunnel
//! does (SOCK_SEQPACKET, [`ZdsHello`] V1 first), and for every `Add` takes the netns fd that
//! comes with it, starts a [`ZtunnelStandIn`] in that namespace and acks; `Keep` and
//! `SnapshotSent` are recorded and acked, `Del` stops the pod's stand-in and is acked. Everything
//! received is recorded in order ([`ZdsEvent`]) and can be waited for.
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

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

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
    /// A datagram that is not a valid request: nacked, then the connection was dropped.
    Invalid(String),
    /// The connection ended (the agent closed it, or the stand-in dropped it).
    Closed,
}

impl ZdsEvent {
    /// The pod the event names, if any.
    pub fn uid(&self) -> Option<&str> {
        match self {
            ZdsEvent::Add { uid, .. } | ZdsEvent::Keep { uid } | ZdsEvent::Del { uid } => Some(uid),
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

/// A ztunnel connected to the agent over ZDS; disconnects (and stops every stand-in) on drop.
pub struct ZdsZtunnel {
    socket: Arc<OwnedFd>,
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    events: Log<ZdsEvent>,
    stand_ins: Mutex<HashMap<String, Arc<ZtunnelStandIn>>>,
    replies: Mutex<Replies>,
    /// Adds are answered without a stand-in in the pod ([`ZdsZtunnel::ack_without_proxies`]).
    without_proxies: AtomicBool,
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
        let socket = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        connect(socket.as_raw_fd(), &UnixAddr::new(socket_path.as_ref())?)?;
        let socket = Arc::new(socket);
        if let Some(hello) = hello {
            send_datagram(socket.as_fd(), hello, None)?;
        }
        let shared = Arc::new(Shared::default());
        let reader = thread::Builder::new().name("zds-ztunnel".into()).spawn({
            let (socket, shared) = (socket.clone(), shared.clone());
            move || read_loop(&socket, &shared)
        })?;
        Ok(Self {
            socket,
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

    /// Whether the connection ended within `timeout`.
    pub fn wait_for_close(&self, timeout: Duration) -> bool {
        self.wait_for(|event| *event == ZdsEvent::Closed, timeout)
            .is_some()
    }

    /// The stand-in serving pod `uid`, while it is added.
    pub fn stand_in(&self, uid: &str) -> Option<Arc<ZtunnelStandIn>> {
        self.shared.stand_ins().get(uid).cloned()
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

    /// Sends `bytes` as one datagram, unasked, with an fd (of `/dev/null`) when `with_fd`.
    pub fn send_raw(&self, bytes: &[u8], with_fd: bool) -> io::Result<()> {
        send_raw(self.socket.as_fd(), bytes, with_fd)
    }

    /// Closes the connection (as a ztunnel that exits), stops every stand-in and waits for the
    /// reader to finish.
    pub fn disconnect(mut self) {
        self.close();
    }

    fn close(&mut self) {
        // Wakes the reader's blocking recvmsg with an end of file.
        let _ = shutdown(self.socket.as_raw_fd(), Shutdown::Both);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        self.shared.stand_ins().clear();
    }
}

impl Drop for ZdsZtunnel {
    fn drop(&mut self) {
        self.close();
    }
}

impl Shared {
    fn stand_ins(&self) -> MutexGuard<'_, HashMap<String, Arc<ZtunnelStandIn>>> {
        self.stand_ins
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn replies(&self) -> MutexGuard<'_, Replies> {
        self.replies.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Serves the connection until it ends: one request at a time, answered before the next is read.
fn read_loop(socket: &OwnedFd, shared: &Shared) {
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
        match serve(&bytes, fds, truncated, shared) {
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
            let netns = fds.pop().expect("one fd, checked above");
            let netns_id = NetnsId::of(&netns).ok();
            let pod_ips = pod_ips(netns.as_fd()).unwrap_or_default();
            let with_proxy = !shared.without_proxies.load(Ordering::Relaxed);
            if with_proxy && !matches!(reply, ZdsReply::Nack(_)) {
                match ZtunnelStandIn::start_in_netns(netns, &pod_ips) {
                    Ok(stand_in) => {
                        shared
                            .stand_ins()
                            .insert(add.uid.clone(), Arc::new(stand_in));
                    }
                    // ztunnel nacks an Add whose proxy does not start, and stays connected.
                    Err(err) if reply == ZdsReply::Ack => {
                        reply = ZdsReply::Nack(format!("failure to start proxy: {err}"));
                    }
                    Err(err) => eprintln!("ZDS stand-in: starting a stand-in: {err}"),
                }
            }
            shared.events.push(ZdsEvent::Add {
                uid: add.uid,
                info: add.workload_info,
                netns: netns_id,
                pod_ips,
            });
        }
        Payload::Keep(keep) => shared.events.push(ZdsEvent::Keep { uid: keep.uid }),
        Payload::Del(del) => {
            // Dropping the last handle stops the stand-in (a test may still hold one).
            shared.stand_ins().remove(&del.uid);
            shared.events.push(ZdsEvent::Del { uid: del.uid });
        }
        Payload::SnapshotSent(_) => shared.events.push(ZdsEvent::SnapshotSent),
    }
    Ok(reply)
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
