//! The sections measured on the agent as a node runs it: the production `weir-agent` binary in
//! a process of its own (so its memory and CPU time are its own), the ztunnel stand-in acking
//! every Add over ZDS, and pods' ADDs executing weir-cni as the runtime does. The node has as many
//! bridges as its pods need (one takes at most [`PODS_PER_BRIDGE`]); one agent serves them all.
//!
//! Sections: pod start, the whole CNI ADD with and without weir-cni, every plugin exec'd as a
//! runtime execs it ([`crate::runtime`]); weir-cni's decision when the agent is
//! away (the API server's, the verdict cache's) against the agent's; scale (enroll latency, agent
//! RSS, map memory and removal time at each size); the node reboot storm.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{json, Value};
use weir_agent::datapath::Datapath;
use weir_tests::agent::{AgentBinary, AgentProcess, NodeFiles};
use weir_tests::chain::{ambient_policy, MESH};
use weir_tests::cni::{self, Command, NetworkConfigList, PluginRunner};
use weir_tests::node::{NodeOptions, PODS_PER_BRIDGE};
use weir_tests::ApiServer;
use weir_tests::{Pod, PodSpec, TestNode, ZdsEvent, ZdsZtunnel};

use crate::enrollment::ENROLL_STEPS;
use crate::pods::{parallel, remove_pods, POD_WORKERS};
use crate::report::{self, micros, ratio, Report, Samples, Table};
use crate::runtime::Sandbox;
use crate::{timed, Plan, ScalePoint, Sections};

/// Attempts at one pod's weir-cni ADD in the storm, as kubelet retries a failed sandbox: under
/// a saturated machine an ADD can outlast weir-cni's 5 s deadline. Retries are reported.
const STORM_ATTEMPTS: usize = 3;

/// Runs the agent sections on a node of their own (only pod start for
/// [`Sections::PodStart`]) and adds their tables to `report`.
pub fn measure(plan: &Plan, sections: Sections, report: &mut Report) -> Result<()> {
    let files = NodeFiles::new()?;
    files.write_policy(&ambient_policy())?;
    let most_pods = plan
        .sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(plan.storm_pods)
        + plan.enroll_probes
        + 2;
    let node = TestNode::with_options(NodeOptions {
        wide_ipv4_range: true,
        extra_bridges: most_pods.div_ceil(PODS_PER_BRIDGE) - 1,
        ..files.node_options()
    })?;
    let measured = with_agent(&files, &node, plan, sections, report);
    // The agent stops as an upgrade does, leaving its datapath pinned: removed here.
    let datapath = Datapath::start(node.datapath_config()).and_then(|d| d.uninstall().wait());
    measured?;
    datapath.context("removing the agent's datapath")
}

fn with_agent(
    files: &NodeFiles,
    node: &TestNode,
    plan: &Plan,
    sections: Sections,
    report: &mut Report,
) -> Result<()> {
    let agent = AgentProcess::start(files, node.netns(), AgentBinary::Run { env: &[] })?;
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).context("ztunnel connects")?;
    ztunnel.ack_without_proxies();
    let weir = WeirCni::installed(node)?;
    // Declared after the agent: dropped (CNI DEL through the whole chain, weir-cni included)
    // while the agent still answers.
    let mut pods: Vec<Pod> = Vec::new();
    let measured = (|| {
        println!("pod start: the whole CNI ADD with and without weir-cni...");
        report.push(pod_start(node, &agent, &weir, plan)?);
        if sections == Sections::PodStart {
            return Ok(());
        }
        println!("weir-cni with the agent away: the API server, the verdict cache...");
        report.push(agent_away(node, files, &weir, plan)?);
        println!("scale, through the agent...");
        let (table, curve) = scale(node, &agent, &weir, &mut pods, plan)?;
        report.push(table);
        report.scale_curve(curve);
        println!("node reboot storm...");
        report.push(reboot_storm(
            node, &agent, &ztunnel, &weir, &mut pods, plan,
        )?);
        Ok(())
    })();
    remove_pods(pods);
    measured
}

/// weir-cni as the node's conflist configures it (the agent's installer chained it there), run
/// by a [`PluginRunner`] started on the node before the bench's pods (and their descriptors)
/// exist, as a runtime with few descriptors runs it.
#[derive(Clone)]
struct WeirCni {
    list: NetworkConfigList,
    plugin: Value,
    binary: PathBuf,
    runner: Arc<PluginRunner>,
}

impl WeirCni {
    fn installed(node: &TestNode) -> Result<Self> {
        let list = node.runtime_network()?;
        let plugin = list
            .plugins
            .last()
            .filter(|plugin| plugin["type"] == "weir-cni")
            .cloned()
            .with_context(|| format!("weir-cni is not chained in {}", list.to_json()))?;
        let binary = cni::find_plugin(&plugin, node.cni_path())?;
        let runner = PluginRunner::start(node.netns()).context("starting weir-plugin-runner")?;
        Ok(Self {
            runner: Arc::new(runner),
            list,
            plugin,
            binary,
        })
    }

    /// The same with `changes` made to its config.
    fn with(&self, changes: Value) -> Self {
        let mut plugin = self.plugin.clone();
        for (key, value) in changes.as_object().into_iter().flatten() {
            plugin[key] = value.clone();
        }
        Self {
            plugin,
            ..self.clone()
        }
    }

    /// weir-cni alone for `pod` (wired by the primary CNI), as the runtime runs it after the
    /// plugins before it.
    fn call(&self, command: Command, pod: &Pod) -> Result<()> {
        let runtime = pod.runtime_conf();
        let config = self
            .list
            .plugin_config(&self.plugin, runtime, Some(pod.prev_result()));
        self.runner
            .invoke(&self.binary, command, runtime, &config)
            .with_context(|| format!("weir-cni {} of pod {}", command.as_str(), pod.name()))?;
        Ok(())
    }
}

fn ambient(name: String) -> PodSpec {
    PodSpec {
        namespace: MESH.into(),
        ..PodSpec::new(&name)
    }
}

/// `count` ambient pods wired by the primary CNI alone, [`POD_WORKERS`] at a time.
fn primary_pods(node: &TestNode, prefix: &str, first: usize, count: usize) -> Result<Vec<Pod>> {
    let indexes: Vec<usize> = (first..first + count).collect();
    parallel(&indexes, POD_WORKERS, |i| {
        node.add_pod_primary(ambient(format!("{prefix}{i}")))
    })
}

/// Pod start: the whole CNI ADD of an ambient pod as a runtime runs it ([`Sandbox::add`]),
/// loopback + bridge + weir-cni against loopback + bridge, pod pair by pod pair, alternating
/// which goes first; with weir-cni's exec alone within it, and the agent's own part of that
/// (its `weir_redirect_seconds` over the section).
fn pod_start(node: &TestNode, agent: &AgentProcess, weir: &WeirCni, plan: &Plan) -> Result<Table> {
    let with_weir = weir.list.clone();
    let mut primary = weir.list.clone();
    primary.plugins.truncate(1);
    let (mut with, mut without, mut weir_exec) = (Samples::new(), Samples::new(), Samples::new());
    let (mut ratios, mut added) = (Vec::new(), Vec::new());
    let timers_before = DatapathTimers::read(node, agent)?;
    for i in 0..plan.chain_pairs {
        let add =
            |chain: &NetworkConfigList, name: String| Sandbox::add(node, chain.clone(), &name);
        // Both sandboxes stay until the pair is timed, each on its own port of cni0.
        let ((_w, w), (_o, o)) = if i % 2 == 0 {
            let w = add(&with_weir, format!("cw{i}"))?;
            (w, add(&primary, format!("cp{i}"))?)
        } else {
            let o = add(&primary, format!("cp{i}"))?;
            (add(&with_weir, format!("cw{i}"))?, o)
        };
        let weir_cni = *w.plugins.last().context("no plugin ran")?;
        ratios.push(w.whole.as_secs_f64() / o.whole.as_secs_f64());
        added.push(w.whole.as_secs_f64() - o.whole.as_secs_f64());
        with.push(w.whole);
        without.push(o.whole);
        weir_exec.push(weir_cni);
    }
    let datapath_part = DatapathTimers::read(node, agent)?.mean_redirect_since(&timers_before);
    let mut table = Table::new(
        "Pod start: the whole CNI ADD with and without weir-cni",
        &[
            "",
            "with weir-cni",
            "without",
            "added by weir-cni (pairs)",
            "with/without (pairs)",
        ],
    );
    let added_median = report::median(&added);
    table.row(&[
        "CNI ADD, median (p99)".into(),
        with.show(),
        without.show(),
        micros(Duration::from_secs_f64(added_median.max(0.0))),
        ratio(&ratios),
    ]);
    table.row(&[
        "weir-cni's exec within it, median (p99)".into(),
        weir_exec.show(),
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    table.row(&[
        "the agent's datapath part of that, mean".into(),
        micros(datapath_part),
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    table.note(format!(
        "{} pairs of ambient pods, each ADD run as a container runtime runs it: every plugin \
         binary exec'd straight from the node's network namespace with the CNI_* environment \
         and its configuration on stdin (loopback as a network of its own, then the conflist, \
         each plugin getting the one before's result): bridge + host-local against the same + \
         weir-cni, which returns once the agent (its binary, in its own process) has enrolled \
         the pod and the ztunnel stand-in acked its Add. weir-cni's exec: from its spawn to its \
         exit within the ADD with it. The agent's datapath part: its own \
         `weir_redirect_seconds` over those ADDs (maps, tc, routing, in the pod's netns); the \
         rest of weir-cni's exec is the process start, the agent's socket, its policy and the \
         ZDS round trip. The namespace's creation is not in it.",
        plan.chain_pairs
    ));
    table.json = json!({
        "pairs": plan.chain_pairs,
        "with_weir_cni": with.json(),
        "without": without.json(),
        "added_by_weir_cni_median_us": added_median * 1e6,
        "with_over_without": report::median(&ratios),
        "weir_cni_exec": weir_exec.json(),
        "datapath_part_mean_s": datapath_part.as_secs_f64(),
    });
    Ok(table)
}

/// weir-cni's ADD of a pod that is not ambient, three ways, in triples with the order rotated:
/// the agent answers (its socket, as installed); the agent is away and the API server decides
/// (the tests' stand-in on the node's loopback, plain http: two GETs); the agent is away and so
/// is the API server, and the verdict cache decides.
fn agent_away(node: &TestNode, files: &NodeFiles, weir: &WeirCni, plan: &Plan) -> Result<Table> {
    let runtime = tokio::runtime::Runtime::new()?;
    // Bound in the node's netns, where weir-cni runs; served from the runtime's threads.
    let api = node.run(|| runtime.block_on(ApiServer::start()))?;
    api.create(&Namespace {
        metadata: ObjectMeta {
            name: Some("default".into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    });
    let names: Vec<String> = (0..plan.chain_pairs.clamp(1, 10))
        .map(|i| format!("away{i}"))
        .collect();
    let mut pods = Vec::new();
    for name in &names {
        pods.push(node.add_pod_primary(PodSpec {
            uid: Some(api.create_pod("default", name)),
            ..PodSpec::new(name)
        })?);
    }
    let kubeconfig = files.run_dir().join("weir-kubeconfig");
    let cluster = json!({"server": api.url()});
    std::fs::write(
        &kubeconfig,
        json!({"clusters": [{"name": "bench", "cluster": cluster}],
               "users": [{"name": "bench", "user": {"token": "bench"}}],
               "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
               "current-context": "bench"})
        .to_string(),
    )?;
    let nowhere = files.run_dir().join("no-agent.sock");
    // The cache the agent would have written: it names the node's pods that are not ambient (a
    // pod it does not know waits for the agent).
    let verdict_cache = files.run_dir().join("bench-verdicts.json");
    let other_pods: Vec<String> = (0..pods.len())
        .map(|i| format!("default/away{i}"))
        .collect();
    std::fs::write(
        &verdict_cache,
        json!({"ambient_namespaces": [], "ambient_pods": [], "opted_out_pods": [],
               "other_pods": other_pods})
        .to_string(),
    )?;
    let variants = [
        ("the agent answers", weir.clone()),
        (
            "agent away: the API server decides",
            weir.with(json!({"agent_socket": nowhere, "kubeconfig": kubeconfig})),
        ),
        (
            "agent and API server away: the verdict cache decides",
            weir.with(json!({"agent_socket": nowhere, "verdict_cache": verdict_cache})),
        ),
    ];
    let mut samples: Vec<Samples> = variants.iter().map(|_| Samples::new()).collect();
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let requests_before = api.requests().len();
    for (round, pod) in pods.iter().cycle().take(plan.enroll_samples).enumerate() {
        let mut took = vec![Duration::ZERO; variants.len()];
        for k in 0..variants.len() {
            let which = (round + k) % variants.len();
            took[which] = node.run(|| timed(|| variants[which].1.call(Command::Add, pod)))?;
        }
        for (which, one) in took.iter().enumerate() {
            samples[which].push(*one);
            ratios[which].push(one.as_secs_f64() / took[0].as_secs_f64());
        }
    }
    let asked = api.requests().len() - requests_before;
    if asked != 2 * plan.enroll_samples {
        bail!("weir-cni asked the API server {asked} times, not twice per ADD");
    }
    remove_pods(pods);
    let mut table = Table::new(
        "weir-cni when the agent is away: a pod that is not ambient",
        &[
            "path",
            "ADD, median (p99)",
            "over the agent's path (triples)",
        ],
    );
    let mut json_paths = Vec::new();
    for ((name, _), (samples, ratios)) in variants.iter().zip(samples.iter().zip(&ratios)) {
        table.row(&[name.to_string(), samples.show(), ratio(ratios)]);
        json_paths.push(json!({"path": name, "add": samples.json(),
                               "over_agent": report::median(ratios)}));
    }
    table.note(format!(
        "{} ADDs each way of pods in a namespace that is not ambient, weir-cni alone executed as \
         the runtime executes it after the primary plugins, in triples with the order rotated. \
         The agent's path: its socket and its policy (it answers \"not ambient\"). The API \
         server's: the agent's socket missing, then GET pod and GET namespace from the tests' \
         API server stand-in on the node's loopback over plain http (a real API server adds a \
         TLS handshake and its own latency; weir-cni allows both GETs 2 s together). The \
         verdict cache's: no kubeconfig, the agent's cache file.",
        plan.enroll_samples
    ));
    table.json = json!({ "samples": plan.enroll_samples, "paths": json_paths });
    Ok(table)
}

/// Scale: at each size, that many ambient pods enrolled through weir-cni ADDs by the agent, then
/// the latency of one more pod's ADD (probe pods, each ADDed and DELeted again), the agent's RSS,
/// the maps' memory, and the time to DEL them all through weir-cni. Pods made for one size stay
/// (unenrolled) for the next.
fn scale(
    node: &TestNode,
    agent: &AgentProcess,
    weir: &WeirCni,
    pods: &mut Vec<Pod>,
    plan: &Plan,
) -> Result<(Table, Vec<ScalePoint>)> {
    let maps = node
        .datapath_config()
        .pin_root
        .join(format!("abi-{}", weir_common::ABI_VERSION));
    let probes = primary_pods(node, "probe", 0, plan.enroll_probes)?;
    let mut table = Table::new(
        "Scale: pods enrolled by the agent",
        &[
            "pods",
            "one more pod's ADD, median (p99)",
            "its datapath part, mean",
            "the datapath's steps, mean",
            "agent RSS",
            "map memory",
            "ADD all",
            "DEL all",
        ],
    );
    let (mut curve, mut json_sizes) = (Vec::new(), Vec::new());
    for &size in &plan.sizes {
        let start = Instant::now();
        let missing = size.saturating_sub(pods.len());
        pods.extend(primary_pods(node, "s", pods.len(), missing)?);
        println!("  {size} pods ({missing} wired in {:.0?})", start.elapsed());
        let enrolled = &pods[..size];
        let add_all = timed(|| {
            on_node(node, enrolled, POD_WORKERS, |pod| {
                weir.call(Command::Add, pod)
            })
        })?;
        let mut enroll = Samples::new();
        let timers_before = DatapathTimers::read(node, agent)?;
        for probe in probes.iter().cycle().take(plan.enroll_samples) {
            node.run(|| -> Result<()> {
                enroll.push(timed(|| weir.call(Command::Add, probe))?);
                weir.call(Command::Del, probe)
            })?;
        }
        let timers = DatapathTimers::read(node, agent)?;
        let datapath_part = timers.mean_redirect_since(&timers_before);
        let steps = timers.mean_steps_since(&timers_before);
        let steps_shown = (ENROLL_STEPS.iter().zip(&steps))
            .map(|(name, mean)| format!("{name} {}", micros(*mean)))
            .collect::<Vec<_>>()
            .join(", ");
        let rss = agent.rss_bytes()?;
        let memory = report::map_memory(&maps)?;
        let del_all = timed(|| {
            on_node(node, enrolled, POD_WORKERS, |pod| {
                weir.call(Command::Del, pod)
            })
        })?;
        println!(
            "  {size} pods: one more ADD {} (datapath {}: {steps_shown}), agent RSS {}, map \
             memory {}, ADD all {add_all:.1?}, DEL all {del_all:.1?}",
            enroll.show(),
            micros(datapath_part),
            report::mebibytes(rss),
            report::mebibytes(memory)
        );
        table.row(&[
            size.to_string(),
            enroll.show(),
            micros(datapath_part),
            steps_shown,
            report::mebibytes(rss),
            report::mebibytes(memory),
            format!("{add_all:.1?}"),
            format!("{del_all:.1?}"),
        ]);
        json_sizes.push(json!({
            "pods": size,
            "one_more_add": enroll.json(),
            "datapath_part_mean_s": datapath_part.as_secs_f64(),
            "datapath_steps_mean_s": (ENROLL_STEPS.iter().zip(&steps))
                .map(|(name, mean)| (name.to_string(), json!(mean.as_secs_f64())))
                .collect::<serde_json::Map<_, _>>(),
            "agent_rss_bytes": rss,
            "map_memory_bytes": memory,
            "add_all_s": add_all.as_secs_f64(),
            "del_all_s": del_all.as_secs_f64(),
        }));
        curve.push(ScalePoint {
            pods: size,
            enroll,
            rss,
        });
    }
    if let (Some(first), Some(last)) = (curve.first(), curve.last()) {
        let growth = last.enroll.median().as_secs_f64() / first.enroll.median().as_secs_f64();
        table.note(format!(
            "One more pod's ADD at {} pods over at {}: {growth:.2}x (median). Each size's pods \
             are enrolled by weir-cni ADDs ({POD_WORKERS} at a time) to the agent (its \
             binary, own process, ztunnel stand-in acking); then {} ADDs of one more pod (weir-cni \
             executed as the runtime executes it after the primary plugins, from a process of \
             few descriptors as a runtime's, each followed by its DEL); its datapath part: the agent's own `weir_redirect_seconds` over those ADDs \
             (maps, tc, routing, in the pod's netns), the rest being weir-cni's exec, the \
             agent's socket and ZDS round trips; its steps: the agent's \
             `weir_enroll_step_seconds` over the same ADDs; agent RSS: VmRSS of its process; map memory: \
             bpftool's bytes_memlock over its pins; ADD all, DEL all: every pod's weir-cni ADD (DEL), {POD_WORKERS} at a time. \
             The pods' namespaces and bridge ports (wired by the bridge plugin, {POD_WORKERS} \
             threads) are not in these times. Targets: at most 2x from 10 to \
             5,000 pods, agent RSS at most 64 MiB at 5,000.",
            last.pods, first.pods, plan.enroll_samples
        ));
    }
    table.json = json!({ "sizes": json_sizes });
    remove_pods(probes);
    Ok((table, curve))
}

/// The agent's enrollment timers at one moment, each a histogram's (sum, count): its
/// `weir_redirect_seconds` and the `weir_enroll_step_seconds` of each of [`ENROLL_STEPS`].
struct DatapathTimers {
    redirect: (f64, f64),
    steps: Vec<(f64, f64)>,
}

impl DatapathTimers {
    /// Read from the agent's `/metrics`, which it serves in the node's netns. A step not timed
    /// yet counts as none.
    fn read(node: &TestNode, agent: &AgentProcess) -> Result<Self> {
        let address = agent.config.metrics_addr;
        let (_, metrics) = node.run(|| weir_tests::agent::http_get(address, "/metrics"))?;
        let value = |series: &str| {
            report::metric(&metrics, series)
                .with_context(|| format!("no {series} in the agent's metrics"))
        };
        let step = |step: &str| {
            let series = |part: &str| format!("weir_enroll_step_seconds_{part}{{step=\"{step}\"}}");
            let value = |part| report::metric(&metrics, &series(part)).unwrap_or(0.0);
            (value("sum"), value("count"))
        };
        Ok(Self {
            redirect: (
                value("weir_redirect_seconds_sum")?,
                value("weir_redirect_seconds_count")?,
            ),
            steps: ENROLL_STEPS.iter().map(|name| step(name)).collect(),
        })
    }

    /// The mean redirect since `before`.
    fn mean_redirect_since(&self, before: &Self) -> Duration {
        mean_between(before.redirect, self.redirect)
    }

    /// Each step's mean since `before`, in the order of [`ENROLL_STEPS`].
    fn mean_steps_since(&self, before: &Self) -> Vec<Duration> {
        (before.steps.iter().zip(&self.steps))
            .map(|(before, after)| mean_between(*before, *after))
            .collect()
    }
}

/// The mean observation between two readings of a histogram's (sum, count).
fn mean_between(before: (f64, f64), after: (f64, f64)) -> Duration {
    Duration::from_secs_f64((after.0 - before.0) / (after.1 - before.1).max(1.0))
}

/// The node reboot storm: `plan.storm_pods` sandboxes already wired by the primary CNI (as the
/// runtime recreates them after a reboot), then every pod's weir-cni ADD at once from
/// `plan.storm_concurrency` threads; wall time until every ADD returned (each returns after
/// ztunnel's ack), and the agent's CPU time meanwhile.
fn reboot_storm(
    node: &TestNode,
    agent: &AgentProcess,
    ztunnel: &ZdsZtunnel,
    weir: &WeirCni,
    pods: &mut Vec<Pod>,
    plan: &Plan,
) -> Result<Table> {
    let missing = plan.storm_pods.saturating_sub(pods.len());
    pods.extend(primary_pods(node, "s", pods.len(), missing)?);
    let storm = &pods[..plan.storm_pods];
    let events_before = ztunnel.events().len();
    let cpu_before = agent.cpu_time()?;
    let start = Instant::now();
    let retries = on_node(node, storm, plan.storm_concurrency, |pod| {
        let mut attempt = 1;
        loop {
            match weir.call(Command::Add, pod) {
                Ok(()) => return Ok(attempt - 1),
                Err(error) if attempt < STORM_ATTEMPTS => {
                    eprintln!("storm: {error:#}, retrying");
                    attempt += 1;
                }
                Err(error) => return Err(error),
            }
        }
    })?;
    let wall = start.elapsed();
    let cpu = agent.cpu_time()? - cpu_before;
    let acked: HashSet<String> = ztunnel.events()[events_before..]
        .iter()
        .filter_map(|event| match event {
            ZdsEvent::Add { uid, .. } => Some(uid.clone()),
            _ => None,
        })
        .collect();
    let unacked = storm
        .iter()
        .filter(|pod| !acked.contains(pod.uid()))
        .count();
    if unacked > 0 {
        bail!("{unacked} of the storm's pods never reached ztunnel");
    }
    on_node(node, storm, POD_WORKERS, |pod| weir.call(Command::Del, pod))?;
    let retries: usize = retries.iter().sum();
    println!(
        "  {} pods: {wall:.2?} wall, agent CPU {cpu:.2?}",
        plan.storm_pods
    );
    let mut table = Table::new(
        "Node reboot storm",
        &[
            "pods",
            "concurrent ADDs",
            "wall time",
            "agent CPU",
            "agent CPU per pod",
            "retried ADDs",
        ],
    );
    table.row(&[
        plan.storm_pods.to_string(),
        plan.storm_concurrency.to_string(),
        format!("{wall:.2?}"),
        format!("{cpu:.2?}"),
        micros(cpu / plan.storm_pods.max(1) as u32),
        retries.to_string(),
    ]);
    table.note(format!(
        "The pods' sandboxes were already wired by the primary CNI (bridge), as the runtime \
         recreates them after a reboot; then every pod's weir-cni ADD, {} executions at a time, \
         to the running agent. Wall time: until the last ADD returned (each returns after the \
         ztunnel stand-in acked its Add; every pod's Add checked). Agent CPU: utime + stime of \
         its process over the storm. An ADD that failed was retried (up to {STORM_ATTEMPTS} \
         attempts, as kubelet retries). Target: at most 1 s of agent CPU for 1,000 \
         pods.",
        plan.storm_concurrency
    ));
    table.json = json!({
        "pods": plan.storm_pods,
        "concurrency": plan.storm_concurrency,
        "wall_s": wall.as_secs_f64(),
        "agent_cpu_s": cpu.as_secs_f64(),
        "retried_adds": retries,
    });
    Ok(table)
}

/// [`parallel`] on the node: the threads start in its namespace, as the runtime's plugins run.
fn on_node<R: Send>(
    node: &TestNode,
    pods: &[Pod],
    workers: usize,
    work: impl Fn(&Pod) -> Result<R> + Sync + Send,
) -> Result<Vec<R>> {
    node.run(|| parallel(pods, workers, work))
}
