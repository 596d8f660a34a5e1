//! Enrollment beside a pod that flaps its addresses: what one enrolled pod changing its
//! interfaces as fast as netlink takes them (a container with CAP_NET_ADMIN in a loop) costs
//! other pods' ADDs, against the same node without it.

use std::io::Write;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;
use weir_agent::datapath::Datapath;
use weir_agent::workload::PodOptions;
use weir_tests::{Pod, TestNode};

use crate::pods::make_pods;
use crate::report::{self, ratio, Samples, Table};
use crate::{alternating_rounds, timed, Plan};

/// An address outside the pods' network, added to and removed from the flapping pod's eth0.
const FLAPPED: &str = "198.51.100.1/32";

/// Address changes per `ip -batch` run: long enough that exec'ing `ip` is a small part of it,
/// short enough that the flapping stops soon after it is told to.
const CHANGES_PER_BATCH: usize = 1000;

/// How long the flapping runs before a turn's first enrollment, so that it meets a flood under
/// way rather than its start.
const FLOOD_HEAD_START: Duration = Duration::from_millis(50);

/// Enrollment of one pod at a time on a node with one enrolled pod flapping its addresses,
/// against the same node quiet: `plan.flap_enrolls` pods each way per round, the variants
/// alternating which goes first.
pub fn enrollment_beside_flapping(
    datapath: &Datapath,
    runtime: &tokio::runtime::Runtime,
    node: &TestNode,
    plan: &Plan,
) -> Result<Table> {
    let flapping = node.add_pod("flapping")?;
    runtime.block_on(datapath.enroll(flapping.workload(PodOptions::default())))?;
    let batch = batch_file()?;
    let pods = make_pods(node, "flap", 2 * plan.rounds * plan.flap_enrolls)?;
    let mut next_pod = pods.iter();
    let changes = Arc::new(AtomicUsize::new(0));
    let mut flapping_time = Duration::ZERO;
    let rounds = alternating_rounds(2, plan.rounds, |variant| {
        let turn: Vec<&Pod> = next_pod.by_ref().take(plan.flap_enrolls).collect();
        let enroll = |pod: &&Pod| {
            timed(|| runtime.block_on(datapath.enroll(pod.workload(PodOptions::default()))))
        };
        if variant == 0 {
            // A turn after a flapping one starts once the owner has taken every command sent
            // before it: the quiet node is quiet.
            runtime.block_on(datapath.enrolled())?;
            return turn.iter().map(enroll).collect::<Result<Samples>>();
        }
        let flood = Flood::start(&flapping, batch.path(), changes.clone());
        thread::sleep(FLOOD_HEAD_START);
        let samples = turn.iter().map(enroll).collect::<Result<Samples>>();
        flapping_time += flood.stop()?;
        samples
    })?;
    let (mut quiet, mut beside) = (Samples::new(), Samples::new());
    let mut median_ratios = Vec::new();
    for round in rounds {
        let [quiet_turn, flapping_turn]: [Samples; 2] =
            round.try_into().ok().context("a round is two turns")?;
        median_ratios
            .push(flapping_turn.median().as_secs_f64() / quiet_turn.median().as_secs_f64());
        quiet.append(quiet_turn);
        beside.append(flapping_turn);
    }
    let over = |flapped: Duration, calm: Duration| flapped.as_secs_f64() / calm.as_secs_f64();
    let (p50_ratio, p99_ratio) = (
        over(beside.median(), quiet.median()),
        over(beside.p99(), quiet.p99()),
    );
    let changes = changes.load(Ordering::Relaxed);
    let rate = changes as f64 / flapping_time.as_secs_f64();

    let mut table = Table::new(
        "Enrollment beside a pod flapping its addresses",
        &[
            "",
            "quiet node",
            "one pod flapping",
            "flapping/quiet",
            "flapping/quiet, rounds' medians",
        ],
    );
    table.row(&[
        "enroll, median".into(),
        report::micros(quiet.median()),
        report::micros(beside.median()),
        format!("{p50_ratio:.2}x"),
        ratio(&median_ratios),
    ]);
    table.row(&[
        "enroll, p99".into(),
        report::micros(quiet.p99()),
        report::micros(beside.p99()),
        format!("{p99_ratio:.2}x"),
        "-".into(),
    ]);
    table.note(format!(
        "{} rounds of {} pods each way, order rotated each round. One pod, enrolled, has \
         {FLAPPED} added to and removed from its eth0 in a loop of `ip -batch` runs of \
         {CHANGES_PER_BATCH} changes each ({changes} changes over the flapping turns, {rate:.0} \
         a second), from {FLOOD_HEAD_START:?} before its turn's first enrollment to after its \
         last; each enrollment a new pod's `Datapath::enroll`, awaited on a tokio runtime as \
         the agent does.",
        plan.rounds, plan.flap_enrolls
    ));
    table.json = json!({
        "pods_per_turn": plan.flap_enrolls,
        "rounds": plan.rounds,
        "quiet_enroll": quiet.json(),
        "flapping_enroll": beside.json(),
        "p50_flapping_over_quiet": p50_ratio,
        "p99_flapping_over_quiet": p99_ratio,
        "rounds_median_flapping_over_quiet": report::median(&median_ratios),
        "address_changes": changes,
        "address_changes_per_second": rate,
    });
    Ok(table)
}

/// The `ip -batch` input of one run: [`FLAPPED`] added and removed, ending removed.
fn batch_file() -> Result<tempfile::NamedTempFile> {
    let mut batch = tempfile::NamedTempFile::new()?;
    for _ in 0..CHANGES_PER_BATCH / 2 {
        writeln!(batch, "addr add {FLAPPED} dev eth0")?;
        writeln!(batch, "addr del {FLAPPED} dev eth0")?;
    }
    batch.flush()?;
    Ok(batch)
}

/// `ip -batch` runs in a pod, one after the other, until stopped.
struct Flood {
    stop: Arc<AtomicBool>,
    runs: thread::JoinHandle<Result<Duration>>,
}

impl Flood {
    fn start(pod: &Pod, batch: &std::path::Path, changes: Arc<AtomicUsize>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let mut ip = Command::new("ip");
        ip.args(["-n", pod.netns().name(), "-force", "-batch"])
            .arg(batch);
        let runs = thread::spawn(move || {
            let mut flapping = Duration::ZERO;
            while !stopped.load(Ordering::Relaxed) {
                flapping += timed(|| {
                    let status = ip.status().context("running `ip -batch`")?;
                    anyhow::ensure!(status.success(), "`ip -batch` failed: {status}");
                    Ok(())
                })?;
                changes.fetch_add(CHANGES_PER_BATCH, Ordering::Relaxed);
            }
            Ok(flapping)
        });
        Self { stop, runs }
    }

    /// Stops after the run under way; returns how long the runs took.
    fn stop(self) -> Result<Duration> {
        self.stop.store(true, Ordering::Relaxed);
        self.runs.join().expect("the flood's thread panicked")
    }
}
