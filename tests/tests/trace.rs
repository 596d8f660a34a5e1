//! `weir-agent trace` as an operator runs it next to a live agent: every kind of decision the
//! programs make for an enrolled pod shows up once, with the pod's name, the tuple and the
//! verdict; several readers trace at once, each with its filters; tracing is off again once the
//! last reader leaves. And the per-pod series on `/metrics`, gone with the pod, and the node's
//! drops and refusals by reason.
//!
//! Needs privileges and the built `weir-agent` (`cargo build -p weir-agent`).
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use serde_json::{json, Value};
use weir_common::{DNS_PORT, DNS_PROXY_PORT, INBOUND_PORT, OUTBOUND_PORT};
use weir_tests::{
    chain::{CniChainNode, MESH, WAIT},
    privileged, raw, tcp_request,
    trace_reader::{matches, tracing_on, wait_until_tracing, Reader},
    udp_request, wait_until, EchoServer, Metrics, APP_PORT,
};

fn at(ip: Ipv4Addr, port: u16) -> String {
    SocketAddr::new(IpAddr::V4(ip), port).to_string()
}

#[test]
fn each_decision_is_traced_with_its_pod_tuple_and_verdict() {
    let node = privileged!(CniChainNode::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, _echo, client, _stand_in) = node.server_and_ambient_pod(&ztunnel, "client");
    let _client_app = EchoServer::app(&client).unwrap();
    assert!(!tracing_on(&node), "tracing is off with no reader");

    let everything = Reader::start(&agent, &[]);
    let inbound_only = Reader::start(&agent, &["--pod", "mesh/client", "--verdict", "inbound"]);
    wait_until_tracing(&node, true);
    // Both readers are connected once each has a record: the switch turns on at the first.
    let to_server = SocketAddr::new(IpAddr::V4(server.ipv4()), APP_PORT);
    let to_client = SocketAddr::new(IpAddr::V4(client.ipv4()), APP_PORT);
    wait_until(WAIT, "a record for each reader", || {
        server.run(|| tcp_request(to_client, "in")).unwrap();
        !everything.lines().is_empty() && !inbound_only.lines().is_empty()
    });

    client.run(|| tcp_request(to_server, "out")).unwrap();
    let resolver = SocketAddr::new(IpAddr::V4(node.test_node().gateway_v4()), DNS_PORT);
    client.run(|| udp_request(resolver, "query")).unwrap();
    let probe = node.test_node().run(|| tcp_request(to_client, "probe"));
    assert!(probe.is_ok(), "the node's probe is answered: {probe:?}");
    let fragmented_syn = raw::Syn {
        source: SocketAddr::new(IpAddr::V4(server.ipv4()), 41001),
        destination: to_client,
        shape: raw::Fragmented(8),
        tcp: raw::Tcp::SYN,
    };
    server
        .run(|| raw::probe(&[fragmented_syn], Duration::from_millis(300)))
        .unwrap();

    let pod = json!({"namespace": MESH, "pod": "client"});
    let with_pod = |fields: Value| {
        let mut wanted = pod.clone();
        wanted
            .as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        wanted
    };
    let outbound = everything.wait_for(&with_pod(json!({
        "verdict": "outbound", "hook": "connect", "protocol": "tcp",
        "destination": to_server.to_string(),
    })));
    assert_eq!(outbound["source"], at(client.ipv4(), 0), "{outbound}");
    assert_eq!(
        outbound["target"],
        at(client.ipv4(), OUTBOUND_PORT),
        "{outbound}"
    );
    let dns = everything.wait_for(&with_pod(json!({
        "verdict": "dns", "hook": "sendmsg", "protocol": "udp",
        "destination": resolver.to_string(),
    })));
    assert_eq!(
        dns["target"],
        at(Ipv4Addr::LOCALHOST, DNS_PROXY_PORT),
        "{dns}"
    );
    let inbound = everything.wait_for(&with_pod(json!({
        "verdict": "inbound", "hook": "tc-ingress", "protocol": "tcp",
        "destination": to_client.to_string(),
    })));
    assert_eq!(
        inbound["source"]
            .as_str()
            .unwrap()
            .rsplit_once(':')
            .unwrap()
            .0,
        server.ipv4().to_string()
    );
    assert_eq!(
        inbound["target"],
        at(client.ipv4(), INBOUND_PORT),
        "{inbound}"
    );
    // ztunnel's SO_ORIGINAL_DST question for the outbound connection, answered.
    everything.wait_for(&with_pod(json!({
        "verdict": "original-dst", "hook": "getsockopt", "destination": to_server.to_string(),
    })));
    // The probe: bound to the probe source on the node, let in at the pod.
    for hook in ["connect", "tc-ingress"] {
        let probe = everything.wait_for(&with_pod(json!({
            "verdict": "probe-bypass", "hook": hook, "destination": to_client.to_string(),
        })));
        assert!(
            probe["source"]
                .as_str()
                .unwrap()
                .starts_with("169.254.7.127:"),
            "{probe}"
        );
    }
    let dropped = everything.wait_for(&with_pod(json!({
        "verdict": "drop-fragment", "hook": "tc-ingress",
        "source": at(server.ipv4(), 41001), "destination": to_client.to_string(),
    })));
    assert_eq!(dropped["target"], Value::Null, "{dropped}");

    // The filtered reader saw only what it asked for, the same decisions as the other. Either
    // reader's subscription may have begun during the loop above, so from the first line both
    // saw on, the filtered reader's lines are all the other's.
    let filtered = inbound_only.lines();
    let all = everything.lines();
    let first_shared = filtered
        .iter()
        .position(|line| all.contains(line))
        .unwrap_or_else(|| panic!("the readers share no line: {filtered:?} and {all:?}"));
    for line in &filtered[first_shared..] {
        assert!(all.contains(line), "{line} in {all:?}");
    }
    for line in &filtered {
        assert!(
            matches(line, &with_pod(json!({"verdict": "inbound"}))),
            "{line}"
        );
    }

    everything.interrupt();
    assert!(tracing_on(&node), "one reader is still tracing");
    inbound_only.interrupt();
    wait_until_tracing(&node, false);
    agent.stop().unwrap();
}

#[test]
fn each_enrolled_pod_has_its_series_until_it_leaves() {
    let node = privileged!(CniChainNode::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, _echo, client, _stand_in) = node.server_and_ambient_pod(&ztunnel, "client");
    let to_server = SocketAddr::new(IpAddr::V4(server.ipv4()), APP_PORT);
    client.run(|| tcp_request(to_server, "out")).unwrap();

    let pod_series = |metrics: &Metrics| {
        metrics
            .to_string()
            .lines()
            .filter(|line| line.starts_with("weir_pod_"))
            .count()
    };
    let metrics = agent.metrics();
    for (name, direction, value) in [
        ("weir_pod_redirected_total", Some("outbound"), 1.0),
        ("weir_pod_redirected_total", Some("inbound"), 0.0),
        ("weir_pod_redirected_total", Some("dns"), 0.0),
        ("weir_pod_bypassed_total", None, 0.0),
        ("weir_pod_dropped_total", None, 0.0),
    ] {
        let mut labels = vec![("namespace", MESH), ("pod", "client")];
        labels.extend(direction.map(|direction| ("direction", direction)));
        assert_eq!(
            metrics.value(name, &labels),
            Some(value),
            "{name}{labels:?} in\n{metrics}"
        );
    }
    assert_eq!(
        pod_series(&metrics),
        5,
        "one series per pod and direction, the plain server has none:\n{metrics}"
    );

    drop(client);
    wait_until(WAIT, "the deleted pod's series to go", || {
        pod_series(&agent.metrics()) == 0
    });
    agent.stop().unwrap();
}

#[test]
fn the_nodes_drops_and_refusals_are_counted_by_reason_with_no_reader() {
    let node = privileged!(CniChainNode::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, _echo, client, _stand_in) = node.server_and_ambient_pod(&ztunnel, "client");
    let _client_app = EchoServer::app(&client).unwrap();
    let count = |metrics: &Metrics, family: &str, reason: &str| {
        metrics
            .value(family, &[("reason", reason)])
            .unwrap_or_else(|| panic!("no {family}{{reason={reason}}} in\n{metrics}"))
    };
    let metrics = agent.metrics();
    for (family, reason) in [
        ("weir_drops_total", "drop-fragment"),
        ("weir_drops_total", "drop-no-proxy"),
        ("weir_refusals_total", "refuse-probe-address"),
        ("weir_refusals_total", "refuse-no-room"),
    ] {
        assert_eq!(count(&metrics, family, reason), 0.0, "{family} {reason}");
    }

    let to_client = SocketAddr::new(IpAddr::V4(client.ipv4()), APP_PORT);
    let fragmented_syn = raw::Syn {
        source: SocketAddr::new(IpAddr::V4(server.ipv4()), 41001),
        destination: to_client,
        shape: raw::Fragmented(8),
        tcp: raw::Tcp::SYN,
    };
    for _ in 0..2 {
        server
            .run(|| raw::probe(&[fragmented_syn], Duration::from_millis(100)))
            .unwrap();
    }
    let to_probe_source = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(169, 254, 7, 127)), APP_PORT);
    let refused = client
        .run(|| tcp_request(to_probe_source, "spoof"))
        .unwrap_err();
    assert!(!tracing_on(&node), "counted with tracing off");

    let metrics = agent.metrics();
    assert_eq!(count(&metrics, "weir_drops_total", "drop-fragment"), 2.0);
    assert_eq!(
        count(&metrics, "weir_refusals_total", "refuse-probe-address"),
        1.0,
        "the pod's connect to the probe source failed: {refused}"
    );
    assert_eq!(count(&metrics, "weir_drops_total", "drop-no-ztunnel"), 0.0);
    assert_eq!(
        count(&metrics, "weir_refusals_total", "refuse-no-address"),
        0.0
    );
    agent.stop().unwrap();
}
