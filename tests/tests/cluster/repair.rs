//! Ambient pods that run unenrolled (started while weir-cni was missing from the chain):
//! repaired live, or labelled or deleted as configured.
use super::*;

#[test]
fn a_pod_that_started_without_weir_cni_is_repaired_live_with_an_event() {
    let cluster = privileged!(Cluster::new());
    // Bound to the node, and wired while weir-cni is missing from the node's chain (the agent
    // has not put it there yet): the real bridge plugin only.
    let (uid, pod) = cluster.pod_with_object(MESH, "app");
    let _process = PodProcess::start(pod.netns(), &uid, CgroupDriver::Cgroupfs).unwrap();
    let server = cluster.pod("default", "server").unwrap();
    let echo = EchoServer::app(&server).unwrap();
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();

    // kubelet reports the pod running: ambient all along, running, and not enrolled.
    cluster.set_running(MESH, "app", &ips_of(&pod));
    let stand_in = ztunnel
        .wait_for_pod(&uid, WAIT)
        .expect("ztunnel gets the Add");
    cluster.wait_for_redirection(MESH, "app", Some("enabled"));
    let target = server.app_v4();
    let reply = pod.run(|| tcp_request(target, "repaired")).unwrap();
    assert_eq!(reply.response, echo.reply_to("repaired"));
    let seen = stand_in
        .wait_for(|seen| seen.listener == OUTBOUND_PORT, WAIT)
        .expect("outbound through ztunnel");
    assert_eq!(seen.original_dst, Some(target));

    let repaired = cluster.wait_for_warnings("RepairedPod");
    assert_eq!(repaired.len(), 1, "{repaired:#?}");
    let event = &repaired[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reportingController"], "cni-repair");
    assert_eq!(event["regarding"]["name"], "app");
    assert_eq!(event["regarding"]["uid"], uid.as_str());
    let note = event["note"].as_str().unwrap();
    assert!(
        note.contains("weir-cni") && note.contains("enrolled live"),
        "{note}"
    );
    wait_for_metric(
        &agent,
        REPAIRED,
        &[("type", "repair"), ("result", "success")],
        1.0,
    );
    agent.stop().unwrap();
}

/// A pod enrolled live was found through a process's `/proc/<pid>/ns/net`. Once that process
/// is gone the path names nothing, or, after the PID is reused, another namespace (the node's
/// among them): changes to the pod apply to the namespace the agent holds, never to a path.
#[test]
fn a_live_enrolled_pod_keeps_its_netns_when_the_process_it_was_found_by_exits() {
    let cluster = privileged!(Cluster::new());
    let (uid, pod) = cluster.pod_with_object(MESH, "app");
    let process = PodProcess::start(pod.netns(), &uid, CgroupDriver::Cgroupfs).unwrap();
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    cluster.set_running(MESH, "app", &ips_of(&pod));
    ztunnel.wait_for_pod(&uid, WAIT).expect("enrolled live");
    cluster.wait_for_redirection(MESH, "app", Some("enabled"));
    drop(process);

    let resolver = SocketAddr::new(cluster.chain.test_node().gateway_v4().into(), DNS_PORT);
    let captured = |answer: &weir_tests::UdpReply| answer.response.starts_with(DNS_REPLY_PREFIX);
    let answer = pod.run(|| udp_request(resolver, "query")).unwrap();
    assert!(captured(&answer), "DNS capture is on by default");
    let mut object: PodObject = cluster.api.get(MESH, "app").unwrap();
    object.metadata.annotations = map(&[(DNS_CAPTURE_ANNOTATION, "false")]);
    cluster.api.update(&object);
    wait_until(WAIT, "the annotation to reach the pod's netns", || {
        !pod.run(|| udp_request(resolver, "query"))
            .is_ok_and(|answer| captured(&answer))
    });
    assert!(ztunnel.pod(&uid).is_some(), "the pod stays enrolled");
    agent.stop().unwrap();
}

#[test]
fn a_broken_pod_that_cannot_be_repaired_is_labelled_or_deleted_as_configured() {
    let cluster = privileged!(Cluster::new());
    let failed_repairs = [("type", "repair"), ("result", "fail")];
    // Running by the API, at an address no network namespace on the node holds.
    cluster.pod_object(MESH, "lost", |pod| {
        pod.status = Some(running_at(&["10.255.0.7".into()]));
    });
    let with =
        |action| move |config: &mut AgentConfig| cluster_config(config).broken_pods.action = action;

    let agent = cluster.start_agent_with(with(BrokenPodAction::Label));
    let labelled = cluster.wait_for_warnings("LabelBrokenPod");
    assert_eq!(labelled.len(), 1, "{labelled:#?}");
    assert_eq!(labelled[0]["reportingController"], "cni-repair");
    assert_eq!(labelled[0]["regarding"]["name"], "lost");
    let note = labelled[0]["note"].as_str().unwrap();
    assert!(
        note.contains("no network namespace") && note.contains("labelled"),
        "{note}"
    );
    let object: PodObject = cluster.api.get(MESH, "lost").unwrap();
    let labels = object.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels.get(UNINITIALIZED_LABEL).map(String::as_str),
        Some("true")
    );
    wait_for_metric(
        &agent,
        REPAIRED,
        &[("type", "label"), ("result", "success")],
        1.0,
    );
    assert!(agent.metrics().value(REPAIRED, &failed_repairs) >= Some(1.0));
    assert_eq!(cluster.redirection(MESH, "lost"), None);
    agent.stop().unwrap();

    let agent = cluster.start_agent_with(with(BrokenPodAction::Delete));
    let deleted = cluster.wait_for_warnings("DeleteBrokenPod");
    assert_eq!(deleted.len(), 1, "{deleted:#?}");
    assert!(
        cluster.api.get::<PodObject>(MESH, "lost").is_none(),
        "deleted"
    );
    let delete = cluster
        .api
        .requests()
        .into_iter()
        .find(|request| request.verb == "delete")
        .expect("a DELETE");
    assert_eq!(delete.path, "/api/v1/namespaces/mesh/pods/lost");
    let preconditions = &delete.body.expect("DeleteOptions")["preconditions"];
    assert_eq!(preconditions["uid"], object.metadata.uid.unwrap().as_str());
    assert_eq!(
        preconditions["resourceVersion"],
        object.metadata.resource_version.unwrap().as_str(),
        "the version the decision was made on"
    );
    wait_for_metric(
        &agent,
        REPAIRED,
        &[("type", "delete"), ("result", "success")],
        1.0,
    );
    // Tried again before its cache saw the pod go, the agent finds it gone: no second Event.
    assert_eq!(cluster.warnings("DeleteBrokenPod").len(), 1);
    agent.stop().unwrap();
}
