//! The sections measured with weir's datapath in this process, as the agent runs it: cost to
//! pods and host processes that are not enrolled, enrollment ([`crate::enrollment`]), also beside
//! a pod flapping its addresses ([`crate::flapping`]), the connection path, sidecar pods'
//! enrollment and connection path ([`crate::sidecar`]) and bulk download.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use prometheus_client::registry::Registry;
use serde_json::json;
use weir_agent::datapath::Datapath;
use weir_agent::workload::PodOptions;
use weir_tests::cgroup::TestCgroup;
use weir_tests::{Pod, TestNode};

use crate::enrollment::{enrollment, enrollment_steps, handoff_round_trips};
use crate::flapping::enrollment_beside_flapping;
use crate::load::Proxy;
use crate::pods::make_pods;
use crate::relays::{connect, connection_table, through_relays, RELAY_RATIOS};
use crate::report::{self, ratio, Report, Table};
use crate::trace_reader::TraceServer;
use crate::{alternating_rounds, load, sidecar, Plan};

const APP_PORT: u16 = 8080;
const BULK_PORT: u16 = 8081;
const UDP_PORT: u16 = 8082;

/// The sections measured with weir's datapath in this process (as the agent runs it), on a node
/// of their own.
pub fn measure(plan: &Plan, report: &mut Report) -> Result<()> {
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
    // The ztunnel stand-ins run in this process.
    datapath.ztunnel_connected(std::process::id()).wait()?;
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
    // Only the first of each is used below; the others give their addresses back (CNI DEL) for
    // the pods of the sections after this one: the node's pods share one /24.
    let first = |pods: Vec<Pod>| pods.into_iter().next().context("no pods were made");
    let (weir_pod, iptables_pod) = (first(weir_pods)?, first(iptables_pods)?);
    drop(floor_pods);
    let handoff = handoff_round_trips(datapath, &runtime)?;
    report.push(enrollment_steps(metrics, weir_median, &handoff)?);
    println!("enrollment beside a pod flapping its addresses...");
    report.push(enrollment_beside_flapping(datapath, &runtime, node, plan)?);

    let trace = TraceServer::start(&runtime, node)?;
    println!("connection path...");
    report.push(connection_path(
        &weir_pod,
        &iptables_pod,
        plain,
        app,
        &trace,
        plan,
    )?);
    for table in sidecar::measure(datapath, &runtime, node, app, plan)? {
        report.push(table);
    }

    println!("bulk download...");
    report.push(bulk_download(datapath, node, bulk, &trace, plan)?);
    Ok(())
}

/// The connection path: short connections at `plan.concurrency` from an app to the server,
/// through the minimal relay in the app's pod, five ways (weir with tracing off and on), each
/// round in another order.
fn connection_path(
    weir_pod: &Pod,
    iptables_pod: &Pod,
    plain: &Pod,
    app: SocketAddr,
    trace: &TraceServer,
    plan: &Plan,
) -> Result<Table> {
    let (mut variants, _relays) =
        through_relays(weir_pod, iptables_pod, plain, app, Proxy::Ztunnel)?;
    const TRACED: usize = 4;
    variants.push(("weir redirect, tracing on", weir_pod, app));
    let mut traced = (0, 0, 0, 0);
    let rounds = alternating_rounds(variants.len(), plan.rounds, |variant| {
        let reader = (variant == TRACED).then(|| trace.reader()).transpose()?;
        let lost_before = trace.lost_in_kernel()?;
        let run = connect(&variants[variant], plan)?;
        if let Some(reader) = reader {
            reader.settle();
            let (records, lost) = reader.tally();
            traced.0 += run.latencies.len();
            traced.1 += records;
            traced.2 += lost;
            traced.3 += trace.lost_in_kernel()? - lost_before;
        }
        Ok(run)
    })?;
    let pairs: Vec<_> = RELAY_RATIOS
        .into_iter()
        .chain([("weir tracing on / off", TRACED, 0)])
        .collect();
    let mut table = connection_table("Connection path", &variants, &rounds, &pairs, plan);
    table.note(format!(
        "{} rounds of {:?} per variant, order rotated each round. The relay (in the app's pod, \
         on 15001, as ztunnel listens) reads SO_ORIGINAL_DST and dials from a marked socket; \
         'straight to the relay' connects to podIP:15001 (the limit of any redirect). \
         Tracing on: one `weir-agent trace` reader on the agent's trace server; it received \
         {} records for {} connections (three each: the app's connect, the relay's marked dial, \
         its SO_ORIGINAL_DST), and was told of {} lost ({} lost in the ring buffer).",
        plan.rounds, plan.turn, traced.1, traced.0, traced.2, traced.3
    ));
    Ok(table)
}

/// Bulk download into a pod, enrolled (weir's tc program sees every packet) with tracing off
/// and on, against the same pod unenrolled, alternating.
fn bulk_download(
    datapath: &Datapath,
    node: &TestNode,
    source: SocketAddr,
    trace: &TraceServer,
    plan: &Plan,
) -> Result<Table> {
    const ENROLLED: usize = 0;
    const TRACED: usize = 1;
    let pod = node.add_pod("bulk")?;
    let rounds = alternating_rounds(3, plan.rounds, |variant| {
        let enrolled = variant == ENROLLED || variant == TRACED;
        if enrolled {
            datapath
                .enroll(pod.workload(PodOptions::default()))
                .wait()?;
        }
        let reader = (variant == TRACED).then(|| trace.reader()).transpose()?;
        let rate = pod.run(|| load::download(source)).context("download");
        drop(reader);
        if enrolled {
            datapath.unenroll(pod.uid()).wait()?;
        }
        rate
    })?;
    let with: Vec<f64> = rounds.iter().map(|r| r[ENROLLED]).collect();
    let traced: Vec<f64> = rounds.iter().map(|r| r[TRACED]).collect();
    let without: Vec<f64> = rounds.iter().map(|r| r[2]).collect();
    let ratios: Vec<f64> = rounds.iter().map(|r| r[ENROLLED] / r[2]).collect();
    let traced_ratios: Vec<f64> = rounds.iter().map(|r| r[TRACED] / r[ENROLLED]).collect();
    let mut table = Table::new("Bulk download into a pod", &["", "MiB/s"]);
    let mib = |rates: &[f64]| format!("{:.0}", report::median(rates) / 1048576.0);
    table.row(&["enrolled (weir's programs)".into(), mib(&with)]);
    table.row(&["enrolled, tracing on".into(), mib(&traced)]);
    table.row(&["not enrolled".into(), mib(&without)]);
    table.row(&["enrolled / not (rounds)".into(), ratio(&ratios)]);
    table.row(&["tracing on / off (rounds)".into(), ratio(&traced_ratios)]);
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
        "tracing_on_bytes_per_s": report::median(&traced),
        "tracing_on_over_off": report::median(&traced_ratios),
    });
    Ok(table)
}

/// What weir's root-cgroup programs cost everyone else: connection and UDP send rates of a pod
/// that is not enrolled and of a host process, with the programs loaded against none,
/// alternating (the datapath is started and uninstalled for each loaded turn). A third turn
/// attaches the same programs to an empty cgroup, where they never run for the measured
/// processes: what remains is the kernel's own cost of a hook being attached anywhere (for an
/// unconnected UDP send, `udp_sendmsg` locks the socket once any sendmsg program is attached).
fn cost_to_others(
    node: &TestNode,
    plain: &Pod,
    app: SocketAddr,
    udp: SocketAddr,
    plan: &Plan,
) -> Result<Table> {
    let measure = || -> Result<[f64; 4]> {
        let pod_tcp = plain.run(|| load::connections(app, plan.concurrency, plan.turn))?;
        let pod_udp = plain.run(|| load::datagrams(udp, plan.turn))?;
        let host_tcp = node.run(|| load::connections(app, plan.concurrency, plan.turn))?;
        let host_udp = node.run(|| load::datagrams(udp, plan.turn))?;
        Ok([pod_tcp.rate, pod_udp.rate, host_tcp.rate, host_udp.rate])
    };
    let empty_cgroup = TestCgroup::new()?;
    let rounds = alternating_rounds(3, plan.rounds, |variant| {
        let mut config = node.datapath_config();
        match variant {
            0 => {}
            1 => return measure(),
            _ => config.cgroup = Some(empty_cgroup.dir.clone()),
        }
        let datapath = Datapath::start(config)?;
        let rates = measure();
        datapath.uninstall().wait()?;
        rates
    })?;
    let mut table = Table::new(
        "Cost to pods and host processes weir does not enroll",
        &[
            "",
            "programs loaded",
            "loaded at an empty cgroup",
            "no programs",
            "loaded/none (rounds)",
            "at an empty cgroup/none (rounds)",
        ],
    );
    let names = [
        "pod: connections/s",
        "pod: UDP datagrams/s",
        "host process: connections/s",
        "host process: UDP datagrams/s",
    ];
    let mut json_rows = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let rates = |variant: usize| -> Vec<f64> { rounds.iter().map(|r| r[variant][i]).collect() };
        let (loaded, none, elsewhere) = (rates(0), rates(1), rates(2));
        let over_none = |rates: &[f64]| -> Vec<f64> {
            rates
                .iter()
                .zip(&none)
                .map(|(rate, none)| rate / none)
                .collect()
        };
        table.row(&[
            (*name).into(),
            format!("{:.0}", report::median(&loaded)),
            format!("{:.0}", report::median(&elsewhere)),
            format!("{:.0}", report::median(&none)),
            ratio(&over_none(&loaded)),
            ratio(&over_none(&elsewhere)),
        ]);
        json_rows.push(json!({
            "what": name,
            "loaded": report::median(&loaded),
            "loaded_at_empty_cgroup": report::median(&elsewhere),
            "none": report::median(&none),
            "loaded_over_none": report::median(&over_none(&loaded)),
            "loaded_at_empty_cgroup_over_none": report::median(&over_none(&elsewhere)),
        }));
    }
    table.note(format!(
        "{} rounds; connections at concurrency {} to a pod, unconnected `sendto` from one socket. \
         At an empty cgroup, weir's programs never run for the measured processes: the kernel's \
         own cost of a hook attached anywhere on the node.",
        plan.rounds, plan.concurrency
    ));
    table.json = json!({ "rows": json_rows });
    Ok(table)
}
