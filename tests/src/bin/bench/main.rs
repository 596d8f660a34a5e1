//! `cargo xtask bench`: weir's datapath against istio-cni's iptables rules, side by side in one
//! run on one throwaway node. Machines are noisy (shared ones more so), so every comparison is
//! made pair by pair (alternating which variant goes first) and reported as medians and the
//! median of the pairs' ratios, never as absolutes to compare across runs.
//!
//! Sections (issue 10): enrollment; scale; connection path; bulk download; cost to pods and host
//! processes that are not enrolled. Output: a markdown table and JSON under `--out`, and an SVG
//! of the scale curve. `--quick` runs tiny sizes: it shows that the bench runs, nothing about
//! speed.

mod load;
mod report;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use weir_agent::datapath::Datapath;
use weir_agent::workload::PodOptions;
use weir_tests::node::NodeOptions;
use weir_tests::{istio_iptables, Pod, TestNode};

use report::{micros, ratio, Report, Samples, Table};

const APP_PORT: u16 = 8080;
const BULK_PORT: u16 = 8081;
const UDP_PORT: u16 = 8082;
/// Threads creating (and removing) pods: CNI ADD is mostly exec and waiting.
const POD_WORKERS: usize = 8;
/// A Linux bridge takes at most 1,024 ports (`BR_MAX_PORTS`; the bridge plugin then fails with
/// "exchange full"), and every pod of the one test node is a port of its bridge. Scale sizes
/// beyond this need the pods spread over several nodes with distinct address ranges.
const PODS_PER_BRIDGE: usize = 1023;

#[derive(Parser)]
#[command(about = "weir's datapath against istio's iptables rules, on a throwaway node")]
struct Args {
    /// Tiny sizes, a few seconds: shows that the bench runs (the test run uses it), not speed.
    #[arg(long, env = "WEIR_BENCH_QUICK")]
    quick: bool,
    /// Enrolled pod counts of the scale section (comma-separated); --quick uses 2,4. One
    /// test node's bridge holds at most 1,023 pods, the other sections' included.
    #[arg(
        long,
        env = "WEIR_BENCH_SIZES",
        value_delimiter = ',',
        default_value = "10,100,900"
    )]
    sizes: Vec<usize>,
    /// Directory for bench.md, bench.json and scale.svg.
    #[arg(long, env = "WEIR_BENCH_OUT", default_value = "target/bench")]
    out: PathBuf,
}

/// How much of everything a run does.
struct Plan {
    /// Pods enrolled each way in the enrollment section.
    enroll_pairs: usize,
    sizes: Vec<usize>,
    /// Alternating rounds of the connection, bulk and cost sections.
    rounds: usize,
    /// Length of one variant's turn in a round.
    turn: Duration,
    concurrency: usize,
    bulk_bytes: usize,
}

impl Plan {
    fn new(args: &Args) -> Self {
        if args.quick {
            return Self {
                enroll_pairs: 3,
                sizes: vec![2, 4],
                rounds: 2,
                turn: Duration::from_millis(100),
                concurrency: 8,
                bulk_bytes: 4 << 20,
            };
        }
        Self {
            enroll_pairs: 40,
            sizes: args.sizes.clone(),
            rounds: 10,
            turn: Duration::from_secs(1),
            concurrency: 8,
            bulk_bytes: 256 << 20,
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
    let pods_needed = plan.sizes.iter().max().unwrap_or(&0) + 2 * plan.enroll_pairs + 3;
    if pods_needed > PODS_PER_BRIDGE {
        bail!(
            "{pods_needed} pods on one test node: its bridge takes at most {PODS_PER_BRIDGE} \
             (lower --sizes)"
        );
    }
    let mut report = Report::new(args.quick);

    let node = TestNode::with_options(NodeOptions {
        wide_ipv4_range: true,
        ..NodeOptions::default()
    })?;
    let server = node.add_pod("server")?;
    let app = SocketAddr::new(server.ipv4().into(), APP_PORT);
    let _server = load::server(server.netns(), app)?;
    let bulk = SocketAddr::new(server.ipv4().into(), BULK_PORT);
    let _bulk = load::bulk_source(server.netns(), bulk, plan.bulk_bytes)?;
    let udp = SocketAddr::new(server.ipv4().into(), UDP_PORT);
    let _udp = load::udp_sink(server.netns(), udp)?;
    let plain = node.add_pod("plain")?;

    println!("cost to pods and host processes weir does not enroll...");
    report.push(cost_to_others(&node, &plain, app, udp, &plan)?);

    let config = node.datapath_config();
    let maps = config
        .pin_root
        .join(format!("abi-{}", weir_common::ABI_VERSION));
    let datapath = Datapath::start(config.clone())?;
    let measured = with_datapath(
        &datapath,
        &node,
        &plain,
        app,
        bulk,
        &maps,
        &plan,
        &mut report,
    );
    datapath.uninstall()?;
    measured?;

    report.finish();
    report.write(&args.out)?;
    println!("\n{}", report.markdown());
    println!("written to {}", args.out.display());
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn with_datapath(
    datapath: &Datapath,
    node: &TestNode,
    plain: &Pod,
    app: SocketAddr,
    bulk: SocketAddr,
    maps: &Path,
    plan: &Plan,
    report: &mut Report,
) -> Result<()> {
    println!("enrollment, weir against istio's iptables route...");
    let weir_pods = make_pods(node, "w", plan.enroll_pairs)?;
    let iptables_pods = make_pods(node, "i", plan.enroll_pairs)?;
    report.push(enrollment(datapath, &weir_pods, &iptables_pods)?);

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

    println!("scale...");
    let (table, curve) = scale(datapath, node, maps, &plan.sizes)?;
    report.push(table);
    report.scale_curve(curve);
    Ok(())
}

/// Enrollment: one pod's redirection put in place, weir's datapath (one long-lived process, as
/// the agent) against istio's route (`iptables-restore` v4 and v6 plus policy routing in the
/// pod), pod pair by pod pair, alternating which goes first.
fn enrollment(datapath: &Datapath, weir_pods: &[Pod], iptables_pods: &[Pod]) -> Result<Table> {
    let (mut weir, mut iptables, mut ratios) = (Samples::new(), Samples::new(), Vec::new());
    for (i, (weir_pod, iptables_pod)) in weir_pods.iter().zip(iptables_pods).enumerate() {
        let enroll_weir = || timed(|| datapath.enroll(weir_pod.workload(PodOptions::default())));
        let enroll_iptables = || timed(|| istio_iptables::apply(iptables_pod.netns()));
        let (w, t) = if i % 2 == 0 {
            (enroll_weir()?, enroll_iptables()?)
        } else {
            let t = enroll_iptables()?;
            (enroll_weir()?, t)
        };
        ratios.push(t.as_secs_f64() / w.as_secs_f64());
        weir.push(w);
        iptables.push(t);
    }
    let mut unenroll = Samples::new();
    for pod in &weir_pods[1..] {
        unenroll.push(timed(|| datapath.unenroll(pod.uid()))?);
    }
    let mut table = Table::new(
        "Enrollment: one pod's redirection",
        &["", "weir", "iptables route", "iptables/weir (pairs)"],
    );
    table.row(&[
        "enroll, median (p99)".into(),
        weir.show(),
        iptables.show(),
        ratio(&ratios),
    ]);
    table.row(&[
        "unenroll, median (p99)".into(),
        unenroll.show(),
        "-".into(),
        "-".into(),
    ]);
    table.note(format!(
        "{} pods each way. weir: `Datapath::enroll` in one long-lived process; iptables route: \
         istio-cni's in-pod `iptables-restore` and `ip6tables-restore` plus its policy routing \
         (`ip rule`/`ip route`, v4 and v6).",
        weir_pods.len()
    ));
    table.json = json!({
        "pods": weir_pods.len(),
        "weir_enroll": weir.json(),
        "iptables_enroll": iptables.json(),
        "iptables_over_weir": report::median(&ratios),
        "weir_unenroll": unenroll.json(),
    });
    Ok(table)
}

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
            datapath.enroll(pod.workload(PodOptions::default()))?;
        }
        let rate = pod.run(|| load::download(source)).context("download");
        if enrolled == 0 {
            datapath.unenroll(pod.uid())?;
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
        datapath.uninstall()?;
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
}

/// Scale: at each size, that many pods enrolled (latency of each), the process's RSS (the
/// datapath runs in it, as in the agent) and the maps' kernel memory with all of them in, then
/// the time to remove them all.
fn scale(
    datapath: &Datapath,
    node: &TestNode,
    maps: &Path,
    sizes: &[usize],
) -> Result<(Table, Vec<ScalePoint>)> {
    let mut table = Table::new(
        "Scale: enrolled pods",
        &[
            "pods",
            "enroll median (p99)",
            "process RSS",
            "map memory",
            "remove all",
        ],
    );
    let mut pods = Vec::new();
    let mut curve = Vec::new();
    let mut json_sizes = Vec::new();
    for &size in sizes {
        let start = Instant::now();
        let missing = size.saturating_sub(pods.len());
        pods.extend(make_pods(node, &format!("s{size}-"), missing)?);
        println!("  {size} pods ({missing} made in {:.0?})", start.elapsed());
        let mut enroll = Samples::new();
        for pod in &pods[..size] {
            enroll.push(timed(|| {
                datapath.enroll(pod.workload(PodOptions::default()))
            })?);
        }
        let rss = report::rss_bytes()?;
        let memory = report::map_memory(maps)?;
        let start = Instant::now();
        for pod in &pods[..size] {
            datapath.unenroll(pod.uid())?;
        }
        let removal = start.elapsed();
        table.row(&[
            size.to_string(),
            enroll.show(),
            report::mebibytes(rss),
            report::mebibytes(memory),
            format!("{:.1?}", removal),
        ]);
        json_sizes.push(json!({
            "pods": size,
            "enroll": enroll.json(),
            "rss_bytes": rss,
            "map_memory_bytes": memory,
            "remove_all_s": removal.as_secs_f64(),
        }));
        curve.push(ScalePoint { pods: size, enroll });
    }
    if let (Some(first), Some(last)) = (curve.first(), curve.last()) {
        let growth = last.enroll.median().as_secs_f64() / first.enroll.median().as_secs_f64();
        table.note(format!(
            "Enroll median at {} pods over at {}: {growth:.2}x. RSS: the bench process, which runs \
             the datapath as the agent does. Map memory: bpftool's bytes_memlock over weir's pins.",
            last.pods, first.pods
        ));
    }
    table.json = json!({ "sizes": json_sizes });
    remove_pods(pods);
    Ok((table, curve))
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
    let next = AtomicUsize::new(0);
    let made = Mutex::new(Vec::with_capacity(count));
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..POD_WORKERS.min(count))
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= count {
                            return Ok(());
                        }
                        let pod = node.add_pod(&format!("{prefix}{i}"))?;
                        made.lock().expect("no panics holding it").push((i, pod));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|worker| worker.join().expect("pod worker panicked"))
    })?;
    let mut made = made.into_inner().expect("no panics holding it");
    made.sort_by_key(|(i, _)| *i);
    Ok(made.into_iter().map(|(_, pod)| pod).collect())
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
