//! Sidecar pods, on the in-process sections' node and datapath: a pod whose traffic goes to its
//! own istio-proxy, redirected by weir's datapath against istio-init's default iptables rules
//! ([`istio_iptables::apply_sidecar`]), for its enrollment and its connection path.

use std::net::SocketAddr;

use anyhow::Result;
use serde_json::json;
use weir_agent::datapath::Datapath;
use weir_agent::workload::{PodOptions, SidecarRedirect, Workload};
use weir_tests::{istio_iptables, Pod, TestNode};

use crate::load::Proxy;
use crate::pods::{make_pods, remove_pods};
use crate::relays::{connect, connection_table, through_relays, RELAY_RATIOS};
use crate::report::{self, ratio, Samples, Table};
use crate::{alternating_rounds, timed, Plan};

const WEIR: usize = 0;
const IPTABLES: usize = 1;

/// The sidecar sections' tables: `plan.enroll_pairs` sidecar pods enrolled each way, then the
/// connection path from the first of each (and from a pod of its own with no redirection) to the
/// server's `app`.
pub fn measure(
    datapath: &Datapath,
    runtime: &tokio::runtime::Runtime,
    node: &TestNode,
    app: SocketAddr,
    plan: &Plan,
) -> Result<[Table; 2]> {
    println!("sidecar enrollment, weir against istio-init's iptables rules...");
    let weir_pods = make_pods(node, "sw", plan.enroll_pairs)?;
    let iptables_pods = make_pods(node, "si", plan.enroll_pairs)?;
    let enrolled = enrollment(datapath, runtime, &weir_pods, &iptables_pods)?;
    println!("sidecar connection path...");
    let plain = node.add_pod("sidecar-plain")?;
    let (weir_pod, iptables_pod) = (&weir_pods[0], &iptables_pods[0]);
    let connections = connection_path(weir_pod, iptables_pod, &plain, app, plan)?;
    datapath.unenroll(weir_pod.uid()).wait()?;
    remove_pods(weir_pods.into_iter().chain(iptables_pods).collect());
    Ok([enrolled, connections])
}

/// What weir is handed for a sidecar pod with istio's injected defaults.
fn sidecar_workload(pod: &Pod) -> Workload {
    Workload {
        sidecar: Some(SidecarRedirect::default()),
        ..pod.workload(PodOptions::default())
    }
}

/// One sidecar pod's redirection put in place, weir's datapath (awaited on `runtime` as the agent
/// does) against istio-init's rules, a pod of each at a time, each going first in turn. The
/// first weir pod stays enrolled; the others are unenrolled, timed.
fn enrollment(
    datapath: &Datapath,
    runtime: &tokio::runtime::Runtime,
    weir_pods: &[Pod],
    iptables_pods: &[Pod],
) -> Result<Table> {
    let (mut weir_next, mut iptables_next) = (weir_pods.iter(), iptables_pods.iter());
    let pairs = alternating_rounds(2, weir_pods.len().min(iptables_pods.len()), |variant| {
        if variant == WEIR {
            let pod = weir_next.next().expect("a weir pod per pair");
            timed(|| runtime.block_on(datapath.enroll(sidecar_workload(pod))))
        } else {
            let pod = iptables_next.next().expect("an iptables pod per pair");
            timed(|| istio_iptables::apply_sidecar(pod.netns()))
        }
    })?;
    let of = |variant: usize| -> Samples { pairs.iter().map(|pair| pair[variant]).collect() };
    let (weir, iptables) = (of(WEIR), of(IPTABLES));
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|pair| pair[IPTABLES].as_secs_f64() / pair[WEIR].as_secs_f64())
        .collect();
    let unenroll = weir_pods[1..]
        .iter()
        .map(|pod| timed(|| datapath.unenroll(pod.uid()).wait()))
        .collect::<Result<Samples>>()?;

    let mut table = Table::new(
        "Sidecar enrollment: one sidecar pod's redirection",
        &["", "weir", "istio-init's iptables", "iptables/weir (pairs)"],
    );
    let enroll = [
        "enroll, median (p99)".into(),
        weir.show(),
        iptables.show(),
        ratio(&ratios),
    ];
    table.row(&enroll);
    let unenrolled = [
        "unenroll, median (p99)".into(),
        unenroll.show(),
        "-".into(),
        "-".into(),
    ];
    table.row(&unenrolled);
    table.note(format!(
        "{} pods each way, a pair at a time, the first of each pair alternating. weir: \
         `Datapath::enroll` of a sidecar pod with istio's injected defaults, in one long-lived \
         process, awaited on a tokio runtime as the agent does; istio-init's iptables: its \
         default sidecar rule set (REDIRECT, proxy uid and gid 1337, every outbound range and \
         inbound port but the proxy's own), IPv4 only as for a pod whose first address is IPv4, \
         through `iptables-restore --noflush` in the pod. istio-init runs as an init container \
         (istio-cni's sidecar mode, from its plugin): neither's process start is counted.",
        pairs.len()
    ));
    table.json = json!({
        "pods": pairs.len(),
        "weir_enroll": weir.json(),
        "iptables_enroll": iptables.json(),
        "iptables_over_weir": report::median(&ratios),
        "weir_unenroll": unenroll.json(),
    });
    Ok(table)
}

/// Short connections at `plan.concurrency` from the app in a sidecar pod to the server, through
/// a minimal stand-in for its istio-proxy's 15001, four ways, each round in another order.
fn connection_path(
    weir_pod: &Pod,
    iptables_pod: &Pod,
    plain: &Pod,
    app: SocketAddr,
    plan: &Plan,
) -> Result<Table> {
    let (variants, _relays) = through_relays(weir_pod, iptables_pod, plain, app, Proxy::Sidecar)?;
    let rounds = alternating_rounds(variants.len(), plan.rounds, |variant| {
        connect(&variants[variant], plan)
    })?;
    let mut table = connection_table(
        "Sidecar connection path",
        &variants,
        &rounds,
        &RELAY_RATIOS,
        plan,
    );
    table.note(format!(
        "{} rounds of {:?} per variant, order rotated each round. The relay stands for Envoy's \
         virtualOutbound: a plain dual-stack listener on the pod's 15001 that reads \
         SO_ORIGINAL_DST and dials as the proxy's uid and gid (1337), the identity both weir and \
         the iptables rules exempt. weir: the pod enrolled as a sidecar pod; iptables REDIRECT: \
         istio-init's default rule set; 'straight to the relay': a pod without redirection whose \
         app connects to its own relay at podIP:15001 (the limit of any redirect); no proxy: \
         that pod's app straight to the server.",
        plan.rounds, plan.turn
    ));
    Ok(table)
}
