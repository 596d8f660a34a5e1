//! A node istio-cni's agent ran, taken over under traffic, and handed back: no window, no
//! restarts.
use super::*;
use weir_tests::istio_iptables::Backend;
use weir_tests::traffic::exchange_line;

/// A node istio-cni's ambient agent runs, taken over by weir as docs/install.md says: weir starts
/// beside it, then istio-cni's agent leaves. Its plugin leaves the chain in the write that puts
/// weir's in; ztunnel, connected to istio-cni's agent until it goes (which removes the socket
/// path the two shared), finds weir and keeps the proxy it runs for the pod, with the same uid
/// and netns (no Del, nothing drained); the pod moves from istio's rules to weir's programs in
/// place, its connections held open and a stream of new ones never failing, none reaching the
/// app around ztunnel; istio's redirection leaves the pod; a pod created afterwards starts
/// through weir.
#[test]
fn a_node_istio_cni_ran_is_taken_over_without_a_window() {
    take_over_from_istio_cni(false, Backend::Nft);
}

/// The same, with weir's agent restarted while the pods wait for ztunnel (killed midway): the
/// new agent names them in its snapshots again, from the cluster's word alone.
#[test]
fn a_takeover_from_istio_cni_survives_a_restart_midway() {
    take_over_from_istio_cni(true, Backend::Nft);
}

/// A node istio-cni's agent ran, taken over: with weir's agent restarted midway (`restart_midway`),
/// istio-cni's rules written with `backend`.
pub(super) fn take_over_from_istio_cni(restart_midway: bool, backend: Backend) {
    use weir_agent::datapath::{
        istio_rules::{self, IstioRules},
        netlink::Rtnl,
    };
    use weir_common::INBOUND_PORT;
    use weir_tests::istio_cni::{self, IstioCniAgent};
    use weir_tests::traffic_loop::{wait_for_connections, TrafficLoop};

    let cluster = privileged!(Cluster::new());
    // Its DaemonSet selects the node: a stopping agent leaves weir in place, as in a restart.
    cluster.daemonset();
    let config = cluster.agent_config();
    let any = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), weir_tests::APP_PORT);
    let server = cluster.pod("default", "server").unwrap();
    let server_echo = EchoServer::start_lasting(server.netns(), "server", any).unwrap();
    let client = cluster.pod("default", "client").unwrap();
    // An ambient pod istio-cni enrolled: its rules in the pod, handed to ztunnel, annotated.
    let (uid, app) = cluster.pod_with_object(MESH, "app");
    let _process = PodProcess::start(app.netns(), &uid, CgroupDriver::Cgroupfs).unwrap();
    let app_echo = EchoServer::start_lasting(app.netns(), "app", any).unwrap();
    let mut object: PodObject = cluster.api.get(MESH, "app").unwrap();
    object.status = Some(running_at(&ips_of(&app)));
    object
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(REDIRECTION_ANNOTATION.into(), "enabled".into());
    cluster.api.update(&object);
    let istio = IstioCniAgent::start(&config.zds_socket, backend).unwrap();
    let ztunnel = ZdsZtunnel::follow(&config.zds_socket).unwrap();
    istio.enroll(&app).unwrap();
    let proxy = ztunnel
        .wait_for_pod(&uid, WAIT)
        .expect("ztunnel runs the pod's proxy");
    // And one deleted while the node changes hands: ztunnel must drop its proxy in the end.
    let (gone_uid, gone) = cluster.pod_with_object(MESH, "gone");
    let mut gone_object: PodObject = cluster.api.get(MESH, "gone").unwrap();
    gone_object.status = Some(running_at(&ips_of(&gone)));
    (gone_object.metadata.annotations.get_or_insert_default())
        .insert(REDIRECTION_ANNOTATION.into(), "enabled".into());
    cluster.api.update(&gone_object);
    istio.enroll(&gone).unwrap();
    ztunnel
        .wait_for_pod(&gone_uid, WAIT)
        .expect("ztunnel runs its proxy");
    let node = cluster.chain.test_node().netns();
    weir_tests::istio_iptables::apply_host_probe_snat(node, &[&app, &gone], backend).unwrap();
    let conflist = cluster.chain.files.net_dir().join("10-weir-test.conflist");
    let mut chain: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    chain["plugins"]
        .as_array_mut()
        .unwrap()
        .push(istio_cni::plugin_entry());
    std::fs::write(&conflist, serde_json::to_vec_pretty(&chain).unwrap()).unwrap();

    let (held_in, held_out) = hold_both_ways(&client, &app, &server);
    exchange(&held_in, &app_echo, "in under istio");
    exchange(&held_out, &server_echo, "out under istio");
    let loop_in = TrafficLoop::start(client.netns(), app.app_v4(), app_echo.reply_to("loop"));
    let loop_out = TrafficLoop::start(app.netns(), server.app_v4(), server_echo.reply_to("loop"));
    wait_for_connections(&[&loop_in, &loop_out], std::time::Instant::now(), 3);

    // weir beside istio-cni's agent, which serves the metrics port weir is given (15014 for
    // both in a cluster) until it leaves; then istio-cni's agent leaves.
    let istio_metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics_addr = istio_metrics.local_addr().unwrap();
    let start_weir = || cluster.start_agent_with(|config| config.metrics_addr = metrics_addr);
    let mut agent = start_weir();
    if restart_midway {
        wait_for_connections(&[&loop_in, &loop_out], std::time::Instant::now(), 3);
        agent.stop().unwrap();
        agent = start_weir();
    }
    assert!(cluster.plugin_installed());
    let plugins = weir_conflist(&cluster.chain).plugins;
    assert!(
        plugins.iter().all(|plugin| plugin["type"] != "istio-cni"),
        "istio-cni's plugin left the chain: {plugins:?}"
    );
    wait_for_connections(&[&loop_in, &loop_out], std::time::Instant::now(), 3);
    cluster.api.delete::<PodObject>(MESH, "gone");
    istio.stop();
    drop(istio_metrics);
    let snapshots = ztunnel.wait_for_snapshots(2, 2 * WAIT);
    assert!(snapshots, "ztunnel found weir: {:?}", ztunnel.events());
    let taken_over = cluster.wait_for_warnings("TakenOver");
    assert_eq!(taken_over[0]["type"], "Normal", "{taken_over:?}");
    wait_for_connections(&[&loop_in, &loop_out], std::time::Instant::now(), 3);
    assert_nothing_failed_or_dropped(loop_in, loop_out, &ztunnel, &uid);
    let events = ztunnel.events();
    assert!(
        ztunnel.wait_for_drained(&gone_uid, WAIT) || ztunnel.wait_for_del(&gone_uid, WAIT),
        "the deleted pod's proxy is dropped: {events:?}"
    );
    let kept = ztunnel
        .pod(&uid)
        .expect("ztunnel still runs the pod's proxy");
    assert!(std::sync::Arc::ptr_eq(&kept, &proxy), "the same proxy");
    exchange(&held_in, &app_echo, "in under weir");
    exchange(&held_out, &server_echo, "out under weir");
    let left = app
        .run(|| IstioRules::find(&mut Rtnl::new().unwrap()))
        .unwrap();
    assert!(!left.redirects(), "{left:?}");
    // New connections take weir's hand-off: the original destination as the local address.
    let reply = client.run(|| tcp_request(app.app_v4(), "new")).unwrap();
    assert_eq!(reply.response, app_echo.reply_to("new"));
    proxy
        .wait_for(
            |s| s.listener == INBOUND_PORT && s.local == app.app_v4(),
            WAIT,
        )
        .expect("by weir's hand-off");
    let dialed: Vec<SocketAddr> = (proxy.dials().iter())
        .filter(|dial| dial.listener == INBOUND_PORT)
        .filter_map(|dial| dial.source)
        .collect();
    for received in app_echo.received() {
        let peer = weir_tests::sockopt::canonical(received.peer);
        assert!(dialed.contains(&peer), "around ztunnel: {received:?}");
    }
    assert!(cluster.warnings("RepairedPod").is_empty());
    wait_for_metric(&agent, "weir_pods_taken_over_total", &[], 1.0);
    // A pod created now starts through weir.
    let (later_uid, _later) = cluster.pod_with_object(MESH, "later");
    ztunnel
        .wait_for_pod(&later_uid, WAIT)
        .expect("through weir");
    // istio-cni's probe SNAT left the node with it; a probe (the node's TCP to the pod) still
    // reaches the app straight from the probe source, by weir's programs.
    wait_until(WAIT, "istio-cni's probe SNAT to leave the node", || {
        node.run(istio_rules::netfilter_leftovers)
            .unwrap()
            .is_empty()
    });
    let reply = node.run(|| tcp_request(app.app_v4(), "probe")).unwrap();
    assert_eq!(reply.response, app_echo.reply_to("probe"));
    let probe = app_echo.wait_for(|r| r.line == "probe", WAIT).unwrap();
    assert_eq!(
        probe.peer.ip(),
        std::net::IpAddr::from(weir_common::PROBE_SOURCE_V4)
    );
    agent.stop().unwrap();
}

/// The reverse, as docs/install.md says: weir, told to hand its pods back, leaves the node while
/// istio-cni's ambient agent starts there (its plugin into the chain, its ZDS server at the
/// shared path, istio's rules written into the pods it finds annotated). Until istio-cni's
/// plugin is in the chain a new ambient pod fails its ADD, never starts unredirected; ztunnel
/// finds istio-cni's agent and keeps the pod's proxy (no Del, nothing drained); weir's programs
/// leave the pod only once istio's rules redirect it, its connections held open (in use, or idle
/// through the whole move) and a stream of new ones never failing, none reaching the app around
/// ztunnel; then weir's plugin, pins and programs are gone from the node.
#[test]
fn a_node_is_handed_back_to_istio_cni_without_a_window() {
    use weir_agent::datapath::{istio_rules::IstioRules, netlink::Rtnl};
    use weir_common::INBOUND_PORT;
    use weir_tests::istio_cni::{self, IstioCniAgent};
    use weir_tests::traffic_loop::{wait_for_connections, TrafficLoop};

    let cluster = privileged!(Cluster::new());
    cluster.daemonset();
    let any = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), weir_tests::APP_PORT);
    let server = cluster.pod("default", "server").unwrap();
    let server_echo = EchoServer::start_lasting(server.netns(), "server", any).unwrap();
    let client = cluster.pod("default", "client").unwrap();
    let agent = cluster.start_agent_with(|config| {
        config.uninstall_on_exit = true;
        config.hand_back_to_istio_cni = Some(Duration::from_secs(60));
    });
    let config = agent.config.clone();
    let ztunnel = ZdsZtunnel::follow(&config.zds_socket).unwrap();
    let (uid, app) = cluster.pod_with_object(MESH, "app");
    let proxy = ztunnel
        .wait_for_pod(&uid, WAIT)
        .expect("ztunnel runs the pod's proxy");
    cluster.set_running(MESH, "app", &ips_of(&app));
    cluster.wait_for_redirection(MESH, "app", Some("enabled"));
    let app_echo = EchoServer::start_lasting(app.netns(), "app", any).unwrap();

    let (held_in, held_out) = hold_both_ways(&client, &app, &server);
    exchange(&held_in, &app_echo, "in under weir");
    exchange(&held_out, &server_echo, "out under weir");
    // Long-lived connections idle from here until the node is istio-cni's.
    let (idle_in, idle_out) = hold_both_ways(&client, &app, &server);
    exchange(&idle_in, &app_echo, "idle in under weir");
    exchange(&idle_out, &server_echo, "idle out under weir");
    // Long-lived connections in use across the move, as with keepalives.
    let in_use = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let keep_using = |stream: std::net::TcpStream, echo: &EchoServer| {
        let (in_use, reply) = (in_use.clone(), echo.reply_to("tick"));
        std::thread::spawn(move || {
            while in_use.load(std::sync::atomic::Ordering::Relaxed) {
                let answer = exchange_line(&stream, "tick").map_err(|e| e.to_string())?;
                if answer != reply {
                    return Err(format!("{answer:?}"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(stream)
        })
    };
    let held_in = keep_using(held_in, &app_echo);
    let held_out = keep_using(held_out, &server_echo);
    let loop_in = TrafficLoop::start(client.netns(), app.app_v4(), app_echo.reply_to("loop"));
    let loop_out = TrafficLoop::start(app.netns(), server.app_v4(), server_echo.reply_to("loop"));
    wait_for_connections(&[&loop_in, &loop_out], std::time::Instant::now(), 3);

    // weir's DaemonSet no longer selects the node: its agent stops, and hands the node back.
    let leaving = std::thread::spawn(move || agent.stop());
    wait_until(WAIT, "weir's agent to stop serving", || {
        http_status(config.health_addr, "/readyz").is_err()
    });
    cluster.pod_object(MESH, "during", |_| {});
    let during = cluster.pod(MESH, "during");
    assert!(
        during.is_err(),
        "a pod started while no agent serves the node"
    );
    wait_for_connections(&[&loop_in, &loop_out], std::time::Instant::now(), 3);

    // istio-cni's agent starts: its plugin into the chain, its ZDS server at the path, and
    // istio's rules in the pods it finds annotated (reconcileIptablesOnStartup).
    let conflist = cluster.chain.files.net_dir().join("10-weir-test.conflist");
    let mut chain: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    chain["plugins"]
        .as_array_mut()
        .unwrap()
        .push(istio_cni::plugin_entry());
    std::fs::write(&conflist, serde_json::to_vec_pretty(&chain).unwrap()).unwrap();
    let istio = IstioCniAgent::start(&config.zds_socket, Backend::Nft).unwrap();
    match istio.enroll(&app) {
        Ok(()) | Err(istio_cni::IstioCniError::NotConnected) => {}
        Err(error) => panic!("istio-cni's agent enrolls the pod: {error}"),
    }
    leaving
        .join()
        .unwrap()
        .expect("weir's agent leaves the node");
    assert!(
        !config.datapath.pin_root.exists(),
        "weir's pins and programs are gone"
    );
    let plugins = weir_conflist(&cluster.chain).plugins;
    assert!(
        plugins.iter().all(|plugin| plugin["type"] != "weir-cni")
            && plugins.iter().any(|plugin| plugin["type"] == "istio-cni"),
        "istio-cni's plugin alone in the chain: {plugins:?}"
    );
    assert!(
        ztunnel.wait_for_snapshots(2, 2 * WAIT),
        "ztunnel found istio-cni's agent: {:?}",
        ztunnel.events()
    );
    wait_for_connections(&[&loop_in, &loop_out], std::time::Instant::now(), 3);
    assert_nothing_failed_or_dropped(loop_in, loop_out, &ztunnel, &uid);
    let kept = ztunnel
        .pod(&uid)
        .expect("ztunnel still runs the pod's proxy");
    assert!(std::sync::Arc::ptr_eq(&kept, &proxy), "the same proxy");
    in_use.store(false, std::sync::atomic::Ordering::Relaxed);
    let held_in = held_in.join().unwrap().expect("in, used across the move");
    let held_out = held_out.join().unwrap().expect("out, used across the move");
    exchange(&held_in, &app_echo, "in under istio");
    exchange(&held_out, &server_echo, "out under istio");
    exchange(&idle_in, &app_echo, "idle in under istio");
    exchange(&idle_out, &server_echo, "idle out under istio");
    let rules = app
        .run(|| IstioRules::find(&mut Rtnl::new().unwrap()))
        .unwrap();
    assert!(rules.redirects(), "{rules:?}");
    let filters = app
        .run(|| {
            std::process::Command::new("tc")
                .args(["filter", "show", "dev", "eth0", "ingress"])
                .output()
        })
        .unwrap();
    assert!(
        filters.stdout.is_empty(),
        "weir's tc program left the pod: {}",
        String::from_utf8_lossy(&filters.stdout)
    );
    // New connections now take istio's redirection, to ztunnel like every one before.
    let reply = client.run(|| tcp_request(app.app_v4(), "new")).unwrap();
    assert_eq!(reply.response, app_echo.reply_to("new"));
    let dialed: Vec<SocketAddr> = (proxy.dials().iter())
        .filter(|dial| dial.listener == INBOUND_PORT)
        .filter_map(|dial| dial.source)
        .collect();
    for received in app_echo.received() {
        let peer = weir_tests::sockopt::canonical(received.peer);
        assert!(dialed.contains(&peer), "around ztunnel: {received:?}");
    }
    istio.stop();
}

/// A connection from `client` into `app` and one from `app` out to `server`, to be held open.
fn hold_both_ways(
    client: &weir_tests::Pod,
    app: &weir_tests::Pod,
    server: &weir_tests::Pod,
) -> (std::net::TcpStream, std::net::TcpStream) {
    let into_app = client
        .run(|| std::net::TcpStream::connect(app.app_v4()))
        .unwrap();
    let out_of_app = app
        .run(|| std::net::TcpStream::connect(server.app_v4()))
        .unwrap();
    (into_app, out_of_app)
}

/// One line over a held connection, answered by `echo`.
fn exchange(stream: &std::net::TcpStream, echo: &EchoServer, line: &str) {
    assert_eq!(
        exchange_line(stream, line).unwrap(),
        echo.reply_to(line),
        "{line}"
    );
}

/// Across the move: no connection of either stream failed, and ztunnel neither deleted nor
/// drained the pod's proxy.
fn assert_nothing_failed_or_dropped(
    loop_in: weir_tests::traffic_loop::TrafficLoop,
    loop_out: weir_tests::traffic_loop::TrafficLoop,
    ztunnel: &ZdsZtunnel,
    uid: &str,
) {
    for (direction, connections) in [("in", loop_in.stop()), ("out", loop_out.stop())] {
        let failed: Vec<_> = connections.iter().filter(|c| c.outcome.is_err()).collect();
        assert!(failed.is_empty(), "{direction}: {failed:?}");
    }
    let events = ztunnel.events();
    assert!(
        events.iter().all(|event| !matches!(
            event,
            ZdsEvent::Del { uid: dropped } | ZdsEvent::Drained { uid: dropped } if dropped == uid
        )),
        "{events:?}"
    );
}
