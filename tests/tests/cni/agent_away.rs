//! Calls while the agent or ztunnel is away, and pods kept through the agent's restart and
//! its upgrade across map layouts.
use super::*;

/// The agent away and no API server: the verdict cache decides. A pod it does not know may carry
/// the ambient label itself, so it waits like an ambient one.
#[test]
fn agent_down_fails_ambient_pods_and_starts_plain_ones() {
    let node = privileged!(Node::new());
    let mut policy = ambient_policy();
    policy
        .pods
        .insert("default/plain".into(), PolicyMeta::default());
    node.files.write_policy(&policy).unwrap();
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
    let error = node
        .pod("default", "stranger")
        .expect_err("a pod unknown to the verdict cache must not start unredirected");
    let message = format!("{error:#}");
    assert!(
        message.contains("pod default/stranger is unknown to the verdict cache"),
        "{message}"
    );
    assert!(message.contains("11"), "try again later: {message}");
}

/// The agent away, and a namespace labelled ambient after its verdict cache was written: the
/// plugin asks the API server with the kubeconfig the agent's installer wrote, and the pod waits;
/// a pod the API server says is not ambient starts.
#[test]
fn agent_down_the_api_server_decides_with_the_installed_kubeconfig() {
    let node = privileged!(Node::new());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // On the node's loopback, where the runtime runs weir-cni.
    let api = node
        .netns()
        .run(|| runtime.block_on(ApiServer::start()))
        .unwrap();
    let account = node.files.run_dir().join("serviceaccount");
    std::fs::create_dir(&account).unwrap();
    std::fs::write(account.join("token"), "agent-token").unwrap();
    let config = AgentConfig {
        service_account: Some(ServiceAccount {
            server: api.url(),
            token_file: account.join("token"),
            ca_file: None,
        }),
        ..node.files.agent_config(node.netns()).unwrap()
    };
    let agent = Agent::start(config).expect("agent ready");
    let kubeconfig = node.files.net_dir().join("weir-kubeconfig");
    let mode = std::fs::metadata(&kubeconfig).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    agent.stop().unwrap();

    for (name, labels) in [
        (
            "late",
            BTreeMap::from([(DATAPLANE_MODE_LABEL.to_owned(), "ambient".to_owned())]),
        ),
        ("default", BTreeMap::new()),
    ] {
        api.create(&Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        });
    }
    let pod = |namespace: &str, name: &str| {
        node.test_node().add_pod_with(PodSpec {
            namespace: namespace.into(),
            uid: Some(api.create_pod(namespace, name)),
            ..PodSpec::new(name)
        })
    };
    let error = pod("late", "app").expect_err("an ambient pod must not start unredirected");
    let message = format!("{error:#}");
    assert!(message.contains("11"), "try again later: {message}");
    assert!(message.contains("ambient pod late/app waits"), "{message}");
    let plain = pod("default", "plain").expect("a plain pod starts");
    assert!(plain.ipv4().is_private());
    let asked: Vec<String> = api.requests().into_iter().map(|r| r.path).collect();
    assert!(
        asked.contains(&"/api/v1/namespaces/late/pods/app".to_owned()),
        "{asked:?}"
    );
}

#[test]
fn ztunnel_absent_fails_add_until_it_connects() {
    let node = privileged!(Node::new());
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
fn agent_restart_recovers_pods_and_hands_them_to_a_reconnecting_ztunnel() {
    let node = privileged!(Node::new());
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
    wait_for_metric(&agent, "weir_enrolled_pods", &[("status", "enabled")], 1.0);
    assert_through_ztunnel(&pod, &stand_in, &server, &echo, "after restart");
    // Inbound too, through the tc program the new agent put in place of the old one's.
    let pod_app = EchoServer::app(&pod).unwrap();
    let inbound = pod.app_v4();
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
    assert_direct(&pod, &server, &echo, "direct");
    assert_eq!(stand_in.seen().len(), before);
    agent.stop().unwrap();
}

/// An upgrade to an agent with another map layout: the old layout's programs keep redirecting
/// until the new agent has enrolled the pod into its own maps, then the old layout is retired.
#[test]
fn agent_upgrade_across_map_layouts_moves_pods_without_a_gap() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, pod, _) = node.server_and_ambient_pod(&ztunnel, "app");
    let pin_root = agent.config.datapath.pin_root.clone();
    agent.stop().unwrap();
    drop(ztunnel);

    // What the previous version left: its maps and links under an older layout's directory.
    let current = pin_root.join(format!("abi-{}", weir_common::ABI_VERSION));
    let older = pin_root.join("abi-0");
    std::fs::rename(&current, &older).unwrap();
    let target = server.app_v4();
    let stand_in = ZtunnelStandIn::start(&pod).unwrap();
    // A loaded machine may reset the first connection to a stand-in just started: that is not
    // a way around ztunnel (one would reach the app), so it is tried again.
    let sent = (0..3).any(|_| pod.run(|| tcp_request(target, "old layout")).is_ok());
    assert!(sent, "a connection through the old layout completes");
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
    assert_through_ztunnel(&pod, &stand_in, &server, &echo, "new layout");
    check(&node, &pod).expect("the pod is redirected by the new layout");
    agent.stop().unwrap();
}
