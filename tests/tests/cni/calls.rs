//! The runtime's ADD, CHECK and DEL through weir-cni: pods enrolled and handed to ztunnel,
//! checked, removed, also many at once and without a previous result.
use super::*;

#[test]
fn add_enrolls_an_ambient_pod_and_hands_it_to_ztunnel() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, client, stand_in) = node.server_and_ambient_pod(&ztunnel, "client");
    let plain = node.pod("default", "plain").unwrap();
    assert!(
        ztunnel.pod(plain.uid()).is_none(),
        "a plain pod is not handed to ztunnel"
    );

    // The ambient pod's traffic goes through ztunnel; the plain pod's does not.
    assert_through_ztunnel(&client, &stand_in, &server, &echo, "mesh");
    assert_direct(&plain, &server, &echo, "plain");

    check(&node, &client).expect("CHECK passes while the pod is redirected");
    check(&node, &plain).expect("CHECK passes for a plain pod");
    agent.stop().unwrap();
}

#[test]
fn del_unenrolls_and_is_idempotent() {
    let node = privileged!(Node::new());
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
    // Both DELs of a pod that was never enrolled (not ambient) reach weir-cni too.
    let plain = node.pod("default", "plain").unwrap();
    weir_only(
        &node,
        Command::Del,
        plain.runtime_conf(),
        Some(plain.prev_result()),
    )
    .unwrap();
    weir_only(
        &node,
        Command::Del,
        &RuntimeConf {
            netns: None,
            ..plain.runtime_conf().clone()
        },
        None,
    )
    .unwrap();

    // The pod talks directly again.
    let before = stand_in.seen().len();
    assert_direct(&client, &server, &echo, "direct");
    assert_eq!(stand_in.seen().len(), before);
    // ztunnel hears of the pod it had once, and of no other.
    let dels: Vec<ZdsEvent> = ztunnel
        .events()
        .into_iter()
        .filter(|event| matches!(event, ZdsEvent::Del { .. }))
        .collect();
    assert_eq!(
        dels,
        [ZdsEvent::Del {
            uid: client.uid().to_owned()
        }]
    );
    agent.stop().unwrap();
}

/// Multus runs weir-cni as a network of its own, as istio-cni with `chained: false` (OpenShift):
/// a NetworkAttachmentDefinition's extra attachment, after the node's primary network, with no
/// `prevResult`. The plugin prints an empty result, the agent takes the pod's IPs from its eth0,
/// and the attachment's DEL takes the pod out again.
#[test]
fn a_standalone_attachment_without_prev_result_enrolls_an_ambient_pod() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let server = node.pod("default", "server").unwrap();
    let echo = EchoServer::app(&server).unwrap();
    let client = unenrolled_ambient_pod(&node, "client");
    // Multus passes the pod's own CNI_ARGS and no pod annotations.
    let attachment = RuntimeConf {
        ifname: "net1".into(),
        capability_args: Default::default(),
        ..client.runtime_conf().clone()
    };

    let result = standalone_weir(&node, Command::Add, &attachment).expect("the attachment's ADD");
    assert_eq!(result, json!({ "cniVersion": "1.0.0" }));
    let stand_in = ztunnel
        .wait_for_pod(client.uid(), WAIT)
        .expect("ztunnel got the pod's netns over ZDS");
    assert_through_ztunnel(&client, &stand_in, &server, &echo, "mesh");
    let records = weir_agent::state::read(&agent.config.state_file).unwrap();
    let enrolled = &records[client.uid()].workload;
    assert_eq!(
        enrolled.ips,
        client.ips(),
        "eth0's addresses, not link-local"
    );
    assert_eq!(
        enrolled.attachment.as_ref().map(|a| a.ifname.as_str()),
        Some("net1")
    );

    standalone_weir(&node, Command::Del, &attachment).expect("the attachment's DEL");
    assert!(
        ztunnel.wait_for_del(client.uid(), WAIT),
        "ztunnel was told to drop the pod"
    );
    let before = stand_in.seen().len();
    assert_direct(&client, &server, &echo, "direct");
    assert_eq!(stand_in.seen().len(), before);
    agent.stop().unwrap();
}

/// weir-cni alone as a network named `istio-cni`, as a NetworkAttachmentDefinition configures it
/// (version 1.0.0, the installed entry's fields), run by Multus without `prevResult`.
fn standalone_weir(
    node: &Node,
    command: Command,
    runtime: &RuntimeConf,
) -> Result<serde_json::Value, weir_tests::cni::CniError> {
    let weir = weir_conflist(node).plugins.last().unwrap().clone();
    let network = NetworkConfigList {
        name: "istio-cni".into(),
        cni_version: "1.0.0".into(),
        plugins: vec![weir.clone()],
    };
    let config = network.plugin_config(&weir, runtime, None);
    let binary = weir_tests::cni::find_plugin(&weir, &runtime.path).unwrap();
    weir_tests::cni::invoke(&binary, command, runtime, &config, node.netns())
}

/// kubelet gives a pod a new sandbox (after a reboot, or when pause dies): it stops the old one,
/// runs the new one through ADD, then removes the old one, whose second DEL has no netns. That DEL
/// names the old sandbox only, and must leave the live one redirected.
#[test]
fn a_del_for_a_pods_old_sandbox_keeps_the_new_one_redirected() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, old, _) = node.server_and_ambient_pod(&ztunnel, "client");
    let new = node
        .test_node()
        .add_pod_with(PodSpec {
            namespace: MESH.into(),
            uid: Some(old.uid().to_owned()),
            ..PodSpec::new("client")
        })
        .unwrap();
    let new_ip = IpAddr::V4(new.ipv4());
    ztunnel
        .wait_for(
            |event| matches!(event, ZdsEvent::Add { uid, pod_ips, .. } if uid == new.uid() && pod_ips.contains(&new_ip)),
            WAIT,
        )
        .expect("ztunnel got the new sandbox over ZDS");
    let stand_in = ztunnel.stand_in(new.uid()).unwrap();

    let removal = RuntimeConf {
        netns: None,
        ..old.runtime_conf().clone()
    };
    weir_only(&node, Command::Del, &removal, None).unwrap();
    assert_through_ztunnel(&new, &stand_in, &server, &echo, "still captured");
    agent.stop().unwrap();
}

#[test]
fn check_detects_missing_redirection() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (pod, _) = node.ambient_pod(&ztunnel, "app");
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
fn hundred_concurrent_adds_all_enroll() {
    let node = privileged!(Node::new());
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
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value(
            "weir_cni_requests_total",
            &[("event", "add"), ("result", "ok")]
        ),
        Some(100.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value(
            "istio_cni_plugin_requests_total",
            &[("response_code", "200")]
        ),
        Some(100.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value("weir_redirect_seconds_count", &[]),
        Some(100.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value("weir_enrolled_pods", &[("status", "enabled")]),
        Some(100.0),
        "{metrics}"
    );
    for (name, labels) in [
        (
            "weir_pods",
            &[("mode", "ambient"), ("state", "enrolled")][..],
        ),
        (
            "weir_enroll_seconds_count",
            &[("mode", "ambient"), ("result", "ok")],
        ),
        ("weir_map_entries", &[("map", "PODS")]),
    ] {
        assert_eq!(
            metrics.value(name, labels),
            Some(100.0),
            "{name}: {metrics}"
        );
    }
    assert_eq!(
        metrics.value("weir_pods", &[("mode", "ambient"), ("state", "pending")]),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(metrics.value("weir_zds_pending_adds", &[]), Some(0.0));
    agent.stop().unwrap();
}

#[test]
fn inbound_reaches_an_enrolled_pod_through_ztunnel() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, stand_in) = node.ambient_pod(&ztunnel, "server");
    let echo = EchoServer::app(&server).unwrap();
    let client = node.pod("default", "client").unwrap();
    let target = server.app_v6();
    let reply = client.run(|| tcp_request(target, "in")).unwrap();
    assert_eq!(reply.response, echo.reply_to("in"));
    assert!(stand_in
        .wait_for(|s| s.listener == INBOUND_PORT && s.local == target, WAIT)
        .is_some());
    agent.stop().unwrap();
}
