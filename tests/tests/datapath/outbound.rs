//! What an enrolled pod sends: TCP to ztunnel's 15001 with its original destination, DNS to
//! the DNS proxy, and what is left alone (ztunnel's own traffic, other families, large transfers).
use super::*;

#[test]
fn outbound_tcp_lands_on_15001_with_the_original_destination() {
    let fixture = privileged!(DatapathNode::new());
    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&client).unwrap();
    let datapath = fixture.enrolled(&client, PodOptions::default());

    let destinations = [
        IpAddr::V4(server.ipv4()),
        IpAddr::V6(server.ipv6()),
        // An AF_INET6 socket to a v4-mapped address fires connect6 only.
        v4_mapped(server.ipv4()),
    ];
    for destination in destinations {
        let target = SocketAddr::new(destination, APP_PORT);
        let reply = client
            .run(|| tcp_request(target, "hello"))
            .unwrap_or_else(|e| panic!("request to {target}: {e}"));
        assert_eq!(reply.response, echo.reply_to("hello"), "to {target}");
        // The app sees the address it asked for, as with iptables REDIRECT.
        assert_eq!(reply.peer_seen_by_client, target);

        let expected = SocketAddr::new(destination.to_canonical(), APP_PORT);
        let seen = ztunnel
            .wait_for(
                |s| s.listener == OUTBOUND_PORT && s.peer == sockopt::canonical(reply.local),
                WAIT,
            )
            .unwrap_or_else(|| panic!("connection to {target} never reached 15001"));
        assert_eq!(seen.original_dst, Some(expected), "SO_ORIGINAL_DST");
        // ztunnel sees the pod as the source, not loopback.
        assert_eq!(seen.peer.ip(), sockopt::canonical(reply.local).ip());
        assert!(client.ips().contains(&seen.peer.ip()), "{seen:?}");
        // ...and dialed the real destination from the pod's own address.
        let received = echo
            .wait_for(|r| r.line == "hello" && r.local.ip() == expected.ip(), WAIT)
            .expect("server got the bytes");
        assert!(client.ips().contains(&received.peer.ip()), "{received:?}");
    }
    assert_eq!(counters(&datapath, &client).outbound, 3);
    datapath.uninstall().wait().unwrap();
}

#[test]
fn dns_goes_to_the_dns_proxy_and_answers_come_from_the_resolver() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let resolver = SocketAddr::new(IpAddr::V4(fixture.node().gateway_v4()), DNS_PORT);
    let resolver_v6 = SocketAddr::new(IpAddr::V6(fixture.node().gateway_v6()), DNS_PORT);
    let real_resolver =
        EchoServer::start_udp(fixture.node().netns(), "node-dns", resolver).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    for target in [resolver, resolver_v6] {
        let unconnected = pod.run(|| udp_request(target, "query")).unwrap();
        assert_eq!(unconnected.response, format!("{DNS_REPLY_PREFIX}query"));
        assert_eq!(
            unconnected.from, target,
            "answer appears to come from the resolver"
        );

        let connected = pod.run(|| udp_request_connected(target, "query")).unwrap();
        assert_eq!(connected.response, format!("{DNS_REPLY_PREFIX}query"));
        assert_eq!(connected.from, target);
        assert_eq!(
            connected.peer,
            Some(target),
            "getpeername shows the resolver"
        );

        let tcp = pod.run(|| tcp_request(target, "query")).unwrap();
        assert!(tcp.response.starts_with(DNS_REPLY_PREFIX), "{tcp:?}");
        assert_eq!(tcp.peer_seen_by_client, target);
    }
    let at_proxy = ztunnel
        .seen()
        .into_iter()
        .filter(|s| s.listener == DNS_PROXY_PORT)
        .count();
    assert_eq!(at_proxy, 6);
    assert_eq!(counters(&datapath, &pod).dns, 6);
    assert!(real_resolver.received().is_empty());
    // ztunnel's DNS proxy never asks for an original destination, so the TCP queries leave no
    // entry where the ones ztunnel asks for would be pushed out by them.
    let pinned = fixture.node().pinned_map(maps::CONN_ORIG_DST).unwrap();
    let original_destinations: aya::maps::HashMap<_, ConnectionKey, Endpoint> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(pinned)).unwrap();
    let to_the_dns_proxy: Vec<ConnectionKey> = original_destinations
        .keys()
        .map(Result::unwrap)
        .filter(|key| key.listener.port == DNS_PROXY_PORT)
        .collect();
    assert!(to_the_dns_proxy.is_empty(), "{to_the_dns_proxy:?}");

    // DNS capture off for this pod: the query reaches the real resolver.
    datapath
        .enroll(pod.workload(PodOptions {
            dns_capture: false,
            ..PodOptions::default()
        }))
        .wait()
        .unwrap();
    let direct = pod.run(|| udp_request(resolver, "query")).unwrap();
    assert_eq!(direct.response, real_resolver.reply_to("query"));
    assert_eq!(direct.from, resolver);
    datapath.uninstall().wait().unwrap();
}

/// A datagram from another pod's port 15053 to a socket that asked the resolver is shown from
/// its real sender: only the DNS proxy's own answers, from loopback, appear to come from the
/// resolver.
#[test]
fn only_the_dns_proxys_answers_appear_to_come_from_the_resolver() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, other) = (fixture.pod("app"), fixture.pod("other"));
    let _ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let resolver = SocketAddr::new(IpAddr::V4(fixture.node().gateway_v4()), DNS_PORT);
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    let (app, answered_from) = pod
        .run(|| {
            let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            socket.set_read_timeout(Some(WAIT))?;
            socket.send_to(b"query", resolver)?;
            let (_, from) = socket.recv_from(&mut [0; 512])?;
            std::io::Result::Ok((socket, from))
        })
        .unwrap();
    assert_eq!(answered_from, resolver, "the DNS proxy's answer");

    let app_address = SocketAddr::new(IpAddr::V4(pod.ipv4()), app.local_addr().unwrap().port());
    let spoofer = SocketAddr::new(IpAddr::V4(other.ipv4()), DNS_PROXY_PORT);
    other
        .run(|| std::net::UdpSocket::bind(spoofer)?.send_to(b"spoofed", app_address))
        .unwrap();
    let mut buf = [0; 512];
    let (len, from) = app.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..len], b"spoofed");
    assert_eq!(from, spoofer, "shown from its real sender");
    datapath.uninstall().wait().unwrap();
}

/// A pod whose CNI result names one family still has addresses of the other (IPv6 link-local
/// ones at least, SLAAC or a secondary network's): its TCP in that family has no pod address to
/// go to ztunnel from, and must not leave around it either.
#[test]
fn tcp_in_a_family_the_cni_result_does_not_name_is_refused() {
    let fixture = privileged!(DatapathNode::new());
    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let _ztunnel = ZtunnelStandIn::start(&client).unwrap();
    let datapath = fixture.start_datapath();
    let ipv4_only = Workload {
        ips: vec![IpAddr::V4(client.ipv4())],
        ..client.workload(PodOptions::default())
    };
    datapath.enroll(ipv4_only).wait().expect("pod enrolled");

    let target = server.app_v6();
    let refused = client
        .run(|| tcp_request(target, "around"))
        .expect_err("IPv6 TCP from an IPv4-only ambient pod must not connect");
    assert_eq!(refused.kind(), ErrorKind::PermissionDenied, "{refused}");
    assert!(echo.wait_for(|r| r.line == "around", WAIT).is_none());
    datapath.uninstall().wait().unwrap();
}

#[test]
fn ztunnel_loopback_and_own_address_traffic_is_never_redirected() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, other) = (fixture.pod("app"), fixture.pod("other"));
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let own = EchoServer::app(&pod).unwrap();
    let other_app = EchoServer::app(&other).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    // Loopback and the pod's own address, v4 and v6: direct.
    for target in [
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), APP_PORT),
        SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), APP_PORT),
        pod.app_v4(),
        pod.app_v6(),
    ] {
        let reply = pod.run(|| tcp_request(target, "local")).unwrap();
        assert_eq!(reply.response, own.reply_to("local"), "to {target}");
    }
    // A socket marked like ztunnel's goes where it was sent.
    let target = other.app_v4();
    let reply = pod.run(|| marked_tcp_request(target, "marked")).unwrap();
    assert_eq!(reply, other_app.reply_to("marked"));
    assert!(
        ztunnel
            .seen()
            .iter()
            .all(|s| s.listener != OUTBOUND_PORT && s.listener != INBOUND_PORT),
        "nothing reached ztunnel: {:?}",
        ztunnel.seen()
    );
    assert_eq!(counters(&datapath, &pod).outbound, 0);
    datapath.uninstall().wait().unwrap();
}

/// A pod's link-local address is the pod's too, though no CNI result names it: a neighbour on the
/// same bridge connecting to it is handed to ztunnel, which refuses a destination that is not a
/// workload address, as under istio. The app never sees the connection.
#[test]
fn link_local_connections_go_to_ztunnel_too() {
    let fixture = privileged!(DatapathNode::new());
    let (neighbour, pod) = (fixture.pod("neighbour"), fixture.pod("app"));
    let echo = EchoServer::app(&pod).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let link_local = pod.link_local().unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    let scope = neighbour
        .run(|| nix::net::if_::if_nametoindex("eth0"))
        .unwrap();
    let target = SocketAddr::V6(SocketAddrV6::new(link_local, APP_PORT, 0, scope));
    let result = neighbour.run(|| tcp_attempt(target, "link-local"));
    assert!(result.is_err(), "ztunnel refuses it: {result:?}");
    let seen = ztunnel
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .unwrap_or_else(|| panic!("the connection to {target} never reached 15006"));
    assert_eq!(seen.local.ip(), IpAddr::V6(link_local));
    assert!(
        echo.received().iter().all(|r| r.line != "link-local"),
        "{:?}",
        echo.received()
    );
    assert!(counters(&datapath, &pod).inbound >= 1, "counted per SYN");
    datapath.uninstall().wait().unwrap();
}

/// What the inbound program must leave alone: large transfers through ztunnel, and fragmented
/// datagrams of protocols weir does not capture.
#[test]
fn large_transfers_and_fragmented_udp_are_unaffected() {
    let fixture = privileged!(DatapathNode::new());
    let (client, pod) = (fixture.pod("client"), fixture.pod("app"));
    let echo = EchoServer::app(&pod).unwrap();
    let _ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    let large = "x".repeat(4 << 20);
    // Larger than the link's MTU: sent as IP fragments, both ways.
    let datagram = "u".repeat(4000);
    for destination in [IpAddr::V4(pod.ipv4()), IpAddr::V6(pod.ipv6())] {
        let target = SocketAddr::new(destination, APP_PORT);
        let reply = client
            .run(|| tcp_request_within(target, &large, Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("4 MiB to {target}: {e}"));
        assert!(
            reply.response == echo.reply_to(&large),
            "4 MiB to {target} came back whole"
        );

        let udp =
            EchoServer::start_udp(pod.netns(), "udp", SocketAddr::new(destination, 0)).unwrap();
        let reply = client
            .run(|| udp_request(udp.addr(), &datagram))
            .unwrap_or_else(|e| panic!("4000-byte datagram to {}: {e}", udp.addr()));
        assert_eq!(reply.response, udp.reply_to(&datagram));
    }
    assert_eq!(counters(&datapath, &pod).dropped, 0);
    datapath.uninstall().wait().unwrap();
}
