//! Enrollment: one pod's redirection put in place by weir's datapath, against istio's iptables
//! route and the kernel floor, and where weir's time goes (its step timers, the hand-off alone).

use std::time::Duration;

use anyhow::{bail, Result};
use prometheus_client::registry::Registry;
use serde_json::json;
use weir_agent::datapath::Datapath;
use weir_agent::workload::PodOptions;
use weir_tests::{istio_iptables, Pod};

use crate::report::{self, micros, ratio, Samples, Table};
use crate::{floor, timed};

/// Enrollment: one pod's redirection put in place, weir's datapath (one long-lived process,
/// awaited on `runtime` as the agent does) against istio's route (`iptables-restore` v4 and v6
/// plus policy routing in the pod) and against the kernel floor ([`floor::KernelFloor`]), a pod
/// of each at a time, each variant going first in turn.
pub fn enrollment(
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
                1 => timed(|| {
                    istio_iptables::apply(iptables_pod.netns(), istio_iptables::Backend::Nft)
                })?,
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
         cookie, the reply-mark sysctls, the return path, the ingress qdisc and a cls_bpf filter \
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
pub fn handoff_round_trips(
    datapath: &Datapath,
    runtime: &tokio::runtime::Runtime,
) -> Result<Samples> {
    (0..HANDOFF_ROUND_TRIPS)
        .map(|_| timed(|| runtime.block_on(datapath.enrolled())))
        .collect()
}

const HANDOFF_ROUND_TRIPS: usize = 1000;

/// The steps of one enrollment, as the datapath's own `weir_enroll_step_seconds` histograms
/// timed them over the enrollment section: mean per pod, what is left of weir's median
/// (`total`) besides them, and the hand-off timed alone (`handoff`).
pub fn enrollment_steps(metrics: &Registry, total: Duration, handoff: &Samples) -> Result<Table> {
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
    for step in ENROLL_STEPS {
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
         rules and routes, one round trip; tc: a qdisc and a rule dump, then the ingress qdisc and \
         cls_bpf filter per interface in one round trip (a qdisc made on an interface that is up waits out an expedited RCU grace \
         period); finish: following the pod, recording it, leaving its netns."
    ));
    table.json = json!({ "steps": json_steps, "handoff": handoff.json() });
    Ok(table)
}

/// The datapath's enrollment steps, in order (`weir_enroll_step_seconds{step}`).
pub const ENROLL_STEPS: [&str; 7] = [
    "netns",
    "interfaces",
    "sysctls",
    "maps",
    "routing",
    "tc",
    "finish",
];
