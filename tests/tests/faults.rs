//! Faults and hostile pods, against the real agent and datapath: an upgrade across map layouts
//! under continuous traffic, the agent SIGKILLed between enrollment steps, what a process in an
//! enrolled pod can and cannot do, and who may reach weir's sockets and pins.
use std::{
    fs,
    io::{self, ErrorKind},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    path::Path,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use socket2::{Domain, SockAddr, Socket, Type};
use weir_agent::workload::PodOptions;
use weir_common::{
    ABI_VERSION, DNS_PORT, DNS_PROXY_PORT, HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT, ZTUNNEL_MARK,
};
use weir_tests::privileged;
use weir_tests::{
    agent::{http_get, AgentBinary, AgentProcess},
    cgroup,
    chain::{listed_pods, CniChainNode, MESH, WAIT},
    io_timeout,
    sockopt::canonical,
    tcp_attempt, tcp_request,
    traffic::{read_line, set_timeouts, write_line},
    traffic_loop::{wait_for_connections, Connection, TrafficLoop},
    udp_request, udp_request_connected,
    ztunnel::DNS_REPLY_PREFIX,
    DatapathNode, EchoServer, PodSpec, Seen, ZdsEvent, ZdsReply, ZdsZtunnel, ZtunnelStandIn,
    APP_PORT,
};

/// uid and gid of an unprivileged process.
const NOBODY: u32 = 65534;

/// The connections of `log` that succeeded without going through ztunnel: never seen on
/// `listener` (by client address) with `target` as their destination.
fn bypassing<'a>(
    log: &'a [Connection],
    seen: &[Seen],
    listener: u16,
    target: SocketAddr,
) -> Vec<&'a Connection> {
    log.iter()
        .filter(|connection| match &connection.outcome {
            Ok(client) => !seen
                .iter()
                .any(|s| s.listener == listener && s.peer == *client && s.destination() == target),
            // Failed connections reached nothing, so they bypassed nothing; the test reports
            // how many there were.
            Err(_) => false,
        })
        .collect()
}

/// An upgrade to another map layout while an enrolled pod makes and receives connections
/// without pause: the new agent moves the pod into its layout and retires the old one, and not
/// one connection, before, during or after, reaches the app or leaves the pod around ztunnel.
#[test]
fn upgrade_across_map_layouts_under_traffic_lets_no_connection_bypass_ztunnel() {
    /// Connections each loop makes before the upgrade and after it.
    const PER_PHASE: usize = 20;
    let node = privileged!(CniChainNode::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, server_app, pod, _) = node.server_and_ambient_pod(&ztunnel, "app");
    let pod_app = EchoServer::app(&pod).unwrap();
    // ztunnel keeps proxying while its agent is away.
    let standing = ZtunnelStandIn::start(&pod).unwrap();
    let pin_root = agent.config.datapath.pin_root.clone();
    agent.stop().unwrap();
    drop(ztunnel);
    // What the previous version left: its maps and links under an older layout's directory.
    let older = pin_root.join("abi-0");
    fs::rename(pin_root.join(format!("abi-{ABI_VERSION}")), &older).unwrap();

    let outbound_target = server.app_v4();
    let inbound_target = pod.app_v4();
    let outbound = TrafficLoop::start(pod.netns(), outbound_target, server_app.reply_to("loop"));
    let inbound = TrafficLoop::start(server.netns(), inbound_target, pod_app.reply_to("loop"));
    let loops = [&outbound, &inbound];
    wait_for_connections(&loops, Instant::now(), PER_PHASE);
    let upgrade_started = Instant::now();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let upgraded = Instant::now();
    assert!(!older.exists(), "the older layout is retired");
    let handed_over = ztunnel.wait_for_pod(pod.uid(), WAIT).expect("handed over");
    wait_for_connections(&loops, upgraded, PER_PHASE);
    let (outbound, inbound) = (outbound.stop(), inbound.stop());

    let seen: Vec<Seen> = [standing.seen(), handed_over.seen()].concat();
    let during_upgrade = |log: &[Connection]| {
        log.iter()
            .filter(|c| c.started >= upgrade_started && c.finished <= upgraded)
            .count()
    };
    let (outbound_during, inbound_during) = (during_upgrade(&outbound), during_upgrade(&inbound));
    let bypassed_outbound = bypassing(&outbound, &seen, OUTBOUND_PORT, outbound_target);
    let bypassed_inbound = bypassing(&inbound, &seen, INBOUND_PORT, inbound_target);
    let failed = |log: &[Connection]| log.iter().filter(|c| c.outcome.is_err()).count();
    eprintln!(
        "{} outbound and {} inbound connections, {outbound_during} and {inbound_during} of them \
         during the upgrade; {} and {} failed",
        outbound.len(),
        inbound.len(),
        failed(&outbound),
        failed(&inbound)
    );
    assert!(
        outbound_during > 0 && inbound_during > 0,
        "no connection ran during the upgrade ({outbound_during} outbound, {inbound_during} inbound)"
    );
    // The first few of each; the counts say how many.
    let describe = |bypassed: &[&Connection]| -> Vec<String> {
        bypassed
            .iter()
            .take(5)
            .map(|c| {
                let phase = if c.finished < upgrade_started {
                    "before"
                } else if c.started > upgraded {
                    "after"
                } else {
                    "during"
                };
                format!("{phase} the upgrade: {:?}", c.outcome)
            })
            .collect()
    };
    assert!(
        bypassed_outbound.is_empty() && bypassed_inbound.is_empty(),
        "of {} outbound connections ({outbound_during} during the upgrade) {} bypassed ztunnel: \
         {:?}; of {} inbound ({inbound_during} during the upgrade) {}: {:?}",
        outbound.len(),
        bypassed_outbound.len(),
        describe(&bypassed_outbound),
        inbound.len(),
        bypassed_inbound.len(),
        describe(&bypassed_inbound),
    );
    agent.stop().unwrap();
}

/// Where the agent is SIGKILLed while it enrolls a pod.
#[derive(Clone, Copy)]
enum KilledAt {
    /// Held at one of the agent's fault-injection points (`fail::fail_point!` in the agent).
    Point(&'static str),
    /// ztunnel got the Add and does not ack it.
    AddSentNotAcked,
}

/// The agent dies mid-enroll; the runtime's ADD fails. After the restart the sandbox is either
/// redirected as a whole (outbound through 15001 with its original destination, inbound through
/// 15006) or untouched; the runtime tears it down and retries, the retry completes the pod, and
/// then the pinned maps and the agent's state name that pod once, and nothing else.
fn killed_mid_enroll(killed_at: KilledAt) {
    let node = privileged!(CniChainNode::new());
    let server = node.pod("default", "server").unwrap();
    let server_app = EchoServer::app(&server).unwrap();
    let pause_at = match killed_at {
        KilledAt::Point(point) => Some(point),
        KilledAt::AddSentNotAcked => None,
    };
    let agent = AgentProcess::start(
        &node.files,
        node.netns(),
        AgentBinary::WithFailpoints { pause_at },
    )
    .expect("agent ready");
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).expect("ztunnel connects");
    if let KilledAt::AddSentNotAcked = killed_at {
        ztunnel.reply_next_add(ZdsReply::Silent);
    }
    let spec = PodSpec {
        namespace: MESH.into(),
        uid: Some(weir_tests::ids::uuid_v4()),
        ..PodSpec::new("app")
    };
    let uid = spec.uid.clone().unwrap();
    let failed = thread::scope(|scope| {
        let adding = scope.spawn(|| node.test_node().try_add_pod(spec.clone()));
        match killed_at {
            KilledAt::Point(_) => agent.wait_until_paused(WAIT).unwrap(),
            KilledAt::AddSentNotAcked => {
                ztunnel
                    .wait_for(
                        |event| matches!(event, ZdsEvent::Add { uid: added, .. } if *added == uid),
                        WAIT,
                    )
                    .expect("ztunnel got the Add");
            }
        }
        agent.kill().unwrap();
        adding.join().unwrap().unwrap()
    });
    let failed = failed.expect_err("the ADD fails when the agent dies in it");
    drop(ztunnel);

    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let sandbox = failed.sandbox;
    let sandbox_app = EchoServer::app(&sandbox).unwrap();
    let in_maps = listed_pods(&agent)
        .iter()
        .any(|row| row["uid"] == uid.as_str() && row["in_maps"] == true);
    // A redirected sandbox's traffic has nowhere to go until ztunnel has its proxy (as with a
    // real ztunnel starting up): the requests wait for the handover.
    let stand_in = in_maps.then(|| {
        ztunnel
            .wait_for_pod(&uid, WAIT)
            .expect("the recovered sandbox is handed to ztunnel")
    });
    let to_server = server.app_v4();
    let to_sandbox = sandbox.app_v4();
    let outbound = sandbox.run(|| tcp_request(to_server, "out")).unwrap();
    assert_eq!(outbound.response, server_app.reply_to("out"));
    let inbound = server.run(|| tcp_request(to_sandbox, "in")).unwrap();
    assert_eq!(inbound.response, sandbox_app.reply_to("in"));
    let (out_client, in_client) = (canonical(outbound.local), canonical(inbound.local));
    let state = if in_maps { "redirected" } else { "untouched" };
    eprintln!("after the restart the failed sandbox is {state}");
    if let Some(stand_in) = stand_in {
        assert!(
            stand_in
                .wait_for(
                    |s| s.listener == OUTBOUND_PORT
                        && s.peer == out_client
                        && s.original_dst == Some(to_server),
                    WAIT
                )
                .is_some(),
            "redirected, yet its outbound bypassed 15001: half-redirected"
        );
        assert!(
            stand_in
                .wait_for(
                    |s| s.listener == INBOUND_PORT
                        && s.peer == in_client
                        && s.destination() == to_sandbox,
                    WAIT
                )
                .is_some(),
            "redirected, yet its inbound bypassed 15006: half-redirected"
        );
    } else {
        // Untouched: both reach the apps directly, from the client's own port.
        assert!(server_app
            .wait_for(|r| r.line == "out" && r.peer == out_client, WAIT)
            .is_some());
        assert!(sandbox_app
            .wait_for(|r| r.line == "in" && r.peer == in_client, WAIT)
            .is_some());
    }

    // The runtime tears the failed sandbox down (CNI DEL) and retries with a new one.
    drop(sandbox_app);
    drop(sandbox);
    let pod = node
        .test_node()
        .add_pod_with(spec)
        .expect("the runtime's retry completes the pod");
    let stand_in = ztunnel.pod(&uid).expect("ztunnel acked the retried pod");
    let reply = pod.run(|| tcp_request(to_server, "retried")).unwrap();
    assert_eq!(reply.response, server_app.reply_to("retried"));
    assert!(
        stand_in
            .wait_for(
                |s| s.listener == OUTBOUND_PORT
                    && s.peer == canonical(reply.local)
                    && s.original_dst == Some(to_server),
                WAIT
            )
            .is_some(),
        "the retried pod's traffic reaches 15001 with its original destination"
    );
    let listed = listed_pods(&agent);
    assert_eq!(listed.len(), 1, "one pod, nothing orphaned: {listed:#?}");
    let row = &listed[0];
    assert_eq!(row["uid"], uid.as_str(), "{row:#}");
    assert_eq!(
        row["netns_cookie"],
        pod.netns().cookie().unwrap(),
        "{row:#}"
    );
    assert_eq!(
        (&row["in_maps"], &row["in_state_file"], &row["status"]),
        (
            &Value::Bool(true),
            &Value::Bool(true),
            &Value::from("enabled")
        ),
        "{row:#}"
    );
    agent.stop().unwrap();
}

#[test]
fn sigkill_after_the_maps_are_written_before_the_tc_program() {
    killed_mid_enroll(KilledAt::Point("enroll-maps-written"));
}

#[test]
fn sigkill_after_redirection_before_ztunnel_add() {
    killed_mid_enroll(KilledAt::Point("enroll-redirected"));
}

#[test]
fn sigkill_after_ztunnel_add_before_its_ack() {
    killed_mid_enroll(KilledAt::AddSentNotAcked);
}

#[test]
fn sigkill_after_ztunnels_ack_before_the_pod_is_recorded() {
    killed_mid_enroll(KilledAt::Point("enroll-acked"));
}

/// Makes the calling thread `nobody` (uid and gid), which clears its effective capabilities
/// (`CAP_NET_ADMIN` and `CAP_NET_RAW` among them): an unprivileged process in a pod. Linux
/// credentials are per thread and the raw syscalls change only this one (glibc's `setuid`
/// would change every thread of the test process), so run it on a thread of its own.
fn become_nobody() {
    // SAFETY: plain syscalls on this thread's credentials, no memory passed.
    let results = unsafe {
        [
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()),
            libc::syscall(libc::SYS_setresgid, NOBODY, NOBODY, NOBODY),
            libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY),
        ]
    };
    assert_eq!(results, [0; 3], "{}", io::Error::last_os_error());
}

/// An app without `CAP_NET_ADMIN` cannot give its socket ztunnel's mark (which the datapath
/// never redirects): the kernel refuses it, and its connection is captured as any other.
#[test]
fn an_unprivileged_app_cannot_take_ztunnels_mark_and_is_captured() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let server_app = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let target = server.app_v4();

    let (refused, client, response) = pod.run(|| {
        become_nobody();
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        let refused = socket
            .set_mark(ZTUNNEL_MARK)
            .expect_err("SO_MARK as nobody");
        socket
            .connect_timeout(&target.into(), io_timeout())
            .unwrap();
        let stream = TcpStream::from(socket);
        set_timeouts(&stream).unwrap();
        write_line(&stream, "unmarked").unwrap();
        let client = canonical(stream.local_addr().unwrap());
        (refused, client, read_line(&stream).unwrap())
    });
    assert_eq!(refused.raw_os_error(), Some(libc::EPERM), "{refused}");
    assert_eq!(response, server_app.reply_to("unmarked"));
    let seen = ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT && s.peer == client, WAIT)
        .expect("captured: reached 15001");
    assert_eq!(seen.original_dst, Some(target));
    datapath.uninstall().wait().unwrap();
}

/// A pod's process with ztunnel's mark (which `CAP_NET_RAW` is enough for from Linux 5.17) is
/// still not ztunnel, whose cgroup it is not in: its connection is captured with its original
/// destination, and it cannot bind the ports ztunnel listens on in its pod, so it can neither
/// take the pod's inbound connections while ztunnel is away nor share ztunnel's listeners. The
/// ztunnel stand-in, in ztunnel's cgroup, binds them afterwards.
#[test]
fn a_pods_process_with_ztunnels_mark_is_not_ztunnel() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let server_app = EchoServer::app(&server).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let marked_socket = |args: &[String]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_weir-marked-socket"));
        command.args(args);
        let output = cgroup::output_apart_from_ztunnel(pod.netns(), command).unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    };

    for port in [INBOUND_PORT, OUTBOUND_PORT, HBONE_PORT] {
        for ip in [IpAddr::V4(pod.ipv4()), IpAddr::V4(Ipv4Addr::UNSPECIFIED)] {
            let address = SocketAddr::new(ip, port).to_string();
            let answer = marked_socket(&["bind".into(), address.clone()]);
            assert_eq!(answer, format!("refused {}", libc::EPERM), "bind {address}");
        }
    }
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();

    let target = server.app_v4();
    let answer = marked_socket(&["request".into(), target.to_string(), "marked".into()]);
    let (client, response) = answer.split_once(' ').unwrap();
    assert_eq!(response, server_app.reply_to("marked"));
    let client: SocketAddr = client.parse().unwrap();
    let seen = ztunnel
        .wait_for(
            |s| s.listener == OUTBOUND_PORT && s.peer == canonical(client),
            WAIT,
        )
        .expect("captured: reached 15001");
    assert_eq!(seen.original_dst, Some(target));
    datapath.uninstall().wait().unwrap();
}

/// Sends `msg` in the SYN (`sendto` with `MSG_FASTOPEN`, no `connect`) and reads the answer;
/// returns the client's address and the answer.
fn fast_open_request(target: SocketAddr, msg: &str) -> io::Result<(SocketAddr, String)> {
    let socket = Socket::new(Domain::for_address(target), Type::STREAM, None)?;
    socket.send_to_with_flags(
        format!("{msg}\n").as_bytes(),
        &target.into(),
        libc::MSG_FASTOPEN,
    )?;
    let stream = TcpStream::from(socket);
    set_timeouts(&stream)?;
    Ok((canonical(stream.local_addr()?), read_line(&stream)?))
}

/// The ways into a socket that do not go through a plain `connect`, captured as istio's rules
/// capture them: TCP Fast Open to 15001 with its original destination, over IPv4, IPv6 and
/// v4-mapped IPv6; DNS over connected and unconnected UDP, v4-mapped too, to the DNS proxy;
/// other UDP, connected or not, passes to its destination (ambient captures no other UDP).
#[test]
fn fast_open_udp_and_v4_mapped_traffic_are_captured_as_istio_captures_them() {
    /// A UDP port that is not DNS.
    const UDP_PORT: u16 = 9053;
    let fixture = privileged!(DatapathNode::new());
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let server_app = EchoServer::app(&server).unwrap();
    let udp_apps = [IpAddr::V4(server.ipv4()), IpAddr::V6(server.ipv6())].map(|ip| {
        EchoServer::start_udp(server.netns(), "udp", SocketAddr::new(ip, UDP_PORT)).unwrap()
    });
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let v4_mapped = IpAddr::V6(server.ipv4().to_ipv6_mapped());
    let server_ips = [
        IpAddr::V4(server.ipv4()),
        IpAddr::V6(server.ipv6()),
        v4_mapped,
    ];

    for ip in server_ips {
        let target = SocketAddr::new(ip, APP_PORT);
        let (client, response) = pod
            .run(|| fast_open_request(target, "fast open"))
            .unwrap_or_else(|e| panic!("fast open to {target}: {e}"));
        assert_eq!(response, server_app.reply_to("fast open"), "to {target}");
        let seen = ztunnel
            .wait_for(|s| s.listener == OUTBOUND_PORT && s.peer == client, WAIT)
            .unwrap_or_else(|| panic!("fast open to {target} never reached 15001"));
        assert_eq!(seen.original_dst, Some(canonical(target)));
    }

    for ip in server_ips {
        let target = SocketAddr::new(ip, UDP_PORT);
        let udp_app = &udp_apps[usize::from(ip.to_canonical().is_ipv6())];
        for (kind, reply) in [
            ("unconnected", pod.run(|| udp_request(target, "udp"))),
            (
                "connected",
                pod.run(|| udp_request_connected(target, "udp")),
            ),
        ] {
            let reply = reply.unwrap_or_else(|e| panic!("{kind} UDP to {target}: {e}"));
            assert_eq!(
                reply.response,
                udp_app.reply_to("udp"),
                "{kind} to {target}"
            );
            assert_eq!(reply.from, target, "{kind} to {target}");
        }
    }

    let gateway = IpAddr::V6(fixture.node().gateway_v4().to_ipv6_mapped());
    let resolver = SocketAddr::new(gateway, DNS_PORT);
    for (kind, reply) in [
        ("unconnected", pod.run(|| udp_request(resolver, "query"))),
        (
            "connected",
            pod.run(|| udp_request_connected(resolver, "query")),
        ),
    ] {
        let reply = reply.unwrap_or_else(|e| panic!("{kind} DNS to {resolver}: {e}"));
        assert_eq!(reply.response, format!("{DNS_REPLY_PREFIX}query"), "{kind}");
        assert_eq!(
            reply.from, resolver,
            "{kind}: the answer shows the resolver"
        );
    }
    let at_dns_proxy = ztunnel
        .seen()
        .iter()
        .filter(|s| s.listener == DNS_PROXY_PORT)
        .count();
    assert_eq!(at_dns_proxy, 2, "only the DNS queries reach the DNS proxy");
    datapath.uninstall().wait().unwrap();
}

/// What an unprivileged process gets from connecting to `socket` (`SOCK_SEQPACKET` for ZDS)
/// and sending `request`: the answer, or `None` when the agent hung up without one.
fn unprivileged_request(socket: &Path, kind: Type, request: &[u8]) -> io::Result<Option<Vec<u8>>> {
    thread::scope(|scope| {
        scope
            .spawn(|| {
                become_nobody();
                let client = Socket::new(Domain::UNIX, kind, None)?;
                client.connect(&SockAddr::unix(socket)?)?;
                client.set_read_timeout(Some(io_timeout()))?;
                client.send(request)?;
                let mut answer = vec![0; 1024];
                let len = io::Read::read(&mut &client, &mut answer)?;
                answer.truncate(len);
                Ok((len > 0).then_some(answer))
            })
            .join()
            .unwrap()
    })
}

/// The agent's sockets and the files that name its pods are 0600 and its pins 0700, so only root
/// reaches them; and were the permissions loosened, the agent still refuses a peer that is not
/// root (peer credentials).
#[test]
fn sockets_pins_and_pod_records_are_root_only_and_non_root_peers_are_refused() {
    let node = privileged!(CniChainNode::new());
    let agent = node.start_agent();
    let config = &agent.config;
    let (cni_socket, zds_socket, trace_socket) =
        (&config.cni_socket, &config.zds_socket, &config.trace_socket);
    let pin_root = &config.datapath.pin_root;
    let maps = pin_root.join(format!("abi-{ABI_VERSION}"));
    for (path, expected) in [
        (cni_socket.as_path(), 0o600),
        (zds_socket.as_path(), 0o600),
        (trace_socket.as_path(), 0o600),
        (config.verdict_cache.as_path(), 0o600),
        (config.state_file.as_path(), 0o600),
        (pin_root.as_path(), 0o700),
        (maps.as_path(), 0o700),
        (&maps.join("links"), 0o700),
    ] {
        let mode = fs::metadata(path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, expected, "{} is {mode:o}", path.display());
    }
    let request = b"{\"not\": \"a request\"}\n";
    // A trace reader sends nothing: whatever it sent would read as its hanging up.
    let sockets: [(&Path, Type, &[u8]); 3] = [
        (cni_socket, Type::STREAM, request),
        (zds_socket, Type::SEQPACKET, request),
        (trace_socket, Type::STREAM, b""),
    ];
    for (path, kind, request) in sockets {
        let error = unprivileged_request(path, kind, request).expect_err("refused");
        assert_eq!(
            error.kind(),
            ErrorKind::PermissionDenied,
            "{}",
            path.display()
        );
    }
    let pins = thread::scope(|scope| {
        scope
            .spawn(|| {
                become_nobody();
                fs::read_dir(&maps).map(|_| ())
            })
            .join()
            .unwrap()
    });
    assert_eq!(pins.unwrap_err().kind(), ErrorKind::PermissionDenied);

    // As if someone loosened the permissions: the agent still answers root only.
    let answer = UnixStream::connect(cni_socket).and_then(|mut stream| {
        use std::io::{Read, Write};
        stream.write_all(request)?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).map(|_| answer)
    });
    assert!(
        answer
            .as_ref()
            .is_ok_and(|answer| answer.contains("malformed")),
        "root gets an answer: {answer:?}"
    );
    for dir in [
        node.files.run_dir().parent().unwrap(),
        &node.files.run_dir(),
    ] {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o711)).unwrap();
    }
    for (path, kind, request) in sockets {
        fs::set_permissions(path, fs::Permissions::from_mode(0o666)).unwrap();
        let answer = unprivileged_request(path, kind, request);
        assert!(
            matches!(answer, Ok(None))
                || answer.as_ref().is_err_and(|e| {
                    // Hung up before or while the request was written.
                    matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe)
                }),
            "{}: a non-root peer is hung up on, got {answer:?}",
            path.display()
        );
    }
    agent.stop().unwrap();
}

/// Every pod can reach the health port, which is on the node's network: it serves the probes'
/// paths and nothing else (no metrics, so no pod names), and thousands of connections that send
/// nothing, or half a request line and then stall, leave kubelet's probe answered at once.
#[test]
fn the_health_port_serves_only_health_and_idle_or_stalled_connections_do_not_starve_it() {
    /// Connections that send nothing.
    const IDLE: usize = 2000;
    /// Connections that send half a request line, then nothing more.
    const STALLED: usize = 200;
    /// kubelet gives up on a probe after 1 s by default; a loaded CI machine gets more.
    const PROBE_DEADLINE: Duration = Duration::from_secs(3);
    let node = privileged!(CniChainNode::new());
    // Both ends of every connection are in this process.
    allow_open_files_up_to_the_hard_limit();
    let agent = node.start_agent();
    let health = agent.config.health_addr;
    assert_eq!(
        http_get(health, "/metrics").unwrap().0,
        404,
        "/metrics on the health port"
    );
    agent.metrics();

    // A connection the listen backlog has no room for is left unanswered rather than refused:
    // the flood stops at the first one.
    let connect = || TcpStream::connect_timeout(&health, Duration::from_millis(500));
    let idle: Vec<TcpStream> = (0..IDLE).map_while(|_| connect().ok()).collect();
    let stalled: Vec<TcpStream> = (0..STALLED)
        .map_while(|_| {
            let mut stream = connect().ok()?;
            io::Write::write_all(&mut stream, b"GET /healthz HT").ok()?;
            Some(stream)
        })
        .collect();
    let asked = Instant::now();
    let answer = http_get(health, "/healthz");
    let took = asked.elapsed();
    let flood = format!(
        "{} idle and {} stalled connections",
        idle.len(),
        stalled.len()
    );
    assert!(
        matches!(&answer, Ok((200, body)) if body == "ok\n"),
        "/healthz after {flood}: {answer:?}"
    );
    assert!(
        took < PROBE_DEADLINE,
        "/healthz after {flood} took {took:?}"
    );
    drop((idle, stalled));
    agent.stop().unwrap();
}

/// Raises this process's soft limit on open files to its hard limit.
fn allow_open_files_up_to_the_hard_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit for both calls to read and write.
    let result = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit)
        } else {
            -1
        }
    };
    assert_eq!(result, 0, "{}", io::Error::last_os_error());
}

/// ztunnel is down (its listeners gone) while a pod stays enrolled: the pod's connections fail
/// rather than go around it, outbound and inbound.
#[test]
fn ztunnel_down_running_pods_fail_closed() {
    let fixture = privileged!(DatapathNode::new());
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let server_app = EchoServer::app(&server).unwrap();
    let pod_app = EchoServer::app(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    let to_server = server.app_v4();
    let outbound = pod.run(|| tcp_request(to_server, "out"));
    assert_eq!(
        outbound.map_err(|e| e.kind()).unwrap_err(),
        ErrorKind::ConnectionRefused,
        "outbound goes to 15001, where nothing listens"
    );
    let to_pod = pod.app_v4();
    let inbound = server.run(|| tcp_attempt(to_pod, "in"));
    assert!(inbound.is_err(), "inbound reached the app: {inbound:?}");
    assert_eq!(server_app.received(), []);
    assert_eq!(pod_app.received(), []);
    datapath.uninstall().wait().unwrap();
}
