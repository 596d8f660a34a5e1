//! `cargo xtask bench`: weir's datapath against istio-cni's iptables rules, side by side in one
//! run on one throwaway node. Machines are noisy (shared ones more so), so every comparison is
//! made pair by pair (alternating which variant goes first) and reported as medians and the
//! median of the pairs' ratios, never as absolutes to compare across runs.
//!
//! Sections: cost to pods and host processes that are not enrolled; enrollment; enrollment
//! beside a pod flapping its addresses ([`flapping`]); connection path;
//! sidecar pods' enrollment and connection path, against istio-init's rules ([`sidecar`]); bulk
//! download (these with weir's datapath in this process: [`in_process`]); then, on a node
//! of their own with the real agent binary ([`node_scale`]): pod start (the whole CNI ADD with
//! and without weir-cni), weir-cni's decision with the agent away (API server, verdict cache),
//! scale, and the node reboot storm; then the agent following a cluster ([`cluster`]): its
//! memory with a node's pods and a cluster's namespaces cached, and the API requests it makes.
//! Output: a markdown table and JSON under `--out`, and an SVG of the scale curve. `--quick`
//! runs tiny sizes: it shows that the bench runs, nothing about speed.

mod cluster;
mod enrollment;
mod flapping;
mod floor;
mod in_process;
mod load;
mod node_scale;
mod pods;
mod relays;
mod report;
mod runtime;
mod sidecar;
mod trace_reader;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;

use report::{Report, Samples};

/// weir-cni ADDs at once in the reboot storm: kubelet starts the pods' sandboxes in parallel.
const STORM_CONCURRENCY: usize = 64;

#[derive(Parser)]
#[command(about = "weir's datapath against istio's iptables rules, on a throwaway node")]
struct Args {
    /// Tiny sizes, a few seconds: shows that the bench runs (the test run uses it), not speed.
    #[arg(long, env = "WEIR_BENCH_QUICK")]
    quick: bool,
    /// Enrolled pod counts of the scale section (comma-separated); --quick uses 2,4. The pods
    /// are spread over as many bridges as they need (1,023 pods each).
    #[arg(
        long,
        env = "WEIR_BENCH_SIZES",
        value_delimiter = ',',
        default_value = "10,100,1000,5000"
    )]
    sizes: Vec<usize>,
    /// Which sections to run: all of them, or (to look into one side) only those measured in
    /// the bench's process (enrollment, connections, sidecar pods, bulk, cost), only those on a
    /// running agent (pod start, the agent away, scale, reboot storm), only pod start, or only
    /// the agent following a cluster (memory, API requests).
    #[arg(long, env = "WEIR_BENCH_SECTIONS", value_enum, default_value_t = Sections::All)]
    sections: Sections,
    /// Directory for bench.md, bench.json and scale.svg.
    #[arg(long, env = "WEIR_BENCH_OUT", default_value = "target/bench")]
    out: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Sections {
    All,
    InProcess,
    Agent,
    PodStart,
    Cluster,
}

/// How much of everything a run does.
struct Plan {
    /// Pods enrolled each way in the enrollment section.
    enroll_pairs: usize,
    /// Pods enrolled each way per round beside a pod flapping its addresses, and without it.
    flap_enrolls: usize,
    /// Pod pairs of the whole CNI ADD with and without weir-cni.
    chain_pairs: usize,
    sizes: Vec<usize>,
    /// ADDs of one more pod timed at each scale size, over `enroll_probes` pods.
    enroll_samples: usize,
    enroll_probes: usize,
    /// Pods of the reboot storm, and how many of their ADDs run at once.
    storm_pods: usize,
    storm_concurrency: usize,
    /// Alternating rounds of the connection, bulk and cost sections.
    rounds: usize,
    /// Length of one variant's turn in a round.
    turn: Duration,
    concurrency: usize,
    bulk_bytes: usize,
    /// The cluster section: pod objects on the agent's node, namespaces in the cluster, and
    /// pods the agent enrolls while its API requests are counted.
    cluster_pods: usize,
    cluster_namespaces: usize,
    cluster_enrolled: usize,
}

impl Plan {
    fn new(args: &Args) -> Self {
        if args.quick {
            return Self {
                enroll_pairs: 3,
                flap_enrolls: 5,
                chain_pairs: 1,
                sizes: vec![2, 4],
                enroll_samples: 3,
                enroll_probes: 1,
                storm_pods: 10,
                storm_concurrency: STORM_CONCURRENCY,
                rounds: 2,
                turn: Duration::from_millis(100),
                concurrency: 8,
                bulk_bytes: 4 << 20,
                cluster_pods: 20,
                cluster_namespaces: 5,
                cluster_enrolled: 2,
            };
        }
        Self {
            enroll_pairs: 40,
            flap_enrolls: 10,
            chain_pairs: 40,
            sizes: args.sizes.clone(),
            enroll_samples: 100,
            enroll_probes: 50,
            storm_pods: 1000,
            storm_concurrency: STORM_CONCURRENCY,
            rounds: 10,
            turn: Duration::from_secs(1),
            concurrency: 8,
            bulk_bytes: 256 << 20,
            cluster_pods: 5000,
            cluster_namespaces: 1000,
            cluster_enrolled: 20,
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !weir_tests::require_privileges() {
        bail!("the benchmark needs root");
    }
    raise_open_files_limit()?;
    let plan = Plan::new(&args);
    let mut report = Report::new(args.quick);
    let measured = measure(&args, &plan, &mut report);
    if let Err(error) = &measured {
        report.stopped(error);
    }
    report.finish();
    report.write(&args.out)?;
    println!("\n{}", report.markdown());
    println!("written to {}", args.out.display());
    measured
}

/// Runs the sections `args` names, each adding its tables to `report`.
fn measure(args: &Args, plan: &Plan, report: &mut Report) -> Result<()> {
    if matches!(args.sections, Sections::All | Sections::InProcess) {
        in_process::measure(plan, report)?;
    }
    if matches!(
        args.sections,
        Sections::All | Sections::Agent | Sections::PodStart
    ) {
        node_scale::measure(plan, args.sections, report)?;
    }
    if matches!(args.sections, Sections::All | Sections::Cluster) {
        println!("the agent following a cluster: memory, API requests...");
        cluster::measure(plan, report)?;
    }
    Ok(())
}

/// One point of the scale curve.
pub struct ScalePoint {
    pub pods: usize,
    pub enroll: Samples,
    /// The agent's resident memory.
    pub rss: u64,
}

/// Runs `turn(variant)` for every variant in each of `rounds` rounds, starting each round one
/// variant later; returns the results by round, then by variant.
fn alternating_rounds<T>(
    variants: usize,
    rounds: usize,
    mut turn: impl FnMut(usize) -> Result<T>,
) -> Result<Vec<Vec<T>>> {
    (0..rounds)
        .map(|round| {
            let mut results: Vec<(usize, T)> = (0..variants)
                .map(|offset| {
                    let variant = (round + offset) % variants;
                    Ok((variant, turn(variant)?))
                })
                .collect::<Result<_>>()?;
            results.sort_by_key(|(variant, _)| *variant);
            Ok(results.into_iter().map(|(_, result)| result).collect())
        })
        .collect()
}

fn timed<T>(step: impl FnOnce() -> Result<T>) -> Result<Duration> {
    let start = Instant::now();
    step()?;
    Ok(start.elapsed())
}

/// Thousands of pods mean thousands of open netns handles (the datapath holds one per pod).
fn raise_open_files_limit() -> Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit with a valid pointer to an rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return Err(std::io::Error::last_os_error()).context("getrlimit");
        }
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
            return Err(std::io::Error::last_os_error()).context("setrlimit");
        }
    }
    Ok(())
}
