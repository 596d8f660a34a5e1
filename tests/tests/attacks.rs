//! The standing attack suite: ways a pod's traffic could go around ztunnel, or around a sidecar
//! pod's own proxy, each tried as an attacker would against the real programs in this kernel
//! (and, in CI, in every kernel of the VM matrix). docs/failure-modes.md lists every attack with
//! the test that drives it, here or beside the feature it attacks.
//!
//! The oracles are what a user would see: for an ambient pod, every connection its app accepts
//! was handed to it by ztunnel (the stand-in saw it, by its tuple), and nothing but ztunnel gets
//! a connection meant for ztunnel's ports; for a sidecar pod, what its settings capture reaches
//! its proxy with the original destination, and what they exclude reaches the server directly.
use std::{
    fs, io,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    process::Command,
    sync::Barrier,
    thread,
    time::Duration,
};

use socket2::{Domain, Socket, Type};
use weir_agent::{datapath::cgroup2_root, workload::PodOptions};
use weir_common::{HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT};
use weir_tests::{
    cgroup,
    chain::{CniChainNode, WAIT as AGENT_WAIT},
    istio_iptables,
    netns::ip,
    privileged,
    receive_batch::{delay_egress, kernel_needs_the_handoff, XdpPass},
    sidecar::{sidecar_pod, SidecarStandIn},
    sockopt::canonical,
    tcp_attempt, tcp_request,
    traffic::{read_line, set_timeouts, write_line},
    wait_until, DatapathNode, EchoServer, Pod, ZtunnelStandIn, APP_PORT,
};

const WAIT: Duration = Duration::from_secs(5);

/// Runs `weir-marked-socket` with `args` in `pod`, in a cgroup of its own (never ztunnel's, as a
/// pod's process): what it printed.
fn marked_socket(pod: &Pod, args: &[&str]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_weir-marked-socket"));
    command.args(args);
    let output = cgroup::output_apart_from_ztunnel(pod.netns(), command).unwrap();
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// Whether a TCP socket listens on `port` in `pod` (IPv4 or IPv6).
fn listening_on(pod: &Pod, port: u16) -> bool {
    let wanted = format!(":{port:04X}");
    pod.run(|| {
        ["tcp", "tcp6"].iter().any(|table| {
            // thread-self: this thread is the one in the pod's netns.
            fs::read_to_string(format!("/proc/thread-self/net/{table}"))
                .unwrap_or_default()
                .lines()
                .skip(1)
                .map(|line| line.split_whitespace().collect::<Vec<_>>())
                .any(|fields| fields.len() > 3 && fields[1].ends_with(&wanted) && fields[3] == "0A")
        })
    })
}

/// The kernel's ephemeral ports for connect and autobind in `pod`: `ports`, as "LOW HIGH".
fn set_port_range(pod: &Pod, ports: &str) {
    pod.run(|| fs::write("/proc/sys/net/ipv4/ip_local_port_range", ports))
        .unwrap()
}

/// A pod's process gives its socket ztunnel's mark (`CAP_NET_RAW` suffices from Linux 5.17) and
/// `listen()`s without binding: the kernel picks its port from the netns's
/// `ip_local_port_range`, a sysctl Kubernetes counts as safe, which the pod has set to one of
/// ztunnel's ports, and no bind hook runs. While ztunnel is away (a restart, an upgrade), the
/// pod's inbound connections, and HBONE, meet only that listener: none may be handed to it.
/// Once ztunnel listens again, the same autobind cannot take its port.
#[test]
fn a_listener_autobound_to_ztunnels_ports_with_its_mark_gets_no_connection() {
    let fixture = privileged!(DatapathNode::new());
    let (client, pod) = (fixture.pod("client"), fixture.pod("app"));
    let echo = EchoServer::app(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());

    for (port, dialled) in [(INBOUND_PORT, APP_PORT), (HBONE_PORT, HBONE_PORT)] {
        set_port_range(&pod, &format!("{port} {port}"));
        let target = SocketAddr::new(IpAddr::V4(pod.ipv4()), dialled);
        let (reply, attacker) = thread::scope(|scope| {
            let attacker = scope.spawn(|| marked_socket(&pod, &["listen", "0.0.0.0:0", "6"]));
            wait_until(WAIT, "the attacker's listener", || listening_on(&pod, port));
            let reply = client.run(|| tcp_attempt(target, "around ztunnel"));
            (reply, attacker.join().unwrap())
        });
        assert_eq!(attacker, format!("listening {port}\nnone"), "to {target}");
        assert!(reply.is_err(), "{target} answered: {reply:?}");
    }
    assert!(echo.received().is_empty(), "{:?}", echo.received());

    // ztunnel is back; it dials the app from ephemeral ports.
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    set_port_range(&pod, &format!("{INBOUND_PORT} {INBOUND_PORT}"));
    let attacker = marked_socket(&pod, &["listen", "0.0.0.0:0", "1"]);
    assert!(
        attacker.starts_with("refused "),
        "autobound beside ztunnel: {attacker}"
    );
    set_port_range(&pod, "32768 60999");
    let reply = client.run(|| tcp_request(pod.app_v4(), "through ztunnel"));
    assert_eq!(reply.unwrap().response, echo.reply_to("through ztunnel"));
    assert!(ztunnel
        .wait_for(|s| s.listener == INBOUND_PORT, WAIT)
        .is_some());
    datapath.uninstall().wait().unwrap();
}

/// ztunnel's sockets are told from a pod's by their cgroup, so a ztunnel whose cgroup could be
/// anyone's is refused, never taken by its mark alone: one in the root of the cgroup v2
/// hierarchy (where every process is on a node with the hybrid hierarchy, or whose runtime gives
/// containers no cgroup v2 of their own), one whose cgroup has cgroups below it, and one whose
/// cgroup cannot be read.
#[test]
fn a_ztunnel_whose_cgroup_could_be_anyones_is_refused() {
    let fixture = privileged!(DatapathNode::new());
    let datapath = fixture.start_datapath();
    let root = cgroup2_root().unwrap();
    let mut ztunnel = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = ztunnel.id();
    let move_to = |dir: &std::path::Path| fs::write(dir.join("cgroup.procs"), pid.to_string());
    let refusal = |pid: u32| {
        let error = datapath.ztunnel_connected(pid).wait().unwrap_err();
        format!("{error:#}")
    };

    move_to(&root).unwrap();
    let refused = refusal(pid);
    assert!(
        refused.contains("root of the cgroup v2 hierarchy"),
        "{refused}"
    );

    let parent = cgroup::TestCgroup::new().unwrap();
    let below = parent.dir.join("below");
    fs::create_dir(&below).unwrap();
    move_to(&parent.dir).unwrap();
    let refused = refusal(pid);
    assert!(refused.contains("has cgroups below it"), "{refused}");

    fs::remove_dir(&below).unwrap();
    assert!(
        datapath.ztunnel_connected(pid).wait().is_ok(),
        "a cgroup of its own"
    );
    ztunnel.kill().unwrap();
    ztunnel.wait().unwrap();
    let refused = refusal(pid);
    assert!(refused.contains("cannot be told from pods"), "{refused}");
    datapath.uninstall().wait().unwrap();
}

/// Opens `count` connections to `target` at once (threads released together), sends `line` on
/// each and reads the answer; returns each one's local address. Runs in the client's netns,
/// which the threads inherit.
fn connect_together(target: SocketAddr, count: usize, line: &str) -> io::Result<Vec<SocketAddr>> {
    let start = Barrier::new(count);
    thread::scope(|scope| {
        let connections: Vec<_> = (0..count)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    tcp_request(target, line).map(|reply| canonical(reply.local))
                })
            })
            .collect();
        connections
            .into_iter()
            .map(|connection| connection.join().unwrap())
            .collect()
    })
}

/// Before Linux 6.5, tc hands a new connection to ztunnel's reuseport listener through the
/// socket lookup. Where a pod's interface receives in batches (GRO, a driver's packet lists,
/// XDP on a veth), tc runs for every SYN of a batch before the lookup of any: each must still
/// be handed to ztunnel, none given to the app. The pod's veth here receives through XDP and
/// GRO (on by default), and the client's SYNs are held back by netem and leave together.
#[test]
fn syns_received_in_one_batch_all_reach_ztunnel() {
    const CONNECTIONS: usize = 12;
    let fixture = privileged!(DatapathNode::new());
    let (client, pod) = (fixture.pod("client"), fixture.pod("app"));
    let echo = EchoServer::app(&pod).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let _xdp = XdpPass::attach(&pod, "eth0").unwrap();
    // Only the socket lookup hand-off (before 6.5) needs the batch; kernels built without netem
    // (this CI machine's) have tc assign the connection itself.
    if !delay_egress(&client, 50).unwrap() {
        assert!(
            !kernel_needs_the_handoff(),
            "this kernel hands connections off through the socket lookup, but has no netem"
        );
    }

    for target in [pod.app_v4(), pod.app_v6()] {
        let clients = client
            .run(|| connect_together(target, CONNECTIONS, "batched"))
            .unwrap_or_else(|e| panic!("connections to {target}: {e}"));
        for peer in clients {
            ztunnel
                .wait_for(|s| s.listener == INBOUND_PORT && s.peer == peer, WAIT)
                .unwrap_or_else(|| panic!("{peer} to {target} never reached 15006"));
        }
    }
    // Every connection the app accepted came from ztunnel's dial.
    assert_eq!(echo.received().len(), 2 * CONNECTIONS);
    datapath.uninstall().wait().unwrap();
}

/// istio keeps a sidecar pod's IPv4 and IPv6 rules apart: an IPv6 range never holds an IPv4
/// address. `excludeOutboundIPRanges: "::/0"` leaves the app's IPv4 captured, and
/// `includeOutboundIPRanges: "::/0"` captures its IPv6 only. A socket bound to `::6`, Envoy's
/// passthrough source, is let through only to the pod itself (istio's `-o lo -s ::6`): an app
/// that binds it is captured like any other.
#[test]
fn a_sidecar_pods_ranges_and_passthrough_source_keep_to_their_family_and_to_loopback() {
    let dual_stack = [("ISTIO_DUAL_STACK", "true")];
    let excluding = sidecar_pod(
        &[("traffic.sidecar.istio.io/excludeOutboundIPRanges", "::/0")],
        &dual_stack,
    );
    let including = sidecar_pod(
        &[("traffic.sidecar.istio.io/includeOutboundIPRanges", "::/0")],
        &dual_stack,
    );
    let Some(node) =
        CniChainNode::with_sidecar_pods(&[("excluding", excluding), ("including", including)])
    else {
        return;
    };
    let agent = node.start_agent();
    let server = node.pod("default", "server").unwrap();
    let server_app = EchoServer::app(&server).unwrap();
    let excluding = node.pod("default", "excluding").unwrap();
    let including = node.pod("default", "including").unwrap();

    for (pod, captured) in [(&excluding, [true, false]), (&including, [false, true])] {
        let proxy = SidecarStandIn::start(pod).unwrap();
        for (target, captured) in [server.app_v4(), server.app_v6()].into_iter().zip(captured) {
            let reply = pod
                .run(|| tcp_request(target, "range"))
                .unwrap_or_else(|e| panic!("{} to {target}: {e}", pod.name()));
            assert_eq!(reply.response, server_app.reply_to("range"));
            // The stand-in records a connection before it answers it.
            let through_proxy = proxy
                .seen()
                .iter()
                .any(|s| s.listener == OUTBOUND_PORT && s.original_dst == Some(target));
            assert_eq!(through_proxy, captured, "{} to {target}", pod.name());
        }
    }

    // `::6` is the pod's (on its lo, as the proxy needs it), and the server routes it back to
    // the pod.
    let passthrough = Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6);
    including
        .run(|| ip(&["-6", "addr", "replace", "::6/128", "dev", "lo"]))
        .unwrap();
    let via = including.ipv6().to_string();
    server
        .run(|| ip(&["-6", "route", "add", "::6/128", "via", &via]))
        .unwrap();
    let proxy = SidecarStandIn::start(&including).unwrap();
    let target = server.app_v6();
    let reply = including
        .run(|| {
            let socket = Socket::new(Domain::IPV6, Type::STREAM, None)?;
            socket.bind(&SocketAddr::new(IpAddr::V6(passthrough), 0).into())?;
            socket.connect_timeout(&target.into(), weir_tests::io_timeout())?;
            let stream = std::net::TcpStream::from(socket);
            set_timeouts(&stream)?;
            write_line(&stream, "from ::6")?;
            read_line(&stream)
        })
        .unwrap();
    assert_eq!(reply, server_app.reply_to("from ::6"));
    let seen = proxy
        .wait_for(|s| s.listener == OUTBOUND_PORT, AGENT_WAIT)
        .expect("the app bound to ::6 reached its proxy");
    assert_eq!(seen.peer.ip(), IpAddr::V6(passthrough));
    assert_eq!(seen.original_dst, Some(target));
    assert!(server_app
        .received()
        .iter()
        .all(|r| r.peer.ip() != IpAddr::V6(passthrough)));
    agent.stop().unwrap();
}

/// The MSS the app's listener in [`generated_frames_reach_no_app_around_ztunnel`] offers: below
/// what any route here gives ztunnel's, so a SYN-ACK that offers it came from the app.
const APP_MSS: u16 = 1_000;
/// Frames per run; `WEIR_ATTACK_FRAMES` asks for more.
const GENERATED_FRAMES: usize = 240;

/// Frames of generated shapes from another pod with `CAP_NET_RAW`: either family, whole, with IPv4
/// options or IPv6 extension headers, split at any 8-byte offset of the segment, behind up to four
/// VLAN tags of either type, SYN with other flags beside it or none, right or wrong checksums, to
/// a port the app listens on and to one nobody does. None reaches the app around ztunnel: the
/// app's listener offers an MSS of its own, and no SYN-ACK carries it; and no SYN to the closed
/// port is answered by the pod's kernel (a RST), only by ztunnel (a SYN-ACK) or not at all. The
/// seed is printed; `WEIR_ATTACK_SEED` replays a run.
#[test]
fn generated_frames_reach_no_app_around_ztunnel() {
    use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};
    use weir_tests::raw::{self, Answer, Shape, Syn, Tcp};

    const MARKED_PORT: u16 = 8090;
    const CLOSED_PORT: u16 = 8099;
    let fixture = privileged!(DatapathNode::new());
    let (attacker, pod) = (fixture.pod("attacker"), fixture.pod("app"));
    let _app = pod.run(|| marked_listener(MARKED_PORT)).unwrap();
    let _ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let seed = std::env::var("WEIR_ATTACK_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    let count = std::env::var("WEIR_ATTACK_FRAMES")
        .ok()
        .and_then(|count| count.parse().ok())
        .unwrap_or(GENERATED_FRAMES);
    eprintln!("{count} generated frames, seed {seed} (WEIR_ATTACK_SEED={seed} replays them)");

    let plain = |source: IpAddr, destination: IpAddr, port: u16| Syn {
        source: SocketAddr::new(source, port),
        destination: SocketAddr::new(destination, MARKED_PORT),
        shape: Shape::Whole,
        tcp: Tcp::SYN,
    };
    let families = [
        (IpAddr::V4(attacker.ipv4()), IpAddr::V4(pod.ipv4())),
        (IpAddr::V6(attacker.ipv6()), IpAddr::V6(pod.ipv6())),
    ];
    // Unenrolled, the app answers with its MSS: what the oracle looks for is there to be seen.
    let direct: Vec<Syn> = (families.iter().zip(40_001..))
        .map(|(&(source, destination), port)| plain(source, destination, port))
        .collect();
    let replies = attacker
        .run(|| raw::probe_replies(&direct, Duration::from_millis(500)))
        .unwrap();
    assert!(
        replies.iter().all(|reply| reply.mss == Some(APP_MSS)),
        "{replies:?}"
    );

    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let mut rng = StdRng::seed_from_u64(seed);
    let mac = pod.mac();
    let tags: [&'static [u16]; 5] = [
        &[],
        &[raw::VLAN],
        &[raw::QINQ, raw::VLAN],
        &[raw::VLAN, raw::VLAN, raw::QINQ],
        &[raw::QINQ, raw::VLAN, raw::VLAN, raw::VLAN],
    ];
    let extensions = [
        raw::HOP_BY_HOP,
        raw::DESTINATION_OPTIONS,
        raw::HOP_BY_HOP_AND_DESTINATION_OPTIONS,
    ];
    let extra_flags = [
        raw::TCP_FIN,
        raw::TCP_RST,
        raw::TCP_PSH,
        raw::TCP_ACK,
        raw::TCP_URG,
        raw::TCP_ECE | raw::TCP_CWR,
    ];
    let frames: Vec<Syn> = (0..count)
        .map(|index| {
            let &(source, destination) = families.choose(&mut rng).unwrap();
            let shape = match rng.gen_range(0..4) {
                0 => Shape::Whole,
                1 if source.is_ipv4() => Shape::Ipv4Options,
                1 => Shape::Ipv6Extensions(extensions.choose(&mut rng).unwrap()),
                2 => Shape::Fragmented(8 * rng.gen_range(1..=3)),
                _ => Shape::VlanTagged(tags.choose(&mut rng).unwrap(), mac),
            };
            let mut flags = if rng.gen_bool(0.9) { raw::TCP_SYN } else { 0 };
            if rng.gen_bool(0.4) {
                flags |= extra_flags.choose(&mut rng).unwrap();
            }
            Syn {
                source: SocketAddr::new(source, 42_000 + index as u16),
                destination: SocketAddr::new(
                    destination,
                    *[MARKED_PORT, CLOSED_PORT].choose(&mut rng).unwrap(),
                ),
                shape,
                tcp: Tcp {
                    flags,
                    checksum_valid: rng.gen_bool(0.85),
                },
            }
        })
        .collect();
    let replies = attacker
        .run(|| raw::probe_replies(&frames, Duration::from_secs(1)))
        .unwrap();
    let report = |why: &str| {
        let lines: Vec<String> = frames
            .iter()
            .zip(&replies)
            .map(|(frame, reply)| format!("{frame:?}: {reply:?}"))
            .collect();
        format!("seed {seed}: {why}\n{}", lines.join("\n"))
    };
    // Flags that make no new connection whoever receives them; the others' SYNs open one.
    let no_connection = raw::TCP_ACK | raw::TCP_RST | raw::TCP_FIN;
    for (frame, reply) in frames.iter().zip(&replies) {
        assert_ne!(
            reply.mss,
            Some(APP_MSS),
            "{}",
            report(&format!("{frame:?} reached the app"))
        );
        let opens = frame.tcp.flags & raw::TCP_SYN != 0 && frame.tcp.flags & no_connection == 0;
        if opens && frame.destination.port() == CLOSED_PORT {
            assert_ne!(
                reply.answer,
                Answer::Reset,
                "{}",
                report(&format!("{frame:?} reached the pod's kernel"))
            );
        }
    }
    // ztunnel answered some: the frames were delivered and the replies caught.
    assert!(
        replies.iter().any(|reply| reply.answer == Answer::SynAck),
        "{}",
        report("no SYN-ACK at all")
    );
    datapath.uninstall().wait().unwrap();
}

/// A segment from the tuple of a connection ztunnel holds at 15006 itself passes the inbound
/// program as a segment of that connection would (only netfilter's `REDIRECT` makes such
/// connections, for a pod weir took over from iptables rules, and conntrack takes their segments
/// there). Sent to a port the app listens on, with the pod answering every SYN with a cookie:
/// no ACK, with or without data or FIN, opens anything at the app, and no SYN from that tuple
/// reaches it.
#[test]
fn segments_from_a_tuple_ztunnel_holds_at_15006_reach_no_app() {
    use weir_tests::raw::{self, Answer, Shape, Syn, Tcp};

    const MARKED_PORT: u16 = 8090;
    let fixture = privileged!(DatapathNode::new());
    let (attacker, pod) = (fixture.pod("attacker"), fixture.pod("app"));
    let app = pod.run(|| marked_listener(MARKED_PORT)).unwrap();
    app.set_nonblocking(true).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    pod.run(|| fs::write("/proc/sys/net/ipv4/tcp_syncookies", "2"))
        .unwrap();

    for destination in [IpAddr::from(pod.ipv4()), IpAddr::from(pod.ipv6())] {
        // ztunnel refuses a connection to its own port and closes its side; the attacker keeps
        // its own open, so ztunnel's socket stays (FIN_WAIT2) under that tuple.
        let lingering = attacker
            .run(|| std::net::TcpStream::connect((destination, INBOUND_PORT)))
            .unwrap();
        let source = lingering.local_addr().unwrap();
        ztunnel
            .wait_for(
                |s| s.listener == INBOUND_PORT && s.peer == canonical(source),
                WAIT,
            )
            .expect("ztunnel holds the connection");
        let segment = |flags| Syn {
            source,
            destination: SocketAddr::new(destination, MARKED_PORT),
            shape: Shape::Whole,
            tcp: Tcp {
                flags,
                checksum_valid: true,
            },
        };
        let segments: Vec<Syn> = [
            raw::TCP_ACK,
            raw::TCP_ACK | raw::TCP_PSH,
            raw::TCP_ACK | raw::TCP_FIN,
            raw::TCP_ACK | raw::TCP_URG,
        ]
        .into_iter()
        .map(segment)
        .collect();
        attacker
            .run(|| raw::probe_replies(&segments, Duration::from_millis(300)))
            .unwrap();
        let accepted = app.accept().map(|(_, peer)| peer.as_socket());
        assert!(
            matches!(&accepted, Err(error) if error.kind() == io::ErrorKind::WouldBlock),
            "from {source}: the app accepted {accepted:?}"
        );
        let syn = attacker
            .run(|| raw::probe_replies(&[segment(raw::TCP_SYN)], Duration::from_millis(500)))
            .unwrap();
        // ztunnel's listener cannot take it either (its connection holds the tuple at 15006):
        // dropped, never the app's.
        assert_ne!(
            syn[0].mss,
            Some(APP_MSS),
            "from {source}: the SYN reached the app"
        );
        assert_ne!(
            syn[0].answer,
            Answer::Reset,
            "from {source}: the pod's kernel answered"
        );
        drop(lingering);
    }
    datapath.uninstall().wait().unwrap();
}

/// A dual-stack listener on `port` whose SYN-ACKs offer [`APP_MSS`]. Runs in the pod's netns.
fn marked_listener(port: u16) -> io::Result<Socket> {
    let socket = Socket::new(Domain::IPV6, Type::STREAM, None)?;
    socket.set_only_v6(false)?;
    socket.set_tcp_mss(u32::from(APP_MSS))?;
    socket.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
    socket.listen(4_096)?;
    Ok(socket)
}

/// A pod's own processes that lack `CAP_NET_ADMIN` over its netns, as `ip netns exec <pod>
/// <wrapper> ...` runs them: a container's root without the capability (the runtime's default
/// set), `nobody`, and root of a user namespace of its own (which does not own the pod's netns).
const UNPRIVILEGED: [(&str, &[&str]); 3] = [
    (
        "root without CAP_NET_ADMIN",
        &[
            "setpriv",
            "--bounding-set=-net_admin",
            "--inh-caps=-net_admin",
        ],
    ),
    (
        "nobody",
        &[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ],
    ),
    (
        "root of its own user namespace",
        &["unshare", "--user", "--map-root-user"],
    ),
];

/// What the kernel says when it refuses an unprivileged process.
const DENIED: [&str; 2] = ["Permission denied", "Operation not permitted"];

/// An ambient pod and what the attacks on it are judged by: a client pod, both apps, the pod's
/// ztunnel, the datapath that enrolled it.
struct Enrolled {
    client: Pod,
    pod: Pod,
    client_app: EchoServer,
    app: EchoServer,
    ztunnel: ZtunnelStandIn,
    /// Last: the pods and servers go before their node.
    _node: DatapathNode,
}

impl Enrolled {
    fn new() -> Option<(Self, weir_agent::datapath::Datapath)> {
        if !weir_tests::require_privileges() {
            return None;
        }
        let fixture = DatapathNode::new().expect("the test's node");
        let (client, pod) = (fixture.pod("client"), fixture.pod("app"));
        let (client_app, app) = (
            EchoServer::app(&client).unwrap(),
            EchoServer::app(&pod).unwrap(),
        );
        let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
        let datapath = fixture.enrolled(&pod, PodOptions::default());
        let enrolled = Self {
            client,
            pod,
            client_app,
            app,
            ztunnel,
            _node: fixture,
        };
        Some((enrolled, datapath))
    }

    /// A connection into the pod and one out of it, after `attacker`, both through ztunnel (the
    /// stand-in saw each by its tuple).
    fn assert_through_ztunnel(&self, attacker: &str) {
        let (client, pod, ztunnel) = (&self.client, &self.pod, &self.ztunnel);
        let line = format!("in after {attacker}");
        let reply = client.run(|| tcp_request(pod.app_v4(), &line)).unwrap();
        assert_eq!(reply.response, self.app.reply_to(&line));
        let peer = canonical(reply.local);
        ztunnel
            .wait_for(|s| s.listener == INBOUND_PORT && s.peer == peer, WAIT)
            .unwrap_or_else(|| panic!("after {attacker}, {peer} reached the app around ztunnel"));
        let line = format!("out after {attacker}");
        let reply = pod.run(|| tcp_request(client.app_v4(), &line)).unwrap();
        assert_eq!(reply.response, self.client_app.reply_to(&line));
        let local = canonical(reply.local);
        ztunnel
            .wait_for(|s| s.listener == OUTBOUND_PORT && s.peer == local, WAIT)
            .unwrap_or_else(|| panic!("after {attacker}, {local} went out around ztunnel"));
    }
}

/// An agent handing the node back to istio-cni leaves an ambient pod only once istio's in-pod
/// rules redirect it, as istio-cni's agent writes them into the pod's netns. A pod's own process
/// that writes the same rules first, to be left and then remove them, must fail at it: as each
/// of [`UNPRIVILEGED`], or there with a network namespace of its own too, where its rules land
/// (no error) but weir does not look. After each, the pod is still weir's and its traffic still
/// goes through ztunnel both ways. The same rules written with `CAP_NET_ADMIN` in the pod's netns
/// do hand it back: what a pod with that capability can do to istio's rules as well
/// (docs/failure-modes.md).
#[test]
fn a_pods_own_process_cannot_get_it_handed_back_around_ztunnel() {
    let Some((enrolled, datapath)) = Enrolled::new() else {
        return;
    };
    let pod = &enrolled.pod;
    let hand_back = || datapath.hand_back(pod.uid()).wait().unwrap();
    assert!(!hand_back(), "handed back before istio's rules are there");

    let own_netns: (&str, &[&str]) = (
        "root of its own user and network namespaces",
        &["unshare", "--user", "--map-root-user", "--net"],
    );
    let attackers = UNPRIVILEGED
        .iter()
        .map(|&(attacker, wrapper)| (attacker, wrapper, false));
    for (attacker, wrapper, writes_them) in attackers.chain([(own_netns.0, own_netns.1, true)]) {
        let written = istio_iptables::restore_as(pod.netns(), wrapper);
        match &written {
            Ok(()) => assert!(writes_them, "{attacker} wrote istio's rules in the pod"),
            Err(error) => {
                let error = format!("{error:#}");
                assert!(!writes_them, "{attacker}: {error}");
                assert!(
                    DENIED.iter().any(|d| error.contains(d)),
                    "{attacker}: {error}"
                );
            }
        }
        assert!(!hand_back(), "{attacker} got the pod handed back");
        enrolled.assert_through_ztunnel(attacker);
    }

    istio_iptables::restore_as(pod.netns(), &[]).unwrap();
    assert!(
        hand_back(),
        "istio's rules written with CAP_NET_ADMIN hand the pod back"
    );
    datapath.uninstall().wait().unwrap();
}

/// weir's tc program hangs on the `ingress` qdisc of the pod's interface. A pod's own process
/// that takes it away (deletes the qdisc or weir's filter), swaps the qdisc for a clsact, or puts
/// a filter of its own before weir's, must fail at each as each of [`UNPRIVILEGED`], and the
/// pod's traffic still goes through ztunnel both ways. The same deletion with `CAP_NET_ADMIN`
/// does take the capture away (the oracle sees the next connection reach the app around
/// ztunnel): what a pod with that capability can do, documented in docs/failure-modes.md.
#[test]
fn a_pods_own_process_cannot_take_weirs_tc_hook_away() {
    let Some((enrolled, datapath)) = Enrolled::new() else {
        return;
    };
    let pod = &enrolled.pod;
    let tc_in_pod = |wrapper: &[&str], args: &[&str]| {
        let mut command = vec!["netns", "exec", pod.netns().name()];
        command.extend_from_slice(wrapper);
        command.push("tc");
        command.extend_from_slice(args);
        weir_tests::netns::ip_output(&command)
    };
    let qdisc = || tc_in_pod(&[], &["qdisc", "show", "dev", "eth0", "ingress"]).unwrap();
    assert!(qdisc().starts_with("qdisc ingress ffff:"), "{}", qdisc());
    let attacks: [&[&str]; 4] = [
        &["qdisc", "del", "dev", "eth0", "ingress"],
        &["qdisc", "replace", "dev", "eth0", "clsact"],
        &[
            "filter", "del", "dev", "eth0", "ingress", "pref", "1", "handle", "0x5745", "bpf",
        ],
        &[
            "filter", "add", "dev", "eth0", "ingress", "pref", "1", "protocol", "all", "matchall",
            "action", "ok",
        ],
    ];
    for (attacker, wrapper) in UNPRIVILEGED {
        for attack in attacks {
            let done = tc_in_pod(wrapper, attack);
            let error = format!(
                "{:#}",
                done.expect_err(&format!("{attacker}: tc {attack:?}"))
            );
            assert!(
                DENIED.iter().any(|d| error.contains(d)),
                "{attacker}: tc {attack:?}: {error}"
            );
        }
        assert!(qdisc().starts_with("qdisc ingress ffff:"), "{}", qdisc());
        enrolled.assert_through_ztunnel(attacker);
    }

    tc_in_pod(&[], attacks[0]).unwrap();
    let reply = (enrolled.client)
        .run(|| tcp_request(pod.app_v4(), "with CAP_NET_ADMIN"))
        .unwrap();
    let peer = canonical(reply.local);
    assert!(
        (enrolled.ztunnel)
            .wait_for(|s| s.listener == INBOUND_PORT && s.peer == peer, WAIT)
            .is_none(),
        "the qdisc's deletion with CAP_NET_ADMIN left the pod captured"
    );
    datapath.uninstall().wait().unwrap();
}
