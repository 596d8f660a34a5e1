//! Tracing on, as `weir-agent trace` turns it on: the agent's trace server consuming the
//! programs' ring buffer, and one reader connected to it.
use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use aya::maps::{Array, Map, PerCpuArray};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    net::UnixStream,
    runtime::Runtime,
    task::JoinHandle,
};
use weir_tests::TestNode;

pub struct TraceServer<'a> {
    runtime: &'a Runtime,
    node: &'a TestNode,
    socket: PathBuf,
    server: JoinHandle<Result<()>>,
    _dir: tempfile::TempDir,
}

impl<'a> TraceServer<'a> {
    /// The agent's trace server for the datapath pinned on `node`, on `runtime`.
    pub fn start(runtime: &'a Runtime, node: &'a TestNode) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("trace.sock");
        let server = runtime.spawn(weir_agent::trace::serve(
            socket.clone(),
            node.datapath_config().pin_root,
            dir.path().join("pods.json"),
        ));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if server.is_finished() || Instant::now() > deadline {
                bail!("the trace server did not start");
            }
            thread::sleep(Duration::from_millis(10));
        }
        Ok(Self {
            runtime,
            node,
            socket,
            server,
            _dir: dir,
        })
    }

    /// A reader draining every record, with tracing on until it is dropped.
    pub fn reader(&self) -> Result<Reader<'_>> {
        let stream = self
            .runtime
            .block_on(UnixStream::connect(&self.socket))
            .context("connecting to the trace server")?;
        let tally = Arc::new(Tally::default());
        let counted = tally.clone();
        let task = self.runtime.spawn(async move {
            let mut lines = BufReader::new(stream).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<weir_agent::trace::Message>(&line) {
                    Ok(weir_agent::trace::Message::Lost { lost }) => {
                        counted.lost.fetch_add(lost, Ordering::Relaxed)
                    }
                    _ => counted.records.fetch_add(1, Ordering::Relaxed),
                };
            }
        });
        self.wait_for_tracing(true)?;
        Ok(Reader {
            server: self,
            task,
            tally,
        })
    }

    /// Records the ring buffer had no room for, so far (`TRACE_LOST`, as bpftool shows it).
    pub fn lost_in_kernel(&self) -> Result<u64> {
        let map = self.node.pinned_map(weir_common::maps::TRACE_LOST)?;
        let lost: PerCpuArray<_, u64> = PerCpuArray::try_from(Map::PerCpuArray(map))?;
        Ok(lost.get(&0, 0)?.iter().sum())
    }

    fn wait_for_tracing(&self, on: bool) -> Result<()> {
        let map = self.node.pinned_map(weir_common::maps::TRACE_ON)?;
        let flag: Array<_, u32> = Array::try_from(Map::Array(map))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while (flag.get(&0, 0)? != 0) != on {
            if Instant::now() > deadline {
                bail!("tracing did not turn {}", if on { "on" } else { "off" });
            }
            thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

impl Drop for TraceServer<'_> {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub struct Reader<'a> {
    server: &'a TraceServer<'a>,
    task: JoinHandle<()>,
    tally: Arc<Tally>,
}

#[derive(Default)]
struct Tally {
    records: AtomicU64,
    lost: AtomicU64,
}

impl Reader<'_> {
    /// Waits until what the agent still had on its way (in the ring buffer, or queued for this
    /// reader) has arrived: nothing new for a moment, or a few seconds at most.
    pub fn settle(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen = self.tally();
        while Instant::now() < deadline {
            thread::sleep(Duration::from_millis(200));
            let now = self.tally();
            if now == seen {
                return;
            }
            seen = now;
        }
    }

    /// Records received so far, and records the agent said this reader lost.
    pub fn tally(&self) -> (u64, u64) {
        (
            self.tally.records.load(Ordering::Relaxed),
            self.tally.lost.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Reader<'_> {
    /// Hangs up and waits until the agent has turned tracing off.
    fn drop(&mut self) {
        self.task.abort();
        if let Err(error) = self.server.wait_for_tracing(false) {
            eprintln!("warning: {error:#}");
        }
    }
}
