//! `weir-agent explain` as an operator runs it next to a live agent: for ambient and sidecar
//! pods with a few annotations, the verdict it predicts for a connection is the one
//! `weir-agent trace` then records for that connection, with the same target.
//!
//! Needs the built `weir-agent` (`cargo build -p weir-agent`), and privileges but for the API
//! server's part.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    process::Command,
};

use k8s_openapi::{
    api::core::v1::{Namespace, Pod as K8sPod},
    apimachinery::pkg::apis::meta::v1::ObjectMeta as K8sMeta,
};
use serde_json::{json, Value};
use weir_agent::policy::{local::ObjectMeta, DATAPLANE_MODE_LABEL};
use weir_common::{DNS_PORT, PROBE_SOURCE_V4};
use weir_tests::{
    agent::{workspace_binary, Agent, NodeFiles},
    chain::{ambient_policy, CniChainNode, MESH, WAIT},
    privileged,
    sidecar::{sidecar_pod, SidecarStandIn},
    tcp_request,
    trace_reader::{matches, wait_until_tracing, Reader},
    try_wait_until, udp_request, ApiServer, EchoServer, Pod, APP_PORT,
};

/// `weir-agent explain` on the agent's pins, state file and policy file, with `args`.
fn explain(node: &CniChainNode, agent: &Agent, args: &[&str]) -> (bool, String) {
    let output = Command::new(workspace_binary("weir-agent"))
        .arg("explain")
        .arg("--pin-root")
        .arg(&agent.config.datapath.pin_root)
        .arg("--state-file")
        .arg(&agent.config.state_file)
        .arg("--policy-file")
        .arg(node.files.policy_file())
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    if !output.status.success() {
        return (false, String::from_utf8_lossy(&output.stderr).into_owned());
    }
    (true, stdout)
}

/// `explain -o json` with `args`, parsed.
fn explained(node: &CniChainNode, agent: &Agent, args: &[&str]) -> Value {
    let (ok, output) = explain(node, agent, &[args, &["-o", "json"]].concat());
    assert!(ok, "weir-agent explain {args:?} failed: {output}");
    serde_json::from_str(&output).unwrap_or_else(|_| panic!("not JSON: {output}"))
}

/// The connection `explain` predicts for `pod` with `args`, then `connect` made while `trace`
/// records: the recorded decision for that connection has the predicted verdict and target.
fn predicted_is_recorded(
    node: &CniChainNode,
    agent: &Agent,
    trace: &Reader,
    pod: &Pod,
    args: &[&str],
    connect: impl FnOnce(),
) -> Value {
    let name = format!("{}/{}", pod.namespace(), pod.name());
    let explanation = explained(node, agent, &[&[name.as_str()], args].concat());
    let predicted = explanation["connection"].clone();
    assert!(
        predicted["verdict"].is_string(),
        "{args:?}: a recorded verdict is predicted: {explanation:#}"
    );
    connect();
    let wanted = json!({
        "namespace": pod.namespace(), "pod": pod.name(),
        "hook": predicted["hook"], "destination": predicted["destination"],
    });
    // Inbound records carry the sender's port, which the prediction cannot know: matched by
    // its address.
    let source_ip = (predicted["hook"] == "tc-ingress").then(|| address_of(&predicted["source"]));
    let recorded = try_wait_until(WAIT, || {
        trace.lines().into_iter().find(|line| {
            matches(line, &wanted)
                && source_ip
                    .as_ref()
                    .is_none_or(|ip| address_of(&line["source"]) == *ip)
        })
    })
    .unwrap_or_else(|| {
        panic!(
            "{args:?}: no record matching {wanted} in {:#?}",
            trace.lines()
        )
    });
    assert_eq!(
        (
            &recorded["verdict"],
            &recorded["target"],
            &recorded["protocol"]
        ),
        (
            &predicted["verdict"],
            &predicted["target"],
            &predicted["protocol"]
        ),
        "{args:?}: predicted {predicted:#}, recorded {recorded:#}"
    );
    predicted
}

/// The address of an `address:port` field.
fn address_of(endpoint: &Value) -> String {
    let endpoint: SocketAddr = endpoint.as_str().unwrap().parse().unwrap();
    endpoint.ip().to_string()
}

fn at(ip: impl Into<IpAddr>, port: u16) -> String {
    SocketAddr::new(ip.into(), port).to_string()
}

/// One datagram to `to`, not waiting for an answer.
fn send_datagram(to: SocketAddr) {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    socket.send_to(b"query", to).unwrap();
}

fn annotations(pairs: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        annotations: pairs
            .iter()
            .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
            .collect::<BTreeMap<_, _>>(),
        ..ObjectMeta::default()
    }
}

#[test]
fn what_explain_predicts_for_ambient_pods_is_what_trace_records() {
    let node = privileged!(CniChainNode::new());
    let mut policy = ambient_policy();
    policy.pods.insert(
        format!("{MESH}/bypass"),
        annotations(&[
            ("ambient.istio.io/bypass-inbound-capture", "true"),
            ("ambient.istio.io/dns-capture", "false"),
        ]),
    );
    node.files.write_policy(&policy).unwrap();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, _echo, client, _client_ztunnel) = node.server_and_ambient_pod(&ztunnel, "client");
    let (bypass, _bypass_ztunnel) = node.ambient_pod(&ztunnel, "bypass");
    let _client_app = EchoServer::app(&client).unwrap();
    let _bypass_app = EchoServer::app(&bypass).unwrap();
    let trace = Reader::start(&agent, &[]);
    wait_until_tracing(&node, true);

    let explanation = explained(&node, &agent, &[&format!("{MESH}/client")]);
    assert_eq!(
        (
            &explanation["enrolled"],
            &explanation["mode"],
            &explanation["status"]
        ),
        (&json!(true), &json!("ambient"), &json!("enabled")),
        "{explanation:#}"
    );
    assert_eq!(
        explanation["policy"]["decision"], "ambient",
        "{explanation:#}"
    );
    let bypass_options = explained(&node, &agent, &[&format!("{MESH}/bypass")])["options"].clone();
    assert_eq!(
        bypass_options,
        json!({"inbound_bypass": true, "dns_capture": false})
    );

    let server_app = server.app_v4().to_string();
    let resolver = SocketAddr::new(node.test_node().gateway_v4().into(), DNS_PORT);
    let own_app = client.app_v4().to_string();
    let server_ip = server.ipv4().to_string();
    let probe_source = Ipv4Addr::from(PROBE_SOURCE_V4).to_string();
    let app_port = APP_PORT.to_string();

    let outbound = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &client,
        &["--to", &server_app],
        || {
            client.run(|| tcp_request(server.app_v4(), "out")).unwrap();
        },
    );
    assert_eq!(
        (&outbound["verdict"], &outbound["target"]),
        (&json!("outbound"), &json!(at(client.ipv4(), 15001)))
    );
    let dns = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &client,
        &["--to", &resolver.to_string(), "--udp"],
        || {
            client.run(|| udp_request(resolver, "query")).unwrap();
        },
    );
    assert_eq!(dns["verdict"], "dns");
    let local = predicted_is_recorded(&node, &agent, &trace, &client, &["--to", &own_app], || {
        client.run(|| tcp_request(client.app_v4(), "self")).unwrap();
    });
    assert_eq!(local["verdict"], "pass-local");
    let inbound = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &client,
        &["--from", &server_ip, "--port", &app_port],
        || {
            server.run(|| tcp_request(client.app_v4(), "in")).unwrap();
        },
    );
    assert_eq!(inbound["verdict"], "inbound");
    let probe = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &client,
        &["--from", &probe_source, "--port", &app_port],
        || {
            node.test_node()
                .run(|| tcp_request(client.app_v4(), "probe"))
                .unwrap();
        },
    );
    assert_eq!(probe["verdict"], "probe-bypass");

    // The annotated pod: inbound is let through, and DNS is not captured.
    let bypassed = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &bypass,
        &["--from", &server_ip, "--port", &app_port],
        || {
            server.run(|| tcp_request(bypass.app_v4(), "in")).unwrap();
        },
    );
    assert_eq!(bypassed["verdict"], "pass-inbound-bypass");
    let uncaptured = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &bypass,
        &["--to", &resolver.to_string(), "--udp"],
        || bypass.run(|| send_datagram(resolver)),
    );
    assert_eq!(uncaptured["verdict"], "pass-uncaptured");

    trace.interrupt();
    agent.stop().unwrap();
}

#[test]
fn what_explain_predicts_for_a_sidecar_pod_is_what_trace_records() {
    let node = privileged!(CniChainNode::new());
    let gateway = node.test_node().gateway_v4();
    let mut policy = ambient_policy();
    let excluded_range = format!("{gateway}/32");
    let meta = sidecar_pod(
        &[
            ("traffic.sidecar.istio.io/excludeOutboundPorts", "9090"),
            (
                "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                &excluded_range,
            ),
            ("traffic.sidecar.istio.io/excludeInboundPorts", "15020,9091"),
        ],
        &[("ISTIO_META_DNS_CAPTURE", "true")],
    );
    policy.pods.insert("default/sidecar".into(), meta);
    node.files.write_policy(&policy).unwrap();
    let agent = node.start_agent();
    let server = node.pod("default", "server").unwrap();
    let _server_app = EchoServer::app(&server).unwrap();
    let pod = node.pod("default", "sidecar").unwrap();
    let _proxy = SidecarStandIn::start(&pod).unwrap();
    let _app = EchoServer::app(&pod).unwrap();
    let trace = Reader::start(&agent, &[]);
    wait_until_tracing(&node, true);

    let (ok, text) = explain(&node, &agent, &["default/sidecar"]);
    assert!(ok, "{text}");
    for line in [
        "default/sidecar: captured (sidecar)",
        "interception mode       REDIRECT",
        "inbound ports           all but 9091, 15020, 15021, 15090",
        "excluded outbound ports 9090",
        &format!("excluded ranges         {excluded_range}"),
        "policy file",
    ] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }

    let server_app = server.app_v4().to_string();
    let excluded_port = at(server.ipv4(), 9090);
    let excluded_address = at(gateway, APP_PORT);
    let resolver = SocketAddr::new(gateway.into(), DNS_PORT);
    let server_ip = server.ipv4().to_string();
    let app_port = APP_PORT.to_string();

    let outbound =
        predicted_is_recorded(&node, &agent, &trace, &pod, &["--to", &server_app], || {
            let _ = pod.run(|| tcp_request(server.app_v4(), "out"));
        });
    assert_eq!(
        (&outbound["verdict"], &outbound["target"]),
        (&json!("outbound"), &json!(at(pod.ipv4(), 15001)))
    );
    for (to, rule) in [
        (&excluded_port, "excludeOutboundPorts"),
        (&excluded_address, "excludeOutboundIPRanges"),
    ] {
        let to_addr: SocketAddr = to.parse().unwrap();
        let passed = predicted_is_recorded(&node, &agent, &trace, &pod, &["--to", to], || {
            let _ = pod.run(|| tcp_request(to_addr, "excluded"));
        });
        assert_eq!(passed["verdict"], "pass-excluded", "{passed:#}");
        assert!(
            passed["rule"].as_str().unwrap().contains(rule),
            "{passed:#}"
        );
    }
    let dns = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &pod,
        &["--to", &resolver.to_string()],
        || {
            let _ = pod.run(|| tcp_request(resolver, "query"));
        },
    );
    assert_eq!(
        (&dns["verdict"], &dns["target"]),
        (&json!("dns"), &json!(at(Ipv4Addr::LOCALHOST, 15053)))
    );
    let inbound = predicted_is_recorded(
        &node,
        &agent,
        &trace,
        &pod,
        &["--from", &server_ip, "--port", &app_port],
        || {
            server.run(|| tcp_request(pod.app_v4(), "in")).unwrap();
        },
    );
    assert_eq!(inbound["verdict"], "inbound");
    // An excluded inbound port is let through unrecorded: nothing for trace to show.
    let excluded_inbound = explained(
        &node,
        &agent,
        &["default/sidecar", "--from", &server_ip, "--port", "9091"],
    )["connection"]
        .clone();
    assert_eq!(
        excluded_inbound["verdict"],
        Value::Null,
        "{excluded_inbound:#}"
    );
    assert!(
        excluded_inbound["rule"]
            .as_str()
            .unwrap()
            .contains("excludeInboundPorts"),
        "{excluded_inbound:#}"
    );

    trace.interrupt();
    agent.stop().unwrap();
}

#[test]
fn a_pod_the_agent_does_not_hold_is_explained_as_not_captured() {
    let node = privileged!(CniChainNode::new());
    let agent = node.start_agent();
    let _plain = node.pod("default", "plain").unwrap();
    let explanation = explained(&node, &agent, &["default/plain", "--to", "10.0.0.1:80"]);
    assert_eq!(explanation["enrolled"], false, "{explanation:#}");
    assert_eq!(explanation["connection"], Value::Null, "{explanation:#}");
    assert_eq!(explanation["policy"]["decision"], "none", "{explanation:#}");
    let reasons = explanation["policy"]["reasons"].to_string();
    assert!(
        reasons.contains("no enablement selector matches"),
        "{reasons}"
    );
    let (ok, error) = explain(&node, &agent, &["default/plain", "--from", "10.0.0.1"]);
    assert!(!ok && error.contains("--port"), "{error}");
    agent.stop().unwrap();
}

/// On a node that follows the cluster, the API server's labels tell why a pod is or is not
/// ambient: the selector that matches, the pod's opt-out, the excluded namespace. Read with
/// `run`'s --kubeconfig, as the agent reads them; nothing of weir need run on the node.
#[test]
fn the_api_servers_labels_tell_why_a_pod_is_or_is_not_ambient() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let api = runtime.block_on(ApiServer::start()).unwrap();
    let labelled = |name: &str, labels: &[(&str, &str)]| K8sMeta {
        name: Some(name.into()),
        labels: Some(
            labels
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect(),
        ),
        ..K8sMeta::default()
    };
    api.create(&Namespace {
        metadata: labelled(MESH, &[(DATAPLANE_MODE_LABEL, "ambient")]),
        ..Namespace::default()
    });
    api.create(&Namespace {
        metadata: labelled("kube-system", &[]),
        ..Namespace::default()
    });
    api.create_pod(MESH, "app");
    api.create_pod("kube-system", "dns");
    let mut opted_out = K8sPod {
        metadata: labelled("opted-out", &[(DATAPLANE_MODE_LABEL, "none")]),
        ..K8sPod::default()
    };
    opted_out.metadata.namespace = Some(MESH.into());
    api.create(&opted_out);

    let files = NodeFiles::new().unwrap();
    let kubeconfig = files.kubeconfig(&api).unwrap();
    let explain = |pod: &str| -> Value {
        let output = Command::new(workspace_binary("weir-agent"))
            .arg("explain")
            .arg(pod)
            .arg("--pin-root")
            .arg(files.run_dir().join("pins"))
            .arg("--state-file")
            .arg(files.run_dir().join("pods.json"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["-o", "json"])
            .output()
            .unwrap();
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(
            output.status.success(),
            "{pod}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let explanation: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(explanation["enrolled"], false, "{explanation:#}");
        assert_eq!(
            explanation["policy"]["source"], "the API server",
            "{explanation:#}"
        );
        explanation["policy"].clone()
    };
    for (pod, decision, reason) in [
        (
            "mesh/app",
            "ambient",
            "ambient: enablement selector 2 of 2 matches",
        ),
        (
            "mesh/opted-out",
            "none",
            "not ambient: no enablement selector matches",
        ),
        (
            "kube-system/dns",
            "none",
            "not ambient: its namespace is excluded",
        ),
    ] {
        let policy = explain(pod);
        assert_eq!(policy["decision"], decision, "{pod}: {policy:#}");
        assert!(
            policy["reasons"][0].as_str().unwrap().starts_with(reason),
            "{pod}: {policy:#}"
        );
    }
}
