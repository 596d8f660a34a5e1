//! One ztunnel connection: hello, snapshot, then queued requests, one at a time, each waiting
//! for its ack. Anything off-protocol closes this connection only.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use anyhow::{bail, Context};
use prost::Message;
use tokio::sync::mpsc;
use tokio::time::timeout;
use tracing::{debug, info, warn};

use super::proto::workload_request::Payload;
use super::proto::workload_response::Payload as Response;
use super::proto::{
    Ack, AddWorkload, KeepWorkload, SnapshotSent, Version, WorkloadRequest, WorkloadResponse,
    ZdsHello,
};
use super::seqpacket::{Datagram, SeqpacketConnection, MAX_DATAGRAM};
use super::{message_name, Metrics, Shared, ZdsError, IO_TIMEOUT};
use crate::datapath::Datapath;
use crate::logging::pod_span;

pub(super) async fn serve(socket: SeqpacketConnection, shared: Arc<Shared>) {
    match run(&socket, &shared).await {
        Ok(()) => debug!("ZDS connection ended by ztunnel"),
        Err(err) => warn!("closing the ZDS connection: {err:#}"),
    }
}

/// Waits while snapshots are held; a peer that closes or speaks meanwhile ends the connection.
async fn wait_for_snapshots(socket: &SeqpacketConnection, shared: &Shared) -> anyhow::Result<()> {
    let mut released = shared.snapshots.subscribe();
    if *released.borrow_and_update() {
        return Ok(());
    }
    info!("ztunnel said hello; its snapshot waits until the agent knows its pods");
    let _held = shared.metrics.held_snapshot();
    tokio::select! {
        // The sender lives in `shared`, as long as this connection.
        _ = released.wait_for(|released| *released) => Ok(()),
        datagram = socket.recv() => {
            let datagram = datagram.context("reading while the snapshot is held")?;
            if datagram.is_eof() {
                bail!("ztunnel closed the connection before its snapshot");
            }
            shared.metrics.error("unsolicited", "protocol");
            bail!("ztunnel sent a datagram unasked while its snapshot was held");
        }
    }
}

/// The connected ztunnel's cgroup, known to the datapath while the connection lasts.
struct ZtunnelSockets {
    datapath: Arc<Datapath>,
    cgroup: u64,
}

impl ZtunnelSockets {
    async fn known(datapath: &Arc<Datapath>, socket: &SeqpacketConnection) -> anyhow::Result<Self> {
        let pid = socket.peer_pid().context("ztunnel's pid")?;
        let cgroup = datapath
            .ztunnel_connected(pid)
            .await
            .context("recording ztunnel's cgroup")?;
        Ok(Self {
            datapath: datapath.clone(),
            cgroup,
        })
    }
}

impl Drop for ZtunnelSockets {
    fn drop(&mut self) {
        // Sent whether or not the answer is awaited.
        drop(self.datapath.ztunnel_disconnected(self.cgroup));
    }
}

async fn run(socket: &SeqpacketConnection, shared: &Arc<Shared>) -> anyhow::Result<()> {
    let hello = read_hello(socket)
        .await
        .inspect_err(|err| shared.metrics.error("hello", err.reason()))
        .context("no valid hello from ztunnel")?;
    if hello.version() != Version::V1 {
        // istio logs the version and goes on; ztunnel only ever sends V1.
        warn!(
            version = hello.version,
            "ztunnel announced an unknown ZDS version; going on"
        );
    }
    wait_for_snapshots(socket, shared).await?;
    let _ztunnel_sockets = match &shared.datapath {
        Some(datapath) => Some(
            ZtunnelSockets::known(datapath, socket)
                .await
                .inspect_err(|_| shared.metrics.error("hello", "identity"))?,
        ),
        None => None,
    };
    let (requests, mut queue) = mpsc::unbounded_channel();
    let (registration, snapshot) = shared.register(requests);
    let conn = registration.id;
    info!(
        conn,
        pods = snapshot.len(),
        connected = *shared.connected.borrow(),
        "ztunnel connected; sending the snapshot"
    );

    for (uid, pod) in snapshot {
        let name = format!("{}/{}", pod.info.namespace, pod.info.name);
        let span = pod_span(&pod.info.namespace, &pod.info.name, &uid);
        let payload = match &pod.netns {
            Some(_) => Payload::Add(AddWorkload {
                uid: uid.clone(),
                workload_info: Some(pod.info),
            }),
            None => Payload::Keep(KeepWorkload { uid: uid.clone() }),
        };
        let message = message_name(&payload);
        match exchange(socket, &shared.metrics, payload, pod.netns.as_deref()).await {
            Ok(()) => {
                span.in_scope(|| debug!(conn, message, "snapshot entry acked"));
                if message == "add" {
                    // No receiver is fine: nobody is waiting for pending pods.
                    let _ = shared.acked.send(uid);
                }
            }
            // As istio: a refused entry is logged and the snapshot goes on.
            Err(err) if !err.is_fatal() => {
                span.in_scope(|| warn!(conn, message, %err, "snapshot entry refused"));
            }
            Err(err) => return Err(err).context(format!("snapshot {message} for {uid} ({name})")),
        }
    }
    let sent = Payload::SnapshotSent(SnapshotSent {});
    match exchange(socket, &shared.metrics, sent, None).await {
        Ok(()) => info!(conn, "snapshot sent and acked"),
        Err(err) if !err.is_fatal() => warn!(conn, %err, "SnapshotSent refused"),
        Err(err) => return Err(err).context("SnapshotSent"),
    }

    loop {
        tokio::select! {
            request = queue.recv() => {
                // The sender lives in the registry until `registration` drops, after this loop.
                let Some(request) = request else { return Ok(()) };
                let message = message_name(&request.payload);
                let result =
                    exchange(socket, &shared.metrics, request.payload, request.netns.as_deref())
                        .await;
                let fatal = match &result {
                    Err(err) if err.is_fatal() => Some(err.to_string()),
                    _ => None,
                };
                // The caller may have given up waiting; the outcome is logged there or here.
                let _ = request.reply.send(result);
                if let Some(err) = fatal {
                    bail!("{message} on connection {conn}: {err}");
                }
            }
            // Idle: ztunnel speaks only when asked, so readable means closed or misbehaving.
            datagram = socket.recv() => {
                let datagram = datagram.context("reading while idle")?;
                if datagram.is_eof() {
                    info!(conn, "ztunnel closed the connection");
                    return Ok(());
                }
                shared.metrics.error("unsolicited", "protocol");
                bail!(
                    "ztunnel sent a datagram unasked on connection {conn} ({} bytes, {} fds)",
                    datagram.bytes.len(),
                    datagram.fds.len()
                );
            }
        }
    }
    // `registration` drops here (or at any early return): the connection leaves the registry.
}

async fn read_hello(socket: &SeqpacketConnection) -> Result<ZdsHello, ZdsError> {
    decode_hello(&recv_in_time(socket).await?)
}

/// ztunnel's next datagram, within [`IO_TIMEOUT`].
async fn recv_in_time(socket: &SeqpacketConnection) -> Result<Datagram, ZdsError> {
    Ok(timeout(IO_TIMEOUT, socket.recv())
        .await
        .map_err(|_| ZdsError::Timeout)??)
}

/// ztunnel's first datagram, its hello.
pub fn decode_hello(datagram: &Datagram) -> Result<ZdsHello, ZdsError> {
    ZdsHello::decode(valid_bytes(datagram)?)
        .map_err(|err| ZdsError::Protocol(format!("undecodable hello: {err}")))
}

/// Sends one request (with the netns fd for Add) and waits for its ack; counts the outcome.
async fn exchange(
    socket: &SeqpacketConnection,
    metrics: &Metrics,
    payload: Payload,
    netns: Option<&OwnedFd>,
) -> Result<(), ZdsError> {
    let message = message_name(&payload);
    let result = async {
        let bytes = WorkloadRequest {
            payload: Some(payload),
        }
        .encode_to_vec();
        if bytes.len() > MAX_DATAGRAM {
            return Err(ZdsError::TooLarge(bytes.len()));
        }
        metrics.request(message);
        timeout(IO_TIMEOUT, socket.send(&bytes, netns.map(AsFd::as_fd)))
            .await
            .map_err(|_| ZdsError::Timeout)??;
        decode_answer(&recv_in_time(socket).await?)
    }
    .await;
    match &result {
        Ok(()) => metrics.ack(message),
        Err(err) => metrics.error(message, err.reason()),
    }
    result
}

/// ztunnel's answer to a request: `Ok` for an ack, [`ZdsError::Nack`] for an ack with an error,
/// [`ZdsError::Protocol`] for anything else.
pub fn decode_answer(datagram: &Datagram) -> Result<(), ZdsError> {
    let response = WorkloadResponse::decode(valid_bytes(datagram)?)
        .map_err(|err| ZdsError::Protocol(format!("undecodable answer: {err}")))?;
    match response.payload {
        Some(Response::Ack(Ack { error })) if error.is_empty() => Ok(()),
        Some(Response::Ack(Ack { error })) => Err(ZdsError::Nack(error)),
        None => Err(ZdsError::Protocol("an answer without an ack".into())),
    }
}

/// The bytes of a datagram from ztunnel, if it is one ZDS allows: not empty (the peer's close),
/// whole, and without descriptors (only the agent sends those).
fn valid_bytes(datagram: &Datagram) -> Result<&[u8], ZdsError> {
    if datagram.is_eof() {
        return Err(ZdsError::ConnectionClosed);
    }
    if !datagram.fds.is_empty() {
        return Err(ZdsError::Protocol(format!(
            "ztunnel sent {} file descriptor(s)",
            datagram.fds.len()
        )));
    }
    if datagram.truncated {
        return Err(ZdsError::Protocol(format!(
            "datagram larger than {MAX_DATAGRAM} bytes"
        )));
    }
    Ok(&datagram.bytes)
}
