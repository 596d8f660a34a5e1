//! What a sidecar pod's traffic does, checked beside istio's own iptables rules: through its
//! own proxy, by family, mode, annotation and interface, as istio sends it.
use super::*;

#[test]
fn a_sidecar_pods_traffic_goes_through_its_own_proxy() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let client = node.pod("default", "client").unwrap();
    traffic_goes_as_istios_sidecar_rules_send_it(&server, &client, &pod);

    // What an operator sees: the pod listed as a sidecar pod with no ambient status, and its
    // per-pod series counting what went to its proxy.
    let listed = listed_pods(&agent);
    let row = listed.iter().find(|row| row["uid"] == pod.uid()).unwrap();
    assert_eq!(row["mode"], "sidecar", "{row:#}");
    assert_eq!(row["status"], serde_json::Value::Null, "{row:#}");
    for (direction, value) in [("outbound", 1.0), ("inbound", 1.0), ("dns", 0.0)] {
        let labels = [
            ("namespace", "default"),
            ("pod", "sidecar"),
            ("direction", direction),
        ];
        wait_for_metric(&agent, "weir_pod_redirected_total", &labels, value);
    }
    agent.stop().unwrap();
}

/// The same traffic, redirected by istio-cni's own iptables rules for the pod (no weir): what
/// the stand-ins and the assertions above expect is what istio does.
#[test]
fn istios_own_sidecar_rules_pass_the_same_checks() {
    let node = privileged!(TestNode::new());
    let server = node.add_pod("server").unwrap();
    let client = node.add_pod("client").unwrap();
    let pod = node.add_pod("sidecar").unwrap();
    assert_eq!(run_validation(&pod), 126, "no rules yet: validation fails");
    istio_iptables::apply_sidecar(pod.netns()).unwrap();
    traffic_goes_as_istios_sidecar_rules_send_it(&server, &client, &pod);
    assert_eq!(run_validation(&pod), 0);
}

/// A sidecar pod `pod` with istio's default redirection, seen through its proxy (the stand-in,
/// started here): outbound, inbound, and every exemption of the defaults.
fn traffic_goes_as_istios_sidecar_rules_send_it(server: &Pod, client: &Pod, pod: &Pod) {
    let server_app = EchoServer::app(server).unwrap();
    let server_status =
        EchoServer::start(server.netns(), "server-15020", addr(server.ipv4(), 15020)).unwrap();
    let proxy = SidecarStandIn::start(pod).unwrap();
    let app = EchoServer::app(pod).unwrap();
    let status = EchoServer::start(pod.netns(), "status", addr(pod.ipv4(), 15020)).unwrap();

    // Outbound TCP goes to the proxy's 15001 with its original destination; the proxy's own
    // dial (its uid) goes out, from the pod.
    let reply = pod.run(|| tcp_request(server.app_v4(), "out")).unwrap();
    assert_eq!(reply.response, server_app.reply_to("out"));
    let seen = proxy
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .expect("the proxy took the connection on 15001");
    assert_eq!(seen.original_dst, Some(server.app_v4()), "{seen:?}");
    assert_eq!(server_app.received()[0].peer.ip(), pod.ipv4());

    // The proxy's own traffic, the excluded outbound port (15020 by default), loopback and IPv6
    // (the pod's first address is IPv4, without ISTIO_DUAL_STACK) are not captured.
    let before = proxy.seen().len();
    let reply = pod.run(|| as_proxy(|| tcp_request(server.app_v4(), "proxy")));
    assert_eq!(reply.unwrap().response, server_app.reply_to("proxy"));
    let reply = pod.run(|| tcp_request(addr(server.ipv4(), 15020), "status"));
    assert_eq!(reply.unwrap().response, server_status.reply_to("status"));
    let local = pod.run(|| tcp_request(addr(Ipv4Addr::LOCALHOST, app.addr().port()), "lo"));
    assert_eq!(local.unwrap().response, app.reply_to("lo"));
    let v6 = pod.run(|| tcp_request(server.app_v6(), "v6")).unwrap();
    assert_eq!(v6.response, server_app.reply_to("v6"));
    assert_eq!(proxy.seen().len(), before, "{:?}", proxy.seen());

    // Inbound goes to the proxy's 15006 with the original destination; the proxy reaches the
    // app from 127.0.0.6, which is never captured.
    let reply = client.run(|| tcp_request(pod.app_v4(), "in")).unwrap();
    assert_eq!(reply.response, app.reply_to("in"));
    let seen = proxy
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .expect("the proxy took the connection on 15006");
    assert_eq!(seen.destination(), pod.app_v4());
    assert_eq!(seen.peer.ip(), client.ipv4());
    let passthrough = app.received().last().unwrap().peer.ip();
    assert_eq!(passthrough, Ipv4Addr::new(127, 0, 0, 6));

    // Inbound to an excluded port (15020, 15021, 15090 always) reaches the app directly.
    let before = proxy.seen().len();
    let reply = client.run(|| tcp_request(addr(pod.ipv4(), 15020), "probe"));
    assert_eq!(reply.unwrap().response, status.reply_to("probe"));
    assert_eq!(status.received()[0].peer.ip(), client.ipv4());
    assert_eq!(proxy.seen().len(), before);
}

/// TPROXY: inbound keeps its destination and the proxy reaches the app from the client's own
/// address (its replies routed back to the proxy), 15008 is captured too, and the proxy, root
/// with gid 1337 as istio's injector runs it then, is exempt by its gid.
#[test]
fn tproxy_mode_keeps_the_clients_address_for_the_app() {
    let mut tproxy = sidecar_pod(&[("sidecar.istio.io/interceptionMode", "TPROXY")], &[]);
    let proxy_container = tproxy.containers.last_mut().unwrap();
    assert_eq!(proxy_container.name, "istio-proxy");
    proxy_container.run_as_user = Some(0);
    let Some((node, agent, pod)) = sidecar_node(tproxy) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let server_app = EchoServer::app(&server).unwrap();
    let client = node.pod("default", "client").unwrap();
    let proxy = SidecarStandIn::start_with(&pod, Interception::Tproxy).unwrap();
    let app = EchoServer::app(&pod).unwrap();
    let tunnel = EchoServer::start(pod.netns(), "15008", addr(pod.ipv4(), 15008)).unwrap();

    let reply = pod.run(|| tcp_request(server.app_v4(), "out")).unwrap();
    assert_eq!(reply.response, server_app.reply_to("out"));
    let seen = proxy
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .expect("the proxy took the connection on 15001");
    assert_eq!(seen.original_dst, Some(server.app_v4()), "{seen:?}");
    assert_eq!(server_app.received()[0].peer.ip(), pod.ipv4());

    for (target, echo, msg) in [
        (pod.app_v4(), &app, "in"),
        (addr(pod.ipv4(), 15008), &tunnel, "hbone"),
    ] {
        let reply = client.run(|| tcp_request(target, msg)).unwrap();
        assert_eq!(reply.response, echo.reply_to(msg));
        let seen = proxy
            .wait_for(
                |s| s.listener == INBOUND_PORT && s.destination() == target,
                WAIT,
            )
            .expect("the proxy took the connection on 15006");
        assert_eq!(
            seen.local, target,
            "TPROXY: the local address is the destination"
        );
        assert_eq!(echo.received()[0].peer.ip(), client.ipv4(), "{msg}");
    }

    // The proxy's own connection to its pod is captured inbound too.
    let reply = pod.run(|| Interception::Tproxy.as_proxy(|| tcp_request(pod.app_v4(), "self")));
    assert_eq!(reply.unwrap().response, app.reply_to("self"));
    let seen = proxy
        .wait_for(
            |s| s.listener == INBOUND_PORT && s.peer.ip() == pod.ipv4(),
            WAIT,
        )
        .expect("the proxy's own connection reached its 15006");
    assert_eq!(seen.destination(), pod.app_v4());
    agent.stop().unwrap();
}

#[test]
fn dual_stack_captures_ipv6_with_its_passthrough_source() {
    let dual_stack = sidecar_pod(&[], &[("ISTIO_DUAL_STACK", "true")]);
    let Some((node, agent, pod)) = sidecar_node(dual_stack) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let server_app = EchoServer::app(&server).unwrap();
    let client = node.pod("default", "client").unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    let app = EchoServer::app(&pod).unwrap();

    let reply = pod.run(|| tcp_request(server.app_v6(), "out6")).unwrap();
    assert_eq!(reply.response, server_app.reply_to("out6"));
    let seen = proxy
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .expect("the proxy took the IPv6 connection on 15001");
    assert_eq!(seen.original_dst, Some(server.app_v6()), "{seen:?}");

    let reply = client.run(|| tcp_request(pod.app_v6(), "in6")).unwrap();
    assert_eq!(reply.response, app.reply_to("in6"));
    let seen = proxy
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .expect("the proxy took the IPv6 connection on 15006");
    assert_eq!(seen.destination(), pod.app_v6());
    let passthrough = app.received().last().unwrap().peer.ip();
    assert_eq!(passthrough, "::6".parse::<IpAddr>().unwrap());
    agent.stop().unwrap();
}

/// Without `ISTIO_DUAL_STACK`, istio writes no ip6tables rules for a pod whose first address is
/// IPv4: its IPv6 reaches the app directly both ways, and its proxy, listening on `[::]`, sees
/// none of it. Once the proxy is gone, IPv6 inbound still reaches the app (IPv4 does not).
#[test]
fn ipv6_goes_around_the_proxy_where_istio_captures_ipv4_only() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let server_app = EchoServer::app(&server).unwrap();
    let client = node.pod("default", "client").unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    let app = EchoServer::app(&pod).unwrap();

    let reply = pod.run(|| tcp_request(server.app_v6(), "out6")).unwrap();
    assert_eq!(reply.response, server_app.reply_to("out6"));
    assert_eq!(
        server_app.received().last().unwrap().peer.ip(),
        IpAddr::V6(pod.ipv6())
    );
    let reply = client.run(|| tcp_request(pod.app_v6(), "in6")).unwrap();
    assert_eq!(reply.response, app.reply_to("in6"));
    assert_eq!(
        app.received().last().unwrap().peer.ip(),
        IpAddr::V6(client.ipv6())
    );
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());

    drop(proxy);
    let reply = client
        .run(|| tcp_request(pod.app_v6(), "in6 alone"))
        .unwrap();
    assert_eq!(reply.response, app.reply_to("in6 alone"));
    let refused = client.run(|| tcp_attempt(pod.app_v4(), "in4 alone"));
    assert!(refused.is_err(), "IPv4 is captured: {refused:?}");
    agent.stop().unwrap();
}

/// An IPv6-only pod has no IPv4 route: a connection to an IPv4 address fails at once
/// (`ENETUNREACH`), as under istio, whose rules act after routing and never see it; also on a
/// port `includeOutboundPorts` names. IPv6 is captured as ever.
#[test]
fn ipv4_from_an_ipv6_only_pod_is_unreachable_as_without_the_mesh() {
    let meta = sidecar_pod(
        &[("traffic.sidecar.istio.io/includeOutboundPorts", "9090")],
        &[],
    );
    let Some((node, agent, pod)) = sidecar_node_in(Families::Ipv6Only, meta) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let _server_app = EchoServer::app(&server).unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    for port in [9090, APP_PORT] {
        let ipv4 = SocketAddr::from(([10, 244, 200, 1], port));
        let error = pod
            .run(|| TcpStream::connect_timeout(&ipv4, WAIT))
            .expect_err("no IPv4 route");
        assert_eq!(
            error.raw_os_error(),
            Some(libc::ENETUNREACH),
            "{ipv4}: {error}"
        );
    }
    pod.run(|| tcp_request(server.app_v6(), "out6")).unwrap();
    let seen = proxy
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .expect("the proxy took the IPv6 connection on 15001");
    assert_eq!(seen.original_dst, Some(server.app_v6()), "{seen:?}");
    assert_eq!(proxy.seen().len(), 1, "{:?}", proxy.seen());
    agent.stop().unwrap();
}

#[test]
fn annotations_and_proxy_settings_shape_the_capture() {
    let Some(server_node) = Node::with_sidecar_pods(&[]) else {
        return;
    };
    // The server's address is known only once it exists; the sidecar pod's policy names it.
    let server = server_node.pod("default", "server").unwrap();
    let excluded = format!("{}/32", server.ipv4());
    let shaped = sidecar_pod(
        &[
            (
                "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                &excluded,
            ),
            ("traffic.sidecar.istio.io/includeInboundPorts", "9090"),
            ("traffic.sidecar.istio.io/excludeOutboundPorts", ""),
        ],
        &[("ISTIO_META_DNS_CAPTURE", "true")],
    );
    let mut policy = ambient_policy();
    policy.pods.insert("default/shaped".into(), shaped);
    server_node.files.write_policy(&policy).unwrap();
    let agent = server_node.start_agent();
    let server_app = EchoServer::app(&server).unwrap();
    let dns_server = EchoServer::start_udp(server.netns(), "dns", addr(server.ipv4(), 53)).unwrap();
    let client = server_node.pod("default", "client").unwrap();
    let pod = server_node.pod("default", "shaped").unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    let app = EchoServer::app(&pod).unwrap();
    let dns_proxy =
        EchoServer::start_udp(pod.netns(), "dns-proxy", addr(Ipv4Addr::LOCALHOST, 15053)).unwrap();

    // An excluded range goes direct; DNS goes to the proxy's 15053 whatever the range says.
    let reply = pod
        .run(|| tcp_request(server.app_v4(), "excluded"))
        .unwrap();
    assert_eq!(reply.response, server_app.reply_to("excluded"));
    let answer = pod
        .run(|| udp_request(addr(server.ipv4(), 53), "q"))
        .unwrap();
    assert_eq!(answer.response, dns_proxy.reply_to("q"));
    assert_eq!(
        answer.from,
        addr(server.ipv4(), 53),
        "the app sees the server it asked"
    );
    assert!(dns_server.received().is_empty());

    // Only the included inbound port is captured: 8080 reaches the app directly.
    let reply = client.run(|| tcp_request(pod.app_v4(), "in")).unwrap();
    assert_eq!(reply.response, app.reply_to("in"));
    assert_eq!(app.received()[0].peer.ip(), client.ipv4());
    let metrics_port = EchoServer::start(pod.netns(), "9090", addr(pod.ipv4(), 9090)).unwrap();
    let reply = client
        .run(|| tcp_request(addr(pod.ipv4(), 9090), "captured"))
        .unwrap();
    assert_eq!(reply.response, metrics_port.reply_to("captured"));
    assert!(proxy
        .wait_for(
            |s| s.listener == INBOUND_PORT && s.local.port() == 9090,
            WAIT
        )
        .is_some());
    agent.stop().unwrap();
}

#[test]
fn an_excluded_interface_is_not_captured_inbound() {
    let excluded = sidecar_pod(
        &[("traffic.sidecar.istio.io/excludeInterfaces", "eth0")],
        &[],
    );
    let Some((node, agent, pod)) = sidecar_node(excluded) else {
        return;
    };
    let client = node.pod("default", "client").unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    let app = EchoServer::app(&pod).unwrap();
    let reply = client.run(|| tcp_request(pod.app_v4(), "direct")).unwrap();
    assert_eq!(reply.response, app.reply_to("direct"));
    assert_eq!(app.received()[0].peer.ip(), client.ipv4());
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());
    agent.stop().unwrap();
}

/// Outbound as istio's `-o <interface> -j RETURN` leaves it: what the pod routes out of an
/// excluded interface (a secondary network, here with a VM's namespace as its far end) is not
/// captured, what it routes out of another still is, and a route added later is followed.
#[test]
fn outbound_routed_out_of_an_excluded_interface_is_not_captured() {
    let excluded = sidecar_pod(
        &[("traffic.sidecar.istio.io/excludeInterfaces", "net1")],
        &[],
    );
    let Some((node, agent, pod)) = sidecar_node(excluded) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let server_app = EchoServer::app(&server).unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    let network = VirtualMachine::behind(&pod, "net1");
    let beyond = Ipv4Addr::new(192, 168, 91, 1);
    ip(&[
        "-n",
        network.netns.name(),
        "addr",
        "add",
        "192.168.91.1/32",
        "dev",
        "lo",
    ])
    .unwrap();
    let far_end = EchoServer::start(&network.netns, "far-end", addr(network.ipv4, 9000)).unwrap();
    let beyond_end = EchoServer::start(&network.netns, "beyond", addr(beyond, 9000)).unwrap();
    // The proxy's record of the connection the pod made from `local`.
    let captured = |local: SocketAddr| {
        proxy
            .seen()
            .iter()
            .any(|s| s.listener == OUTBOUND_PORT && s.peer == local)
    };
    // Sent until one is not captured: weir follows the pod's routes as they change.
    let uncaptured = |target: SocketAddr, echo: &EchoServer, message: &str| {
        try_wait_until(WAIT, || {
            let reply = pod.run(|| tcp_request(target, message)).ok()?;
            assert_eq!(reply.response, echo.reply_to(message));
            (!captured(reply.local)).then_some(())
        })
        .is_some()
    };

    assert!(uncaptured(addr(network.ipv4, 9000), &far_end, "on net1"));
    let reply = pod.run(|| tcp_request(server.app_v4(), "on eth0")).unwrap();
    assert_eq!(reply.response, server_app.reply_to("on eth0"));
    assert!(captured(reply.local), "{:?}", proxy.seen());

    // A route out of net1 added now: followed.
    let target = addr(beyond, 9000);
    let beyond_route = ["-n", pod.netns().name(), "route", "add", "192.168.91.0/24"];
    ip(&[&beyond_route[..], &["via", "192.168.77.2", "dev", "net1"]].concat()).unwrap();
    assert!(uncaptured(target, &beyond_end, "beyond net1"));
    agent.stop().unwrap();
}

#[test]
fn only_included_ranges_and_ports_are_captured() {
    let Some(node) = Node::with_sidecar_pods(&[]) else {
        return;
    };
    // The pods' addresses are known only once they exist; the sidecar pods' policy names them.
    let server = node.pod("default", "server").unwrap();
    let other = node.pod("default", "other").unwrap();
    let included = format!("{}/32", server.ipv4());
    let mut policy = ambient_policy();
    let by_range = sidecar_pod(
        &[(
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            &included,
        )],
        &[],
    );
    let by_port = sidecar_pod(
        &[
            ("traffic.sidecar.istio.io/includeOutboundIPRanges", ""),
            ("traffic.sidecar.istio.io/includeOutboundPorts", "9090"),
        ],
        &[],
    );
    policy.pods.insert("default/by-range".into(), by_range);
    policy.pods.insert("default/by-port".into(), by_port);
    node.files.write_policy(&policy).unwrap();
    let agent = node.start_agent();
    let server_app = EchoServer::app(&server).unwrap();
    let server_9090 = EchoServer::start(server.netns(), "9090", addr(server.ipv4(), 9090)).unwrap();
    let other_app = EchoServer::app(&other).unwrap();

    let pod = node.pod("default", "by-range").unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    let reply = pod.run(|| tcp_request(other.app_v4(), "outside")).unwrap();
    assert_eq!(reply.response, other_app.reply_to("outside"));
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());
    let reply = pod.run(|| tcp_request(server.app_v4(), "inside")).unwrap();
    assert_eq!(reply.response, server_app.reply_to("inside"));
    let seen = proxy.wait_for(|s| s.listener == OUTBOUND_PORT, WAIT);
    assert_eq!(seen.unwrap().original_dst, Some(server.app_v4()));

    let pod = node.pod("default", "by-port").unwrap();
    let proxy = SidecarStandIn::start(&pod).unwrap();
    let reply = pod
        .run(|| tcp_request(server.app_v4(), "no range"))
        .unwrap();
    assert_eq!(reply.response, server_app.reply_to("no range"));
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());
    let target = addr(server.ipv4(), 9090);
    let reply = pod.run(|| tcp_request(target, "port")).unwrap();
    assert_eq!(reply.response, server_9090.reply_to("port"));
    let seen = proxy.wait_for(|s| s.listener == OUTBOUND_PORT, WAIT);
    assert_eq!(seen.unwrap().original_dst, Some(target));
    agent.stop().unwrap();
}
