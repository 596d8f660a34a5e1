//! kubelet's probes: from the node (or a configured source address in kubelet's cgroup) they
//! reach the app directly, and the probe source opens no other door.
use super::*;

/// weir makes the probe source address local on the node (the probes' replies come back to
/// it): no pod reaches the node's wildcard listeners through it, neither an ambient pod (around
/// ztunnel), nor ztunnel's own dials from it, nor a pod weir leaves alone.
#[test]
fn the_probe_address_is_no_door_to_the_node() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, plain) = (fixture.pod("app"), fixture.pod("plain"));
    let node_listener = EchoServer::start(
        fixture.node().netns(),
        "node",
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    )
    .unwrap();
    let _ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    let port = node_listener.addr().port();
    for probe_address in [
        IpAddr::V4(PROBE_SOURCE_V4.into()),
        IpAddr::V6(PROBE_SOURCE_V6.into()),
    ] {
        let target = SocketAddr::new(probe_address, port);
        let shown = |reply: std::io::Result<weir_tests::Reply>| reply.map(|r| r.response);
        let attempts = [
            (
                "an ambient pod",
                shown(pod.run(|| tcp_request(target, "door"))),
            ),
            ("ztunnel", pod.run(|| marked_tcp_request(target, "door"))),
            (
                "a pod weir leaves alone",
                shown(plain.run(|| tcp_request(target, "door"))),
            ),
        ];
        for (who, attempt) in attempts {
            let refused = attempt.expect_err(&format!("{who} reached the node through {target}"));
            assert_eq!(
                refused.kind(),
                ErrorKind::PermissionDenied,
                "{who} to {target}: {refused}"
            );
        }
    }
    assert!(node_listener.wait_for(|r| r.line == "door", WAIT).is_none());
    datapath.uninstall().wait().unwrap();
}

#[test]
fn node_probes_reach_the_app_directly_other_traffic_is_captured() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, other) = (fixture.pod("app"), fixture.pod("other"));
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let echo = EchoServer::app(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    for (destination, probe_source) in [
        (IpAddr::V4(pod.ipv4()), IpAddr::V4(PROBE_SOURCE_V4.into())),
        (IpAddr::V6(pod.ipv6()), IpAddr::V6(PROBE_SOURCE_V6.into())),
    ] {
        let target = SocketAddr::new(destination, APP_PORT);
        let reply = fixture
            .node()
            .run(|| tcp_request(target, "probe"))
            .unwrap_or_else(|e| panic!("probe to {target}: {e}"));
        assert_eq!(reply.response, echo.reply_to("probe"));
        let received = echo
            .wait_for(|r| r.line == "probe" && r.local.ip() == destination, WAIT)
            .unwrap();
        assert_eq!(received.peer.ip(), probe_source);
    }
    assert!(ztunnel.seen().iter().all(|s| s.listener != INBOUND_PORT));
    assert_eq!(counters(&datapath, &pod).bypassed, 2);

    // Another pod's traffic is still captured.
    let target = pod.app_v4();
    other.run(|| tcp_request(target, "pod")).unwrap();
    assert!(ztunnel
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .is_some());
    datapath.uninstall().wait().unwrap();
}

/// The probe source is the operator's to choose (istio's HOST_PROBE_SNAT_IP and
/// HOST_PROBE_SNAT_IPV6), and can be kept to kubelet's cgroup: a probe from kubelet's cgroup
/// leaves from the configured address and reaches the app; the same connection from another
/// process of the node is captured like a pod's. The address an earlier agent made local goes.
/// A restarted kubelet's cgroup, made anew at the same path, is followed.
#[test]
fn a_configured_probe_source_goes_only_to_kubelets_cgroup() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let echo = EchoServer::app(&pod).unwrap();
    fixture.start_datapath().shutdown().wait().unwrap();
    let local_table = |address: &str| {
        ip_output(&[
            "-n",
            fixture.node().netns().name(),
            "route",
            "show",
            "table",
            "local",
            address,
        ])
        .unwrap()
    };
    assert!(
        !local_table("169.254.7.127").is_empty(),
        "the default is local"
    );

    let kubelet = cgroup::TestCgroup::new().unwrap();
    let probe_source = ProbeSource {
        v4: Ipv4Addr::new(169, 254, 99, 7),
        v6: "fd16:9254:99::7".parse().unwrap(),
        cgroup: Some(kubelet.path()),
    };
    let datapath = Datapath::start(DatapathConfig {
        probe_source: probe_source.clone(),
        ..fixture.node().datapath_config()
    })
    .unwrap();
    datapath
        .ztunnel_connected(std::process::id())
        .wait()
        .unwrap();
    datapath
        .enroll(pod.workload(PodOptions::default()))
        .wait()
        .unwrap();
    assert!(
        local_table("169.254.7.127").is_empty(),
        "the earlier default is gone"
    );
    assert!(!local_table("169.254.99.7").is_empty());

    let probes = [
        (IpAddr::V4(pod.ipv4()), IpAddr::V4(probe_source.v4)),
        (IpAddr::V6(pod.ipv6()), IpAddr::V6(probe_source.v6)),
    ];
    // The second time, kubelet has restarted: its cgroup, at the same path, is a new one.
    for (restarted, (destination, source)) in [false, true]
        .into_iter()
        .flat_map(|restarted| probes.map(|probe| (restarted, probe)))
    {
        if restarted && destination.is_ipv4() {
            kubelet.make_again().unwrap();
            // The agent follows it within a second; the audit does at once.
            datapath.audit().wait().unwrap();
        }
        let line = format!("kubelet-{destination}-{restarted}");
        let mut probe = Command::new("bash");
        probe.arg("-c").arg(format!(
            "exec 3<>/dev/tcp/{destination}/{APP_PORT} && echo {line} >&3 && head -n1 <&3"
        ));
        let out = cgroup::output_in_cgroup(fixture.node().netns(), &kubelet.dir, probe).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            echo.reply_to(&line)
        );
        let received = echo.wait_for(|r| r.line == line, WAIT).unwrap();
        assert_eq!(
            received.peer.ip(),
            source,
            "kubelet's probe leaves from the probe source (restarted: {restarted})"
        );
    }
    assert!(ztunnel.seen().iter().all(|s| s.listener != INBOUND_PORT));

    // This test process is not in kubelet's cgroup: its connection is captured.
    let target = pod.app_v4();
    fixture
        .node()
        .run(|| tcp_request(target, "not kubelet"))
        .unwrap();
    assert!(ztunnel
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .is_some());
    datapath.uninstall().wait().unwrap();
    assert!(
        local_table("169.254.99.7").is_empty(),
        "uninstall removes it"
    );
}

/// A pod with CAP_NET_ADMIN may put any address on its interfaces, the API server's among them:
/// the node's own connections to such an address keep their source. Only the addresses the
/// runtime gave the pod, which kubelet probes, get the probe source.
#[test]
fn the_probe_source_goes_only_to_the_pods_cni_addresses() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server, echo, _ztunnel, datapath) = enrolled_app_and_server(&fixture);
    // The pod claims the server's address; the interface watch indexes it for the pod.
    let claimed = server.ipv4();
    ip(&[
        "-n",
        pod.netns().name(),
        "address",
        "add",
        &format!("{claimed}/32"),
        "dev",
        "eth0",
    ])
    .unwrap();
    let pod_ips = fixture.node().pinned_pod_ips().unwrap();
    let key = weir_common::IpKey::from_v4(claimed.octets());
    wait_until(WAIT, "the claimed address to be indexed", || {
        pod_ips.get(&key, 0).is_ok()
    });

    let target = SocketAddr::new(IpAddr::V4(claimed), APP_PORT);
    let reply = fixture
        .node()
        .run(|| tcp_request(target, "from the node"))
        .unwrap();
    assert_eq!(reply.response, echo.reply_to("from the node"));
    let received = echo.wait_for(|r| r.line == "from the node", WAIT).unwrap();
    assert_eq!(
        received.peer.ip(),
        IpAddr::V4(fixture.node().gateway_v4()),
        "the node's connection keeps its own source"
    );
    assert!(datapath.is_redirected(pod.uid()).wait().unwrap());
    datapath.uninstall().wait().unwrap();
}
