//! The agent's side: the ring buffer's one consumer, fanning decisions out to the readers
//! connected to the trace socket.
use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use aya::maps::{Array, MapData, PerCpuArray};
use tokio::{
    io::{unix::AsyncFd, AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
    sync::broadcast,
};
use tracing::{debug, info, warn};
use weir_common::TraceRecord;

use super::decision::{Message, PodNames};
use crate::{datapath::TraceMaps, root_only};

/// Decisions waiting for the slowest reader; past this it loses the oldest, and is told.
const BACKLOG: usize = 4096;
/// Bytes of lines written to a reader at once, at most.
const MAX_BATCH: usize = 64 * 1024;
/// How often the ring buffer's own losses are read and reported while someone traces.
const LOST_EVERY: Duration = Duration::from_secs(1);

/// Serves readers on `socket` until the agent stops. The datapath must have pinned its maps
/// under `pin_root`; `state_file` names the pods.
pub async fn serve(socket: PathBuf, pin_root: PathBuf, state_file: PathBuf) -> Result<()> {
    let TraceMaps {
        on,
        events,
        lost: kernel_lost,
    } = TraceMaps::open(&pin_root)?;
    let switch = Arc::new(Switch::new(on)?);
    let listener = listen(&socket)?;
    info!(socket = %socket.display(), "serving trace readers");
    let (decisions, _) = broadcast::channel::<Arc<str>>(BACKLOG);
    let names = PodNames::new(pin_root, state_file);
    tokio::spawn(report_kernel_losses(
        kernel_lost,
        switch.clone(),
        decisions.clone(),
    ));
    let mut consumer = tokio::spawn(consume(events, names, decisions.clone()));
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted.context("accepting a trace reader")?;
                // A reader turns tracing on and sees every pod's connections.
                if let Err(error) = root_only::require_root_peer(&stream, "trace") {
                    warn!(error = format!("{error:#}"), "trace reader");
                    continue;
                }
                let reader = Reader::connect(switch.clone(), decisions.subscribe())?;
                tokio::spawn(reader.serve(stream));
            }
            ended = &mut consumer => {
                return ended.context("the trace consumer")?;
            }
        }
    }
}

fn listen(socket: &Path) -> Result<UnixListener> {
    if let Some(dir) = socket.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match fs::remove_file(socket) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            return Err(error).with_context(|| format!("removing {}", socket.display()))
        }
        _ => {}
    }
    let listener =
        UnixListener::bind(socket).with_context(|| format!("binding {}", socket.display()))?;
    // What pods connect to is theirs: root only, as the pinned maps are.
    fs::set_permissions(socket, fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} root-only", socket.display()))?;
    Ok(listener)
}

/// Reads the ring buffer as records arrive and sends each decision, named, to every reader.
async fn consume(
    events: aya::maps::RingBuf<MapData>,
    mut names: PodNames,
    decisions: broadcast::Sender<Arc<str>>,
) -> Result<()> {
    // SAFETY: the ring buffer owns its fd, and the AsyncFd owns the ring buffer.
    let mut ring = unsafe { AsyncFd::register(events) }.context("polling the trace ring buffer")?;
    loop {
        let mut ready = ring.readable_mut().await?;
        let ring = ready.get_inner_mut();
        while let Some(item) = ring.next() {
            if item.len() < size_of::<TraceRecord>() {
                continue;
            }
            // SAFETY: the programs write whole `TraceRecord`s; the length was checked.
            let record: TraceRecord =
                unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<TraceRecord>()) };
            drop(item);
            let line =
                serde_json::to_string(&Message::Decision(Box::new(names.decision(&record))))?;
            // No reader: the record goes nowhere, as it should once tracing is off.
            let _ = decisions.send(line.into());
        }
        ready.clear_ready();
    }
}

/// The ring buffer's losses, sent to every reader as they grow.
async fn report_kernel_losses(
    lost: PerCpuArray<MapData, u64>,
    switch: Arc<Switch>,
    decisions: broadcast::Sender<Arc<str>>,
) {
    let total = |lost: &PerCpuArray<MapData, u64>| {
        lost.get(&0, 0)
            .map(|per_cpu| per_cpu.iter().sum::<u64>())
            .unwrap_or(0)
    };
    let mut reported = total(&lost);
    let mut tick = tokio::time::interval(LOST_EVERY);
    loop {
        tick.tick().await;
        let now = total(&lost);
        if now > reported && switch.readers() > 0 {
            let line = serde_json::to_string(&Message::Lost {
                lost: now - reported,
            })
            .expect("a number serializes");
            let _ = decisions.send(line.into());
        }
        reported = now;
    }
}

/// Tracing on while at least one reader is connected.
struct Switch {
    state: Mutex<(usize, Array<MapData, u32>)>,
}

impl Switch {
    /// Off: an agent that stopped with readers connected left it on.
    fn new(mut on: Array<MapData, u32>) -> Result<Self> {
        on.set(0, 0, 0).context("turning tracing off")?;
        Ok(Self {
            state: Mutex::new((0, on)),
        })
    }

    fn readers(&self) -> usize {
        self.state.lock().unwrap().0
    }

    fn change(&self, joined: bool) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        let (readers, on) = &mut *state;
        let before = *readers;
        *readers = if joined { before + 1 } else { before - 1 };
        if (before == 0) != (*readers == 0) {
            on.set(0, u32::from(*readers > 0), 0)
                .context("writing TRACE_ON")?;
            info!(tracing = *readers > 0, "trace readers changed");
        }
        Ok(())
    }
}

/// A connected reader; tracing stays on for it until it is dropped.
struct Reader {
    switch: Arc<Switch>,
    decisions: broadcast::Receiver<Arc<str>>,
}

impl Reader {
    fn connect(switch: Arc<Switch>, decisions: broadcast::Receiver<Arc<str>>) -> Result<Self> {
        switch.change(true)?;
        Ok(Self { switch, decisions })
    }

    /// Sends decisions until the reader hangs up: each wakeup writes every line waiting, in
    /// one write, so a busy node costs a reader few system calls.
    async fn serve(mut self, stream: UnixStream) {
        let (mut hangup, mut out) = stream.into_split();
        let mut byte = [0u8; 1];
        let mut batch = Vec::new();
        loop {
            let first = tokio::select! {
                // A reader sends nothing: any read that returns is its end.
                _ = hangup.read(&mut byte) => break,
                received = self.decisions.recv() => received,
            };
            let mut received = Some(first);
            while let Some(next) = received.take() {
                match next {
                    Ok(line) => batch.extend_from_slice(line.as_bytes()),
                    Err(broadcast::error::RecvError::Lagged(lost)) => batch.extend_from_slice(
                        serde_json::to_string(&Message::Lost { lost })
                            .expect("a number serializes")
                            .as_bytes(),
                    ),
                    Err(broadcast::error::RecvError::Closed) => return,
                }
                batch.push(b'\n');
                if batch.len() < MAX_BATCH {
                    received = match self.decisions.try_recv() {
                        Err(broadcast::error::TryRecvError::Empty) => None,
                        Err(broadcast::error::TryRecvError::Lagged(lost)) => {
                            Some(Err(broadcast::error::RecvError::Lagged(lost)))
                        }
                        Err(broadcast::error::TryRecvError::Closed) => {
                            Some(Err(broadcast::error::RecvError::Closed))
                        }
                        Ok(line) => Some(Ok(line)),
                    };
                }
            }
            if let Err(error) = out.write_all(&batch).await {
                debug!(%error, "trace reader gone");
                break;
            }
            batch.clear();
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Err(error) = self.switch.change(false) {
            warn!(error = format!("{error:#}"), "turning tracing off");
        }
    }
}
