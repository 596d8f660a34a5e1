//! The ZDS server: how weir hands pods to ztunnel, wire-identical to istio-cni's node agent
//! (`cni/pkg/nodeagent/ztunnelserver.go`), so an unmodified ztunnel in in-pod mode can use it.
//!
//! ztunnel connects to a SOCK_SEQPACKET Unix socket (default `/var/run/ztunnel/ztunnel.sock`)
//! and says [`ZdsHello`]; weir answers with a snapshot of every pod it has handed over (`Add`
//! with the pod's netns fd, or `Keep` when weir holds no netns for the pod) closed by
//! `SnapshotSent`, then streams `Add`s (to the newest connection) and `Del`s (to every
//! connection) as pods come and go. Every request waits for one [`Ack`]; requests on one
//! connection never overlap, because acks are matched to requests only by order.
//!
//! How weir differs from istio where istio's choice is not visible on the wire:
//! - A connection counts (for [`ZdsHandle::connections`], the `ztunnel_connected` gauge and as
//!   "newest") from its hello on, not from `accept`: the snapshot is taken at that moment under
//!   the same lock as the registry, so a pod registered concurrently is sent exactly once, in
//!   the snapshot or after it.
//! - A request that is not acked in time closes the connection (istio keeps it, and the late
//!   ack would then be taken as the next request's); ztunnel reconnects and gets a snapshot.
//! - Liveness: the socket is watched while idle, so a closed peer (or one that sends anything
//!   unasked) is seen at once instead of at istio's periodic short read.
//! - An empty datagram reads as the peer's close, as it does for ztunnel.
//! - Snapshots can be held ([`ZdsHandle::hold_snapshots`]): a ztunnel that connects meanwhile
//!   waits after its hello. ztunnel drops every pod a snapshot does not name, so none may be
//!   sent before the agent knows which pods it holds (istio starts its ZDS server only then).
//!
//! [`Ack`]: proto::Ack

mod connection;
mod metrics;
pub mod proto;
mod seqpacket;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use prometheus_client::registry::Registry;
use prost::Message;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tracing::{debug, error, info, warn};

use crate::datapath::Datapath;

pub use connection::{decode_answer, decode_hello};
use metrics::{message_name, Metrics};
use proto::workload_request::Payload;
use proto::{AddWorkload, DelWorkload, WorkloadRequest};
pub use proto::{WorkloadInfo, ZdsHello};
pub use seqpacket::{recv_datagram, send_datagram, Datagram, MAX_DATAGRAM};

/// Where istio-cni listens and ztunnel connects by default.
pub const DEFAULT_SOCKET_PATH: &str = "/var/run/ztunnel/ztunnel.sock";

/// The hello, write and ack deadlines (istio's `readWriteDeadline`).
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// At most one accept per interval (istio: a 5/s rate limiter): a ztunnel reconnecting in a
/// tight loop cannot make the agent spin.
const ACCEPT_INTERVAL: Duration = Duration::from_millis(200);
/// Connections served at once; more wait in the listen backlog. Two is the normal maximum
/// (rolling upgrade); connections that never say hello leave after [`IO_TIMEOUT`].
const MAX_CONNECTIONS: usize = 8;
/// How often the socket's path is checked: another node agent leaving the node (istio-cni's,
/// when weir takes its place) removes the path it shared with weir, and ztunnel, which connects
/// by path, would never find weir again.
const SOCKET_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Snapshot acks kept for slow [`ZdsHandle::acked`] receivers.
const ACKED_CAPACITY: usize = 1024;

#[derive(Clone, Debug)]
pub struct ZdsConfig {
    /// The Unix socket ztunnel connects to; its directory is created if missing.
    pub socket_path: PathBuf,
}

impl Default for ZdsConfig {
    fn default() -> Self {
        Self {
            socket_path: DEFAULT_SOCKET_PATH.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("no ztunnel is connected")]
    NotConnected,
    #[error("ztunnel refused: {0}")]
    Nack(String),
    #[error("ztunnel did not answer within {IO_TIMEOUT:?}")]
    Timeout,
    #[error("the ztunnel connection closed before the request was answered")]
    ConnectionClosed,
    #[error("ztunnel protocol error: {0}")]
    Protocol(String),
    #[error("the message would take {0} bytes, more than a ZDS datagram's {MAX_DATAGRAM}")]
    TooLarge(usize),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl ZdsError {
    /// Whether the connection cannot be used after this error: the request/ack pairing is lost.
    fn is_fatal(&self) -> bool {
        !matches!(self, ZdsError::Nack(_) | ZdsError::TooLarge(_))
    }

    /// The `reason` label of `weir_zds_errors`.
    fn reason(&self) -> &'static str {
        match self {
            ZdsError::NotConnected => "not_connected",
            ZdsError::Nack(_) => "nack",
            ZdsError::Timeout => "timeout",
            ZdsError::ConnectionClosed => "closed",
            ZdsError::Protocol(_) => "protocol",
            ZdsError::TooLarge(_) => "too_large",
            ZdsError::Io(_) => "io",
        }
    }
}

/// The agent's side of ZDS: the registry of pods handed to ztunnel, and the connections.
#[derive(Clone)]
pub struct ZdsHandle {
    shared: Arc<Shared>,
}

/// Binds the socket and returns the handle and the future that serves it (until dropped or
/// aborted, which also closes every connection). Needs no runtime until the future is polled.
///
/// `datapath`, where there is one, is told each ztunnel process that connects, before its
/// snapshot: the programs know ztunnel's sockets by its cgroup.
pub fn start(
    config: ZdsConfig,
    datapath: Option<Arc<Datapath>>,
    registry: &mut Registry,
) -> io::Result<(ZdsHandle, impl Future<Output = ()>)> {
    let listener = seqpacket::bind_listener(&config.socket_path)?;
    info!(socket = %config.socket_path.display(), "ZDS server listening");
    let shared = Arc::new(Shared {
        state: Mutex::default(),
        snapshots: watch::Sender::new(true),
        connected: watch::Sender::new(0),
        acked: broadcast::Sender::new(ACKED_CAPACITY),
        metrics: Metrics::register(registry),
        datapath,
    });
    let handle = ZdsHandle {
        shared: shared.clone(),
    };
    Ok((handle, serve(listener, config.socket_path, shared)))
}

impl ZdsHandle {
    /// Registers the pod (so every future snapshot names it) and, if a ztunnel is connected,
    /// sends Add + fd to the newest connection and waits for its Ack. Err(NotConnected) when no
    /// ztunnel is connected (the pod stays registered and is sent on the next connect).
    ///
    /// With `netns: None` the pod is only registered: ZDS has no Add without an fd, so
    /// snapshots name it with Keep (ztunnel keeps a proxy it already has) and this returns Ok.
    /// Registering a uid again replaces its info and netns.
    pub async fn add(
        &self,
        uid: &str,
        info: WorkloadInfo,
        netns: Option<Arc<OwnedFd>>,
    ) -> Result<(), ZdsError> {
        let payload = Payload::Add(AddWorkload {
            uid: uid.to_owned(),
            workload_info: Some(info.clone()),
        });
        // Refused before registering: a pod that cannot be encoded would fail every snapshot.
        let len = request_len(&payload);
        if len > MAX_DATAGRAM {
            self.shared.metrics.error("add", "too_large");
            return Err(ZdsError::TooLarge(len));
        }
        let pod = format!("{}/{}", info.namespace, info.name);
        let reply = {
            let mut state = self.shared.lock();
            state.pods.insert(
                uid.to_owned(),
                Pod {
                    info,
                    netns: netns.clone(),
                },
            );
            let Some(netns) = netns else {
                info!(
                    uid,
                    pod, "pod registered without a netns: ztunnel is told to keep it"
                );
                return Ok(());
            };
            let Some(newest) = state.connections.last() else {
                info!(
                    uid,
                    pod, "no ztunnel connected: the pod is sent when one connects"
                );
                return Err(ZdsError::NotConnected);
            };
            debug!(uid, pod, conn = newest.id, "queueing Add");
            newest.send(payload, Some(netns))
        };
        let pending = self.shared.metrics.pending_add();
        let result = reply.await;
        drop(pending);
        match &result {
            Ok(()) => info!(uid, pod, "ztunnel acked the Add"),
            Err(error) => warn!(uid, pod, %error, "Add failed"),
        }
        result
    }

    /// Unregisters the pod and sends Del to every connection (best effort, waits for acks with
    /// the deadline). Del is sent even for a uid that was not registered (ztunnel ignores
    /// unknown uids). Returns the first failure; without connections there is nothing to do.
    pub async fn del(&self, uid: &str) -> Result<(), ZdsError> {
        let replies: Vec<_> = {
            let mut state = self.shared.lock();
            // ztunnel never had it (a pod that was not enrolled, a second DEL): nothing to drop.
            if state.pods.remove(uid).is_none() {
                return Ok(());
            }
            state
                .connections
                .iter()
                .map(|connection| {
                    let payload = Payload::Del(DelWorkload {
                        uid: uid.to_owned(),
                    });
                    (connection.id, connection.send(payload, None))
                })
                .collect()
        };
        let mut first_error = None;
        for (conn, reply) in replies {
            match reply.await {
                Ok(()) => debug!(uid, conn, "ztunnel acked the Del"),
                Err(error) => {
                    warn!(uid, conn, %error, "Del failed");
                    first_error.get_or_insert(error);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Until [`ZdsHandle::release_snapshots`], a ztunnel that connects gets no snapshot: it
    /// waits after its hello, unregistered (no Add reaches it either).
    pub fn hold_snapshots(&self) {
        self.shared.snapshots.send_replace(false);
    }

    /// Lets every waiting ztunnel, and those that connect from now on, have its snapshot.
    pub fn release_snapshots(&self) {
        self.shared.snapshots.send_replace(true);
    }

    /// Number of connected ztunnels, as a watch so callers can wait for one.
    pub fn connections(&self) -> watch::Receiver<usize> {
        self.shared.connected.subscribe()
    }

    /// Uids acked by a ztunnel through a snapshot (pods that were pending when it connected).
    /// Only Adds: a Keep ack does not mean ztunnel proxies the pod.
    pub fn acked(&self) -> broadcast::Receiver<String> {
        self.shared.acked.subscribe()
    }
}

fn request_len(payload: &Payload) -> usize {
    WorkloadRequest {
        payload: Some(payload.clone()),
    }
    .encoded_len()
}

/// State shared by the handle, the accept loop and the connections.
struct Shared {
    state: Mutex<State>,
    /// Whether snapshots may be sent ([`ZdsHandle::hold_snapshots`]).
    snapshots: watch::Sender<bool>,
    connected: watch::Sender<usize>,
    acked: broadcast::Sender<String>,
    metrics: Metrics,
    datapath: Option<Arc<Datapath>>,
}

#[derive(Default)]
struct State {
    /// Every pod handed to ztunnel, by uid; ordered so snapshots are deterministic.
    pods: BTreeMap<String, Pod>,
    /// Connections past their hello, oldest first.
    connections: Vec<Connection>,
    next_id: u64,
}

#[derive(Clone)]
struct Pod {
    info: WorkloadInfo,
    netns: Option<Arc<OwnedFd>>,
}

/// A connection's request queue, served in order by its task.
struct Connection {
    id: u64,
    requests: mpsc::UnboundedSender<Request>,
}

impl Connection {
    /// Queues a request; the returned future resolves with its outcome.
    fn send(
        &self,
        payload: Payload,
        netns: Option<Arc<OwnedFd>>,
    ) -> impl Future<Output = Result<(), ZdsError>> {
        let (reply, outcome) = oneshot::channel();
        let queued = self.requests.send(Request {
            payload,
            netns,
            reply,
        });
        async move {
            queued.map_err(|_| ZdsError::ConnectionClosed)?;
            // Dropped unanswered: the connection ended first.
            outcome.await.unwrap_or(Err(ZdsError::ConnectionClosed))
        }
    }
}

struct Request {
    payload: Payload,
    netns: Option<Arc<OwnedFd>>,
    reply: oneshot::Sender<Result<(), ZdsError>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes a connection that said hello the newest one and returns its snapshot, atomically
    /// with respect to the registry: every pod is either in the snapshot or queued after it.
    fn register(
        self: &Arc<Self>,
        requests: mpsc::UnboundedSender<Request>,
    ) -> (Registration, Vec<(String, Pod)>) {
        let mut state = self.lock();
        state.next_id += 1;
        let id = state.next_id;
        state.connections.push(Connection { id, requests });
        self.metrics.connections.inc();
        let snapshot = state
            .pods
            .iter()
            .map(|(uid, pod)| (uid.clone(), pod.clone()))
            .collect();
        self.count(state.connections.len());
        let registration = Registration {
            shared: self.clone(),
            id,
        };
        (registration, snapshot)
    }

    fn count(&self, connections: usize) {
        // The gauge first: whoever the watch wakes sees the same number in the metrics.
        self.metrics
            .connected
            .set(i64::try_from(connections).unwrap_or(i64::MAX));
        self.connected.send_replace(connections);
    }
}

/// A connection's place in [`State::connections`], given up on drop (however its task ends).
struct Registration {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state
            .connections
            .retain(|connection| connection.id != self.id);
        self.shared.count(state.connections.len());
        info!(
            conn = self.id,
            connected = state.connections.len(),
            "ztunnel disconnected"
        );
    }
}

/// Accepts connections at a bounded rate and serves each on a task of its own; the tasks are
/// aborted when this future is dropped. Binds `path` again whenever it no longer names the
/// listening socket; connections already made go on.
async fn serve(listener: OwnedFd, path: PathBuf, shared: Arc<Shared>) {
    let mut bound = seqpacket::bound_file(&path).ok();
    let mut listener = match seqpacket::Listener::new(listener) {
        Ok(listener) => listener,
        Err(err) => {
            error!(%err, "cannot serve ZDS: the socket cannot be registered with the runtime");
            return;
        }
    };
    let mut connections = JoinSet::new();
    let mut pace = tokio::time::interval(ACCEPT_INTERVAL);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut socket_check = tokio::time::interval(SOCKET_CHECK_INTERVAL);
    loop {
        pace.tick().await;
        while connections.len() >= MAX_CONNECTIONS {
            connections.join_next().await;
        }
        let accepted = loop {
            tokio::select! {
                accepted = listener.accept() => break accepted,
                // Reap finished connections while waiting.
                Some(_) = connections.join_next() => {}
                _ = socket_check.tick() => {
                    if seqpacket::bound_file(&path).ok() != bound {
                        if let Some(rebound) = bind_again(&path) {
                            (listener, bound) = rebound;
                        }
                    }
                }
            }
        };
        match accepted {
            // The socket file is root-only already; this also refuses a peer that reached it
            // through looser permissions (ztunnel runs as root).
            Ok(socket) => match socket.peer_uid() {
                Ok(0) => {
                    debug!("ztunnel connection accepted");
                    connections.spawn(connection::serve(socket, shared.clone()));
                }
                Ok(uid) => warn!(uid, "refusing a ZDS connection from a non-root peer"),
                Err(err) => warn!(%err, "ZDS peer credentials"),
            },
            // E.g. EMFILE; the pace keeps a persistent failure from spinning.
            Err(err) => warn!(%err, "ZDS accept failed"),
        }
    }
}

/// A new listener at `path`, whose file was removed or replaced; `None` (logged, tried again at
/// the next check) when it cannot be made.
fn bind_again(path: &Path) -> Option<(seqpacket::Listener, Option<(u64, u64)>)> {
    warn!(
        socket = %path.display(),
        "the ZDS socket's file was removed or replaced (by another node agent leaving the node?): \
         listening there again, so that ztunnel finds this agent when it reconnects"
    );
    let rebound = seqpacket::bind_listener(path).and_then(|fd| {
        let bound = seqpacket::bound_file(path).ok();
        Ok((seqpacket::Listener::new(fd)?, bound))
    });
    rebound
        .inspect_err(|err| error!(%err, socket = %path.display(), "cannot listen for ztunnel"))
        .ok()
}
