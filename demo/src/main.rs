//! `cargo xtask demo`: weir's main job on a throwaway node, told in plain words.
//!
//! A node (a network namespace with a bridge, and a CNI config directory the way the primary CNI
//! wrote it), the real weir-agent (which installs weir-cni into that config), a ztunnel stand-in
//! connected over ZDS, and pods made by running the node's CNI chain as a container runtime does.
//! Everything is removed at the end, also on Ctrl-C.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::Command,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::{bail, Context, Result};
use weir_agent::policy::{
    local::{LocalPolicy, ObjectMeta},
    DATAPLANE_MODE_LABEL,
};
use weir_common::{DNS_PROXY_PORT, INBOUND_PORT, OUTBOUND_PORT, PROBE_SOURCE_V4};
use weir_tests::{
    agent::{Agent, NodeFiles},
    tcp_request, udp_request_connected,
    zds_client::ZdsZtunnel,
    EchoServer, Pod, PodSpec, TestNode,
};

const WAIT: Duration = Duration::from_secs(3);
const APP_PORT: u16 = 8080;

fn main() {
    let interrupted = Arc::new(AtomicBool::new(false));
    watch_for_ctrl_c(interrupted.clone());
    if let Err(error) = demo(&interrupted) {
        eprintln!("\ndemo failed: {error:#}");
        std::process::exit(1);
    }
}

/// Ctrl-C ends the demo at the next step; what was built is then torn down by the owners' Drop.
fn watch_for_ctrl_c(interrupted: Arc<AtomicBool>) {
    use nix::sys::signal::{SigSet, Signal};
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block().expect("blocking SIGINT");
    std::thread::spawn(move || {
        if signals.wait().is_ok() {
            eprintln!("\ninterrupted: cleaning up...");
            interrupted.store(true, Ordering::SeqCst);
        }
    });
}

struct Narrator<'a> {
    interrupted: &'a AtomicBool,
}

impl Narrator<'_> {
    fn step(&self, title: &str) -> Result<()> {
        if self.interrupted.load(Ordering::SeqCst) {
            bail!("interrupted");
        }
        println!("\n==> {title}");
        Ok(())
    }

    fn say(&self, line: impl AsRef<str>) {
        println!("    {}", line.as_ref());
    }
}

fn demo(interrupted: &AtomicBool) -> Result<()> {
    if !weir_tests::require_privileges() {
        bail!("the demo needs root: it makes network namespaces and loads eBPF programs");
    }
    let n = Narrator { interrupted };
    n.step("A throwaway node")?;
    let files = NodeFiles::new()?;
    let mut policy = LocalPolicy::default();
    policy.namespaces.insert(
        "bookinfo".into(),
        ObjectMeta {
            labels: BTreeMap::from([(DATAPLANE_MODE_LABEL.into(), "ambient".into())]),
            ..ObjectMeta::default()
        },
    );
    files.write_policy(&policy)?;
    let node = TestNode::with_options(files.node_options())?;
    n.say(format!(
        "network namespace {} with bridge cni0 ({}/24, {}/64)",
        node.netns().name(),
        node.gateway_v4(),
        node.gateway_v6()
    ));
    let conflist = files.net_dir().join("10-weir-test.conflist");
    n.say(format!(
        "CNI config as the primary CNI wrote it: {}",
        conflist.display()
    ));
    n.say(format!("  plugins: {}", plugin_types(&conflist)?));
    n.say("ambient policy: namespace `bookinfo` is labelled istio.io/dataplane-mode=ambient");

    n.step("Starting weir-agent")?;
    let mut config = files.agent_config(node.netns())?;
    config.uninstall_on_exit = true;
    let agent = Agent::start(config)?;
    n.say(format!(
        "eBPF programs loaded once, cgroup hooks pinned under {}",
        agent.config.datapath.pin_root.display()
    ));
    n.say(format!(
        "installer: weir-cni copied to {}",
        files.bin_dir().display()
    ));
    n.say(format!("  plugins now: {}", plugin_types(&conflist)?));
    n.say(format!(
        "ready: /readyz on {}, metrics on {}/metrics",
        agent.config.health_addr, agent.config.metrics_addr
    ));

    n.step("ztunnel connects over ZDS")?;
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket)?;
    n.say(format!(
        "{} (the stand-in follows ztunnel's in-pod contract)",
        agent.config.zds_socket.display()
    ));

    n.step("The runtime creates pods through the node's CNI chain (bridge → weir-cni)")?;
    let reviews = pod(&node, "bookinfo", "reviews")?;
    n.say(format!(
        "bookinfo/reviews  {}  ambient: enrolled",
        addresses(&reviews)
    ));
    let legacy = pod(&node, "default", "legacy")?;
    n.say(format!(
        "default/legacy    {}  not ambient: passed through",
        addresses(&legacy)
    ));
    let stand_in = ztunnel
        .wait_for_pod(reviews.uid(), WAIT)
        .context("ztunnel never got the ambient pod")?;
    n.say("ztunnel received bookinfo/reviews' netns (ZDS Add + fd), acked, and listens in it");
    let reviews_app = EchoServer::start(
        reviews.netns(),
        "reviews",
        (IpAddr::from([0u8; 16]), APP_PORT).into(),
    )?;
    let legacy_app = EchoServer::start(
        legacy.netns(),
        "legacy",
        (IpAddr::from([0u8; 16]), APP_PORT).into(),
    )?;

    n.step("Traffic")?;
    let to_legacy = SocketAddr::new(IpAddr::V4(legacy.ipv4()), APP_PORT);
    let reply = reviews.run(|| tcp_request(to_legacy, "hello"))?;
    let seen = stand_in
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .context("outbound did not reach ztunnel")?;
    n.say(format!(
        "reviews → legacy {to_legacy}: through ztunnel :{OUTBOUND_PORT}, SO_ORIGINAL_DST = {}",
        seen.original_dst.map_or("none".into(), |a| a.to_string())
    ));
    n.say(format!(
        "  the app sees its peer as {} and got {:?}",
        reply.peer_seen_by_client, reply.response
    ));
    let to_reviews = SocketAddr::new(IpAddr::V4(reviews.ipv4()), APP_PORT);
    let reply = legacy.run(|| tcp_request(to_reviews, "hi"))?;
    let seen = stand_in
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .context("inbound did not reach ztunnel")?;
    let received = reviews_app
        .wait_for(|r| r.line == "hi", WAIT)
        .context("the app never got the inbound request")?;
    n.say(format!(
        "legacy → reviews {to_reviews}: through ztunnel :{INBOUND_PORT} (its local address {} is the original destination)",
        seen.local
    ));
    n.say(format!(
        "  the app saw the client as {} (source kept), and the reply came back: {:?}",
        received.peer.ip(),
        reply.response
    ));
    let reply = node.run(|| tcp_request(to_reviews, "probe"))?;
    let probe = reviews_app
        .wait_for(|r| r.line == "probe", WAIT)
        .context("probe")?;
    n.say(format!(
        "node (a kubelet probe) → reviews: straight to the app, from {} (istio's probe source {}), reply {:?}",
        probe.peer.ip(),
        Ipv4Addr::from(PROBE_SOURCE_V4),
        reply.response
    ));
    let resolver = SocketAddr::new(IpAddr::V4(node.gateway_v4()), 53);
    let answer = reviews.run(|| udp_request_connected(resolver, "example.com?"))?;
    n.say(format!(
        "reviews DNS → {resolver}: answered by ztunnel's DNS proxy (:{DNS_PROXY_PORT}), and appears to come from {}",
        answer.from
    ));
    let reply = legacy.run(|| {
        tcp_request(
            SocketAddr::new(IpAddr::V4(legacy.ipv4()), APP_PORT),
            "local",
        )
    })?;
    n.say(format!(
        "legacy → itself: direct ({:?}); plain pods are untouched",
        reply.response
    ));
    drop(legacy_app);

    n.step("Per-pod counters (POD_COUNTERS, summed over CPUs)")?;
    let counters = agent
        .config
        .datapath
        .pin_root
        .join(format!("abi-{}/POD_COUNTERS", weir_common::ABI_VERSION));
    let output = Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&counters)
        .output()?;
    let entries: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let reviews_cookie = reviews.netns().cookie()?;
    // With BTF, bpftool's JSON carries the typed entry under "formatted".
    for entry in entries
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| &e["formatted"])
    {
        let sum = |field: &str| -> u64 {
            entry["values"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|cpu| cpu["value"][field].as_u64().unwrap_or(0))
                .sum()
        };
        let pod = if entry["key"].as_u64() == Some(reviews_cookie) {
            "bookinfo/reviews"
        } else {
            "?"
        };
        n.say(format!(
            "{pod}: outbound {}, inbound {}, dns {}, bypassed {}, dropped {}",
            sum("outbound"),
            sum("inbound"),
            sum("dns"),
            sum("bypassed"),
            sum("dropped")
        ));
    }

    n.step("What the datapath holds (bpftool)")?;
    let maps = agent
        .config
        .datapath
        .pin_root
        .join(format!("abi-{}", weir_common::ABI_VERSION));
    for map in ["PODS", "POD_COUNTERS"] {
        let path = maps.join(map);
        n.say(format!("$ bpftool map dump pinned {}", path.display()));
        let output = Command::new("bpftool")
            .args(["map", "dump", "pinned"])
            .arg(&path)
            .output()?;
        for line in String::from_utf8_lossy(&output.stdout).lines().take(40) {
            n.say(format!("  {line}"));
        }
    }

    n.step(
        "Cleaning up: CNI DEL for every pod, weir-cni removed from the conflist, datapath unpinned",
    )?;
    drop((reviews, legacy));
    agent.stop()?;
    n.say(format!("  plugins now: {}", plugin_types(&conflist)?));
    drop(node);
    n.say("done");
    Ok(())
}

fn pod(node: &TestNode, namespace: &str, name: &str) -> Result<Pod> {
    node.add_pod_with(PodSpec {
        namespace: namespace.into(),
        ..PodSpec::new(name)
    })
}

fn addresses(pod: &Pod) -> String {
    format!("{} {}", pod.ipv4(), pod.ipv6())
}

fn plugin_types(conflist: &std::path::Path) -> Result<String> {
    let list: serde_json::Value = serde_json::from_slice(&std::fs::read(conflist)?)?;
    Ok(list["plugins"]
        .as_array()
        .map(|plugins| {
            plugins
                .iter()
                .map(|p| p["type"].as_str().unwrap_or("?").to_owned())
                .collect::<Vec<_>>()
                .join(" → ")
        })
        .unwrap_or_default())
}
