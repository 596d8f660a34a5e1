//! A stand-in for istio-cni's ambient node agent, the one weir takes a node over from, written
//! from istio's own (`cni/pkg/nodeagent/ztunnelserver.go` and `net_linux.go`, and the installer's
//! `cni/pkg/install/cniconfig.go`), not from weir's: so that a test of the hand-over has the other
//! side as istio has it.
//!
//! [`IstioCniAgent`] is its ZDS server and its pod enrollment:
//! - It listens on a SOCK_SEQPACKET socket at the given path, removing a file left there first.
//! - For each ztunnel that connects it reads the hello (any version, within 5 s), sends the
//!   snapshot (an Add with the pod's netns fd and `WorkloadInfo` for every enrolled pod), then
//!   `SnapshotSent`; later Adds go to the newest connection and Dels to every connection.
//!   Requests on a connection go one at a time, each waiting for its Ack (5 s).
//! - Enrolling a pod ([`IstioCniAgent::add_pod`]) puts it in the snapshot, installs istio's
//!   in-pod rules ([`istio_iptables::apply`]), then sends the Add: with no ztunnel connected that
//!   fails, and the pod goes to the next ztunnel in its snapshot.
//! - [`IstioCniAgent::stop`] is the agent leaving the node: its listener closes, which removes
//!   the path whatever file it names by then (Go's `UnixListener.Close`), and its connections
//!   close with the process.
//!
//! Not here: istio's periodic keepalive read (a closed connection is noticed from its hangup
//! instead), its rate limit on accepts, and its keeping a connection whose ack timed out (a
//! failed request drops the connection, as weir does).
//!
//! Blocking, with a thread accepting and a thread per connection. It shares weir's wire types and
//! datagram plumbing ([`send_datagram`], [`recv_datagram`]), not its protocol logic.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    accept4, bind, listen, shutdown, socket, AddressFamily, Backlog, Shutdown, SockFlag, SockType,
    UnixAddr,
};
use prost::Message;
use serde_json::{json, Value};
use socket2::SockRef;
use weir_agent::zds::proto::{
    workload_request::Payload, workload_response, AddWorkload, DelWorkload, SnapshotSent,
    WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello,
};
use weir_agent::zds::{recv_datagram, send_datagram};

use crate::istio_iptables::{self, Backend};
use crate::netns::NetNs;
use crate::zds_client::NetnsId;
use crate::Pod;

/// istio's `readWriteDeadline`: for the hello, each write and each ack.
const DEADLINE: Duration = Duration::from_secs(5);
/// How often the accepting and watching threads look at the stop flag (milliseconds).
const STOP_POLL_MS: u8 = 50;

/// Why enrolling or removing a pod failed.
#[derive(Debug, thiserror::Error)]
pub enum IstioCniError {
    /// istio-cni's rules could not be installed in the pod: the pod is not enrolled.
    #[error("failed to create in-pod rules: {0:#}")]
    Rules(anyhow::Error),
    /// No ztunnel is connected: the pod is enrolled and goes to the next one in its snapshot.
    #[error("no ztunnel connection")]
    NotConnected,
    /// ztunnel answered with an error.
    #[error("got ack error: {0}")]
    Nack(String),
    /// The connection failed (or closed) before the ack: it is dropped.
    #[error("ztunnel connection: {0}")]
    Io(#[from] io::Error),
}

/// istio-cni's node agent on the node: its ZDS server and the pods it enrolled. Stopped on drop.
pub struct IstioCniAgent {
    path: PathBuf,
    backend: Backend,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    /// istio's pod cache: what every snapshot sends, by uid.
    pods: Mutex<BTreeMap<String, Enrolled>>,
    /// In the order they connected: the last is the newest.
    connections: Mutex<Vec<Arc<Connection>>>,
    /// Every connection's thread, joined on stop.
    threads: Mutex<Vec<JoinHandle<()>>>,
    stopping: AtomicBool,
}

struct Enrolled {
    info: WorkloadInfo,
    netns: Arc<OwnedFd>,
    netns_id: Option<NetnsId>,
}

struct Connection {
    socket: OwnedFd,
    /// Held for a whole request and its ack, and by the connection's own thread from before it
    /// is listed until its snapshot is acked: acks are matched to requests by order alone.
    requests: Mutex<()>,
}

impl IstioCniAgent {
    /// Listens for ztunnel on `socket_path` (its directory created, a file there removed);
    /// writes pods' rules with `backend`.
    pub fn start(socket_path: impl AsRef<Path>, backend: Backend) -> io::Result<Self> {
        let path = socket_path.as_ref().to_owned();
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        remove_socket_file(&path)?;
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        bind(listener.as_raw_fd(), &UnixAddr::new(&path)?)?;
        listen(&listener, Backlog::new(16)?)?;
        let shared = Arc::new(Shared::default());
        let acceptor = thread::Builder::new().name("istio-cni-zds".into()).spawn({
            let shared = shared.clone();
            move || accept_loop(&listener, &shared)
        })?;
        Ok(Self {
            path,
            backend,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The socket path it serves.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// The ztunnels connected (from `accept`, as istio counts them, until their hangup is seen).
    pub fn connections(&self) -> usize {
        self.shared.connections().len()
    }

    /// Enrolls the pod whose network namespace is `netns`, as istio's `AddPodToMesh`: into the
    /// snapshot, istio's in-pod rules (once per namespace), then the Add to the newest ztunnel.
    pub fn add_pod(
        &self,
        uid: &str,
        netns: &NetNs,
        info: WorkloadInfo,
    ) -> Result<(), IstioCniError> {
        let fd = Arc::new(OwnedFd::from(netns.open()?));
        let netns_id = NetnsId::of(&*fd).ok();
        let previous = self.shared.pods().insert(
            uid.to_owned(),
            Enrolled {
                info: info.clone(),
                netns: fd.clone(),
                netns_id,
            },
        );
        // istio reconciles its rules with what is there; applying the same set twice would add
        // its jumps and policy routes a second time.
        let has_rules = previous.is_some_and(|p| p.netns_id.is_some() && p.netns_id == netns_id);
        if !has_rules {
            if let Err(error) = istio_iptables::apply(netns, self.backend) {
                self.shared.pods().remove(uid);
                return Err(IstioCniError::Rules(error));
            }
        }
        let newest = self.shared.connections().last().cloned();
        let newest = newest.ok_or(IstioCniError::NotConnected)?;
        let add = Payload::Add(AddWorkload {
            uid: uid.to_owned(),
            workload_info: Some(info),
        });
        self.shared.request(&newest, add, Some(fd.as_fd()))
    }

    /// [`Self::add_pod`] for a pod of the harness, named as its `WorkloadInfo` says
    /// ([`workload_info`]).
    pub fn enroll(&self, pod: &Pod) -> Result<(), IstioCniError> {
        self.add_pod(pod.uid(), pod.netns(), workload_info(pod))
    }

    /// A deleted pod, as istio's `RemovePodFromMesh` for a pod that is gone: out of the snapshot,
    /// and a Del to every ztunnel. Returns the first failure.
    pub fn del_pod(&self, uid: &str) -> Result<(), IstioCniError> {
        self.shared.pods().remove(uid);
        let connections = self.shared.connections().clone();
        let mut first_error = None;
        for connection in connections {
            let del = Payload::Del(DelWorkload {
                uid: uid.to_owned(),
            });
            if let Err(error) = self.shared.request(&connection, del, None) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The agent leaves the node: the listener closes and its path is removed, then every
    /// ztunnel's connection closes.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::Relaxed);
        let _ = acceptor.join();
        // Go unlinks the path on close without looking at what it names: a socket another agent
        // bound there meanwhile goes too.
        let _ = remove_socket_file(&self.path);
        for connection in self.shared.connections().drain(..) {
            let _ = shutdown(connection.socket.as_raw_fd(), Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.shared.threads());
        for thread in threads {
            let _ = thread.join();
        }
    }
}

impl Drop for IstioCniAgent {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// istio's `WorkloadInfo` for a pod (`podToWorkload`): its name, namespace and service account,
/// `default` as Kubernetes fills it in when the pod names none.
pub fn workload_info(pod: &Pod) -> WorkloadInfo {
    WorkloadInfo {
        name: pod.name().to_owned(),
        namespace: pod.namespace().to_owned(),
        service_account: "default".to_owned(),
    }
}

/// The entry istio-cni's installer puts last in the node's conflist, with the chart's defaults
/// for ambient: istio's plugin `Config` as it marshals it, `cniVersion` dropped as it is when
/// inserted into a list.
pub fn plugin_entry() -> Value {
    json!({
        "name": "istio-cni",
        "type": "istio-cni",
        "ipam": {},
        "dns": {},
        "plugin_log_level": "info",
        "cni_agent_run_dir": "/var/run/istio-cni",
        "ambient_enabled": true,
        "enablement_selectors": [
            {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
            {
                "podSelector": {"matchExpressions": [{
                    "key": "istio.io/dataplane-mode",
                    "operator": "NotIn",
                    "values": ["none"],
                }]},
                "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}},
            },
        ],
        "exclude_namespaces": ["kube-system"],
        "pod_namespace": "istio-system",
        "native_nftables": false,
    })
}

impl Shared {
    fn pods(&self) -> MutexGuard<'_, BTreeMap<String, Enrolled>> {
        self.pods.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, Vec<Arc<Connection>>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn threads(&self) -> MutexGuard<'_, Vec<JoinHandle<()>>> {
        self.threads.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One request and its ack, on a connection no one else is using; a failure other than a
    /// nack drops the connection.
    fn request(
        &self,
        connection: &Arc<Connection>,
        payload: Payload,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), IstioCniError> {
        let _alone = connection
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let result = exchange(connection.socket.as_fd(), payload, fd);
        if let Err(IstioCniError::Io(_)) = &result {
            self.drop_connection(connection);
        }
        result
    }

    fn drop_connection(&self, connection: &Arc<Connection>) {
        self.connections().retain(|c| !Arc::ptr_eq(c, connection));
        let _ = shutdown(connection.socket.as_raw_fd(), Shutdown::Both);
    }
}

fn remove_socket_file(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

fn accept_loop(listener: &OwnedFd, shared: &Arc<Shared>) {
    while !shared.stopping.load(Ordering::Relaxed) {
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(STOP_POLL_MS)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(err) => {
                eprintln!("istio-cni stand-in: poll: {err}");
                return;
            }
        }
        let accepted = accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC);
        let socket = match accepted {
            // SAFETY: accept4 returned a new descriptor that nothing else owns.
            Ok(fd) => unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) },
            Err(nix::Error::EAGAIN | nix::Error::EINTR) => continue,
            Err(err) => {
                eprintln!("istio-cni stand-in: accept: {err}");
                continue;
            }
        };
        let timeouts = SockRef::from(&socket)
            .set_read_timeout(Some(DEADLINE))
            .and_then(|()| SockRef::from(&socket).set_write_timeout(Some(DEADLINE)));
        if let Err(err) = timeouts {
            eprintln!("istio-cni stand-in: deadlines: {err}");
            continue;
        }
        let connection = Arc::new(Connection {
            socket,
            requests: Mutex::new(()),
        });
        let spawned = thread::Builder::new().name("istio-cni-conn".into()).spawn({
            let shared = shared.clone();
            move || serve_connection(&connection, &shared)
        });
        match spawned {
            Ok(thread) => {
                let mut threads = shared.threads();
                threads.retain(|thread| !thread.is_finished());
                threads.push(thread);
            }
            Err(err) => eprintln!("istio-cni stand-in: a connection's thread: {err}"),
        }
    }
}

/// istio's `handleConn`: listed as a connection at once, hello, snapshot, then served until the
/// ztunnel hangs up or the agent stops.
fn serve_connection(connection: &Arc<Connection>, shared: &Shared) {
    {
        let alone = connection
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        shared.connections().push(connection.clone());
        // `shut_down` sets the flag before it closes the listed connections: one of the two
        // sees the other.
        let served = if shared.stopping.load(Ordering::Relaxed) {
            Ok(())
        } else {
            hello_and_snapshot(connection.socket.as_fd(), shared)
        };
        drop(alone);
        if let Err(err) = served {
            eprintln!("istio-cni stand-in: ztunnel connection: {err}");
            shared.drop_connection(connection);
            return;
        }
    }
    // Only a hangup is waited for (poll reports it unasked): ztunnel sends nothing unasked, and
    // acks are read by the requests.
    while !shared.stopping.load(Ordering::Relaxed) {
        let mut fds = [PollFd::new(connection.socket.as_fd(), PollFlags::empty())];
        match poll(&mut fds, PollTimeout::from(STOP_POLL_MS)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => break,
            Err(err) => {
                eprintln!("istio-cni stand-in: poll: {err}");
                break;
            }
        }
    }
    shared.drop_connection(connection);
}

fn hello_and_snapshot(socket: BorrowedFd<'_>, shared: &Shared) -> Result<(), IstioCniError> {
    let hello = recv_datagram(socket)?;
    if hello.bytes.is_empty() || hello.truncated {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "no hello").into());
    }
    ZdsHello::decode(hello.bytes.as_slice())
        .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))?;
    let snapshot: Vec<(String, WorkloadInfo, Arc<OwnedFd>)> = shared
        .pods()
        .iter()
        .map(|(uid, pod)| (uid.clone(), pod.info.clone(), pod.netns.clone()))
        .collect();
    for (uid, info, netns) in snapshot {
        let add = Payload::Add(AddWorkload {
            uid,
            workload_info: Some(info),
        });
        // istio only logs a pod ztunnel refused, and goes on.
        match exchange(socket, add, Some(netns.as_fd())) {
            Ok(()) | Err(IstioCniError::Nack(_)) => {}
            Err(error) => return Err(error),
        }
    }
    match exchange(socket, Payload::SnapshotSent(SnapshotSent {}), None) {
        Ok(()) | Err(IstioCniError::Nack(_)) => Ok(()),
        Err(error) => Err(error),
    }
}

/// Sends one request (with `fd` attached) and reads its ack.
fn exchange(
    socket: BorrowedFd<'_>,
    payload: Payload,
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), IstioCniError> {
    let request = WorkloadRequest {
        payload: Some(payload),
    };
    send_datagram(socket, &request.encode_to_vec(), fd)?;
    let answer = recv_datagram(socket)?;
    if answer.bytes.is_empty() && !answer.truncated {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    if answer.truncated {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated message").into());
    }
    let response = WorkloadResponse::decode(answer.bytes.as_slice())
        .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))?;
    match response.payload {
        Some(workload_response::Payload::Ack(ack)) if !ack.error.is_empty() => {
            Err(IstioCniError::Nack(ack.error))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_entry_is_istio_cnis() {
        let entry = plugin_entry();
        assert_eq!(entry["type"], "istio-cni");
        assert_eq!(entry["name"], "istio-cni");
        // Inserted into a list, the entry carries no version of its own.
        assert!(entry.get("cniVersion").is_none());
        assert_eq!(entry["ambient_enabled"], true);
    }
}
