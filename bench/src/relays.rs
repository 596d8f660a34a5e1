//! The connection path sections' shared part (the ambient and the sidecar one): the ways a
//! connection is made through a relay in the app's pod, one turn of a way, and the table of
//! their rates and ratios.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use serde_json::json;
use weir_tests::Pod;

use crate::load::{self, Proxy};
use crate::report::{self, micros, ratio, Samples, Table};
use crate::Plan;

/// One way of a connection path section: its name, the pod its app runs in, where that connects.
pub type Variant<'a> = (&'static str, &'a Pod, SocketAddr);

/// The rate ratios between the ways [`through_relays`] gives: names, and the variants' indexes.
pub const RELAY_RATIOS: [(&str, usize, usize); 3] = [
    ("weir / straight to the relay", 0, 2),
    ("weir / iptables", 0, 1),
    ("iptables / straight to the relay", 1, 2),
];

/// The four ways of a connection path section, from the app in a pod redirected by weir, in one
/// redirected by istio's iptables rules, straight to the relay of a plain pod (podIP:15001: the
/// limit of any redirect) and from that pod to `app` with no proxy; `proxy`'s relay runs in each
/// pod until the pools returned are dropped.
pub fn through_relays<'a>(
    weir_pod: &'a Pod,
    iptables_pod: &'a Pod,
    plain: &'a Pod,
    app: SocketAddr,
    proxy: Proxy,
) -> Result<(Vec<Variant<'a>>, Vec<load::Pool>)> {
    let pods = [weir_pod, iptables_pod, plain];
    for pod in pods {
        // The relay closes first toward the app, so TIME_WAITs pile up on podIP:15001; reuse
        // keeps the app's port search short in every variant alike.
        pod.netns().sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    }
    let relays = pods
        .map(|pod| load::relay(pod.netns(), app, proxy))
        .into_iter()
        .collect::<Result<_, _>>()?;
    let straight = SocketAddr::new(plain.ipv4().into(), weir_common::OUTBOUND_PORT);
    let variants = vec![
        ("weir redirect", weir_pod, app),
        ("iptables REDIRECT", iptables_pod, app),
        ("straight to the relay", plain, straight),
        ("no proxy", plain, app),
    ];
    Ok((variants, relays))
}

/// One turn of a variant: short connections at `plan.concurrency` from its pod.
pub fn connect(&(name, pod, target): &Variant, plan: &Plan) -> Result<load::Run> {
    pod.run(|| load::connections(target, plan.concurrency, plan.turn))
        .with_context(|| format!("connections: {name}"))
}

/// A connection path section's table: each variant's median rate and latencies over `rounds`,
/// then the median of the rounds' rate ratios for `pairs` (names and the variants' indexes).
pub fn connection_table(
    section: &str,
    variants: &[Variant],
    rounds: &[Vec<load::Run>],
    pairs: &[(&str, usize, usize)],
    plan: &Plan,
) -> Table {
    let mut table = Table::new(
        &format!(
            "{section}: short TCP connections at concurrency {}",
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
    let mut json_ratios = Vec::new();
    for &(name, a, b) in pairs {
        let ratios: Vec<f64> = rounds
            .iter()
            .map(|round| round[a].rate / round[b].rate)
            .collect();
        table.row(&[
            format!("rate {name} (rounds)"),
            ratio(&ratios),
            "".into(),
            "".into(),
        ]);
        json_ratios.push(json!({"pair": name, "median": report::median(&ratios)}));
    }
    table.json = json!({
        "concurrency": plan.concurrency,
        "rounds": plan.rounds,
        "variants": json_variants,
        "ratios": json_ratios,
    });
    table
}
