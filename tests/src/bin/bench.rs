//! `cargo xtask bench`: weir's datapath against istio-cni's iptables rules, side by side in one
//! run on one node. The machines are noisy, so it reports medians and ratios, never absolutes
//! to compare across runs.
//!
//! - enroll: time to put one pod's redirection in place (weir: `Datapath::enroll`, one
//!   long-lived process; istio: `iptables-restore` v4+v6 plus policy routing in the pod).
//! - connect: one TCP request from an enrolled pod to another pod through the ztunnel stand-in,
//!   and the same from a pod with no redirection at all (the floor).
//! - conntrack: entries the pod's netns holds after the connections (weir keeps none).
use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use weir_agent::{datapath::Datapath, workload::PodOptions};
use weir_tests::{istio_iptables, tcp_request, EchoServer, Pod, TestNode, ZtunnelStandIn};

const PODS: usize = 40;
const CONNECTIONS: usize = 400;
const APP_PORT: u16 = 8080;

fn main() -> Result<()> {
    if !weir_tests::require_privileges() {
        anyhow::bail!("the benchmark needs root");
    }
    let node = TestNode::new()?;
    println!(
        "making {} pods with the CNI reference plugins...",
        2 * PODS + 2
    );
    let weir_pods = pods(&node, "w")?;
    let iptables_pods = pods(&node, "i")?;
    let server = node.add_pod("server")?;
    let plain = node.add_pod("plain")?;
    let echo = EchoServer::start(server.netns(), "server", (server.ipv4(), APP_PORT).into())?;

    let config = node.datapath_config();
    let maps = config
        .pin_root
        .join(format!("abi-{}", weir_common::ABI_VERSION));
    let datapath = Datapath::start(config)?;
    let result = compare(&datapath, &maps, &weir_pods, &iptables_pods, &plain, &echo);
    datapath.uninstall()?;
    result
}

fn compare(
    datapath: &Datapath,
    maps: &std::path::Path,
    weir_pods: &[Pod],
    iptables_pods: &[Pod],
    plain: &Pod,
    echo: &EchoServer,
) -> Result<()> {
    let weir_enroll = timed(weir_pods, |pod| {
        datapath
            .enroll(pod.workload(PodOptions::default()))
            .map(drop)
    })?;
    let iptables_enroll = timed(iptables_pods, |pod| istio_iptables::apply(pod.netns()))?;

    let target = echo.addr();
    let weir_client = &weir_pods[0];
    let iptables_client = &iptables_pods[0];
    let _weir_ztunnel = ZtunnelStandIn::start(weir_client)?;
    let _iptables_ztunnel = ZtunnelStandIn::start(iptables_client)?;
    let weir_connect = connections(weir_client, target)?;
    let iptables_connect = connections(iptables_client, target)?;
    let direct_connect = connections(plain, target)?;

    let memory = map_memory(maps);
    let weir_unenroll = timed(&weir_pods[1..], |pod| {
        datapath.unenroll(pod.uid()).map(drop)
    })?;

    println!();
    println!(
        "{:<34} {:>12} {:>12} {:>14}",
        "median (p90)", "weir", "iptables", "iptables/weir"
    );
    row("enroll one pod", &weir_enroll, &iptables_enroll);
    row(
        "TCP request via ztunnel stand-in",
        &weir_connect,
        &iptables_connect,
    );
    println!(
        "{:<34} {:>12}  (no redirection, no proxy)",
        "TCP request, direct",
        show(&direct_connect)
    );
    println!(
        "{:<34} {:>12}",
        "unenroll one pod (weir)",
        show(&weir_unenroll)
    );
    println!(
        "{:<34} {:>12} {:>12}",
        "conntrack entries in the pod",
        conntrack_count(weir_client),
        conntrack_count(iptables_client)
    );
    println!(
        "{:<34} {:>12}  (all maps with {PODS} pods enrolled; bpftool's bytes_memlock)",
        "kernel memory of weir's maps",
        memory.map_or("-".into(), |bytes| format!(
            "{:.1}MiB",
            bytes as f64 / 1048576.0
        ))
    );
    println!(
        "\n{PODS} pods enrolled each way, {CONNECTIONS} requests each; medians over the samples."
    );
    Ok(())
}

fn pods(node: &TestNode, prefix: &str) -> Result<Vec<Pod>> {
    (0..PODS)
        .map(|i| node.add_pod(&format!("{prefix}{i}")))
        .collect()
}

fn timed(pods: &[Pod], mut step: impl FnMut(&Pod) -> Result<()>) -> Result<Vec<Duration>> {
    pods.iter()
        .map(|pod| {
            let start = Instant::now();
            step(pod).with_context(|| format!("pod {}", pod.name()))?;
            Ok(start.elapsed())
        })
        .collect()
}

fn connections(client: &Pod, target: SocketAddr) -> Result<Vec<Duration>> {
    client.run(|| {
        (0..CONNECTIONS)
            .map(|_| {
                let start = Instant::now();
                tcp_request(target, "bench").context("request")?;
                Ok(start.elapsed())
            })
            .collect()
    })
}

/// Median and 90th percentile.
fn stats(samples: &[Duration]) -> (Duration, Duration) {
    let mut sorted = samples.to_vec();
    sorted.sort();
    (sorted[sorted.len() / 2], sorted[sorted.len() * 9 / 10])
}

fn show(samples: &[Duration]) -> String {
    let (median, p90) = stats(samples);
    format!("{} ({})", micros(median), micros(p90))
}

fn micros(duration: Duration) -> String {
    format!("{}µs", duration.as_micros())
}

fn row(name: &str, weir: &[Duration], iptables: &[Duration]) {
    let ratio = stats(iptables).0.as_secs_f64() / stats(weir).0.as_secs_f64();
    println!(
        "{name:<34} {:>12} {:>12} {:>13.1}x",
        show(weir),
        show(iptables),
        ratio
    );
}

/// Sum of `bytes_memlock` over the pinned maps in `dir`, as bpftool reports them.
fn map_memory(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let output = std::process::Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(entry?.path())
            .output()?;
        let info: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        total += info["bytes_memlock"].as_u64().unwrap_or(0);
    }
    Ok(total)
}

/// The pod's conntrack table size (`-` when conntrack is not loaded in the kernel at all).
fn conntrack_count(pod: &Pod) -> String {
    pod.run(|| std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count"))
        .map(|count| count.trim().to_owned())
        .unwrap_or_else(|_| "-".into())
}
