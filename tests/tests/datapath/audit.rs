//! What the agent sees of the datapath: its audit of what others changed behind its back, and
//! the programs' own log of their decisions.
use super::*;

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
