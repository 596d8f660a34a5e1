//! weir on the node around the plugin: the installer's conflist entry kept in the chain, the
//! agent's HTTP servers, `weir-agent pods`.
use super::*;

#[test]
fn installer_chains_weir_into_the_node_conflist() {
    let node = privileged!(Node::new());
    let agent = node.start_agent();
    let conflist: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.files.net_dir().join("10-weir-test.conflist")).unwrap(),
    )
    .unwrap();
    let plugins = conflist["plugins"].as_array().unwrap();
    assert_eq!(plugins[0]["type"], "bridge", "the primary CNI stays first");
    assert_eq!(plugins.last().unwrap()["type"], "weir-cni");
    assert!(node.files.bin_dir().join("weir-cni").exists());
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value("istio_cni_install_ready", &[]),
        Some(1.0),
        "{metrics}"
    );
    assert_describes_itself(&metrics);
    agent.stop().unwrap();
}

/// What an agent says of itself on /metrics, pods or none: its build and kernel path, its
/// maps' capacities, its process.
fn assert_describes_itself(metrics: &Metrics) {
    let handoff = if kernel_needs_the_handoff() {
        "sk_lookup"
    } else {
        "tc"
    };
    let build = [
        ("version", env!("CARGO_PKG_VERSION")),
        ("map_layout", &ABI_VERSION.to_string()),
        ("inbound_handoff", handoff),
    ];
    assert_eq!(
        metrics.value("weir_build_info", &build),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value("weir_map_capacity", &[("map", "PODS")]),
        Some(f64::from(MAX_PODS)),
        "{metrics}"
    );
    assert_eq!(
        metrics.value("weir_map_entries", &[("map", "PODS")]),
        Some(0.0),
        "{metrics}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = metrics.value("process_start_time_seconds", &[]).unwrap();
    assert!(now - 600.0 < started && started <= now, "{metrics}");
    for positive in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_cpu_seconds_total",
    ] {
        assert!(
            metrics.value(positive, &[]).unwrap() > 0.0,
            "{positive}: {metrics}"
        );
    }
}

/// Pods can reach the health and metrics ports: a connection that sends nothing is closed, and
/// many of them keep neither probes nor scrapes from being answered.
#[test]
fn idle_http_connections_are_closed_and_do_not_block_probes() {
    use std::io::Read;
    let node = privileged!(Node::new());
    let agent = node.start_agent();
    let addr = agent.config.health_addr;
    let idle: Vec<std::net::TcpStream> = (0..32)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    assert_eq!(
        http_get(addr, "/healthz").unwrap(),
        (200, "ok\n".to_owned())
    );
    let mut first = &idle[0];
    first
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut rest = Vec::new();
    // EOF (or a reset): the server hung up on the idle client; a read timeout means it did not.
    match first.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "the idle connection got {rest:?}"),
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset),
    }
    agent.stop().unwrap();
}

/// With weir's own CNI config, the primary CNI writing its file again while the agent is away (as
/// on a node reboot, before the agent is back) does not take weir out of the chain: the runtime
/// still loads weir's file, and an ambient pod waits instead of starting unredirected.
#[test]
fn an_owned_config_keeps_weir_chained_when_the_primary_rewrites_its_file() {
    let node = privileged!(Node::new());
    let owning_agent = || {
        let mut config = node.files.agent_config(node.netns()).unwrap();
        config.cni_placement.placement = weir_agent::install::Placement::Owned;
        Agent::start(config).unwrap()
    };
    let primary = node.files.net_dir().join("10-weir-test.conflist");
    let primary_as_written = std::fs::read(&primary).unwrap();
    let agent = owning_agent();
    assert_eq!(
        std::fs::read(&primary).unwrap(),
        primary_as_written,
        "the primary's file is its CNI's"
    );
    agent.stop().unwrap();

    std::fs::write(&primary, &primary_as_written).unwrap();
    let error = node
        .pod(MESH, "app")
        .expect_err("an ambient pod must not start unredirected");
    let message = format!("{error:#}");
    assert!(message.contains("unreachable"), "{message}");

    let agent = owning_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    let (server, echo, pod, stand_in) = node.server_and_ambient_pod(&ztunnel, "app-again");
    assert_through_ztunnel(&pod, &stand_in, &server, &echo, "hello");
    agent.stop().unwrap();
}

/// `weir-agent pods` as an operator runs it next to a live agent: every enrolled pod with its
/// uid, addresses, netns cookie, status, options and counters, from the pinned maps and the
/// agent's state file; and what the two disagree on, flagged.
#[test]
fn pods_command_lists_what_the_node_holds() {
    let node = privileged!(Node::new());
    let mut policy = ambient_policy();
    policy.pods.insert(
        format!("{MESH}/quiet"),
        PolicyMeta {
            annotations: BTreeMap::from([
                (BYPASS_INBOUND_ANNOTATION.into(), "true".into()),
                (DNS_CAPTURE_ANNOTATION.into(), "false".into()),
            ]),
            ..PolicyMeta::default()
        },
    );
    node.files.write_policy(&policy).unwrap();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, client, stand_in) = node.server_and_ambient_pod(&ztunnel, "client");
    let (quiet, _) = node.ambient_pod(&ztunnel, "quiet");
    let (client_app, quiet_app) = (
        EchoServer::app(&client).unwrap(),
        EchoServer::app(&quiet).unwrap(),
    );

    // One of each counted event.
    let to_server = server.app_v4();
    client.run(|| tcp_request(to_server, "out")).unwrap();
    quiet.run(|| tcp_request(to_server, "out")).unwrap();
    let resolver = SocketAddr::new(IpAddr::V4(node.test_node().gateway_v4()), DNS_PORT);
    client.run(|| udp_request(resolver, "query")).unwrap();
    let to_client = client.app_v4();
    let reply = server.run(|| tcp_request(to_client, "in")).unwrap();
    assert_eq!(reply.response, client_app.reply_to("in"));
    let to_quiet = quiet.app_v4();
    let reply = server.run(|| tcp_request(to_quiet, "bypassed")).unwrap();
    assert_eq!(reply.response, quiet_app.reply_to("bypassed"));
    let fragmented_syn = raw::Syn {
        source: SocketAddr::new(IpAddr::V4(server.ipv4()), 41001),
        destination: to_client,
        shape: raw::Fragmented(8),
        tcp: raw::Tcp::SYN,
    };
    server
        .run(|| raw::probe(&[fragmented_syn], Duration::from_millis(300)))
        .unwrap();

    let state_file = agent.config.state_file.clone();
    let listed = pods_command(&agent, &state_file, &["--output", "json"]);
    let rows = listed.as_array().expect("one JSON array");
    let names: Vec<&str> = rows
        .iter()
        .map(|row| row["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["client", "quiet"], "the plain server is not listed");
    for (row, pod, options, counters) in [
        (
            &rows[0],
            &client,
            json!({"inbound_bypass": false, "dns_capture": true}),
            json!({"outbound": 1, "inbound": 1, "dns": 1, "bypassed": 0, "dropped": 1}),
        ),
        (
            &rows[1],
            &quiet,
            json!({"inbound_bypass": true, "dns_capture": false}),
            json!({"outbound": 1, "inbound": 0, "dns": 0, "bypassed": 1, "dropped": 0}),
        ),
    ] {
        assert_eq!(row["namespace"], MESH);
        assert_eq!(row["uid"], pod.uid());
        assert_eq!(row["status"], "enabled");
        assert_eq!(row["netns_cookie"], pod.netns().cookie().unwrap());
        assert_eq!(row["netns"], pod.netns_path().to_str().unwrap());
        // The CNI result's addresses and the link-local one indexed for the pod besides.
        let ips: Vec<IpAddr> = serde_json::from_value(row["ips"].clone()).unwrap();
        for ip in [
            IpAddr::V4(pod.ipv4()),
            IpAddr::V6(pod.ipv6()),
            IpAddr::V6(pod.link_local().unwrap()),
        ] {
            assert!(ips.contains(&ip), "{ip} in {row}");
        }
        assert_eq!(row["options"], options, "{row}");
        assert_eq!(row["counters"], counters, "{row}");
        assert_eq!(
            (&row["in_maps"], &row["in_state_file"]),
            (&json!(true), &json!(true))
        );
    }
    let table = pods_command(&agent, &state_file, &[]);
    let table = table.as_str().unwrap();
    for pod in [&client, &quiet] {
        let line = table
            .lines()
            .find(|line| line.starts_with(&format!("{MESH}/{}", pod.name())))
            .unwrap_or_else(|| panic!("no line for {}:\n{table}", pod.name()));
        assert!(
            line.contains(pod.uid()) && line.contains("enabled"),
            "{line}"
        );
    }
    // Wide: the netns each pod was enrolled with besides.
    let wide = pods_command(&agent, &state_file, &["-o", "wide"]);
    let wide = wide.as_str().unwrap();
    for pod in [&client, &quiet] {
        let line = wide.lines().find(|line| line.contains(pod.uid())).unwrap();
        assert!(line.contains(pod.netns_path().to_str().unwrap()), "{line}");
    }
    assert!(wide.starts_with("POD "), "{wide}");
    assert!(wide.lines().next().unwrap().contains(" NETNS "), "{wide}");
    // YAML: the JSON output's objects.
    let yaml = pods_command(&agent, &state_file, &["--output", "yaml"]);
    let yaml: serde_json::Value = serde_norway::from_str(yaml.as_str().unwrap()).unwrap();
    assert_eq!(yaml, listed);
    println!("{table}{wide}{listed:#}");

    // A state file that lost `quiet` and still holds a pod the maps do not.
    let records = weir_agent::state::read(&state_file).unwrap();
    let serde_json::Value::Object(mut records) = serde_json::to_value(records).unwrap() else {
        unreachable!("records are a map")
    };
    records.remove(quiet.uid()).unwrap();
    let mut ghost = records[client.uid()].clone();
    ghost["uid"] = "ghost-uid".into();
    ghost["name"] = "ghost".into();
    records.insert("ghost-uid".into(), ghost);
    let edited = node.files.run_dir().join("edited-pods.json");
    std::fs::write(&edited, serde_json::to_vec(&records).unwrap()).unwrap();
    let listed = pods_command(&agent, &edited, &["--output", "json"]);
    let rows = listed.as_array().unwrap();
    let uids: Vec<&str> = rows
        .iter()
        .map(|row| row["uid"].as_str().unwrap())
        .collect();
    assert_eq!(uids, [client.uid(), "ghost-uid", quiet.uid()]);
    let (ghost, unnamed) = (&rows[1], &rows[2]);
    assert_eq!(
        (&ghost["in_maps"], &ghost["netns_cookie"]),
        (&json!(false), &json!(null))
    );
    assert_eq!(ghost["counters"], json!(null));
    assert_eq!(
        (&unnamed["in_state_file"], &unnamed["name"]),
        (&json!(false), &json!(null))
    );
    assert_eq!(unnamed["status"], json!(null));
    assert_eq!(unnamed["counters"]["bypassed"], 1);
    let table = pods_command(&agent, &edited, &[]);
    let table = table.as_str().unwrap();
    let line_of = |needle: &str| table.lines().find(|line| line.contains(needle)).unwrap();
    assert!(line_of("ghost-uid").starts_with("mesh/ghost"), "{table}");
    assert!(line_of("ghost-uid").contains("orphan"), "{table}");
    assert!(line_of(quiet.uid()).starts_with("<unknown>"), "{table}");
    assert!(
        line_of(quiet.uid()).contains("not in the state file"),
        "{table}"
    );
    println!("{table}");

    // Reading did not disturb the agent: its pods are still redirected, and counted.
    assert_through_ztunnel(&client, &stand_in, &server, &echo, "again");
    let listed = pods_command(&agent, &state_file, &["--output", "json"]);
    assert_eq!(listed[0]["counters"]["outbound"], 2);
    agent.stop().unwrap();
}
