//! `cargo xtask bench`: weir's datapath against istio-cni's iptables rules, side by side in one
//! run on one throwaway node. Machines are noisy (shared ones more so), so every comparison is
//! made pair by pair (alternating which variant goes first) and reported as medians and the
//! median of the pairs' ratios, never as absolutes to compare across runs.
//!
//! Sections: cost to pods and host processes that are not enrolled; enrollment;
//! connection path; bulk download (these with weir's datapath in this process); then, on a node
//! of their own with the real agent binary ([`node_scale`]): the whole CNI ADD with and without
//! weir-cni, weir-cni's decision with the agent away (API server, verdict cache), scale, and the
//! node reboot storm; then the agent following a cluster ([`cluster`]): its memory with a node's
//! pods and a cluster's namespaces cached, and the API requests it makes. Output: a markdown table and JSON under `--out`,
//! and an SVG of the scale curve. `--quick` runs tiny sizes: it shows that the bench runs,
//! nothing about speed.

mod cluster;
mod floor;
mod load;
mod node_scale;
mod report;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use prometheus_client::registry::Registry;
use serde_json::json;
use weir_agent::datapath::Datapath;
use weir_agent::workload::PodOptions;
use weir_tests::{istio_iptables, Pod, TestNode};

use report::{micros, ratio, Report, Samples, Table};

const APP_PORT: u16 = 8080;
const BULK_PORT: u16 = 8081;
const UDP_PORT: u16 = 8082;
/// Threads creating (and removing) pods: CNI ADD is mostly exec and waiting.
const POD_WORKERS: usize = 8;
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
    /// the bench's process (enrollment, connections, bulk, cost), only those on a running
    /// agent (scale, pod start, reboot storm), or only the agent following a cluster (memory,
    /// API requests).
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
    Cluster,
}

/// How much of everything a run does.
struct Plan {
    /// Pods enrolled each way in the enrollment section.
    enroll_pairs: usize,
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
    if matches!(args.sections, Sections::All | Sections::InProcess) {
        in_process(&plan, &mut report)?;
    }
    if matches!(args.sections, Sections::All | Sections::Agent) {
        node_scale::measure(&plan, &mut report)?;
    }
    if matches!(args.sections, Sections::All | Sections::Cluster) {
        println!("the agent following a cluster: memory, API requests...");
        cluster::measure(&plan, &mut report)?;
    }

    report.finish();
    report.write(&args.out)?;
    println!("\n{}", report.markdown());
    println!("written to {}", args.out.display());
    Ok(())
}

/// The sections measured with weir's datapath in this process (as the agent runs it), on a node
/// of their own.
fn in_process(plan: &Plan, report: &mut Report) -> Result<()> {
    let node = TestNode::new()?;
    let server = node.add_pod("server")?;
    let app = SocketAddr::new(server.ipv4().into(), APP_PORT);
    let _server = load::server(server.netns(), app)?;
    let bulk = SocketAddr::new(server.ipv4().into(), BULK_PORT);
    let _bulk = load::bulk_source(server.netns(), bulk, plan.bulk_bytes)?;
    let udp = SocketAddr::new(server.ipv4().into(), UDP_PORT);
    let _udp = load::udp_sink(server.netns(), udp)?;
    let plain = node.add_pod("plain")?;

    println!("cost to pods and host processes weir does not enroll...");
    report.push(cost_to_others(&node, &plain, app, udp, plan)?);

    let datapath = Datapath::start(node.datapath_config())?;
    let mut metrics = Registry::default();
    datapath.register_metrics(&mut metrics);
    let measured = with_datapath(&datapath, &metrics, &node, &plain, app, bulk, plan, report);
    datapath.uninstall().wait()?;
    measured
}

#[allow(clippy::too_many_arguments)]
fn with_datapath(
    datapath: &Datapath,
    metrics: &Registry,
    node: &TestNode,
    plain: &Pod,
    app: SocketAddr,
    bulk: SocketAddr,
    plan: &Plan,
    report: &mut Report,
) -> Result<()> {
    println!("enrollment, weir against istio's iptables route...");
    let weir_pods = make_pods(node, "w", plan.enroll_pairs)?;
    let iptables_pods = make_pods(node, "i", plan.enroll_pairs)?;
    let floor_pods = make_pods(node, "f", plan.enroll_pairs)?;
    // The agent's runtime, so the hand-off timed is the agent's: a task awaiting the owner.
    let runtime = tokio::runtime::Runtime::new()?;
    let (enroll, weir_median) =
        enrollment(datapath, &runtime, &weir_pods, &iptables_pods, &floor_pods)?;
    report.push(enroll);
    let handoff = handoff_round_trips(datapath, &runtime)?;
    report.push(enrollment_steps(metrics, weir_median, &handoff)?);

    println!("connection path...");
    report.push(connection_path(
        &weir_pods[0],
        &iptables_pods[0],
        plain,
        app,
        plan,
    )?);

    println!("bulk download...");
    report.push(bulk_download(datapath, node, bulk, plan)?);
    Ok(())
}

/// Enrollment: one pod's redirection put in place, weir's datapath (one long-lived process,
/// awaited on `runtime` as the agent does) against istio's route (`iptables-restore` v4 and v6
/// plus policy routing in the pod) and against the kernel floor ([`floor::KernelFloor`]), a pod
/// of each at a time, each variant going first in turn.
fn enrollment(
    datapath: &Datapath,
    runtime: &tokio::runtime::Runtime,
    weir_pods: &[Pod],
    iptables_pods: &[Pod],
    floor_pods: &[Pod],
) -> Result<(Table, Duration)> {
    let mut kernel_floor = floor::KernelFloor::new()?;
    let (mut weir, mut iptables, mut floor) = (Samples::new(), Samples::new(), Samples::new());
    let (mut ratios, mut own) = (Vec::new(), Samples::new());
    let triples = weir_pods.iter().zip(iptables_pods).zip(floor_pods);
    for (i, ((weir_pod, iptables_pod), floor_pod)) in triples.enumerate() {
        let mut times = [Duration::ZERO; 3];
        for turn in 0..3 {
            let variant = (i + turn) % 3;
            times[variant] = match variant {
                0 => timed(|| {
                    runtime.block_on(datapath.enroll(weir_pod.workload(PodOptions::default())))
                })?,
                1 => timed(|| istio_iptables::apply(iptables_pod.netns()))?,
                _ => timed(|| kernel_floor.enroll(floor_pod))?,
            };
        }
        let [w, t, f] = times;
        ratios.push(t.as_secs_f64() / w.as_secs_f64());
        own.push(w.saturating_sub(f));
        weir.push(w);
        iptables.push(t);
        floor.push(f);
    }
    let mut unenroll = Samples::new();
    for pod in &weir_pods[1..] {
        unenroll.push(timed(|| datapath.unenroll(pod.uid()).wait())?);
    }
    let mut table = Table::new(
        "Enrollment: one pod's redirection",
        &[
            "",
            "weir",
            "kernel floor",
            "iptables route",
            "iptables/weir (triples)",
        ],
    );
    table.row(&[
        "enroll, median (p99)".into(),
        weir.show(),
        floor.show(),
        iptables.show(),
        ratio(&ratios),
    ]);
    table.row(&[
        "weir less the floor: the agent's own, median (p99)".into(),
        own.show(),
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    table.row(&[
        "unenroll, median (p99)".into(),
        unenroll.show(),
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    table.note(format!(
        "{} pods each way. weir: `Datapath::enroll` in one long-lived process, awaited on a \
         tokio runtime as the agent does; kernel floor: the kernel work of a weir enrollment \
         bare, from the bench's thread (entering the netns, an rtnetlink socket and the netns \
         cookie, the reply-mark sysctls, the return path, the clsact qdisc and a cls_bpf filter \
         on eth0), without weir's interface dumps, map entries, subscription, records and \
         thread hand-off; iptables route: istio-cni's in-pod `iptables-restore` and \
         `ip6tables-restore` plus its policy routing (`ip rule`/`ip route`, v4 and v6).",
        weir_pods.len()
    ));
    table.json = json!({
        "pods": weir_pods.len(),
        "weir_enroll": weir.json(),
        "kernel_floor_enroll": floor.json(),
        "weir_less_floor": own.json(),
        "iptables_enroll": iptables.json(),
        "iptables_over_weir": report::median(&ratios),
        "weir_unenroll": unenroll.json(),
    });
    Ok((table, weir.median()))
}

/// The hand-off alone, [`HANDOFF_ROUND_TRIPS`] times: a command with next to no work (the
/// enrolled pods' uids) awaited on `runtime`, from the call to the datapath thread taking it and
/// its answer waking the task.
fn handoff_round_trips(datapath: &Datapath, runtime: &tokio::runtime::Runtime) -> Result<Samples> {
    (0..HANDOFF_ROUND_TRIPS)
        .map(|_| timed(|| runtime.block_on(datapath.enrolled())))
        .collect()
}

const HANDOFF_ROUND_TRIPS: usize = 1000;

/// The steps of one enrollment, as the datapath's own `weir_enroll_step_seconds` histograms
/// timed them over the enrollment section: mean per pod, what is left of weir's median
/// (`total`) besides them, and the hand-off timed alone (`handoff`).
fn enrollment_steps(metrics: &Registry, total: Duration, handoff: &Samples) -> Result<Table> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, metrics)?;
    let value = |series: &str, step: &str| {
        report::metric(
            &text,
            &format!("weir_enroll_step_seconds_{series}{{step=\"{step}\"}}"),
        )
    };
    let mut table = Table::new(
        "Enrollment: where weir's time goes",
        &["step", "mean per pod", "share"],
    );
    let mut steps = Vec::new();
    for step in STEPS {
        let (Some(sum), Some(count)) = (value("sum", step), value("count", step)) else {
            bail!("no weir_enroll_step_seconds for step {step}");
        };
        steps.push((step, Duration::from_secs_f64(sum / count)));
    }
    let stepped: Duration = steps.iter().map(|(_, mean)| *mean).sum();
    let total = total.max(stepped);
    let rest = [("rest: weir's median less the steps", total - stepped)];
    let mut json_steps = Vec::new();
    for (step, mean) in steps.into_iter().chain(rest) {
        let share = mean.as_secs_f64() / total.as_secs_f64();
        table.row(&[step.into(), micros(mean), format!("{:.0}%", share * 100.0)]);
        json_steps.push(json!({"step": step, "mean_us": mean.as_secs_f64() * 1e6}));
    }
    table.row(&[
        "hand-off alone: an empty command, median (p99)".into(),
        handoff.show(),
        format!(
            "{:.0}%",
            handoff.median().as_secs_f64() / total.as_secs_f64() * 100.0
        ),
    ]);
    table.note(format!(
        "Means of the datapath's own step timers over the enrollment section; the rest is weir's \
         median enroll less the steps (the hand-off and what no step times). The hand-off alone: \
         {HANDOFF_ROUND_TRIPS} commands that do next to nothing (the enrolled uids), each \
         awaited on a tokio runtime as the agent does: the command reaching the datapath thread \
         and its answer waking the task. netns: opening and entering the pod's netns, its \
         rtnetlink socket, cookie and change subscription; interfaces: one link and one address \
         dump; sysctls: tcp_fwmark_accept and fwmark_reflect per family (kernel path walks in \
         /proc/sys); maps: counters, config and address entries; routing: the return path's \
         rules and routes, one round trip; tc: the clsact qdisc and cls_bpf filter per interface, \
         one round trip (a qdisc made on an interface that is up waits out an expedited RCU grace \
         period); finish: following the pod, recording it, leaving its netns."
    ));
    table.json = json!({ "steps": json_steps, "handoff": handoff.json() });
    Ok(table)
}

/// The datapath's enrollment steps, in order (`weir_enroll_step_seconds{step}`).
const STEPS: [&str; 7] = [
    "netns",
    "interfaces",
    "sysctls",
    "maps",
    "routing",
    "tc",
    "finish",
];

/// The connection path: short connections at `plan.concurrency` from an app to the server,
/// through the minimal relay in the app's pod, four ways, each round in another order.
fn connection_path(
    weir_pod: &Pod,
    iptables_pod: &Pod,
    plain: &Pod,
    app: SocketAddr,
    plan: &Plan,
) -> Result<Table> {
    for pod in [weir_pod, iptables_pod, plain] {
        // The relay closes first toward the app, so TIME_WAITs pile up on podIP:15001; reuse
        // keeps the app's port search short in every variant alike.
        pod.netns().sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    }
    let _relays = [weir_pod, iptables_pod, plain]
        .map(|pod| load::relay(pod.netns(), app))
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let straight = SocketAddr::new(plain.ipv4().into(), weir_common::OUTBOUND_PORT);
    let variants: [(&str, &Pod, SocketAddr); 4] = [
        ("weir redirect", weir_pod, app),
        ("iptables REDIRECT", iptables_pod, app),
        ("straight to the relay", plain, straight),
        ("no proxy", plain, app),
    ];
    let rounds = alternating_rounds(variants.len(), plan.rounds, |variant| {
        let (_, pod, target) = variants[variant];
        pod.run(|| load::connections(target, plan.concurrency, plan.turn))
            .with_context(|| format!("connections: {}", variants[variant].0))
    })?;
    let mut table = Table::new(
        &format!(
            "Connection path: short TCP connections at concurrency {}",
            plan.concurrency
        ),
        &["variant", "connections/s", "latency p50", "latency p99"],
    );
    let mut json_variants = Vec::new();
    for (variant, (name, _, _)) in variants.iter().enumerate() {
        let runs: Vec<&load::Run> = rounds.iter().map(|round| &round[variant]).collect();
        let rates: Vec<f64> = runs.iter().map(|run| run.rate).collect();
        let latencies = Samples::from(runs.iter().flat_map(|run| run.latencies.clone()));
        table.row(&[
            (*name).into(),
            format!("{:.0}", report::median(&rates)),
            micros(latencies.median()),
            micros(latencies.p99()),
        ]);
        json_variants.push(json!({
            "variant": name,
            "connections_per_s": report::median(&rates),
            "latency": latencies.json(),
        }));
    }
    let pair = |a: usize, b: usize| -> Vec<f64> {
        rounds
            .iter()
            .map(|round| round[a].rate / round[b].rate)
            .collect()
    };
    let pairs = [
        ("weir / straight to the relay", pair(0, 2)),
        ("weir / iptables", pair(0, 1)),
        ("iptables / straight to the relay", pair(1, 2)),
    ];
    for (name, ratios) in &pairs {
        table.row(&[
            format!("rate {name} (rounds)"),
            ratio(ratios),
            "".into(),
            "".into(),
        ]);
    }
    table.note(format!(
        "{} rounds of {:?} per variant, order rotated each round. The relay (in the app's pod, \
         on 15001, as ztunnel listens) reads SO_ORIGINAL_DST and dials from a marked socket; \
         'straight to the relay' connects to podIP:15001 (the limit of any redirect).",
        plan.rounds, plan.turn
    ));
    table.json = json!({
        "concurrency": plan.concurrency,
        "rounds": plan.rounds,
        "variants": json_variants,
        "ratios": pairs.iter().map(|(name, r)| json!({"pair": name, "median": report::median(r)})).collect::<Vec<_>>(),
    });
    Ok(table)
}

/// Bulk download into a pod, enrolled (weir's tc program sees every packet) against the same
/// pod unenrolled, alternating.
fn bulk_download(
    datapath: &Datapath,
    node: &TestNode,
    source: SocketAddr,
    plan: &Plan,
) -> Result<Table> {
    let pod = node.add_pod("bulk")?;
    let rounds = alternating_rounds(2, plan.rounds, |enrolled| {
        if enrolled == 0 {
            datapath
                .enroll(pod.workload(PodOptions::default()))
                .wait()?;
        }
        let rate = pod.run(|| load::download(source)).context("download");
        if enrolled == 0 {
            datapath.unenroll(pod.uid()).wait()?;
        }
        rate
    })?;
    let with: Vec<f64> = rounds.iter().map(|r| r[0]).collect();
    let without: Vec<f64> = rounds.iter().map(|r| r[1]).collect();
    let ratios: Vec<f64> = rounds.iter().map(|r| r[0] / r[1]).collect();
    let mut table = Table::new("Bulk download into a pod", &["", "MiB/s"]);
    let mib = |rates: &[f64]| format!("{:.0}", report::median(rates) / 1048576.0);
    table.row(&["enrolled (weir's programs)".into(), mib(&with)]);
    table.row(&["not enrolled".into(), mib(&without)]);
    table.row(&["enrolled / not (rounds)".into(), ratio(&ratios)]);
    table.note(format!(
        "{} MiB per download over one connection (marked, as ztunnel's dials), {} rounds.",
        plan.bulk_bytes >> 20,
        plan.rounds
    ));
    table.json = json!({
        "bytes": plan.bulk_bytes,
        "enrolled_bytes_per_s": report::median(&with),
        "not_enrolled_bytes_per_s": report::median(&without),
        "enrolled_over_not": report::median(&ratios),
    });
    Ok(table)
}

/// What weir's root-cgroup programs cost everyone else: connection and UDP send rates of a pod
/// that is not enrolled and of a host process, with the programs loaded against none,
/// alternating (the datapath is started and uninstalled for each loaded turn).
fn cost_to_others(
    node: &TestNode,
    plain: &Pod,
    app: SocketAddr,
    udp: SocketAddr,
    plan: &Plan,
) -> Result<Table> {
    let config = node.datapath_config();
    let measure = || -> Result<[f64; 4]> {
        let pod_tcp = plain.run(|| load::connections(app, plan.concurrency, plan.turn))?;
        let pod_udp = plain.run(|| load::datagrams(udp, plan.turn))?;
        let host_tcp = node.run(|| load::connections(app, plan.concurrency, plan.turn))?;
        let host_udp = node.run(|| load::datagrams(udp, plan.turn))?;
        Ok([pod_tcp.rate, pod_udp.rate, host_tcp.rate, host_udp.rate])
    };
    let rounds = alternating_rounds(2, plan.rounds, |loaded| {
        if loaded == 1 {
            return measure();
        }
        let datapath = Datapath::start(config.clone())?;
        let rates = measure();
        datapath.uninstall().wait()?;
        rates
    })?;
    let mut table = Table::new(
        "Cost to pods and host processes weir does not enroll",
        &["", "programs loaded", "no programs", "loaded/none (rounds)"],
    );
    let names = [
        "pod: connections/s",
        "pod: UDP datagrams/s",
        "host process: connections/s",
        "host process: UDP datagrams/s",
    ];
    let mut json_rows = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let loaded: Vec<f64> = rounds.iter().map(|r| r[0][i]).collect();
        let none: Vec<f64> = rounds.iter().map(|r| r[1][i]).collect();
        let ratios: Vec<f64> = rounds.iter().map(|r| r[0][i] / r[1][i]).collect();
        table.row(&[
            (*name).into(),
            format!("{:.0}", report::median(&loaded)),
            format!("{:.0}", report::median(&none)),
            ratio(&ratios),
        ]);
        json_rows.push(json!({
            "what": name,
            "loaded": report::median(&loaded),
            "none": report::median(&none),
            "loaded_over_none": report::median(&ratios),
        }));
    }
    table.note(format!(
        "{} rounds; connections at concurrency {} to a pod, unconnected `sendto` from one socket.",
        plan.rounds, plan.concurrency
    ));
    table.json = json!({ "rows": json_rows });
    Ok(table)
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

/// `count` pods made by [`POD_WORKERS`] threads at once.
fn make_pods(node: &TestNode, prefix: &str, count: usize) -> Result<Vec<Pod>> {
    let indexes: Vec<usize> = (0..count).collect();
    parallel(&indexes, POD_WORKERS, |i| {
        node.add_pod(&format!("{prefix}{i}"))
    })
}

/// `work` on every item from `workers` threads at once (each taking the next item); the results
/// in the items' order, or the first failure (the items after it are then left undone).
fn parallel<T: Sync, R: Send>(
    items: &[T],
    workers: usize,
    work: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let done = Mutex::new(Vec::with_capacity(items.len()));
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..workers.min(items.len()))
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return Ok(());
                        };
                        let result =
                            work(item).inspect_err(|_| failed.store(true, Ordering::Relaxed))?;
                        done.lock().expect("no panics holding it").push((i, result));
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|worker| worker.join().expect("worker panicked"))
    })?;
    let mut done = done.into_inner().expect("no panics holding it");
    done.sort_by_key(|(i, _)| *i);
    Ok(done.into_iter().map(|(_, result)| result).collect())
}

/// Drops (CNI DEL, netns removal) `pods` from [`POD_WORKERS`] threads at once.
fn remove_pods(pods: Vec<Pod>) {
    let queue = Mutex::new(pods);
    std::thread::scope(|scope| {
        for _ in 0..POD_WORKERS {
            scope.spawn(|| loop {
                let pod = queue.lock().expect("no panics holding it").pop();
                match pod {
                    Some(pod) => drop(pod),
                    None => return,
                }
            });
        }
    });
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
