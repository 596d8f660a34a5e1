//! Sidecar pods through the node's real CNI chain and the real agent: their traffic goes to their
//! own istio-proxy (the stand-in) as istio-cni's sidecar rules send it, and istio's
//! `istio-validation` check passes in them. No ztunnel runs in these tests: a sidecar pod never
//! waits for one.
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    os::{
        fd::{AsFd, AsRawFd},
        unix::process::CommandExt,
    },
    process::Command as Process,
    time::Duration,
};

use weir_agent::policy::local::ObjectMeta;
use weir_common::{
    maps, ConnectionKey, NatEntry, PortKey, INBOUND_PORT, OUTBOUND_PORT, REROUTE_NAT_ENTRIES,
};
use weir_tests::{
    agent::Agent,
    chain::{ambient_policy, listed_pods, wait_for_metric, weir_only, CniChainNode as Node, WAIT},
    cni::Command,
    istio_iptables,
    netns::{ip, ip_output, owning_user_namespace},
    privileged, raw,
    sidecar::{as_proxy, sidecar_pod, Interception, SidecarStandIn, PROXY_ID},
    tcp_connect_from, tcp_request,
    traffic::{read_line, write_line},
    try_wait_until, udp_request,
    virtual_machine::VirtualMachine,
    wait_until, EchoServer, Families, Pod, PodSpec, TestNode, APP_PORT,
};

/// A node whose policy makes `default/sidecar` the sidecar pod `meta`, its agent, and that pod
/// (made through the node's CNI chain).
fn sidecar_node(meta: ObjectMeta) -> Option<(Node, Agent, Pod)> {
    sidecar_node_in(Families::default(), meta)
}

/// [`sidecar_node`], its pods getting the addresses of `families`.
fn sidecar_node_in(families: Families, meta: ObjectMeta) -> Option<(Node, Agent, Pod)> {
    let node = Node::with_sidecar_pods_in(families, &[("sidecar", meta)])?;
    let agent = node.start_agent();
    let pod = node.pod("default", "sidecar").unwrap();
    Some((node, agent, pod))
}

/// Runs the `istio-validation` stand-in in the pod as the proxy's uid and gid; its exit code.
fn run_validation(pod: &Pod) -> i32 {
    run_validation_in(pod, false)
}

/// [`run_validation`], as the proxy's ids in the pod's own user namespace when
/// `in_user_namespace` (a pod with `hostUsers: false`), else as the node's.
fn run_validation_in(pod: &Pod, in_user_namespace: bool) -> i32 {
    let netns = pod.netns().open().unwrap();
    let userns = in_user_namespace.then(|| owning_user_namespace(netns.as_fd()).unwrap());
    let userns_fd = userns.as_ref().map(|fd| fd.as_raw_fd());
    let mut validation = Process::new(env!("CARGO_BIN_EXE_istio-validation"));
    validation.env("INSTANCE_IP", pod.ips()[0].to_string());
    let fd = netns.as_raw_fd();
    // SAFETY: async-signal-safe syscalls; the fds stay open until the child has exec'd. The
    // user namespace first (which owns the netns), the netns while the child may still enter
    // it, then the proxy's identity; supplementary groups are the node's to set.
    unsafe {
        validation.pre_exec(move || {
            let id = PROXY_ID;
            let failed = userns_fd.is_some_and(|u| libc::setns(u, libc::CLONE_NEWUSER) != 0)
                || libc::setns(fd, libc::CLONE_NEWNET) != 0
                || (userns_fd.is_none() && libc::setgroups(0, std::ptr::null()) != 0)
                || libc::setresgid(id, id, id) != 0
                || libc::setresuid(id, id, id) != 0;
            if failed {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = validation.output().unwrap();
    eprintln!(
        "istio-validation in {}: {}{}",
        pod.name(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output.status.code().unwrap_or(-1)
}

#[test]
fn istio_validation_passes_in_a_sidecar_pod_and_fails_without_weir() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    let plain = node.pod("default", "plain").unwrap();
    assert_eq!(
        run_validation(&plain),
        126,
        "no redirection: validation fails"
    );
    assert_eq!(run_validation(&pod), 0, "weir's redirection validates");
    agent.stop().unwrap();
}

/// A pod whose first address is IPv6 is validated over IPv6: its proxy's `[::1]` to `[::6]:15002`
/// must hairpin to 15006 as istio's ip6tables rules send it, or the pod never starts.
#[test]
fn istio_validation_passes_in_sidecar_pods_whose_first_address_is_ipv6() {
    for families in [Families::Ipv6Only, Families::DualStackIpv6First] {
        let Some((_node, agent, pod)) = sidecar_node_in(families, sidecar_pod(&[], &[])) else {
            return;
        };
        assert!(pod.ips()[0].is_ipv6(), "{families:?}: {pod:?}");
        assert_eq!(run_validation(&pod), 0, "{families:?}");
        agent.stop().unwrap();
    }
}

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
    let refused = client.run(|| tcp_request(pod.app_v4(), "in4 alone"));
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
fn an_invalid_sidecar_annotation_fails_the_add_naming_it() {
    let bad = sidecar_pod(&[("sidecar.istio.io/interceptionMode", "NONE")], &[]);
    let Some(node) = Node::with_sidecar_pods(&[("bad", bad)]) else {
        return;
    };
    let agent = node.start_agent();
    let failed = node
        .test_node()
        .try_add_pod(PodSpec {
            namespace: "default".into(),
            ..PodSpec::new("bad")
        })
        .unwrap()
        .expect_err("the ADD fails");
    let error = format!("{:#}", failed.error);
    assert!(
        error.contains("sidecar.istio.io/interceptionMode"),
        "{error}"
    );
    let failed_pods = [("mode", "sidecar"), ("state", "failed")];
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value("weir_pods", &failed_pods),
        Some(1.0),
        "{metrics}"
    );
    // The runtime tears the sandbox down with a DEL: the pod is no longer a failure to see.
    drop(failed);
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value("weir_pods", &failed_pods),
        Some(0.0),
        "{metrics}"
    );
    agent.stop().unwrap();
}

#[test]
fn del_unenrolls_a_sidecar_pod_and_leaves_no_entry() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    // 15020, 15021, 15090 inbound; 15020 outbound.
    assert_eq!(port_entries(&node, &pod), 4);
    weir_only(
        &node,
        Command::Del,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .unwrap();
    assert_eq!(port_entries(&node, &pod), 0);
    assert_eq!(run_validation(&pod), 126, "the pod is no longer redirected");
    agent.stop().unwrap();
}

/// The pod stays redirected while no agent runs; the next agent takes it back from the pinned
/// maps without telling ztunnel of it, and a DEL then removes every entry of its lists, which
/// that agent had to find in the maps.
#[test]
fn a_restart_keeps_a_sidecar_pod_redirected_and_away_from_ztunnel() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    agent.stop().unwrap();
    assert_eq!(run_validation(&pod), 0, "redirected while no agent runs");

    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    assert!(ztunnel.wait_for_snapshot(WAIT));
    let named = ztunnel
        .events()
        .into_iter()
        .any(|e| e.uid() == Some(pod.uid()));
    assert!(!named, "ztunnel never hears of a sidecar pod");
    let listed = listed_pods(&agent);
    let row = listed.iter().find(|row| row["uid"] == pod.uid()).unwrap();
    assert_eq!(row["mode"], "sidecar", "{row:#}");
    assert_eq!(run_validation(&pod), 0);

    weir_only(
        &node,
        Command::Del,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .unwrap();
    assert_eq!(port_entries(&node, &pod), 0);
    assert_eq!(run_validation(&pod), 126);
    agent.stop().unwrap();
}

/// The entries of `pod`'s translation map in the pinned `REROUTE_NAT`, two per connection; zero
/// when it has none.
fn translations(node: &Node, pod: &Pod) -> usize {
    let cookie = pod.netns().cookie().unwrap();
    let map = node.test_node().pinned_map(maps::REROUTE_NAT).unwrap();
    let pods: aya::maps::HashOfMaps<_, u64> =
        aya::maps::HashOfMaps::try_from(aya::maps::Map::HashOfMaps(map)).unwrap();
    let Ok(translations) = pods.get(&cookie, 0) else {
        return 0;
    };
    let translations: aya::maps::HashMap<_, ConnectionKey, NatEntry> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(translations)).unwrap();
    translations.keys().filter_map(Result::ok).count()
}

/// The pod's entries in the pinned `SIDECAR_PORTS`, as bpftool would find them.
fn port_entries(node: &Node, pod: &Pod) -> usize {
    let cookie = pod.netns().cookie().unwrap();
    let map = node.test_node().pinned_map(maps::SIDECAR_PORTS).unwrap();
    let ports: aya::maps::HashMap<_, PortKey, u8> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(map)).unwrap();
    ports
        .keys()
        .filter_map(Result::ok)
        .filter(|key| key.netns_cookie == cookie)
        .count()
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

fn addr(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

#[test]
fn tcp_from_a_rerouted_interface_goes_to_the_proxy_for_included_ranges() {
    rerouted_through_the_proxy(Interception::Redirect);
}

#[test]
fn tproxy_mode_reroutes_with_the_original_destination_as_local_address() {
    rerouted_through_the_proxy(Interception::Tproxy);
}

/// A VM behind a sidecar pod's rerouted interface (KubeVirt's): its TCP to the pod's included
/// outbound ranges goes to the pod's proxy on 15001 with the original destination, and the
/// VM's connection is with that destination, also where the interface is excluded too (istio's
/// rerouting rules come first); TCP to anything else goes where the pod routes it, and IPv6,
/// which the pod does not capture, is not rerouted. Kept while no agent runs and by the next
/// one; the pod's DEL takes it away. In REDIRECT mode the connection is translated to the
/// proxy at the pod's address; in TPROXY mode it is delivered with its destination, which the
/// proxy's transparent listener answers from.
fn rerouted_through_the_proxy(mode: Interception) {
    let Some(node) = Node::with_sidecar_pods(&[]) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let included = format!("{}/32", server.ipv4());
    let mut policy = ambient_policy();
    let mode_name = match mode {
        Interception::Redirect => "REDIRECT",
        Interception::Tproxy => "TPROXY",
    };
    let mut vm_host = sidecar_pod(
        &[
            ("sidecar.istio.io/interceptionMode", mode_name),
            ("istio.io/reroute-virtual-interfaces", "tap0"),
            ("traffic.sidecar.istio.io/excludeInterfaces", "tap0"),
            (
                "traffic.sidecar.istio.io/includeOutboundIPRanges",
                &included,
            ),
        ],
        &[],
    );
    if mode == Interception::Tproxy {
        vm_host.containers.last_mut().unwrap().run_as_user = Some(0);
    }
    policy.pods.insert("default/vmhost".into(), vm_host);
    node.files.write_policy(&policy).unwrap();
    let agent = node.start_agent();
    let server_app = EchoServer::app(&server).unwrap();
    let host = node.pod("default", "vmhost").unwrap();
    let host_app = EchoServer::app(&host).unwrap();
    let proxy = SidecarStandIn::start_with(&host, mode).unwrap();
    // Made after the pod's enrollment, as a VM's interface is: weir sets it up when it appears.
    let vm = VirtualMachine::behind(&host, "tap0");
    let through_proxy = |message: &str| -> bool {
        let Ok(reply) = vm.netns.run(|| tcp_request(server.app_v4(), message)) else {
            return false;
        };
        assert_eq!(reply.response, server_app.reply_to(message));
        assert_eq!(reply.peer_seen_by_client, server.app_v4());
        let seen = proxy.wait_for(
            |s| s.listener == OUTBOUND_PORT && s.peer == reply.local,
            WAIT,
        );
        let seen = seen.unwrap_or_else(|| panic!("{message:?} did not go through the proxy"));
        assert_eq!(seen.original_dst, Some(server.app_v4()), "SO_ORIGINAL_DST");
        true
    };
    assert!(try_wait_until(WAIT, || through_proxy("from the vm")).is_some());

    let reply = vm
        .netns
        .run(|| tcp_request(host.app_v4(), "not included"))
        .unwrap();
    assert_eq!(reply.response, host_app.reply_to("not included"));
    assert_eq!(
        host_app.received()[0].peer,
        reply.local,
        "straight to the app"
    );
    assert!(proxy.seen().iter().all(|s| s.peer != reply.local));
    let rules = |family: &str| ip_output(&["-n", host.netns().name(), family, "rule"]).unwrap();
    let rule = format!(
        "from all to {} iif tap0 ipproto tcp lookup 100",
        server.ipv4()
    );
    assert!(rules("-4").contains(&rule), "{}", rules("-4"));
    assert!(!rules("-6").contains("tap0"), "{}", rules("-6"));

    agent.stop().unwrap();
    assert!(through_proxy("while no agent runs"));
    let agent = node.start_agent();
    assert!(through_proxy("after a restart"));
    // Closed, the connections leave no translation behind.
    let freed = || translations(&node, &host) == 0;
    wait_until(WAIT, "closed connections' translations to go", freed);

    weir_only(
        &node,
        Command::Del,
        host.runtime_conf(),
        Some(host.prev_result()),
    )
    .unwrap();
    assert!(!rules("-4").contains("tap0"), "{}", rules("-4"));
    assert_eq!(translations(&node, &host), 0);
    let before = proxy.seen().len();
    let _ = vm
        .netns
        .run(|| tcp_request(server.app_v4(), "after the DEL"));
    assert_eq!(proxy.seen().len(), before);
    agent.stop().unwrap();
}

/// The REDIRECT-mode sidecar pods [`two_vms_at_one_address`] makes, each with a VM behind
/// `tap0`.
const VM_HOSTS: [&str; 2] = ["vm-a", "vm-b"];

/// Two REDIRECT-mode sidecar pods whose VMs have one address, as KubeVirt's masquerade binding
/// gives every VM the same one, and the server their included range holds, which keeps each
/// connection for as long as its client does.
struct TwoVms {
    node: Node,
    agent: Agent,
    _server_pod: Pod,
    server: EchoServer,
    pods: [Pod; 2],
    proxies: [SidecarStandIn; 2],
    vms: [VirtualMachine; 2],
}

/// A source port both VMs connect from in the tests below.
const VM_PORT: u16 = 40_000;

fn two_vms_at_one_address() -> Option<TwoVms> {
    let node = Node::with_sidecar_pods(&[])?;
    let server_pod = node.pod("default", "server").unwrap();
    let included = format!("{}/32", server_pod.ipv4());
    let mut policy = ambient_policy();
    for name in VM_HOSTS {
        let meta = sidecar_pod(
            &[
                ("traffic.sidecar.istio.io/kubevirtInterfaces", "tap0"),
                (
                    "traffic.sidecar.istio.io/includeOutboundIPRanges",
                    &included,
                ),
            ],
            &[],
        );
        policy.pods.insert(format!("default/{name}"), meta);
    }
    node.files.write_policy(&policy).unwrap();
    let agent = node.start_agent();
    let server =
        EchoServer::start_lasting(server_pod.netns(), "server", server_pod.app_v4()).unwrap();
    let pods = VM_HOSTS.map(|name| node.pod("default", name).unwrap());
    let proxies = pods
        .each_ref()
        .map(|pod| SidecarStandIn::start(pod).unwrap());
    let vms = pods
        .each_ref()
        .map(|pod| VirtualMachine::behind(pod, "tap0"));
    assert_eq!(vms[0].ipv4, vms[1].ipv4);
    // Until weir has set up a VM's interface, which it does once the interface appears, TCP
    // from the VM is refused.
    for (vm, proxy) in vms.iter().zip(&proxies) {
        let through_proxy = || {
            vm.netns
                .run(|| tcp_request(server.addr(), "ready"))
                .is_ok_and(|reply| proxy.seen().iter().any(|s| s.peer == reply.local))
        };
        assert!(try_wait_until(WAIT, through_proxy).is_some());
    }
    let vms = TwoVms {
        node,
        agent,
        _server_pod: server_pod,
        server,
        pods,
        proxies,
        vms,
    };
    vms.wait_for_no_translations();
    Some(vms)
}

impl TwoVms {
    /// Waits for the pods' closed connections' translations to go: each pod's map is empty.
    fn wait_for_no_translations(&self) {
        for pod in &self.pods {
            let freed = || translations(&self.node, pod) == 0;
            wait_until(WAIT, "closed connections' translations to go", freed);
        }
    }

    /// Connects VM `vm` from `port` to the server and waits for its pod's proxy to have it,
    /// with the server as its original destination; the connection is held.
    fn hold_connection(&self, vm: usize, port: u16) -> TcpStream {
        let server = self.server.addr();
        let stream = self.vms[vm]
            .netns
            .run(|| tcp_connect_from(port, server))
            .unwrap_or_else(|error| panic!("VM {}: {error}", VM_HOSTS[vm]));
        let from = stream.local_addr().unwrap();
        let seen = self.proxies[vm].wait_for(|s| s.peer == from, WAIT);
        let seen = seen.unwrap_or_else(|| panic!("{from} did not reach {}'s proxy", VM_HOSTS[vm]));
        assert_eq!(seen.original_dst, Some(server), "SO_ORIGINAL_DST");
        stream
    }

    /// Sends `message` on a held connection: the server answers it.
    fn exchange(&self, stream: &TcpStream, message: &str) {
        write_line(stream, message).unwrap();
        assert_eq!(read_line(stream).unwrap(), self.server.reply_to(message));
    }
}

/// Every KubeVirt VM has one address: a VM's connection is its own pod's, even from the same
/// port to the same destination as another pod's VM, and goes to its own pod's proxy with its
/// own original destination while the other's is open. Once both are closed (FIN both ways),
/// their translations are gone, as are those of a connection the VM resets.
#[test]
fn vms_at_one_address_reach_their_own_pods_proxy() {
    let Some(vms) = two_vms_at_one_address() else {
        return;
    };
    let held = vms.hold_connection(0, VM_PORT);
    let from = held.local_addr().unwrap();
    let other = vms.hold_connection(1, VM_PORT);
    assert_eq!(other.local_addr().unwrap(), from);
    let taken = vms.proxies[0]
        .seen()
        .iter()
        .filter(|s| s.peer == from)
        .count();
    assert_eq!(
        taken, 1,
        "{}'s proxy took the other VM's connection",
        VM_HOSTS[0]
    );
    vms.exchange(&other, "from b");
    vms.exchange(&held, "from a");
    drop((held, other));
    vms.wait_for_no_translations();

    let reset = vms.hold_connection(1, VM_PORT + 1);
    socket2::SockRef::from(&reset)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(reset);
    vms.wait_for_no_translations();
    vms.agent.stop().unwrap();
}

/// The MAC address of the pod's `interface`.
fn link_mac(pod: &Pod, interface: &str) -> [u8; 6] {
    let link = ip_output(&["-n", pod.netns().name(), "link", "show", interface]).unwrap();
    let mac = link
        .split_whitespace()
        .skip_while(|word| *word != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC in {link}"));
    let octets: Vec<u8> = mac
        .split(':')
        .map(|octet| u8::from_str_radix(octet, 16).unwrap())
        .collect();
    octets.try_into().unwrap()
}

/// A VM's SYN flood (half-open: from addresses beside its own, whose SYN-ACKs nobody answers)
/// past its pod's translation bound leaves another pod's open connection translated.
#[test]
fn a_vms_syn_flood_leaves_other_pods_translations_alone() {
    let Some(vms) = two_vms_at_one_address() else {
        return;
    };
    let held = vms.hold_connection(1, VM_PORT);
    let before = translations(&vms.node, &vms.pods[1]);
    assert_eq!(before, 2, "two per connection");
    let flood = REROUTE_NAT_ENTRIES / 2 + 1_000;
    let mac = link_mac(&vms.pods[0], "tap0");
    let spoofed = Ipv4Addr::new(192, 168, 77, 3);
    let syns = (0..flood).map(|n| raw::Syn {
        source: addr(spoofed, 1_024 + n as u16),
        destination: vms.server.addr(),
        shape: raw::VlanTagged(&[], mac),
        tcp: raw::Tcp::SYN,
    });
    let sent = vms.vms[0].netns.run(|| raw::flood(syns, mac)).unwrap();
    assert_eq!(sent, flood as usize);
    // Past its bound, the flooding pod's map recycles its own entries.
    let bound = REROUTE_NAT_ENTRIES as usize;
    let filled = || Some(translations(&vms.node, &vms.pods[0])).filter(|n| *n > bound / 2);
    let flooding = wait_until(WAIT, "the flood to fill its pod's map", filled);
    assert!(flooding <= bound, "{flooding} translations");
    assert_eq!(translations(&vms.node, &vms.pods[1]), before);
    vms.exchange(&held, "after the flood");
    vms.agent.stop().unwrap();
}

/// A pod in a user namespace of its own (`hostUsers: false`): its proxy and istio-validation
/// run as 1337 there, which the node sees as another id. weir maps the proxy's ids through the
/// pod's maps: istio-validation passes as the pod's 1337, and the node's 1337, which is nobody
/// in the pod, is not taken for the proxy.
#[test]
fn a_user_namespaced_pods_proxy_is_known_by_its_ids_in_the_pod() {
    let Some(node) = Node::with_sidecar_pods(&[("userns", sidecar_pod(&[], &[]))]) else {
        return;
    };
    let agent = node.start_agent();
    let pod = node
        .test_node()
        .add_pod_with(PodSpec {
            namespace: "default".into(),
            user_namespace: Some(100_000),
            ..PodSpec::new("userns")
        })
        .unwrap();
    assert_eq!(run_validation_in(&pod, true), 0, "as the pod's proxy");
    assert_eq!(run_validation_in(&pod, false), 126, "as the node's 1337");
    agent.stop().unwrap();
}
