//! What reaches an enrolled pod: every connection through ztunnel's 15006 or 15008, whatever
//! the packets' shape or address, and nothing around it.
use super::*;

/// `client` reaches `server`'s app over IPv4 and IPv6 through ztunnel's 15006 listener: the
/// accepted socket has the original destination as its local address (TPROXY semantics),
/// ztunnel dials the app keeping the client's address, and the app's answer comes back.
fn inbound_lands_on_ztunnel(
    client: &Pod,
    server: &Pod,
    echo: &EchoServer,
    ztunnel: &ZtunnelStandIn,
    line: &str,
) {
    for (source, destination) in [
        (IpAddr::V4(client.ipv4()), IpAddr::V4(server.ipv4())),
        (IpAddr::V6(client.ipv6()), IpAddr::V6(server.ipv6())),
    ] {
        let target = SocketAddr::new(destination, APP_PORT);
        let reply = client
            .run(|| tcp_request(target, line))
            .unwrap_or_else(|e| panic!("request to {target}: {e}"));
        // The answer came back: the app's replies reached ztunnel's transparent socket.
        assert_eq!(reply.response, echo.reply_to(line));
        let seen = ztunnel
            .wait_for(
                |s| s.listener == INBOUND_PORT && s.peer.ip() == source,
                WAIT,
            )
            .unwrap_or_else(|| panic!("connection to {target} never reached 15006"));
        assert_eq!(seen.local, target);
        assert_eq!(seen.destination(), target);
        let received = echo
            .wait_for(|r| r.line == line && r.local.ip() == destination, WAIT)
            .unwrap();
        assert_eq!(received.peer.ip(), source);
    }
}

#[test]
fn inbound_tcp_lands_on_15006_and_replies_return_through_ztunnel() {
    let fixture = privileged!(DatapathNode::new());
    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&server).unwrap();
    let datapath = fixture.enrolled(&server, PodOptions::default());

    inbound_lands_on_ztunnel(&client, &server, &echo, &ztunnel, "inbound");

    // HBONE reaches 15008 directly.
    let hbone = SocketAddr::new(IpAddr::V4(server.ipv4()), HBONE_PORT);
    let reply = client.run(|| tcp_request(hbone, "connect")).unwrap();
    assert_eq!(reply.response, HBONE_REPLY);
    assert!(ztunnel
        .wait_for(|s| s.listener == HBONE_PORT && s.local == hbone, WAIT)
        .is_some());
    // Counted per SYN: a slow guest's retransmitted SYN counts again.
    assert!(counters(&datapath, &server).inbound >= 2);
    datapath.uninstall().wait().unwrap();
}

/// HBONE goes to ztunnel's 15008 listener, as istio sends it: an app that holds the port while
/// ztunnel is away must not be handed plaintext from outside.
#[test]
fn hbone_reaches_only_ztunnels_listener() {
    let fixture = privileged!(DatapathNode::new());
    let (client, pod) = (fixture.pod("client"), fixture.pod("app"));
    let impostor = EchoServer::start(
        pod.netns(),
        "impostor",
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), HBONE_PORT),
    )
    .unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    for destination in [IpAddr::V4(pod.ipv4()), IpAddr::V6(pod.ipv6())] {
        let target = SocketAddr::new(destination, HBONE_PORT);
        let reply = client.run(|| tcp_attempt(target, "plaintext"));
        assert!(reply.is_err(), "{target} reached the app: {reply:?}");
    }
    assert!(impostor.wait_for(|r| r.line == "plaintext", WAIT).is_none());
    // Each SYN, retransmissions included.
    assert!(counters(&datapath, &pod).dropped >= 2);
    datapath.uninstall().wait().unwrap();
}

/// Inbound is decided for the pod whose interface it arrives on, whatever address it is for: an
/// address beyond those indexed for the pod, and one another pod (with its inbound bypass) held
/// first, both go to the pod's ztunnel, which refuses destinations that are no workload's. The
/// app sees neither.
#[test]
fn inbound_is_decided_for_the_pod_it_arrives_at_whatever_its_address() {
    let fixture = privileged!(DatapathNode::new());
    let (first, pod, neighbour) = (
        fixture.pod("first"),
        fixture.pod("app"),
        fixture.pod("neighbour"),
    );
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let echo = EchoServer::app(&pod).unwrap();
    let shared = Ipv4Addr::new(10, 98, 0, 1);
    let added: Vec<Ipv4Addr> = (1..=20).map(|n| Ipv4Addr::new(10, 99, 0, n)).collect();
    let add = |pod: &Pod, address: &Ipv4Addr| {
        let address = format!("{address}/32");
        ip(&[
            "-n",
            pod.netns().name(),
            "address",
            "add",
            &address,
            "dev",
            "eth0",
        ])
        .unwrap();
    };
    add(&first, &shared);
    add(&pod, &shared);
    for address in &added {
        add(&pod, address);
    }
    let datapath = fixture.start_datapath();
    let bypass = PodOptions {
        inbound_bypass: true,
        ..PodOptions::default()
    };
    datapath.enroll(first.workload(bypass)).wait().unwrap();
    datapath
        .enroll(pod.workload(PodOptions::default()))
        .wait()
        .unwrap();
    let pod_ips = fixture.node().pinned_pod_ips().unwrap();
    let indexed = |address: &Ipv4Addr| {
        pod_ips
            .get(&weir_common::IpKey::from_v4(address.octets()), 0)
            .ok()
    };
    assert_eq!(indexed(&shared), Some(first.netns().cookie().unwrap()));
    let unindexed = *added
        .iter()
        .find(|address| indexed(address).is_none())
        .expect("the pod has more addresses than are indexed for it");

    for address in [shared, unindexed] {
        let counted_before = counters(&datapath, &pod).inbound;
        let route = format!("{address}/32");
        let via = pod.ipv4().to_string();
        ip(&[
            "-n",
            neighbour.netns().name(),
            "route",
            "add",
            &route,
            "via",
            &via,
        ])
        .unwrap();
        let target = SocketAddr::new(IpAddr::V4(address), APP_PORT);
        let line = format!("to {address}");
        let result = neighbour.run(|| tcp_attempt(target, &line));
        assert!(result.is_err(), "ztunnel refuses it: {result:?}");
        let seen = ztunnel
            .wait_for(|s| s.listener == INBOUND_PORT && s.local == target, WAIT)
            .unwrap_or_else(|| panic!("the connection to {target} never reached 15006"));
        assert_eq!(seen.peer.ip(), IpAddr::V4(neighbour.ipv4()));
        assert!(
            echo.received().iter().all(|r| r.line != line),
            "the app got {line}: {:?}",
            echo.received()
        );
        // Counted per SYN: a slow guest's retransmitted SYN counts again.
        assert!(
            counters(&datapath, &pod).inbound > counted_before,
            "counted for {address}"
        );
    }
    datapath.uninstall().wait().unwrap();
}

#[test]
fn inbound_bypass_lets_inbound_through_and_still_captures_outbound() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, other) = (fixture.pod("app"), fixture.pod("other"));
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let echo = EchoServer::app(&pod).unwrap();
    let other_app = EchoServer::app(&other).unwrap();
    let options = PodOptions {
        inbound_bypass: true,
        ..PodOptions::default()
    };
    let datapath = fixture.enrolled(&pod, options);

    let inbound = pod.app_v4();
    let reply = other.run(|| tcp_request(inbound, "in")).unwrap();
    assert_eq!(reply.response, echo.reply_to("in"));
    let received = echo.wait_for(|r| r.line == "in", WAIT).unwrap();
    assert_eq!(received.peer.ip(), IpAddr::V4(other.ipv4()));

    let outbound = other.app_v4();
    let reply = pod.run(|| tcp_request(outbound, "out")).unwrap();
    assert_eq!(reply.response, other_app.reply_to("out"));
    assert!(ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .is_some());
    assert!(ztunnel.seen().iter().all(|s| s.listener != INBOUND_PORT));
    let counted = counters(&datapath, &pod);
    assert_eq!(
        (counted.inbound, counted.bypassed, counted.outbound),
        (0, 1, 1)
    );
    datapath.uninstall().wait().unwrap();
}

/// Hand-made SYNs from another pod, as an attacker with `CAP_NET_RAW` sends them: whatever their
/// shape, none reaches the pod's kernel around ztunnel. A SYN is either handed to ztunnel (which
/// answers SYN-ACK, also for a port nobody else listens on) or dropped and counted (no answer at
/// all); the app's listener and the kernel's RST for a closed port never answer.
#[test]
fn no_packet_shape_reaches_the_pod_around_ztunnel() {
    let fixture = privileged!(DatapathNode::new());
    let (attacker, pod) = (fixture.pod("attacker"), fixture.pod("app"));
    let _echo = EchoServer::app(&pod).unwrap();
    let _ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    let v4 = [
        (raw::Whole, Answer::SynAck),
        (raw::Ipv4Options, Answer::SynAck),
        // The first fragment carries only the ports; then one that also carries the flags.
        (raw::Fragmented(8), Answer::Nothing),
        (raw::Fragmented(16), Answer::Nothing),
    ];
    let v6 = [
        (raw::Whole, Answer::SynAck),
        (raw::Ipv6Extensions(raw::HOP_BY_HOP), Answer::SynAck),
        (
            raw::Ipv6Extensions(raw::DESTINATION_OPTIONS),
            Answer::SynAck,
        ),
        (
            raw::Ipv6Extensions(raw::HOP_BY_HOP_AND_DESTINATION_OPTIONS),
            Answer::SynAck,
        ),
        // The kernel itself drops an IPv6 first fragment without the whole TCP header.
        (raw::Fragmented(24), Answer::Nothing),
    ];
    // Behind VLAN tags with id 0, which the kernel takes off on its own: one before tc runs,
    // the others after it, before IP. Deeper than the program walks: dropped.
    let mac = pod.mac();
    let tagged = |tags| (raw::VlanTagged(tags, mac), Answer::SynAck);
    let tag_shapes = [
        tagged(&[raw::VLAN]),
        tagged(&[raw::VLAN, raw::VLAN]),
        tagged(&[raw::QINQ, raw::VLAN]),
        tagged(&[raw::QINQ, raw::VLAN, raw::VLAN]),
        (
            raw::VlanTagged(&[raw::QINQ, raw::VLAN, raw::VLAN, raw::VLAN], mac),
            Answer::Nothing,
        ),
    ];
    let v4: Vec<_> = v4.into_iter().chain(tag_shapes).collect();
    let v6: Vec<_> = v6.into_iter().chain(tag_shapes).collect();
    let mut syns = Vec::new();
    let mut expected = Vec::new();
    let mut source_port = 41000;
    // A port with the app listening, and one with nothing listening.
    for port in [APP_PORT, CLOSED_PORT] {
        let families = [
            (IpAddr::V4(attacker.ipv4()), IpAddr::V4(pod.ipv4()), &v4[..]),
            (IpAddr::V6(attacker.ipv6()), IpAddr::V6(pod.ipv6()), &v6[..]),
        ];
        for (source, destination, shapes) in families {
            for (shape, answer) in shapes {
                source_port += 1;
                syns.push(raw::Syn {
                    source: SocketAddr::new(source, source_port),
                    destination: SocketAddr::new(destination, port),
                    shape: *shape,
                    tcp: raw::Tcp::SYN,
                });
                expected.push(*answer);
            }
        }
    }
    let answers = attacker
        .run(|| raw::probe(&syns, Duration::from_secs(1)))
        .unwrap();
    let report: Vec<_> = syns
        .iter()
        .zip(&answers)
        .map(|(syn, answer)| format!("{:?} to {}: {answer:?}", syn.shape, syn.destination))
        .collect();
    assert_eq!(answers, expected, "{report:#?}");

    let counted = counters(&datapath, &pod);
    let steered = expected.iter().filter(|a| **a == Answer::SynAck).count();
    assert_eq!(counted.inbound as usize, steered, "{counted:?}");
    // Every fragmented SYN reached the pod and was dropped there, not somewhere on the way. A
    // frame too deep in VLAN tags is dropped before its addresses are read, for no pod.
    let too_deep = syns
        .iter()
        .filter(|syn| matches!(syn.shape, raw::VlanTagged(tags, _) if tags.len() > 3))
        .count();
    assert_eq!(
        counted.dropped as usize,
        expected.len() - steered - too_deep,
        "{counted:?}"
    );
    datapath.uninstall().wait().unwrap();
}

/// SYNs that tc hands to ztunnel and the kernel then drops before its socket lookup (here: sent
/// to another MAC, which the bridge floods to the pod and IP drops) leave nothing behind: the
/// hand-off keeps at most its slots' listeners per CPU, however many were dropped, a slot whose
/// SYN never came is free again once stale, and a real connection after them reaches ztunnel
/// with its original destination. Before 6.5 this is the socket lookup hand-off's state; from
/// 6.5 tc assigns and keeps nothing.
#[test]
fn syns_dropped_after_tc_leave_nothing_behind() {
    let fixture = privileged!(DatapathNode::new());
    let (attacker, pod) = (fixture.pod("attacker"), fixture.pod("app"));
    let _echo = EchoServer::app(&pod).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    const FLOOD: u16 = 1_000;
    let not_the_pods_mac = [0x02, 0, 0, 0, 0x57, 0x99];
    let (source, destination) = (IpAddr::V4(attacker.ipv4()), IpAddr::V4(pod.ipv4()));
    let syns = (0..FLOOD).map(|n| raw::Syn {
        source: SocketAddr::new(source, 20_000 + n),
        destination: SocketAddr::new(destination, APP_PORT),
        shape: raw::VlanTagged(&[], not_the_pods_mac),
        tcp: raw::Tcp::SYN,
    });
    let sent = attacker.run(|| raw::flood(syns, not_the_pods_mac)).unwrap();
    assert_eq!(sent, usize::from(FLOOD));
    // Each reached the pod's program and was steered to ztunnel; none went to the app. Before
    // 6.5 a SYN that finds every hand-off slot of its CPU held by SYNs still on their way (these,
    // which never reach their lookup) is dropped instead, to be sent again.
    let counted = counters(&datapath, &pod);
    assert_eq!(counted.bypassed, 0, "{counted:?}");
    assert!(
        counted.inbound + counted.dropped >= u64::from(FLOOD),
        "{counted:?}"
    );
    if !kernel_needs_the_handoff() {
        assert!(counted.inbound >= u64::from(FLOOD), "{counted:?}");
    }
    let handoff = fixture.node().pinned_map(maps::HANDOFF).unwrap();
    let handoff =
        aya::maps::SockHash::<_, u32>::try_from(aya::maps::Map::SockHash(handoff)).unwrap();
    let held = handoff.keys().count();
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert!(
        held <= cpus * HANDOFF_SLOTS as usize,
        "{held} hand-offs held after {FLOOD} dropped SYNs"
    );

    let target = SocketAddr::new(destination, APP_PORT);
    attacker
        .run(|| tcp_request(target, "after the flood"))
        .unwrap_or_else(|e| panic!("request to {target} after the flood: {e}"));
    let seen = ztunnel
        .wait_for(
            |s| s.listener == INBOUND_PORT && s.peer.ip() == source,
            WAIT,
        )
        .expect("the connection after the flood never reached 15006");
    assert_eq!(seen.destination(), target);
    datapath.uninstall().wait().unwrap();
}

/// A pod answering SYNs with cookies (flooded, or `tcp_syncookies=2`) keeps no state between the
/// SYN, which ztunnel's listener answers, and the client's ACK: that ACK meets only the app's
/// listener, which would accept the cookie. It goes to ztunnel too, and every connection lands
/// there with its original destination.
#[test]
fn syn_cookie_acks_open_connections_only_at_ztunnel() {
    let fixture = privileged!(DatapathNode::new());
    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&server).unwrap();
    let datapath = fixture.enrolled(&server, PodOptions::default());
    server
        .run(|| std::fs::write("/proc/sys/net/ipv4/tcp_syncookies", "2"))
        .unwrap();

    inbound_lands_on_ztunnel(&client, &server, &echo, &ztunnel, "cookie");
    datapath.uninstall().wait().unwrap();
}

/// A connection to a port nobody listens on in an ambient pod fails at once, as without the
/// mesh: the kernel's RST for ztunnel's source-preserving dial returns to ztunnel (it carries the
/// dial's mark) instead of leaving toward the client's address, so ztunnel sees "refused" rather
/// than waiting out its connect deadline, and closes the client's connection.
#[test]
fn a_closed_port_in_an_ambient_pod_refuses_at_once() {
    let fixture = privileged!(DatapathNode::new());
    let (client, pod) = (fixture.pod("client"), fixture.pod("app"));
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    for destination in [IpAddr::V4(pod.ipv4()), IpAddr::V6(pod.ipv6())] {
        let target = SocketAddr::new(destination, CLOSED_PORT);
        let error = client
            .run(|| tcp_request(target, "anyone?"))
            .expect_err("nothing listens there");
        assert!(
            matches!(
                error.kind(),
                ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
            ),
            "to {target}: the connection is closed, not left to time out: {error}"
        );
        let dial = ztunnel
            .wait_for_dial(|d| d.target == target, WAIT)
            .unwrap_or_else(|| panic!("ztunnel never dialed {target}"));
        let why = dial.error.unwrap_or_default();
        assert!(
            why.contains("Connection refused"),
            "ztunnel's dial to {target} was refused, not timed out: {why}"
        );
    }
    datapath.uninstall().wait().unwrap();
}
