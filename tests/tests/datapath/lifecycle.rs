//! A pod's redirection over its life: enrolled, followed as its addresses change, kept through
//! the owner's restart and failed re-enrollments, moved from istio-cni's rules, removed whole.
use super::*;

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

    // The enrolled pod is redirected, from one tc hook on its interface (the node's tc blocks
    // are one list the kernel searches at every qdisc made: an unused egress hook would double
    // it)...
    pod.run(|| tcp_request(target, "via ztunnel")).unwrap();
    assert!(ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .is_some());
    let in_pod = |command: &[&str]| {
        let mut args = vec!["netns", "exec", pod.netns().name()];
        args.extend_from_slice(command);
        ip_output(&args).unwrap()
    };
    let qdiscs = in_pod(&["tc", "qdisc", "show", "dev", "eth0", "ingress"]);
    assert!(qdiscs.starts_with("qdisc ingress ffff:"), "{qdiscs}");
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
    let qdiscs = in_pod(&["tc", "qdisc", "show", "dev", "eth0", "ingress"]);
    assert_eq!(qdiscs, "");
    for sysctl in weir_agent::datapath::netns::REPLY_MARK_SYSCTLS {
        let value = in_pod(&["cat", &format!("/proc/sys/{sysctl}")]);
        assert_eq!(value.trim(), "0", "{sysctl}");
    }
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

    // Re-enrolled after the change: the pod's two CNI addresses and 16 others, whatever it had
    // before (its link-local address), as many as it may have.
    let bound = 2 + 16;
    assert!(before < bound);
    try_wait_until(WAIT, || (indexed() == bound).then_some(()))
        .unwrap_or_else(|| panic!("{} addresses indexed, not {bound}", indexed()));
    assert!(datapath.is_redirected(pod.uid()).wait().unwrap());
    let target = server.app_v4();
    pod.run(|| tcp_request(target, "captured")).unwrap();
    assert!(ztunnel
        .wait_for(|s| s.listener == OUTBOUND_PORT, WAIT)
        .is_some());
    datapath.uninstall().wait().unwrap();
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
    istio_iptables::apply(app.netns(), istio_iptables::Backend::Nft).unwrap();

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
        left.has_return_path() && left.return_rules == 2,
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
