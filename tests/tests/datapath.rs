//! The datapath in this kernel: real programs, pods wired by the real CNI plugins, bytes flowing
//! through the ztunnel stand-in. Each test has its own node netns and pin directory, so tests run
//! in parallel; the datapath is uninstalled when a test ends, also when it fails.
use std::{
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpListener, TcpStream},
    os::fd::AsRawFd,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use weir_agent::{
    datapath::{
        istio_rules::IstioRules, netlink::Rtnl, Datapath, DatapathConfig, EnrollNetns, ProbeSource,
    },
    workload::{PodOptions, Workload},
};
use weir_common::{
    maps, ConnectionKey, Endpoint, PodCounters, DNS_PORT, DNS_PROXY_PORT, HANDOFF_SLOTS,
    HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT, PROBE_SOURCE_V4, PROBE_SOURCE_V6,
};
use weir_tests::{cgroup, privileged};
use weir_tests::{
    istio_iptables,
    netns::{ip, ip_output},
    raw::{self, Answer},
    receive_batch::kernel_needs_the_handoff,
    sockopt, tcp_request, tcp_request_within,
    traffic::exchange_line,
    traffic_loop::{wait_for_connections, Connection, TrafficLoop},
    udp_request, udp_request_connected,
    ztunnel::{DNS_REPLY_PREFIX, HBONE_REPLY},
    DatapathNode, EchoServer, Pod, TestNode, ZtunnelStandIn, APP_PORT,
};
use weir_tests::{try_wait_until, wait_until};

const WAIT: Duration = Duration::from_secs(2);
/// A port nothing in the test pods listens on.
const CLOSED_PORT: u16 = 8081;

fn v4_mapped(ip: Ipv4Addr) -> IpAddr {
    IpAddr::V6(ip.to_ipv6_mapped())
}

/// An enrolled pod `app` with its ztunnel, and a pod `server` (not enrolled) running the echo app.
fn enrolled_app_and_server(
    fixture: &DatapathNode,
) -> (Pod, Pod, EchoServer, ZtunnelStandIn, Datapath) {
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    (pod, server, echo, ztunnel, datapath)
}

fn counters(datapath: &Datapath, pod: &Pod) -> PodCounters {
    datapath
        .counters(pod.uid())
        .wait()
        .unwrap()
        .expect("pod is enrolled")
}

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
        let reply = client.run(|| tcp_request(target, "plaintext"));
        assert!(reply.is_err(), "{target} reached the app: {reply:?}");
    }
    assert!(impostor.wait_for(|r| r.line == "plaintext", WAIT).is_none());
    // Each SYN, retransmissions included.
    assert!(counters(&datapath, &pod).dropped >= 2);
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

#[test]
fn unenrolled_pods_are_untouched_and_unenroll_restores_direct_traffic() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, plain, server) = (
        fixture.pod("app"),
        fixture.pod("plain"),
        fixture.pod("server"),
    );
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let plain_ztunnel = ZtunnelStandIn::start(&plain).unwrap();
    let echo = EchoServer::app(&server).unwrap();
    let plain_app = EchoServer::app(&plain).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    // A pod that is not enrolled talks directly, both ways.
    let target = server.app_v4();
    let reply = plain.run(|| tcp_request(target, "plain")).unwrap();
    assert_eq!(reply.response, echo.reply_to("plain"));
    let to_plain = plain.app_v6();
    let reply = server.run(|| tcp_request(to_plain, "in")).unwrap();
    assert_eq!(reply.response, plain_app.reply_to("in"));
    assert!(
        plain_ztunnel.seen().is_empty(),
        "{:?}",
        plain_ztunnel.seen()
    );

    // The enrolled pod is redirected...
    pod.run(|| tcp_request(target, "via ztunnel")).unwrap();
    assert!(ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .is_some());
    // ...until it is unenrolled; a second unenroll is a no-op.
    assert!(datapath.unenroll(pod.uid()).wait().unwrap());
    assert!(!datapath.unenroll(pod.uid()).wait().unwrap());
    let before = ztunnel.seen().len();
    let reply = pod.run(|| tcp_request(target, "direct")).unwrap();
    assert_eq!(reply.response, echo.reply_to("direct"));
    let received = echo.wait_for(|r| r.line == "direct", WAIT).unwrap();
    assert_eq!(received.peer.ip(), IpAddr::V4(pod.ipv4()));
    assert_eq!(ztunnel.seen().len(), before, "{:?}", ztunnel.seen());
    assert_eq!(datapath.counters(pod.uid()).wait().unwrap(), None);
    // Nothing of weir's is left in the pod: no qdisc, the sysctls back to the defaults.
    let in_pod = |command: &[&str]| {
        let mut args = vec!["netns", "exec", pod.netns().name()];
        args.extend_from_slice(command);
        ip_output(&args).unwrap()
    };
    let qdiscs = in_pod(&["tc", "qdisc", "show", "dev", "eth0"]);
    assert!(!qdiscs.contains("clsact"), "{qdiscs}");
    for sysctl in weir_agent::datapath::netns::REPLY_MARK_SYSCTLS {
        let value = in_pod(&["cat", &format!("/proc/sys/{sysctl}")]);
        assert_eq!(value.trim(), "0", "{sysctl}");
    }
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

/// Every pod on the node shares the address index: one pod adding addresses by the hundred
/// gets a bounded share of it, and stays redirected.
#[test]
fn a_pod_adding_addresses_gets_a_bounded_share_of_the_index() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server, _echo, ztunnel, datapath) = enrolled_app_and_server(&fixture);
    let pod_ips = fixture.node().pinned_pod_ips().unwrap();
    let indexed = || pod_ips.keys().count();
    let before = indexed();
    let added = 64;
    let batch: String = (0..added)
        .map(|n| {
            format!(
                "address add 10.99.{}.{}/32 dev eth0\n",
                n / 200,
                n % 200 + 1
            )
        })
        .collect();
    let mut ip_batch = Command::new("ip")
        .args(["-n", pod.netns().name(), "-batch", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    ip_batch
        .stdin
        .take()
        .unwrap()
        .write_all(batch.as_bytes())
        .unwrap();
    assert!(ip_batch.wait().unwrap().success());

    // Re-enrolled after the change: some of the new addresses are indexed.
    wait_until(WAIT, "the new addresses to be followed", || {
        indexed() != before
    });
    thread::sleep(Duration::from_millis(300));
    // The pod's two CNI addresses and at most 16 others.
    assert!(indexed() <= 2 + 16, "{} addresses indexed", indexed());
    assert!(datapath.is_redirected(pod.uid()).wait().unwrap());
    let target = server.app_v4();
    pod.run(|| tcp_request(target, "captured")).unwrap();
    assert!(ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .is_some());
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
        let result = neighbour.run(|| tcp_request(target, &line));
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
    let result = neighbour.run(|| tcp_request(target, "link-local"));
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

/// The getsockopt hook sees every getsockopt on the node: all calls it does not own must come
/// back exactly as the kernel answers them.
#[test]
fn getsockopt_hook_leaves_other_calls_untouched() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let listener = pod
        .run(|| TcpListener::bind((Ipv6Addr::UNSPECIFIED, 0)))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let target = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let client = pod.run(|| std::net::TcpStream::connect(target)).unwrap();
    let (accepted, _) = listener.accept().unwrap();

    let before = getsockopt_answers(&accepted, &client);
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let after = getsockopt_answers(&accepted, &client);
    assert_eq!(before, after);
    datapath.uninstall().wait().unwrap();
}

/// An answer larger than a page that weir does not own reaches the caller whole. Kernels from 5.8
/// until 6.5 fail such a call with EFAULT when a getsockopt program leaves `optlen` above a page:
/// for every process on the node, since the hook is at the root cgroup.
#[test]
fn getsockopt_answers_larger_than_a_page_are_untouched() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    const GROUPS: usize = 2_000;
    let answer = thread::spawn(|| {
        // Credentials are per thread in the kernel: the raw syscall changes this thread's
        // groups only (glibc's setgroups would change the whole test process's).
        let groups: Vec<libc::gid_t> = (1..=GROUPS as libc::gid_t).collect();
        // SAFETY: `groups` holds GROUPS ids.
        let ret = unsafe { libc::syscall(libc::SYS_setgroups, GROUPS, groups.as_ptr()) };
        assert_eq!(ret, 0, "setgroups: {}", std::io::Error::last_os_error());
        let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut buf = vec![0u8; GROUPS * 4 + 4096];
        let mut optlen = buf.len() as libc::socklen_t;
        // SAFETY: buf holds optlen bytes.
        let ret = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                buf.as_mut_ptr().cast(),
                &mut optlen,
            )
        };
        assert_eq!(ret, 0, "SO_PEERGROUPS: {}", std::io::Error::last_os_error());
        buf.truncate(optlen as usize);
        buf
    })
    .join()
    .unwrap();
    assert_eq!(
        answer.len(),
        GROUPS * 4,
        "the whole answer, past the first page"
    );
    let last = u32::from_ne_bytes(answer[answer.len() - 4..].try_into().unwrap());
    assert_eq!(last, GROUPS as u32);
    datapath.uninstall().wait().unwrap();
}

/// A TCP request from a socket marked like ztunnel's.
fn marked_tcp_request(target: SocketAddr, msg: &str) -> std::io::Result<String> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(target),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_mark(weir_common::ZTUNNEL_MARK)?;
    socket.connect_timeout(&target.into(), WAIT)?;
    let mut stream = std::net::TcpStream::from(socket);
    stream.set_read_timeout(Some(WAIT))?;
    writeln!(stream, "{msg}")?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    Ok(line.trim_end().to_owned())
}

/// What a handful of getsockopt calls return: SO_ORIGINAL_DST on sockets weir did not redirect
/// (both levels), a plain option, and a large-buffer call (optlen above a page).
fn getsockopt_answers(accepted: &impl AsRawFd, client: &impl AsRawFd) -> Vec<(i32, Vec<u8>)> {
    let calls = [
        (accepted.as_raw_fd(), libc::SOL_IP, 80, 128),
        (accepted.as_raw_fd(), libc::SOL_IPV6, 80, 128),
        (client.as_raw_fd(), libc::SOL_SOCKET, libc::SO_TYPE, 4),
        (client.as_raw_fd(), libc::SOL_IP, libc::IP_TOS, 4),
        (
            client.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_CONGESTION,
            8192,
        ),
    ];
    calls
        .into_iter()
        .map(|(fd, level, name, len)| {
            let mut buf = vec![0u8; len];
            let mut optlen = len as libc::socklen_t;
            // SAFETY: buf holds optlen bytes.
            let ret =
                unsafe { libc::getsockopt(fd, level, name, buf.as_mut_ptr().cast(), &mut optlen) };
            let result = if ret == 0 {
                0
            } else {
                std::io::Error::last_os_error().raw_os_error().unwrap()
            };
            buf.truncate(optlen as usize);
            (result, buf)
        })
        .collect()
}

/// A datapath owner in another process, driven over its stdin.
struct Owner {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Owner {
    /// Returns once the owner has the node's datapath (it answered `ready`).
    fn spawn(node: &TestNode) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weir-datapath-owner"))
            .arg(node.netns().name())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("owner process");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut ready = String::new();
        stdout.read_line(&mut ready).unwrap();
        assert_eq!(ready.trim(), "ready");
        Self {
            child,
            stdin,
            stdout,
        }
    }

    fn send(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).unwrap();
        answer.trim().to_owned()
    }

    /// Crashes the owner (SIGKILL) and returns when the process is gone (reaped).
    fn kill(mut self) -> Instant {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        Instant::now()
    }
}

/// The owner process crashes and another takes over; the datapath keeps redirecting in between,
/// with no owner process at all: connections made after the first owner was reaped and before
/// the second was ready all reached ztunnel.
#[test]
fn redirection_survives_owner_restart_without_a_gap() {
    /// Connections that must complete in each phase: with the first owner, with none, with the
    /// second.
    const PER_PHASE: usize = 10;
    let fixture = privileged!(DatapathNode::new());
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let echo = EchoServer::app(&server).unwrap();
    let target = server.app_v4();

    let mut first = Owner::spawn(fixture.node());
    let pod_spec = serde_json::to_string(&pod.workload(PodOptions::default())).unwrap();
    assert_eq!(first.send(&format!("enroll {pod_spec}")), "ok");
    let enrolled = Instant::now();

    let traffic = TrafficLoop::start(pod.netns(), target, echo.reply_to("loop"));
    wait_for_connections(&[&traffic], enrolled, PER_PHASE);
    let no_owner_since = first.kill();
    // The second owner starts only once connections went through with no owner process at all.
    wait_for_connections(&[&traffic], no_owner_since, PER_PHASE);
    let mut second = Owner::spawn(fixture.node());
    let owner_again = Instant::now();
    wait_for_connections(&[&traffic], owner_again, PER_PHASE);
    let log = traffic.stop();
    for connection in &log {
        assert!(
            connection.outcome.is_ok(),
            "connection during restart: {:?}",
            connection.outcome
        );
    }

    let seen = ztunnel.seen();
    let without_owner: Vec<&Connection> = log
        .iter()
        .filter(|c| c.started > no_owner_since && c.finished < owner_again)
        .collect();
    assert!(
        !without_owner.is_empty(),
        "no connection was made while no owner ran"
    );
    for connection in &without_owner {
        assert!(
            seen.iter().any(|s| s.listener == OUTBOUND_PORT
                && Ok(s.peer) == connection.outcome
                && s.original_dst == Some(target)),
            "the connection from {:?} made while no owner ran never reached 15001",
            connection.outcome
        );
    }
    let made = log.len();
    eprintln!(
        "{made} connections, {} of them while no owner ran",
        without_owner.len()
    );
    assert!(made > 10, "only {made} connections");
    let redirected = seen
        .iter()
        .filter(|s| s.listener == OUTBOUND_PORT && s.original_dst == Some(target))
        .count();
    assert_eq!(redirected, made, "every connection went through ztunnel");

    // The new owner recovered the pod from the pinned maps: it can unenroll it by uid.
    assert_eq!(second.send(&format!("unenroll {}", pod.uid())), "ok true");
    let before = ztunnel.seen().len();
    pod.run(|| tcp_request(target, "direct")).unwrap();
    assert_eq!(ztunnel.seen().len(), before);
    assert_eq!(second.send("uninstall"), "ok");
    second.child.wait().unwrap();
}

/// A fault while enrolling leaves nothing behind: no map entry, no tc filter, no redirection.
#[test]
fn failed_enrollment_leaves_nothing_behind() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    // With `lo` down the return-path route cannot be added: enrollment fails midway, after the
    // tc filter went on.
    let lo = |state| ip(&["-n", pod.netns().name(), "link", "set", "lo", state]).unwrap();
    lo("down");
    let datapath = fixture.start_datapath();
    datapath
        .enroll(pod.workload(PodOptions::default()))
        .wait()
        .expect_err("enrollment fails");
    assert_eq!(datapath.counters(pod.uid()).wait().unwrap(), None);
    assert!(!datapath.is_redirected(pod.uid()).wait().unwrap());
    // `ip netns exec` exits with tc's status: a tc that fails shows nothing, and must not pass.
    let filters = ip_output(&[
        "netns",
        "exec",
        pod.netns().name(),
        "tc",
        "filter",
        "show",
        "dev",
        "eth0",
        "ingress",
    ])
    .expect("tc filter show");
    assert!(filters.is_empty(), "{filters}");
    let target = server.app_v4();
    let reply = pod.run(|| tcp_request(target, "direct")).unwrap();
    assert_eq!(reply.response, echo.reply_to("direct"));
    assert!(ztunnel.seen().is_empty());

    // Once the fault is gone the same pod enrolls.
    lo("up");
    datapath
        .enroll(pod.workload(PodOptions::default()))
        .wait()
        .unwrap();
    assert!(datapath.is_redirected(pod.uid()).wait().unwrap());
    datapath.uninstall().wait().unwrap();
}

#[test]
fn a_failed_re_enrollment_keeps_the_pod_redirected_as_it_was() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server, _echo, ztunnel, datapath) = enrolled_app_and_server(&fixture);
    // With `lo` down the return path cannot be set up again: the new options fail midway.
    let lo = |state| ip(&["-n", pod.netns().name(), "link", "set", "lo", state]).unwrap();
    lo("down");
    let bypass = PodOptions {
        inbound_bypass: true,
        ..PodOptions::default()
    };
    datapath
        .enroll(pod.workload(bypass))
        .wait()
        .expect_err("re-enrollment fails");
    lo("up");

    assert!(datapath.is_redirected(pod.uid()).wait().unwrap());
    // `lo` going down took the IPv6 `local default dev lo table 100` route with it (the IPv4
    // one stays): the audit finds that piece of the return path missing and puts it back; the
    // maps are as they were.
    assert_eq!(datapath.audit().wait().unwrap(), ["return_path_missing"]);
    assert!(datapath.audit().wait().unwrap().is_empty());
    let target = server.app_v4();
    pod.run(|| tcp_request(target, "still captured")).unwrap();
    let seen = ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .expect("outbound still goes to ztunnel");
    assert_eq!(seen.original_dst, Some(target));
    // Inbound too: the options of the failed attempt did not apply.
    let to_pod = pod.app_v4();
    let _ = server.run(|| tcp_request(to_pod, "inbound"));
    assert!(ztunnel
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .is_some());
    datapath.uninstall().wait().unwrap();
}

#[test]
fn the_audit_counts_and_writes_back_entries_removed_behind_the_agents_back() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server, echo, ztunnel, datapath) = enrolled_app_and_server(&fixture);
    // As an operator's `bpftool map delete` would.
    let mut pod_ips = fixture.node().pinned_pod_ips().unwrap();
    let keys: Vec<_> = pod_ips.keys().map(Result::unwrap).collect();
    assert!(!keys.is_empty());
    for key in &keys {
        pod_ips.remove(key).unwrap();
    }

    let target = server.app_v4();
    let reply = pod.run(|| tcp_request(target, "uncaptured")).unwrap();
    assert_eq!(
        reply.response,
        echo.reply_to("uncaptured"),
        "capture is lost"
    );
    assert!(!datapath.is_redirected(pod.uid()).wait().unwrap());

    let found = datapath.audit().wait().unwrap();
    assert!(!found.is_empty());
    assert!(
        found.iter().all(|kind| *kind == "address_missing"),
        "{found:?}"
    );
    assert!(datapath.is_redirected(pod.uid()).wait().unwrap());
    pod.run(|| tcp_request(target, "captured again")).unwrap();
    assert!(ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .is_some());
    assert!(
        datapath.audit().wait().unwrap().is_empty(),
        "nothing left to find"
    );
    datapath.uninstall().wait().unwrap();
}

/// What a pod with CAP_NET_ADMIN can do to weir's objects in its own netns: the audit puts them
/// back, and the pod's inbound traffic goes through ztunnel again.
#[test]
fn the_audit_restores_tc_filters_and_the_return_path_a_pod_removed() {
    let fixture = privileged!(DatapathNode::new());
    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&server).unwrap();
    let datapath = fixture.enrolled(&server, PodOptions::default());
    let in_pod = |command: &[&str]| {
        let mut args = vec!["netns", "exec", server.netns().name()];
        args.extend_from_slice(command);
        ip_output(&args).unwrap_or_else(|error| panic!("{error:#}"))
    };
    in_pod(&["tc", "filter", "del", "dev", "eth0", "ingress"]);
    for family in ["-4", "-6"] {
        in_pod(&[
            "ip",
            family,
            "rule",
            "del",
            "fwmark",
            "0x1000/0x1000",
            "lookup",
            "100",
        ]);
    }

    let mut found = datapath.audit().wait().unwrap();
    found.sort();
    assert_eq!(
        found,
        [
            "return_path_missing",
            "return_path_missing",
            "tc_filter_missing"
        ]
    );
    for (source, target) in [
        (IpAddr::V4(client.ipv4()), server.app_v4()),
        (IpAddr::V6(client.ipv6()), server.app_v6()),
    ] {
        let reply = client
            .run(|| tcp_request(target, "inbound"))
            .unwrap_or_else(|e| panic!("request to {target}: {e}"));
        // The app's replies found their way back to ztunnel's transparent socket.
        assert_eq!(reply.response, echo.reply_to("inbound"));
        let seen = ztunnel
            .wait_for(
                |s| s.listener == INBOUND_PORT && s.peer.ip() == source,
                WAIT,
            )
            .unwrap_or_else(|| panic!("connection to {target} never reached 15006"));
        assert_eq!(seen.destination(), target);
    }
    assert!(
        datapath.audit().wait().unwrap().is_empty(),
        "nothing left to find"
    );
    datapath.uninstall().wait().unwrap();
}

/// A filter a pod puts before weir's (classic BPF needs no more than CAP_NET_ADMIN) is the pod's
/// own: the audit reports it, every time, and leaves it and weir's filter in place.
#[test]
fn the_audit_reports_a_tc_filter_a_pod_put_before_weirs() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let in_pod = |command: &[&str]| {
        let mut args = vec!["netns", "exec", pod.netns().name()];
        args.extend_from_slice(command);
        ip_output(&args).unwrap_or_else(|error| panic!("{error:#}"))
    };
    // Matches every packet, which with no action lets it through: weir's filter never sees it.
    in_pod(&[
        "tc",
        "filter",
        "add",
        "dev",
        "eth0",
        "ingress",
        "protocol",
        "all",
        "pref",
        "1",
        "handle",
        "1",
        "bpf",
        "bytecode",
        "1,6 0 0 4294967295,",
    ]);
    for _ in 0..2 {
        assert_eq!(datapath.audit().wait().unwrap(), ["tc_filter_preceded"]);
    }
    let filters = in_pod(&["tc", "filter", "show", "dev", "eth0", "ingress"]);
    assert!(filters.contains("handle 0x1 "), "{filters}");
    assert!(filters.contains("handle 0x5745 "), "{filters}");
    datapath.uninstall().wait().unwrap();
}

#[test]
fn the_nodes_own_netns_is_never_enrolled() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let datapath = fixture.start_datapath();
    let node = Workload {
        netns: fixture.node().netns().path().to_path_buf(),
        ..pod.workload(PodOptions::default())
    };
    let error = datapath
        .enroll(node)
        .wait()
        .expect_err("the node's netns is refused");
    assert!(
        format!("{error:#}").contains("node's own network namespace"),
        "{error:#}"
    );
    assert_eq!(datapath.counters(pod.uid()).wait().unwrap(), None);
    assert!(datapath.enrolled().wait().unwrap().is_empty());
    datapath.uninstall().wait().unwrap();
}

/// With `--bpf-log` the programs carry their logging code, which the verifier must accept too,
/// and the agent forwards their records to the `log` crate.
#[test]
fn bpf_log_reports_the_programs_decisions() {
    let fixture = privileged!(DatapathNode::new());
    static RECORDS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    struct Collect;
    impl log::Log for Collect {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &log::Record<'_>) {
            if record.target().starts_with("weir_ebpf") {
                RECORDS.lock().unwrap().push(record.args().to_string());
            }
        }
        fn flush(&self) {}
    }
    log::set_logger(&Collect).expect("no other logger in this test binary");
    log::set_max_level(log::LevelFilter::Debug);

    let (client, server) = (fixture.pod("client"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let _ztunnel = ZtunnelStandIn::start(&server).unwrap();
    let config = DatapathConfig {
        bpf_log: true,
        ..fixture.node().datapath_config()
    };
    let datapath = Datapath::start(config).expect("datapath starts with logging on");
    datapath
        .ztunnel_connected(std::process::id())
        .wait()
        .unwrap();
    datapath
        .enroll(server.workload(PodOptions::default()))
        .wait()
        .expect("pod enrolled");

    let wait_for_record = |expected: String| {
        let recorded = || {
            RECORDS
                .lock()
                .unwrap()
                .iter()
                .any(|r| r.contains(&expected))
        };
        if try_wait_until(WAIT, recorded).is_none() {
            panic!("no record with {expected:?}: {:?}", RECORDS.lock().unwrap());
        }
    };

    let target = server.app_v4();
    let reply = client.run(|| tcp_request(target, "logged")).unwrap();
    assert_eq!(reply.response, echo.reply_to("logged"));
    wait_for_record(format!("to {}:{APP_PORT} assigned to 15006", server.ipv4()));
    // A drop says why.
    let fragmented_syn = raw::Syn {
        source: SocketAddr::new(IpAddr::V4(client.ipv4()), 41001),
        destination: target,
        shape: raw::Fragmented(8),
        tcp: raw::Tcp::SYN,
    };
    client
        .run(|| raw::probe(&[fragmented_syn], Duration::from_millis(300)))
        .unwrap();
    wait_for_record(format!(
        "to {}:{APP_PORT}: a first fragment no connection owns",
        server.ipv4()
    ));
    datapath.uninstall().wait().unwrap();
}

/// A pod istio-cni redirected with its in-pod rules is enrolled live and moves to weir's
/// programs in place: connections made under istio's rules (through ztunnel both ways) go on,
/// new ones take weir's path, none reaches the app around ztunnel at any moment of the move,
/// istio's redirection is gone at once and its return path once its last connection closed.
#[test]
fn a_pod_istio_cni_redirected_moves_to_weir_in_place() {
    let fixture = privileged!(DatapathNode::new());
    let (client, app, server) = (
        fixture.pod("client"),
        fixture.pod("app"),
        fixture.pod("server"),
    );
    let any = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), APP_PORT);
    let app_echo = EchoServer::start_lasting(app.netns(), "app", any).unwrap();
    let server_echo = EchoServer::start_lasting(server.netns(), "server", any).unwrap();
    let ztunnel = ZtunnelStandIn::start(&app).unwrap();
    istio_iptables::apply(app.netns()).unwrap();

    // Held across the move: the app's connection out, and one into the app.
    let held_out = app.run(|| TcpStream::connect(server.app_v4())).unwrap();
    let held_in = client.run(|| TcpStream::connect(app.app_v4())).unwrap();
    let exchange = |stream: &TcpStream, echo: &EchoServer, line: &str| {
        let answer = exchange_line(stream, line)
            .unwrap_or_else(|error| panic!("{line}: {error}: {:#?}", ztunnel.dials()));
        assert_eq!(answer, echo.reply_to(line), "{line}");
    };
    exchange(&held_out, &server_echo, "out before");
    exchange(&held_in, &app_echo, "in before");
    let under_istio = ztunnel.seen();
    assert!(
        under_istio
            .iter()
            .any(|s| s.listener == INBOUND_PORT && s.local.port() == INBOUND_PORT),
        "istio's REDIRECT brought the connection in: {under_istio:?}"
    );

    // New connections all through the move, both ways.
    let loop_in = TrafficLoop::start(client.netns(), app.app_v4(), app_echo.reply_to("loop"));
    let loop_out = TrafficLoop::start(app.netns(), server.app_v4(), server_echo.reply_to("loop"));
    wait_for_connections(&[&loop_in, &loop_out], Instant::now(), 3);
    let datapath = fixture.start_datapath();
    let netns = std::fs::File::open(app.netns_path()).unwrap();
    datapath
        .enroll_in(
            app.workload(PodOptions::default()),
            EnrollNetns::Found(netns.into()),
        )
        .wait()
        .unwrap();
    wait_for_connections(&[&loop_in, &loop_out], Instant::now(), 3);
    for (direction, connections) in [("in", loop_in.stop()), ("out", loop_out.stop())] {
        let failed: Vec<_> = connections.iter().filter(|c| c.outcome.is_err()).collect();
        assert!(failed.is_empty(), "{direction}: {failed:?}");
    }

    let left = app
        .run(|| IstioRules::find(&mut Rtnl::new().unwrap()))
        .unwrap();
    assert!(!left.redirects(), "istio's redirection is gone: {left:?}");
    assert!(
        !left.return_path.is_empty() && left.return_rules == 2,
        "its return path stays for the connection ztunnel made under it: {left:?}"
    );
    exchange(&held_out, &server_echo, "out after");
    exchange(&held_in, &app_echo, "in after");

    // New connections take weir's path: the accepted socket has the original destination.
    for (source, target) in [
        (IpAddr::V4(client.ipv4()), app.app_v4()),
        (IpAddr::V6(client.ipv6()), app.app_v6()),
    ] {
        let reply = client.run(|| tcp_request(target, "new in")).unwrap();
        assert_eq!(reply.response, app_echo.reply_to("new in"));
        ztunnel
            .wait_for(
                |s| s.listener == INBOUND_PORT && s.peer.ip() == source && s.local == target,
                WAIT,
            )
            .unwrap_or_else(|| panic!("{target}: not by weir's hand-off: {:?}", ztunnel.seen()));
    }
    let reply = app.run(|| tcp_request(server.app_v6(), "new out")).unwrap();
    assert_eq!(reply.response, server_echo.reply_to("new out"));
    ztunnel
        .wait_for(
            |s| s.listener == OUTBOUND_PORT && s.original_dst == Some(server.app_v6()),
            WAIT,
        )
        .expect("outbound through ztunnel");

    // Whatever reached the app came from ztunnel's dials.
    let dialed: Vec<SocketAddr> = ztunnel
        .dials()
        .iter()
        .filter(|dial| dial.listener == INBOUND_PORT)
        .filter_map(|dial| dial.source)
        .collect();
    for received in app_echo.received() {
        assert!(
            dialed.contains(&sockopt::canonical(received.peer)),
            "reached the app around ztunnel: {received:?}"
        );
    }

    // The return path goes once the last connection made under it has.
    drop(held_in);
    datapath.audit().wait().unwrap();
    exchange(&held_out, &server_echo, "out at the end");
    let left = app
        .run(|| IstioRules::find(&mut Rtnl::new().unwrap()))
        .unwrap();
    assert_eq!(left.return_rules, 2, "{left:?}");
    drop(held_out);
    let gone = try_wait_until(WAIT, || {
        datapath.audit().wait().unwrap();
        let left = app
            .run(|| IstioRules::find(&mut Rtnl::new().unwrap()))
            .unwrap();
        left.is_empty().then_some(())
    });
    assert!(
        gone.is_some(),
        "istio's return path outlived its connections: {:?}\n{}",
        app.run(|| IstioRules::find(&mut Rtnl::new().unwrap())),
        app.run(|| std::fs::read_to_string("/proc/thread-self/net/nf_conntrack"))
            .unwrap_or_default()
    );
    datapath.uninstall().wait().unwrap();
}
