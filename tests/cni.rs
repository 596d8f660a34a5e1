//! Pods enrolled the way kubelet's runtime enrolls them: the node's CNI config (bridge +
//! host-local, with weir-cni inserted by weir's own installer), the runtime's ADD/CHECK/DEL calls,
//! the real agent, and ztunnel (the stand-in) connected over ZDS.
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv6Addr, SocketAddr},
    os::unix::net::UnixStream,
    sync::Arc,
    time::Duration,
};

use weir_agent::policy::{
    local::{LocalPolicy, ObjectMeta},
    DATAPLANE_MODE_LABEL,
};
use weir_common::{INBOUND_PORT, OUTBOUND_PORT};
use weir_tests::{
    agent::{http_get, Agent, NodeFiles},
    cni::{Command, RuntimeConf},
    require_privileges, tcp_request,
    zds_client::{NetnsId, ZdsEvent, ZdsZtunnel},
    EchoServer, Pod, PodSpec, TestNode, ZtunnelStandIn,
};

const WAIT: Duration = Duration::from_secs(3);
const APP_PORT: u16 = 8080;
const MESH: &str = "mesh";

/// The namespace `mesh` is ambient; `default` is not.
fn ambient_policy() -> LocalPolicy {
    let mut policy = LocalPolicy::default();
    policy.namespaces.insert(
        MESH.into(),
        ObjectMeta {
            labels: BTreeMap::from([(DATAPLANE_MODE_LABEL.into(), "ambient".into())]),
            ..ObjectMeta::default()
        },
    );
    policy
}

struct Node {
    files: NodeFiles,
    node: TestNode,
}

impl Node {
    fn new() -> Self {
        let files = NodeFiles::new().unwrap();
        files.write_policy(&ambient_policy()).unwrap();
        let node = files.node().unwrap();
        Self { files, node }
    }

    fn start_agent(&self) -> Agent {
        Agent::start(self.files.agent_config(self.node.netns()).unwrap()).expect("agent ready")
    }

    /// A plain `server` pod with an echo app, and an ambient pod `name` that ztunnel received.
    fn server_and_ambient_pod(
        &self,
        ztunnel: &ZdsZtunnel,
        name: &str,
    ) -> (Pod, EchoServer, Pod, Arc<ZtunnelStandIn>) {
        let server = self.pod("default", "server").unwrap();
        let echo = app(&server);
        let pod = self.pod(MESH, name).unwrap();
        let stand_in = ztunnel
            .wait_for_pod(pod.uid(), WAIT)
            .expect("ztunnel got the pod's netns over ZDS");
        (server, echo, pod, stand_in)
    }

    /// The agent, with ztunnel connected to it.
    fn start_agent_and_ztunnel(&self) -> (Agent, ZdsZtunnel) {
        let agent = self.start_agent();
        let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).expect("ztunnel connects");
        (agent, ztunnel)
    }

    fn pod(&self, namespace: &str, name: &str) -> anyhow::Result<Pod> {
        self.node.add_pod_with(PodSpec {
            namespace: namespace.into(),
            ..PodSpec::new(name)
        })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Agents here stop as an upgrade does, leaving the datapath for the next one.
        weir_tests::agent::remove_datapath(&weir_tests::agent::pin_root(self.node.netns()));
    }
}

fn app(pod: &Pod) -> EchoServer {
    EchoServer::start(
        pod.netns(),
        pod.name(),
        (Ipv6Addr::UNSPECIFIED, APP_PORT).into(),
    )
    .unwrap()
}

#[test]
fn installer_chains_weir_into_the_node_conflist() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let agent = node.start_agent();
    let conflist: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.files.net_dir().join("10-weir-test.conflist")).unwrap(),
    )
    .unwrap();
    let plugins = conflist["plugins"].as_array().unwrap();
    assert_eq!(plugins[0]["type"], "bridge", "the primary CNI stays first");
    assert_eq!(plugins.last().unwrap()["type"], "weir-cni");
    assert!(node.files.bin_dir().join("weir-cni").exists());
    let (status, metrics) = http_get(agent.config.metrics_addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(metrics.contains("istio_cni_install_ready 1"), "{metrics}");
    agent.stop().unwrap();
}

#[test]
fn add_enrolls_an_ambient_pod_and_hands_it_to_ztunnel() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let server = node.pod("default", "server").unwrap();
    let echo = app(&server);
    let client = node.pod(MESH, "client").unwrap();
    let plain = node.pod("default", "plain").unwrap();

    let stand_in = ztunnel
        .wait_for_pod(client.uid(), WAIT)
        .expect("ztunnel got the pod's netns over ZDS");
    assert!(
        ztunnel.pod(plain.uid()).is_none(),
        "a plain pod is not handed to ztunnel"
    );

    // The ambient pod's traffic goes through ztunnel; the plain pod's does not.
    let target = SocketAddr::new(IpAddr::V4(server.ipv4()), APP_PORT);
    let reply = client.run(|| tcp_request(target, "mesh")).unwrap();
    assert_eq!(reply.response, echo.reply_to("mesh"));
    let seen = stand_in
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .expect("outbound through ztunnel");
    assert_eq!(seen.original_dst, Some(target));
    let reply = plain.run(|| tcp_request(target, "plain")).unwrap();
    assert_eq!(reply.response, echo.reply_to("plain"));
    let received = echo.wait_for(|r| r.line == "plain", WAIT).unwrap();
    assert_eq!(received.peer.ip(), IpAddr::V4(plain.ipv4()));

    check(&node, &client).expect("CHECK passes while the pod is redirected");
    check(&node, &plain).expect("CHECK passes for a plain pod");
    agent.stop().unwrap();
}

#[test]
fn del_unenrolls_and_is_idempotent() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, client, stand_in) = node.server_and_ambient_pod(&ztunnel, "client");

    // The runtime's two DELs reach weir-cni: StopPodSandbox (netns, prevResult), then
    // RemovePodSandbox (neither). Only weir's part of the chain runs here, so the pod keeps its
    // network and shows what DEL left behind.
    let runtime = client.runtime_conf().clone();
    weir_only(&node, Command::Del, &runtime, Some(client.prev_result())).unwrap();
    let second = RuntimeConf {
        netns: None,
        ..runtime.clone()
    };
    weir_only(&node, Command::Del, &second, None).unwrap();
    assert!(
        ztunnel.wait_for_del(client.uid(), WAIT),
        "ztunnel was told to drop the pod"
    );

    // The pod talks directly again.
    let before = stand_in.seen().len();
    let target = SocketAddr::new(IpAddr::V4(server.ipv4()), APP_PORT);
    client.run(|| tcp_request(target, "direct")).unwrap();
    let received = echo.wait_for(|r| r.line == "direct", WAIT).unwrap();
    assert_eq!(received.peer.ip(), IpAddr::V4(client.ipv4()));
    assert_eq!(stand_in.seen().len(), before);
    agent.stop().unwrap();
}

/// Waits until the agent's /metrics shows `line`.
fn wait_for_metric(agent: &Agent, line: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, metrics) = http_get(agent.config.metrics_addr, "/metrics").unwrap();
        if metrics.lines().any(|l| l == line) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {line} in\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The node's conflist as the installer left it: bridge, then weir-cni.
fn weir_conflist(node: &Node) -> weir_tests::cni::NetworkConfigList {
    let list: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.files.net_dir().join("10-weir-test.conflist")).unwrap(),
    )
    .unwrap();
    weir_tests::cni::NetworkConfigList::from_json(&list).unwrap()
}

/// A call to weir-cni alone, configured as the node's conflist configures it.
fn weir_only(
    node: &Node,
    command: Command,
    runtime: &RuntimeConf,
    prev_result: Option<&serde_json::Value>,
) -> Result<serde_json::Value, weir_tests::cni::CniError> {
    let conflist = weir_conflist(node);
    let weir = conflist.plugins.last().unwrap().clone();
    let config = conflist.plugin_config(&weir, runtime, prev_result);
    let binary = weir_tests::cni::find_plugin(&weir, &runtime.path).unwrap();
    weir_tests::cni::invoke(&binary, command, runtime, &config, node.node.netns())
}

/// CHECK, with the pod's ADD result as prevResult.
fn check(node: &Node, pod: &Pod) -> Result<serde_json::Value, weir_tests::cni::CniError> {
    weir_only(
        node,
        Command::Check,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
}

#[test]
fn check_detects_missing_redirection() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let pod = node.pod(MESH, "app").unwrap();
    ztunnel.wait_for_pod(pod.uid(), WAIT).unwrap();
    check(&node, &pod).expect("CHECK passes while redirected");

    // Someone deletes the pod's entry behind weir's back (bpftool, as an operator would).
    let cookie = pod.netns().cookie().unwrap();
    let key: Vec<String> = cookie.to_ne_bytes().iter().map(|b| b.to_string()).collect();
    let pods_map = agent
        .config
        .datapath
        .pin_root
        .join(format!("abi-{}/PODS", weir_common::ABI_VERSION));
    let status = std::process::Command::new("bpftool")
        .args(["map", "delete", "pinned"])
        .arg(&pods_map)
        .arg("key")
        .args(&key)
        .status()
        .unwrap();
    assert!(status.success());
    let error = check(&node, &pod).expect_err("CHECK fails without redirection");
    assert!(format!("{error}").contains("no redirection"), "{error}");
    agent.stop().unwrap();
}

#[test]
fn agent_down_fails_ambient_pods_and_starts_plain_ones() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let agent = node.start_agent();
    agent.stop().unwrap();
    // The plugin stays installed, as after an agent crash or during an upgrade.
    let error = node
        .pod(MESH, "app")
        .expect_err("an ambient pod must not start unredirected");
    let message = format!("{error:#}");
    assert!(message.contains("unreachable"), "{message}");
    assert!(message.contains("11"), "try again later: {message}");
    let plain = node.pod("default", "plain").expect("a plain pod starts");
    assert!(plain.ipv4().is_private());
}

#[test]
fn ztunnel_absent_fails_add_until_it_connects() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let agent = node.start_agent();
    let error = node
        .pod(MESH, "early")
        .expect_err("no ztunnel: the ADD fails");
    assert!(format!("{error:#}").contains("pending"), "{error:#}");
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    let pod = node
        .pod(MESH, "retried")
        .expect("the runtime's retry succeeds");
    assert!(ztunnel.wait_for_pod(pod.uid(), WAIT).is_some());
    agent.stop().unwrap();
}

#[test]
fn hundred_concurrent_adds_all_enroll() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let pods: Vec<Pod> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..100)
            .map(|i| {
                let node = &node;
                scope.spawn(move || node.pod(MESH, &format!("p{i}")).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for pod in &pods {
        assert!(
            ztunnel.wait_for_pod(pod.uid(), WAIT).is_some(),
            "pod {} handed to ztunnel",
            pod.name()
        );
    }
    let (_, metrics) = http_get(agent.config.metrics_addr, "/metrics").unwrap();
    assert!(
        metrics.contains(r#"nodeagent_reconcile_events_total{event="add",result="ok"} 100"#),
        "{metrics}"
    );
    assert!(
        metrics.contains("weir_redirect_seconds_count 100"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"weir_enrolled_pods{status="enabled"} 100"#),
        "{metrics}"
    );
    agent.stop().unwrap();
}

#[test]
fn malformed_and_oversized_requests_get_errors() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let agent = node.start_agent();
    let ask = |payload: &[u8]| -> serde_json::Value {
        let mut stream = UnixStream::connect(&agent.config.cni_socket).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let _ = stream.write_all(payload);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let garbage = ask(b"{not json\n");
    assert_eq!(garbage["result"], "error");
    assert_eq!(garbage["code"], 6);
    let oversized = ask(&vec![b'x'; 200 * 1024]);
    assert_eq!(oversized["result"], "error");
    // The agent still serves pods afterwards.
    let _ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    node.pod(MESH, "after").expect("still serving");
    agent.stop().unwrap();
}

#[test]
fn inbound_reaches_an_enrolled_pod_through_ztunnel() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let server = node.pod(MESH, "server").unwrap();
    let echo = app(&server);
    let client = node.pod("default", "client").unwrap();
    let stand_in = ztunnel.wait_for_pod(server.uid(), WAIT).unwrap();
    let target = SocketAddr::new(IpAddr::V6(server.ipv6()), APP_PORT);
    let reply = client.run(|| tcp_request(target, "in")).unwrap();
    assert_eq!(reply.response, echo.reply_to("in"));
    assert!(stand_in
        .wait_for(|s| s.listener == INBOUND_PORT && s.local == target, WAIT)
        .is_some());
    agent.stop().unwrap();
}

#[test]
fn agent_restart_recovers_pods_and_hands_them_to_a_reconnecting_ztunnel() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, pod, _) = node.server_and_ambient_pod(&ztunnel, "app");
    agent.stop().unwrap();
    assert!(ztunnel.wait_for_close(WAIT), "ztunnel saw the agent go");
    drop(ztunnel);

    // The next agent takes the pod back from the pinned maps and finds its netns again.
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    assert!(ztunnel.wait_for_snapshot(WAIT));
    let expected = NetnsId::of(pod.netns().open().unwrap()).unwrap();
    let events = ztunnel.events();
    let add = events
        .iter()
        .find(|e| e.uid() == Some(pod.uid()))
        .expect("the snapshot names the pod");
    match add {
        ZdsEvent::Add { info, netns, .. } => {
            assert_eq!(*netns, Some(expected), "with the pod's own netns");
            let info = info.as_ref().unwrap();
            assert_eq!((info.namespace.as_str(), info.name.as_str()), (MESH, "app"));
        }
        other => panic!("expected Add with the netns, got {other:?}"),
    }
    let stand_in = ztunnel.wait_for_pod(pod.uid(), WAIT).unwrap();
    // Pending after the restart until ztunnel acked the snapshot's Add, then enabled.
    wait_for_metric(&agent, r#"weir_enrolled_pods{status="enabled"} 1"#);
    let target = SocketAddr::new(IpAddr::V4(server.ipv4()), APP_PORT);
    let reply = pod.run(|| tcp_request(target, "after restart")).unwrap();
    assert_eq!(reply.response, echo.reply_to("after restart"));
    assert!(stand_in
        .wait_for(
            |s| s.listener == OUTBOUND_PORT && s.original_dst == Some(target),
            WAIT
        )
        .is_some());
    // Inbound too, through the tc program the new agent put in place of the old one's.
    let pod_app = app(&pod);
    let inbound = SocketAddr::new(IpAddr::V4(pod.ipv4()), APP_PORT);
    let reply = server.run(|| tcp_request(inbound, "in")).unwrap();
    assert_eq!(reply.response, pod_app.reply_to("in"));
    assert!(stand_in
        .wait_for(|s| s.listener == INBOUND_PORT && s.local == inbound, WAIT)
        .is_some());

    // DEL after the restart removes everything, as before it.
    weir_only(
        &node,
        Command::Del,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .unwrap();
    assert!(ztunnel.wait_for_del(pod.uid(), WAIT));
    let before = stand_in.seen().len();
    pod.run(|| tcp_request(target, "direct")).unwrap();
    assert_eq!(stand_in.seen().len(), before);
    agent.stop().unwrap();
}

/// An upgrade to an agent with another map layout: the old layout's programs keep redirecting
/// until the new agent has enrolled the pod into its own maps, then the old layout is retired.
#[test]
fn agent_upgrade_across_map_layouts_moves_pods_without_a_gap() {
    if !require_privileges() {
        return;
    }
    let node = Node::new();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, pod, _) = node.server_and_ambient_pod(&ztunnel, "app");
    let pin_root = agent.config.datapath.pin_root.clone();
    agent.stop().unwrap();
    drop(ztunnel);

    // What the previous version left: its maps and links under an older layout's directory.
    let current = pin_root.join(format!("abi-{}", weir_common::ABI_VERSION));
    let older = pin_root.join("abi-0");
    std::fs::rename(&current, &older).unwrap();
    let target = SocketAddr::new(IpAddr::V4(server.ipv4()), APP_PORT);
    let stand_in = ZtunnelStandIn::start(&pod).unwrap();
    pod.run(|| tcp_request(target, "old layout")).unwrap();
    assert!(
        stand_in
            .wait_for(|s| s.original_dst == Some(target), WAIT)
            .is_some(),
        "the old layout's programs still redirect"
    );
    drop(stand_in);

    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    assert!(
        !older.exists(),
        "the older layout is retired once its pod moved"
    );
    let stand_in = ztunnel
        .wait_for_pod(pod.uid(), WAIT)
        .expect("handed to ztunnel");
    let reply = pod.run(|| tcp_request(target, "new layout")).unwrap();
    assert_eq!(reply.response, echo.reply_to("new layout"));
    assert!(stand_in
        .wait_for(|s| s.original_dst == Some(target), WAIT)
        .is_some());
    check(&node, &pod).expect("the pod is redirected by the new layout");
    agent.stop().unwrap();
}
