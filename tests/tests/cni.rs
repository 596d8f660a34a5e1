//! Pods enrolled the way kubelet's runtime enrolls them: the node's CNI config (bridge +
//! host-local, with weir-cni inserted by weir's own installer), the runtime's ADD/CHECK/DEL calls,
//! the real agent, and ztunnel (the stand-in) connected over ZDS.
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    time::Duration,
};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;
use weir_agent::{
    config::AgentConfig,
    install::ServiceAccount,
    policy::{
        local::ObjectMeta as PolicyMeta, BYPASS_INBOUND_ANNOTATION, DATAPLANE_MODE_LABEL,
        DNS_CAPTURE_ANNOTATION,
    },
};
use weir_common::{ABI_VERSION, DNS_PORT, INBOUND_PORT, MAX_PODS};
use weir_tests::privileged;
use weir_tests::{
    agent::{http_get, Agent},
    chain::{
        ambient_policy, assert_direct, assert_through_ztunnel, pods_command, wait_for_metric,
        weir_conflist, weir_only, CniChainNode as Node, MESH, WAIT,
    },
    cni::{Command, NetworkConfigList, RuntimeConf},
    raw,
    receive_batch::kernel_needs_the_handoff,
    tcp_request, udp_request,
    zds_client::{NetnsId, ZdsEvent, ZdsZtunnel},
    ApiServer, EchoServer, Metrics, Pod, PodSpec, ZtunnelStandIn,
};

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

#[test]
fn add_enrolls_an_ambient_pod_and_hands_it_to_ztunnel() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, client, stand_in) = node.server_and_ambient_pod(&ztunnel, "client");
    let plain = node.pod("default", "plain").unwrap();
    assert!(
        ztunnel.pod(plain.uid()).is_none(),
        "a plain pod is not handed to ztunnel"
    );

    // The ambient pod's traffic goes through ztunnel; the plain pod's does not.
    assert_through_ztunnel(&client, &stand_in, &server, &echo, "mesh");
    assert_direct(&plain, &server, &echo, "plain");

    check(&node, &client).expect("CHECK passes while the pod is redirected");
    check(&node, &plain).expect("CHECK passes for a plain pod");
    agent.stop().unwrap();
}

#[test]
fn del_unenrolls_and_is_idempotent() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, client, stand_in) = node.server_and_ambient_pod(&ztunnel, "client");

    // The runtime's two DELs reach weir-cni: StopPodSandbox (netns, prevResult), then
    // RemovePodSandbox (neither). Only weir's part of the chain runs here, so the pod keeps its
    // network and shows what DEL left behind.
    let runtime = client.runtime_conf().clone();
    weir_only(&node, Command::Del, &runtime, Some(client.prev_result())).unwrap();
    let second = RuntimeConf {
        netns: None,
        ..runtime.clone()
    };
    weir_only(&node, Command::Del, &second, None).unwrap();
    assert!(
        ztunnel.wait_for_del(client.uid(), WAIT),
        "ztunnel was told to drop the pod"
    );
    // Both DELs of a pod that was never enrolled (not ambient) reach weir-cni too.
    let plain = node.pod("default", "plain").unwrap();
    weir_only(
        &node,
        Command::Del,
        plain.runtime_conf(),
        Some(plain.prev_result()),
    )
    .unwrap();
    weir_only(
        &node,
        Command::Del,
        &RuntimeConf {
            netns: None,
            ..plain.runtime_conf().clone()
        },
        None,
    )
    .unwrap();

    // The pod talks directly again.
    let before = stand_in.seen().len();
    assert_direct(&client, &server, &echo, "direct");
    assert_eq!(stand_in.seen().len(), before);
    // ztunnel hears of the pod it had once, and of no other.
    let dels: Vec<ZdsEvent> = ztunnel
        .events()
        .into_iter()
        .filter(|event| matches!(event, ZdsEvent::Del { .. }))
        .collect();
    assert_eq!(
        dels,
        [ZdsEvent::Del {
            uid: client.uid().to_owned()
        }]
    );
    agent.stop().unwrap();
}

/// Multus runs weir-cni as a network of its own, as istio-cni with `chained: false` (OpenShift):
/// a NetworkAttachmentDefinition's extra attachment, after the node's primary network, with no
/// `prevResult`. The plugin prints an empty result, the agent takes the pod's IPs from its eth0,
/// and the attachment's DEL takes the pod out again.
#[test]
fn a_standalone_attachment_without_prev_result_enrolls_an_ambient_pod() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let server = node.pod("default", "server").unwrap();
    let echo = EchoServer::app(&server).unwrap();
    let client = unenrolled_ambient_pod(&node, "client");
    // Multus passes the pod's own CNI_ARGS and no pod annotations.
    let attachment = RuntimeConf {
        ifname: "net1".into(),
        capability_args: Default::default(),
        ..client.runtime_conf().clone()
    };

    let result = standalone_weir(&node, Command::Add, &attachment).expect("the attachment's ADD");
    assert_eq!(result, json!({ "cniVersion": "1.0.0" }));
    let stand_in = ztunnel
        .wait_for_pod(client.uid(), WAIT)
        .expect("ztunnel got the pod's netns over ZDS");
    assert_through_ztunnel(&client, &stand_in, &server, &echo, "mesh");
    let records = weir_agent::state::read(&agent.config.state_file).unwrap();
    let enrolled = &records[client.uid()].workload;
    assert_eq!(
        enrolled.ips,
        client.ips(),
        "eth0's addresses, not link-local"
    );
    assert_eq!(
        enrolled.attachment.as_ref().map(|a| a.ifname.as_str()),
        Some("net1")
    );

    standalone_weir(&node, Command::Del, &attachment).expect("the attachment's DEL");
    assert!(
        ztunnel.wait_for_del(client.uid(), WAIT),
        "ztunnel was told to drop the pod"
    );
    let before = stand_in.seen().len();
    assert_direct(&client, &server, &echo, "direct");
    assert_eq!(stand_in.seen().len(), before);
    agent.stop().unwrap();
}

/// weir-cni alone as a network named `istio-cni`, as a NetworkAttachmentDefinition configures it
/// (version 1.0.0, the installed entry's fields), run by Multus without `prevResult`.
fn standalone_weir(
    node: &Node,
    command: Command,
    runtime: &RuntimeConf,
) -> Result<serde_json::Value, weir_tests::cni::CniError> {
    let weir = weir_conflist(node).plugins.last().unwrap().clone();
    let network = NetworkConfigList {
        name: "istio-cni".into(),
        cni_version: "1.0.0".into(),
        plugins: vec![weir.clone()],
    };
    let config = network.plugin_config(&weir, runtime, None);
    let binary = weir_tests::cni::find_plugin(&weir, &runtime.path).unwrap();
    weir_tests::cni::invoke(&binary, command, runtime, &config, node.netns())
}

/// kubelet gives a pod a new sandbox (after a reboot, or when pause dies): it stops the old one,
/// runs the new one through ADD, then removes the old one, whose second DEL has no netns. That DEL
/// names the old sandbox only, and must leave the live one redirected.
#[test]
fn a_del_for_a_pods_old_sandbox_keeps_the_new_one_redirected() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, old, _) = node.server_and_ambient_pod(&ztunnel, "client");
    let new = node
        .test_node()
        .add_pod_with(PodSpec {
            namespace: MESH.into(),
            uid: Some(old.uid().to_owned()),
            ..PodSpec::new("client")
        })
        .unwrap();
    let new_ip = IpAddr::V4(new.ipv4());
    ztunnel
        .wait_for(
            |event| matches!(event, ZdsEvent::Add { uid, pod_ips, .. } if uid == new.uid() && pod_ips.contains(&new_ip)),
            WAIT,
        )
        .expect("ztunnel got the new sandbox over ZDS");
    let stand_in = ztunnel.stand_in(new.uid()).unwrap();

    let removal = RuntimeConf {
        netns: None,
        ..old.runtime_conf().clone()
    };
    weir_only(&node, Command::Del, &removal, None).unwrap();
    assert_through_ztunnel(&new, &stand_in, &server, &echo, "still captured");
    agent.stop().unwrap();
}

/// CHECK, with the pod's ADD result as prevResult.
fn check(node: &Node, pod: &Pod) -> Result<serde_json::Value, weir_tests::cni::CniError> {
    weir_only(
        node,
        Command::Check,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
}

#[test]
fn check_detects_missing_redirection() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (pod, _) = node.ambient_pod(&ztunnel, "app");
    check(&node, &pod).expect("CHECK passes while redirected");

    // Someone deletes the pod's entry behind weir's back (bpftool, as an operator would).
    let cookie = pod.netns().cookie().unwrap();
    let key: Vec<String> = cookie.to_ne_bytes().iter().map(|b| b.to_string()).collect();
    let pods_map = agent
        .config
        .datapath
        .pin_root
        .join(format!("abi-{}/PODS", weir_common::ABI_VERSION));
    let status = std::process::Command::new("bpftool")
        .args(["map", "delete", "pinned"])
        .arg(&pods_map)
        .arg("key")
        .args(&key)
        .status()
        .unwrap();
    assert!(status.success());
    let error = check(&node, &pod).expect_err("CHECK fails without redirection");
    assert!(format!("{error}").contains("no redirection"), "{error}");
    agent.stop().unwrap();
}

/// The agent away and no API server: the verdict cache decides. A pod it does not know may carry
/// the ambient label itself, so it waits like an ambient one.
#[test]
fn agent_down_fails_ambient_pods_and_starts_plain_ones() {
    let node = privileged!(Node::new());
    let mut policy = ambient_policy();
    policy
        .pods
        .insert("default/plain".into(), PolicyMeta::default());
    node.files.write_policy(&policy).unwrap();
    let agent = node.start_agent();
    agent.stop().unwrap();
    // The plugin stays installed, as after an agent crash or during an upgrade.
    let error = node
        .pod(MESH, "app")
        .expect_err("an ambient pod must not start unredirected");
    let message = format!("{error:#}");
    assert!(message.contains("unreachable"), "{message}");
    assert!(message.contains("11"), "try again later: {message}");
    let plain = node.pod("default", "plain").expect("a plain pod starts");
    assert!(plain.ipv4().is_private());
    let error = node
        .pod("default", "stranger")
        .expect_err("a pod unknown to the verdict cache must not start unredirected");
    let message = format!("{error:#}");
    assert!(
        message.contains("pod default/stranger is unknown to the verdict cache"),
        "{message}"
    );
    assert!(message.contains("11"), "try again later: {message}");
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

/// The agent away, and a namespace labelled ambient after its verdict cache was written: the
/// plugin asks the API server with the kubeconfig the agent's installer wrote, and the pod waits;
/// a pod the API server says is not ambient starts.
#[test]
fn agent_down_the_api_server_decides_with_the_installed_kubeconfig() {
    let node = privileged!(Node::new());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // On the node's loopback, where the runtime runs weir-cni.
    let api = node
        .netns()
        .run(|| runtime.block_on(ApiServer::start()))
        .unwrap();
    let account = node.files.run_dir().join("serviceaccount");
    std::fs::create_dir(&account).unwrap();
    std::fs::write(account.join("token"), "agent-token").unwrap();
    let config = AgentConfig {
        service_account: Some(ServiceAccount {
            server: api.url(),
            token_file: account.join("token"),
            ca_file: None,
        }),
        ..node.files.agent_config(node.netns()).unwrap()
    };
    let agent = Agent::start(config).expect("agent ready");
    let kubeconfig = node.files.net_dir().join("weir-kubeconfig");
    let mode = std::fs::metadata(&kubeconfig).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    agent.stop().unwrap();

    for (name, labels) in [
        (
            "late",
            BTreeMap::from([(DATAPLANE_MODE_LABEL.to_owned(), "ambient".to_owned())]),
        ),
        ("default", BTreeMap::new()),
    ] {
        api.create(&Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        });
    }
    let pod = |namespace: &str, name: &str| {
        node.test_node().add_pod_with(PodSpec {
            namespace: namespace.into(),
            uid: Some(api.create_pod(namespace, name)),
            ..PodSpec::new(name)
        })
    };
    let error = pod("late", "app").expect_err("an ambient pod must not start unredirected");
    let message = format!("{error:#}");
    assert!(message.contains("11"), "try again later: {message}");
    assert!(message.contains("ambient pod late/app waits"), "{message}");
    let plain = pod("default", "plain").expect("a plain pod starts");
    assert!(plain.ipv4().is_private());
    let asked: Vec<String> = api.requests().into_iter().map(|r| r.path).collect();
    assert!(
        asked.contains(&"/api/v1/namespaces/late/pods/app".to_owned()),
        "{asked:?}"
    );
}

#[test]
fn ztunnel_absent_fails_add_until_it_connects() {
    let node = privileged!(Node::new());
    let agent = node.start_agent();
    let error = node
        .pod(MESH, "early")
        .expect_err("no ztunnel: the ADD fails");
    assert!(format!("{error:#}").contains("pending"), "{error:#}");
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    let pod = node
        .pod(MESH, "retried")
        .expect("the runtime's retry succeeds");
    assert!(ztunnel.wait_for_pod(pod.uid(), WAIT).is_some());
    agent.stop().unwrap();
}

#[test]
fn hundred_concurrent_adds_all_enroll() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let pods: Vec<Pod> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..100)
            .map(|i| {
                let node = &node;
                scope.spawn(move || node.pod(MESH, &format!("p{i}")).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for pod in &pods {
        assert!(
            ztunnel.wait_for_pod(pod.uid(), WAIT).is_some(),
            "pod {} handed to ztunnel",
            pod.name()
        );
    }
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value(
            "weir_cni_requests_total",
            &[("event", "add"), ("result", "ok")]
        ),
        Some(100.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value(
            "istio_cni_plugin_requests_total",
            &[("response_code", "200")]
        ),
        Some(100.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value("weir_redirect_seconds_count", &[]),
        Some(100.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value("weir_enrolled_pods", &[("status", "enabled")]),
        Some(100.0),
        "{metrics}"
    );
    for (name, labels) in [
        (
            "weir_pods",
            &[("mode", "ambient"), ("state", "enrolled")][..],
        ),
        (
            "weir_enroll_seconds_count",
            &[("mode", "ambient"), ("result", "ok")],
        ),
        ("weir_map_entries", &[("map", "PODS")]),
    ] {
        assert_eq!(
            metrics.value(name, labels),
            Some(100.0),
            "{name}: {metrics}"
        );
    }
    assert_eq!(
        metrics.value("weir_pods", &[("mode", "ambient"), ("state", "pending")]),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(metrics.value("weir_zds_pending_adds", &[]), Some(0.0));
    agent.stop().unwrap();
}

#[test]
fn malformed_and_oversized_requests_get_errors() {
    let node = privileged!(Node::new());
    let agent = node.start_agent();
    let ask = |payload: &[u8]| -> serde_json::Value {
        let mut stream = UnixStream::connect(&agent.config.cni_socket).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let _ = stream.write_all(payload);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let garbage = ask(b"{not json\n");
    assert_eq!(garbage["result"], "error");
    assert_eq!(garbage["code"], 6);
    let oversized = ask(&vec![b'x'; 200 * 1024]);
    assert_eq!(oversized["result"], "error");
    // The agent still serves pods afterwards.
    let _ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    node.pod(MESH, "after").expect("still serving");
    agent.stop().unwrap();
}

/// The code and message of the error result weir-cni printed.
fn cni_error(result: Result<serde_json::Value, weir_tests::cni::CniError>) -> (u64, String) {
    match result {
        Err(weir_tests::cni::CniError::Plugin(failure)) => (
            failure.code.expect("an error result has a code"),
            failure.msg,
        ),
        other => panic!("expected an error result, got {other:?}"),
    }
}

/// An ambient pod wired by the node's primary CNI only, for weir-cni's calls made by hand.
fn unenrolled_ambient_pod(node: &Node, name: &str) -> Pod {
    node.test_node()
        .add_pod_primary(PodSpec {
            namespace: MESH.into(),
            ..PodSpec::new(name)
        })
        .unwrap()
}

/// An ambient pod's request that lacks what its enrollment needs gets the spec's code for what
/// is wrong and a message naming it, never "try again later": the runtime would send the same
/// request again and again. (weir-cni answers what it can check alone the same way, without
/// asking the agent: `cni/tests/plugin.rs`.) The runtime's DELs after the failed ADD succeed.
#[test]
fn malformed_requests_get_the_specs_code_for_what_is_wrong() {
    let node = privileged!(Node::new());
    let agent = node.start_agent();
    let pod = unenrolled_ambient_pod(&node, "app");
    let (runtime, prev) = (pod.runtime_conf(), pod.prev_result());
    let without_netns = RuntimeConf {
        netns: None,
        ..runtime.clone()
    };
    let without_uid = RuntimeConf {
        args: runtime
            .args
            .iter()
            .filter(|(key, _)| key != "K8S_POD_UID")
            .cloned()
            .collect(),
        ..runtime.clone()
    };
    let mut without_addresses = prev.clone();
    without_addresses["ips"] = json!([]);
    // Without them in prevResult the agent looks on eth0, where only link-local ones are left.
    let flush = [
        "-n",
        pod.netns().name(),
        "addr",
        "flush",
        "dev",
        "eth0",
        "scope",
        "global",
    ];
    weir_tests::netns::ip(&flush).unwrap();
    let mut bad_address = prev.clone();
    bad_address["ips"][0]["address"] = "10.244.0.300/24".into();
    let add = |runtime: &RuntimeConf, prev: &serde_json::Value| {
        weir_only(&node, Command::Add, runtime, Some(prev))
    };
    for (result, code, msg) in [
        (
            add(&without_uid, prev),
            4,
            "CNI_ARGS has no K8S_POD_UID: ambient pod mesh/app cannot be enrolled",
        ),
        (
            add(runtime, &without_addresses),
            7,
            "neither prevResult nor the pod's eth0 has an IP address: ambient pod mesh/app \
             cannot be enrolled",
        ),
        (
            add(runtime, &bad_address),
            7,
            "prevResult address \"10.244.0.300/24\" is not an IP address: ambient pod mesh/app \
             cannot be enrolled",
        ),
    ] {
        let (got_code, got_msg) = cni_error(result);
        assert_eq!((got_code, got_msg.as_str()), (code, msg));
    }
    weir_only(&node, Command::Del, runtime, Some(prev)).expect("StopPodSandbox's DEL");
    weir_only(&node, Command::Del, &without_netns, None).expect("RemovePodSandbox's DEL");
    agent.stop().unwrap();
}

/// An enrollment that can never succeed fails for good (a well-known code where the spec has
/// one, else 999) and says why: `CNI_NETNS` names nothing (the sandbox's namespace is gone),
/// a file left behind once the namespace was unmounted, or the node's own namespace. Asked again,
/// the answer is the same; the pod's DELs succeed, and its real namespace enrolls afterwards.
#[test]
fn an_enrollment_that_can_never_succeed_fails_for_good() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let pod = unenrolled_ambient_pod(&node, "app");
    let gone = node.files.run_dir().join("cni-gone");
    let unmounted = tempfile::NamedTempFile::new_in(node.files.run_dir()).unwrap();
    let node_netns = node.netns().path().to_owned();
    for (netns, code, msg) in [
        (&gone, 4, "does not exist"),
        (
            &unmounted.path().to_owned(),
            4,
            "is not a network namespace",
        ),
        (
            &node_netns,
            999,
            "refusing to redirect the node's own network namespace as pod",
        ),
    ] {
        let runtime = RuntimeConf {
            netns: Some(netns.clone()),
            ..pod.runtime_conf().clone()
        };
        for _ in 0..2 {
            let (got_code, got_msg) = cni_error(weir_only(
                &node,
                Command::Add,
                &runtime,
                Some(pod.prev_result()),
            ));
            assert_eq!(got_code, code, "{got_msg}");
            assert!(got_msg.starts_with("CNI_NETNS: "), "{got_msg}");
            assert!(got_msg.contains(msg), "{got_msg}");
            assert!(
                got_msg.ends_with("ambient pod mesh/app cannot be enrolled"),
                "{got_msg}"
            );
        }
        weir_only(&node, Command::Del, &runtime, Some(pod.prev_result())).unwrap();
    }
    assert!(ztunnel.pod(pod.uid()).is_none());
    weir_only(
        &node,
        Command::Add,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .expect("the pod's own netns enrolls");
    assert!(ztunnel.wait_for_pod(pod.uid(), WAIT).is_some());
    agent.stop().unwrap();
}

/// What clears up without a new request is "try again later" (11), with its cause, and the
/// runtime's retry then succeeds: here the agent cannot read its policy for a moment (an
/// editor writing the file in place).
#[test]
fn a_failure_that_clears_up_is_try_again_later() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let pod = unenrolled_ambient_pod(&node, "app");
    std::fs::write(node.files.policy_file(), "{\"namespaces\": {").unwrap();
    let add = || {
        weir_only(
            &node,
            Command::Add,
            pod.runtime_conf(),
            Some(pod.prev_result()),
        )
    };
    let (code, msg) = cni_error(add());
    assert_eq!(code, 11, "{msg}");
    assert!(
        msg.starts_with("cannot decide whether pod mesh/app is ambient: EOF while parsing"),
        "{msg}"
    );
    node.files.write_policy(&ambient_policy()).unwrap();
    add().expect("the runtime's retry");
    assert!(ztunnel.wait_for_pod(pod.uid(), WAIT).is_some());
    agent.stop().unwrap();
}

#[test]
fn inbound_reaches_an_enrolled_pod_through_ztunnel() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, stand_in) = node.ambient_pod(&ztunnel, "server");
    let echo = EchoServer::app(&server).unwrap();
    let client = node.pod("default", "client").unwrap();
    let target = server.app_v6();
    let reply = client.run(|| tcp_request(target, "in")).unwrap();
    assert_eq!(reply.response, echo.reply_to("in"));
    assert!(stand_in
        .wait_for(|s| s.listener == INBOUND_PORT && s.local == target, WAIT)
        .is_some());
    agent.stop().unwrap();
}

#[test]
fn agent_restart_recovers_pods_and_hands_them_to_a_reconnecting_ztunnel() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, pod, _) = node.server_and_ambient_pod(&ztunnel, "app");
    agent.stop().unwrap();
    assert!(ztunnel.wait_for_close(WAIT), "ztunnel saw the agent go");
    drop(ztunnel);

    // The next agent takes the pod back from the pinned maps and finds its netns again.
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    assert!(ztunnel.wait_for_snapshot(WAIT));
    let expected = NetnsId::of(pod.netns().open().unwrap()).unwrap();
    let events = ztunnel.events();
    let add = events
        .iter()
        .find(|e| e.uid() == Some(pod.uid()))
        .expect("the snapshot names the pod");
    match add {
        ZdsEvent::Add { info, netns, .. } => {
            assert_eq!(*netns, Some(expected), "with the pod's own netns");
            let info = info.as_ref().unwrap();
            assert_eq!((info.namespace.as_str(), info.name.as_str()), (MESH, "app"));
        }
        other => panic!("expected Add with the netns, got {other:?}"),
    }
    let stand_in = ztunnel.wait_for_pod(pod.uid(), WAIT).unwrap();
    // Pending after the restart until ztunnel acked the snapshot's Add, then enabled.
    wait_for_metric(&agent, "weir_enrolled_pods", &[("status", "enabled")], 1.0);
    assert_through_ztunnel(&pod, &stand_in, &server, &echo, "after restart");
    // Inbound too, through the tc program the new agent put in place of the old one's.
    let pod_app = EchoServer::app(&pod).unwrap();
    let inbound = pod.app_v4();
    let reply = server.run(|| tcp_request(inbound, "in")).unwrap();
    assert_eq!(reply.response, pod_app.reply_to("in"));
    assert!(stand_in
        .wait_for(|s| s.listener == INBOUND_PORT && s.local == inbound, WAIT)
        .is_some());

    // DEL after the restart removes everything, as before it.
    weir_only(
        &node,
        Command::Del,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .unwrap();
    assert!(ztunnel.wait_for_del(pod.uid(), WAIT));
    let before = stand_in.seen().len();
    assert_direct(&pod, &server, &echo, "direct");
    assert_eq!(stand_in.seen().len(), before);
    agent.stop().unwrap();
}

/// An upgrade to an agent with another map layout: the old layout's programs keep redirecting
/// until the new agent has enrolled the pod into its own maps, then the old layout is retired.
#[test]
fn agent_upgrade_across_map_layouts_moves_pods_without_a_gap() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, pod, _) = node.server_and_ambient_pod(&ztunnel, "app");
    let pin_root = agent.config.datapath.pin_root.clone();
    agent.stop().unwrap();
    drop(ztunnel);

    // What the previous version left: its maps and links under an older layout's directory.
    let current = pin_root.join(format!("abi-{}", weir_common::ABI_VERSION));
    let older = pin_root.join("abi-0");
    std::fs::rename(&current, &older).unwrap();
    let target = server.app_v4();
    let stand_in = ZtunnelStandIn::start(&pod).unwrap();
    // A loaded machine may reset the first connection to a stand-in just started: that is not
    // a way around ztunnel (one would reach the app), so it is tried again.
    let sent = (0..3).any(|_| pod.run(|| tcp_request(target, "old layout")).is_ok());
    assert!(sent, "a connection through the old layout completes");
    assert!(
        stand_in
            .wait_for(|s| s.original_dst == Some(target), WAIT)
            .is_some(),
        "the old layout's programs still redirect"
    );
    drop(stand_in);

    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    assert!(
        !older.exists(),
        "the older layout is retired once its pod moved"
    );
    let stand_in = ztunnel
        .wait_for_pod(pod.uid(), WAIT)
        .expect("handed to ztunnel");
    assert_through_ztunnel(&pod, &stand_in, &server, &echo, "new layout");
    check(&node, &pod).expect("the pod is redirected by the new layout");
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
