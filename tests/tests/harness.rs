//! The harness checked against itself, with no weir datapath: pods wired by CNI reach each other
//! and the node, and the ztunnel stand-in behaves as ztunnel does, including (with istio's own
//! iptables redirection in place of weir) the original-destination lookup, the relays and the
//! source-preserving inbound dial; and ztunnel keeps its proxies when istio-cni's node agent
//! hands the node to weir's ZDS server.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weir_agent::zds::ZdsError;
use weir_common::{DNS_PROXY_PORT, HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT};
use weir_tests::istio_cni::{self, IstioCniAgent};
use weir_tests::istio_iptables::Backend;
use weir_tests::privileged;
use weir_tests::traffic::{read_line, write_line};
use weir_tests::zds_server::ZdsServer;
use weir_tests::ztunnel::{DNS_REPLY_PREFIX, HBONE_REPLY};
use weir_tests::{
    istio_iptables, tcp_connect_from, tcp_request, udp_request, udp_request_connected,
    DatapathNode, EchoServer, Pod, Reply, ZdsEvent, ZdsZtunnel, ZtunnelStandIn, APP_PORT,
};

/// A cluster DNS service address: not routed anywhere, only reachable through redirection.
const CLUSTER_DNS: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa)),
];
const WAIT: Duration = Duration::from_secs(2);
/// For a ztunnel to connect and take a snapshot: it tries every 100 ms, weir's server accepts
/// at most every 200 ms.
const ZDS_WAIT: Duration = Duration::from_secs(10);

/// The same-family address pairs of two pods: (a's IPv4, b's IPv4), (a's IPv6, b's IPv6).
fn address_pairs(a: &Pod, b: &Pod) -> [(IpAddr, IpAddr); 2] {
    [
        (a.ipv4().into(), b.ipv4().into()),
        (a.ipv6().into(), b.ipv6().into()),
    ]
}

#[test]
fn pods_talk_directly_over_ipv4_and_ipv6() {
    let fixture = privileged!(DatapathNode::new());
    let (a, b) = (fixture.pod("a"), fixture.pod("b"));
    for (a_ip, b_ip) in address_pairs(&a, &b) {
        let echo = EchoServer::start(b.netns(), "b", (b_ip, APP_PORT).into()).unwrap();
        let reply = a.run(|| tcp_request(echo.addr(), "hello")).unwrap();
        assert_eq!(reply.response, echo.reply_to("hello"));
        assert_eq!(reply.peer_seen_by_client, echo.addr());
        assert_eq!(reply.local.ip(), a_ip);
        let received = echo.received();
        assert_eq!(received.len(), 1);
        assert_eq!(received[0].peer, reply.local);
        assert_eq!(received[0].local, echo.addr());
        assert_eq!(received[0].line, "hello");
    }
}

#[test]
fn udp_between_pods_connected_and_not() {
    let fixture = privileged!(DatapathNode::new());
    let (a, b) = (fixture.pod("a"), fixture.pod("b"));
    for (a_ip, b_ip) in address_pairs(&a, &b) {
        let echo = EchoServer::start_udp(b.netns(), "b", (b_ip, 5353).into()).unwrap();
        let unconnected = a.run(|| udp_request(echo.addr(), "q1")).unwrap();
        assert_eq!(unconnected.response, echo.reply_to("q1"));
        assert_eq!(unconnected.from, echo.addr());
        assert_eq!(unconnected.peer, None);
        let connected = a.run(|| udp_request_connected(echo.addr(), "q2")).unwrap();
        assert_eq!(connected.response, echo.reply_to("q2"));
        assert_eq!(connected.from, echo.addr());
        assert_eq!(connected.peer, Some(echo.addr()));
        assert_eq!(connected.local.ip(), a_ip);
        let peers: Vec<IpAddr> = echo.received().iter().map(|r| r.peer.ip()).collect();
        assert_eq!(peers, [a_ip, a_ip]);
    }
}

#[test]
fn node_and_pods_reach_each_other() {
    let fixture = privileged!(DatapathNode::new());
    let (node, pod) = (fixture.node(), fixture.pod("a"));
    let gateways: [IpAddr; 2] = [node.gateway_v4().into(), node.gateway_v6().into()];
    for (pod_ip, gateway) in pod.ips().into_iter().zip(gateways) {
        // The node (kubelet) to the pod: it comes from the bridge's address.
        let in_pod = EchoServer::start(pod.netns(), "pod", (pod_ip, APP_PORT).into()).unwrap();
        let reply = node.run(|| tcp_request(in_pod.addr(), "probe")).unwrap();
        assert_eq!(reply.response, in_pod.reply_to("probe"));
        assert_eq!(in_pod.received()[0].peer.ip(), gateway);

        // The pod to a server on the node ("another host").
        let remote = EchoServer::start(node.netns(), "remote", (gateway, APP_PORT).into()).unwrap();
        let reply = pod.run(|| tcp_request(remote.addr(), "out")).unwrap();
        assert_eq!(reply.response, remote.reply_to("out"));
        assert_eq!(remote.received()[0].peer.ip(), pod_ip);
    }
}

#[test]
fn pods_have_their_own_netns_cookies_and_identities() {
    let fixture = privileged!(DatapathNode::new());
    let (node, pods) = (fixture.node(), [fixture.pod("a"), fixture.pod("b")]);
    let cookies = [
        node.netns().cookie().unwrap(),
        pods[0].netns().cookie().unwrap(),
        pods[1].netns().cookie().unwrap(),
    ];
    assert!(cookies.iter().all(|cookie| *cookie != 0), "{cookies:?}");
    assert!(cookies[0] != cookies[1] && cookies[1] != cookies[2] && cookies[0] != cookies[2]);
    assert_ne!(pods[0].uid(), pods[1].uid());
    assert_ne!(pods[0].ipv4(), pods[1].ipv4());
    assert_eq!(pods[0].namespace(), "default");
    // The CNI result is kept, as a runtime passes it on as prevResult.
    let ips = pods[0].prev_result()["ips"].as_array().unwrap();
    assert_eq!(ips.len(), 2);
    assert_eq!(ips[0]["gateway"], node.gateway_v4().to_string());
}

#[test]
fn teardown_leaves_nothing_behind() {
    let var_lib_cni = Path::new("/var/lib/cni").exists();
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("a");
    let node = fixture.node();
    let netns_paths = [node.netns().path().to_owned(), pod.netns_path().to_owned()];
    let ipam_dir = node.ipam_dir().to_owned();
    assert!(
        ipam_dir.join("weir-test").read_dir().unwrap().count() > 0,
        "host-local keeps its state in the node's dataDir"
    );
    // Pods keep the node alive: dropping the node first defers its teardown to the last pod.
    drop(fixture);
    assert!(netns_paths[0].exists());
    drop(pod);
    for path in netns_paths.iter().chain([&ipam_dir]) {
        assert!(!path.exists(), "{} is left behind", path.display());
    }
    assert_eq!(Path::new("/var/lib/cni").exists(), var_lib_cni);
}

#[test]
fn teardown_runs_when_a_test_panics() {
    let fixture = privileged!(DatapathNode::new());
    let mut left = Vec::new();
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // Owned by the closure, so the panic unwinds through the node's teardown.
        let fixture = fixture;
        let pod = fixture.pod("a");
        let _ztunnel = ZtunnelStandIn::start(&pod).unwrap();
        let node = fixture.node();
        left.extend([
            node.netns().path().to_owned(),
            pod.netns_path().to_owned(),
            node.ipam_dir().to_owned(),
        ]);
        panic!("a failing test");
    }));
    assert!(failed.is_err());
    for path in &left {
        assert!(!path.exists(), "{} is left behind", path.display());
    }
}

#[test]
fn standin_listeners_take_direct_connections() {
    let fixture = privileged!(DatapathNode::new());
    let (a, b) = (fixture.pod("a"), fixture.pod("b"));
    let ztunnel = ZtunnelStandIn::start(&a).unwrap();
    for (a_ip, b_ip) in address_pairs(&a, &b) {
        // HBONE is reached directly, from other pods (ztunnels).
        let reply = b
            .run(|| tcp_request((a_ip, HBONE_PORT).into(), "CONNECT"))
            .unwrap();
        assert_eq!(reply.response, HBONE_REPLY);
        let seen = ztunnel
            .wait_for(|s| s.listener == HBONE_PORT && s.peer.ip() == b_ip, WAIT)
            .unwrap();
        assert_eq!(seen.local, (a_ip, HBONE_PORT).into());

        // Straight to podIP:15001: no original destination, so the local address is the
        // destination, which is ztunnel itself: a self-call, refused (the connection closes,
        // with a reset when our line was still unread).
        let refused = a.run(|| tcp_request((a_ip, OUTBOUND_PORT).into(), "loop"));
        let kind = refused.unwrap_err().kind();
        assert!(
            matches!(
                kind,
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
            ),
            "{kind:?}"
        );
        let seen = ztunnel
            .wait_for(|s| s.listener == OUTBOUND_PORT && s.peer.ip() == a_ip, WAIT)
            .unwrap();
        assert_eq!(seen.original_dst, None);
        assert_eq!(seen.destination(), (a_ip, OUTBOUND_PORT).into());
        let dial = ztunnel
            .wait_for_dial(|d| d.peer == seen.peer, WAIT)
            .unwrap();
        assert!(dial.error.unwrap().contains("self-call"));
    }
}

/// Asks `server` for `name` from inside `pod` over UDP, connected UDP and TCP: the stand-in's DNS
/// proxy on `localhost` takes the three queries and answers each, from `server`'s address as far
/// as the app can tell.
fn resolve_three_ways(
    pod: &Pod,
    ztunnel: &ZtunnelStandIn,
    server: SocketAddr,
    localhost: IpAddr,
    name: &str,
) {
    let expected = format!("{DNS_REPLY_PREFIX}{name}");
    for reply in [
        pod.run(|| udp_request(server, name)).unwrap(),
        pod.run(|| udp_request_connected(server, name)).unwrap(),
    ] {
        assert_eq!((reply.response, reply.from), (expected.clone(), server));
    }
    let tcp = pod.run(|| tcp_request(server, name)).unwrap();
    assert_eq!(tcp.response, expected);
    let on_localhost = ztunnel
        .seen()
        .into_iter()
        .filter(|s| s.listener == DNS_PROXY_PORT && s.local.ip() == localhost)
        .count();
    assert_eq!(on_localhost, 3, "queries at the DNS proxy on {localhost}");
}

/// Waits until the stand-in took the client's connection `reply` on `listener`, with `target`
/// as its original destination, and dialed `target` for it from `client_ip`; returns the dialing
/// socket's address.
fn relayed(
    ztunnel: &ZtunnelStandIn,
    listener: u16,
    reply: &Reply,
    target: SocketAddr,
    client_ip: IpAddr,
) -> SocketAddr {
    let seen = ztunnel
        .wait_for(|s| s.listener == listener && s.peer == reply.local, WAIT)
        .unwrap();
    assert_eq!(seen.original_dst, Some(target));
    let dial = ztunnel
        .wait_for_dial(|d| d.peer == seen.peer, WAIT)
        .unwrap();
    assert_eq!((dial.target, dial.error), (target, None));
    let source = dial.source.unwrap();
    assert_eq!(source.ip(), client_ip);
    source
}

#[test]
fn standin_dns_proxy_answers_on_localhost() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("a");
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    for localhost in [
        IpAddr::from(Ipv4Addr::LOCALHOST),
        Ipv6Addr::LOCALHOST.into(),
    ] {
        let proxy: SocketAddr = (localhost, DNS_PROXY_PORT).into();
        resolve_three_ways(&pod, &ztunnel, proxy, localhost, "query");
    }
}

/// The outbound path with istio's iptables as the datapath: the app's connection is redirected to
/// 15001, the stand-in finds the original destination with SO_ORIGINAL_DST and relays to it from
/// the pod's address.
#[test]
fn standin_relays_outbound_to_the_original_destination() {
    let fixture = privileged!(DatapathNode::new());
    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let ztunnel = ZtunnelStandIn::start(&client).unwrap();
    istio_iptables::apply(client.netns(), Backend::Nft).unwrap();
    for (client_ip, server_ip) in address_pairs(&client, &server) {
        let echo =
            EchoServer::start(server.netns(), "server", (server_ip, APP_PORT).into()).unwrap();
        let reply = client.run(|| tcp_request(echo.addr(), "out")).unwrap();
        assert_eq!(reply.response, echo.reply_to("out"));
        // REDIRECT rewrites back: the app believes it talks to the server.
        assert_eq!(reply.peer_seen_by_client, echo.addr());
        let source = relayed(&ztunnel, OUTBOUND_PORT, &reply, echo.addr(), client_ip);
        assert_eq!(echo.received()[0].peer, source);
    }
}

/// The inbound path with istio's iptables: redirected to 15006, dialed to the app from the
/// client's address (transparent), and the app's replies routed back to the stand-in.
#[test]
fn standin_inbound_keeps_the_client_address() {
    let fixture = privileged!(DatapathNode::new());
    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let ztunnel = ZtunnelStandIn::start(&server).unwrap();
    istio_iptables::apply(server.netns(), Backend::Nft).unwrap();
    for (client_ip, server_ip) in address_pairs(&client, &server) {
        let echo = EchoServer::start(server.netns(), "app", (server_ip, APP_PORT).into()).unwrap();
        let reply = client.run(|| tcp_request(echo.addr(), "in")).unwrap();
        assert_eq!(reply.response, echo.reply_to("in"));
        relayed(&ztunnel, INBOUND_PORT, &reply, echo.addr(), client_ip);
        // The app sees the client, not ztunnel.
        assert_eq!(echo.received()[0].peer.ip(), client_ip);
    }
}

/// DNS with istio's iptables: queries to the cluster DNS service (UDP and TCP port 53) land on the
/// stand-in's localhost listeners, and answers come back from the address the app asked.
#[test]
fn standin_dns_proxy_takes_redirected_queries() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("a");
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    istio_iptables::apply(pod.netns(), Backend::Nft).unwrap();
    for dns in CLUSTER_DNS {
        let localhost = if dns.is_ipv4() {
            IpAddr::from(Ipv4Addr::LOCALHOST)
        } else {
            Ipv6Addr::LOCALHOST.into()
        };
        resolve_three_ways(&pod, &ztunnel, (dns, 53).into(), localhost, "lookup");
    }
}

#[test]
fn standin_stops_promptly_with_connections_open() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("a");
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    // An idle connection to the DNS proxy: its handler waits for a line.
    let _idle = pod
        .run(|| std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, DNS_PROXY_PORT)))
        .unwrap();
    ztunnel
        .wait_for(|s| s.listener == DNS_PROXY_PORT, WAIT)
        .unwrap();
    let started = Instant::now();
    ztunnel.stop();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    // The listeners are gone with it: nothing answers. A reset instead of a refusal is a listener
    // closed with the SYN in its queue: a process another test forks at that moment holds the
    // listener's descriptor until it execs, so the close can land a moment after `stop`.
    let error = pod
        .run(|| tcp_request((pod.ipv4(), HBONE_PORT).into(), "x"))
        .unwrap_err();
    assert!(
        matches!(
            error.kind(),
            io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset
        ),
        "{error}"
    );
}

/// A node taken over from istio-cni with no window: istio-cni enrolled the pods (its rules in
/// them, each handed to ztunnel), its agent leaves, weir's ZDS server takes the same socket path
/// with the pods it knows, and ztunnel, connecting again, keeps the proxy of a pod weir names in
/// the same namespace (a connection through it goes on) and drains the one of a pod weir does not
/// name.
#[test]
fn ztunnel_keeps_its_proxies_when_weir_takes_over_from_istio_cni() {
    let fixture = privileged!(DatapathNode::new());
    let (client, gone, server) = (
        fixture.pod("client"),
        fixture.pod("gone"),
        fixture.pod("server"),
    );
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ztunnel").join("ztunnel.sock");
    let istio_cni = IstioCniAgent::start(&socket, Backend::Nft).unwrap();
    let ztunnel = ZdsZtunnel::follow(&socket).unwrap();
    assert!(
        ztunnel.wait_for_snapshot(ZDS_WAIT),
        "{:?}",
        ztunnel.events()
    );
    istio_cni.enroll(&client).unwrap();
    istio_cni.enroll(&gone).unwrap();
    let proxy = ztunnel.wait_for_pod(client.uid(), WAIT).unwrap();
    assert!(ztunnel.wait_for_pod(gone.uid(), WAIT).is_some());

    // istio's rules take the client's traffic to its proxy's 15001.
    let echo =
        EchoServer::start_lasting(server.netns(), "server", (server.ipv4(), APP_PORT).into())
            .unwrap();
    // A new connection from the client, answered through its proxy's 15001.
    let through_proxy = |line: &str| {
        let reply = client.run(|| tcp_request(echo.addr(), line)).unwrap();
        assert_eq!(reply.response, echo.reply_to(line));
        relayed(
            &proxy,
            OUTBOUND_PORT,
            &reply,
            echo.addr(),
            client.ipv4().into(),
        );
    };
    through_proxy("before");
    let held = client.run(|| tcp_connect_from(0, echo.addr())).unwrap();
    write_line(&held, "held").unwrap();
    assert_eq!(read_line(&held).unwrap(), echo.reply_to("held"));
    let held_local = held.local_addr().unwrap();
    assert!(proxy
        .wait_for(
            |s| s.listener == OUTBOUND_PORT && s.peer == held_local,
            WAIT
        )
        .is_some());

    istio_cni.stop();
    assert!(ztunnel.wait_for_close(WAIT), "{:?}", ztunnel.events());
    assert!(
        !socket.exists(),
        "istio-cni's listener takes its path along"
    );

    // weir's ZDS server, holding snapshots until it has registered the pods it knows: only the
    // client.
    let weir = ZdsServer::start(&socket);
    weir.handle.hold_snapshots();
    let netns = Arc::new(OwnedFd::from(client.netns().open().unwrap()));
    let info = istio_cni::workload_info(&client);
    let added = weir.block_on(weir.handle.add(client.uid(), info, Some(netns)));
    assert!(matches!(added, Err(ZdsError::NotConnected)), "{added:?}");
    weir.handle.release_snapshots();

    assert!(
        ztunnel.wait_for_snapshots(2, ZDS_WAIT),
        "{:?}",
        ztunnel.events()
    );
    let kept = ztunnel.stand_in(client.uid()).unwrap();
    assert!(
        Arc::ptr_eq(&kept, &proxy),
        "the client's proxy was restarted"
    );
    assert!(ztunnel.wait_for_drained(gone.uid(), WAIT));
    assert!(ztunnel.stand_in(gone.uid()).is_none());
    let events = ztunnel.events();
    let closed = events.iter().position(|e| *e == ZdsEvent::Closed).unwrap();
    let second: Vec<(&str, Option<&str>)> = events[closed + 1..]
        .iter()
        .map(|event| {
            let kind = match event {
                ZdsEvent::Connected => "connected",
                ZdsEvent::Add { .. } => "add",
                ZdsEvent::Drained { .. } => "drained",
                ZdsEvent::SnapshotSent => "snapshot",
                other => panic!("unexpected on the second connection: {other:?}"),
            };
            (kind, event.uid())
        })
        .collect();
    assert_eq!(
        second,
        [
            ("connected", None),
            ("add", Some(client.uid())),
            ("drained", Some(gone.uid())),
            ("snapshot", None),
        ]
    );

    // The connection made under istio-cni goes on, and new ones take the same proxy.
    write_line(&held, "still").unwrap();
    assert_eq!(read_line(&held).unwrap(), echo.reply_to("still"));
    through_proxy("after");
}
