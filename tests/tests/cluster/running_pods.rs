//! The reconcile loop: running pods follow what the cluster says of them (labels, annotations,
//! deletion), one pod's failure retried with its own backoff.
use super::*;

#[test]
fn namespace_label_enrolls_and_removes_a_running_pod() {
    let cluster = privileged!(Cluster::new());
    // Wired before the agent installs weir-cni: only live enrollment can redirect it.
    let pod = cluster.pod("default", "live").unwrap();
    let ips = [pod.ipv4().to_string(), pod.ipv6().to_string()];
    cluster.pod_object("default", "live", |object| {
        object.status = Some(running_at(&ips));
    });
    let object: PodObject = cluster.api.get("default", "live").unwrap();
    let uid = object.metadata.uid.unwrap();
    let _process = weir_tests::cgroup::PodProcess::start(
        pod.netns(),
        &uid,
        weir_tests::cgroup::CgroupDriver::Cgroupfs,
    )
    .unwrap();
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    assert!(ztunnel.pod(&uid).is_none(), "not ambient yet");

    let labelled = |labels: &[(&str, &str)]| Namespace {
        metadata: meta(None, "default", labels),
        ..Namespace::default()
    };
    cluster
        .api
        .update(&labelled(&[(DATAPLANE_MODE_LABEL, "ambient")]));
    assert!(
        ztunnel.wait_for_pod(&uid, WAIT).is_some(),
        "ztunnel gets the Add"
    );
    cluster.wait_for_redirection("default", "live", Some("enabled"));

    cluster.api.update(&labelled(&[]));
    assert!(ztunnel.wait_for_del(&uid, WAIT), "ztunnel gets the Del");
    cluster.wait_for_redirection("default", "live", None);
    // Seen out of the mesh before: flipped in by its namespace's label, not a repair.
    assert_eq!(cluster.warnings("RepairedPod"), Vec::<Value>::new());
    let repairs = [("type", "repair"), ("result", "success")];
    assert_eq!(agent.metrics().value(REPAIRED, &repairs), None);
    agent.stop().unwrap();
}

#[test]
fn opt_out_deletion_and_completion_remove_running_pods_live() {
    let cluster = privileged!(Cluster::new());
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let names = ["opting-out", "deleted", "completed"];
    let mut running = Vec::new();
    for name in names {
        let (uid, pod) = cluster.pod_with_object(MESH, name);
        ztunnel.wait_for_pod(&uid, WAIT).unwrap();
        cluster.wait_for_redirection(MESH, name, Some("enabled"));
        running.push((uid, pod));
    }
    let recorded = |uid: &str| {
        weir_agent::state::read(&agent.config.state_file)
            .unwrap()
            .contains_key(uid)
    };
    assert!(running.iter().all(|(uid, _)| recorded(uid)));

    let mut opting_out: PodObject = cluster.api.get(MESH, "opting-out").unwrap();
    opting_out.metadata.labels = map(&[(DATAPLANE_MODE_LABEL, "none")]);
    cluster.api.update(&opting_out);
    cluster
        .api
        .delete::<PodObject>(MESH, "deleted")
        .expect("the pod existed");
    let mut completed: PodObject = cluster.api.get(MESH, "completed").unwrap();
    completed.status = Some(k8s_openapi::api::core::v1::PodStatus {
        phase: Some("Succeeded".into()),
        ..Default::default()
    });
    cluster.api.update(&completed);

    for (name, (uid, _)) in names.iter().zip(&running) {
        assert!(
            ztunnel.wait_for_del(uid, WAIT),
            "{name}: ztunnel gets the Del"
        );
    }
    wait_until(WAIT, "the state file to forget the removed pods", || {
        !running.iter().any(|(uid, _)| recorded(uid))
    });
    cluster.wait_for_redirection(MESH, "opting-out", None);
    agent.stop().unwrap();
}

/// kubelet's order for a pod going away: deletionTimestamp, then the sandbox stops (CNI DEL)
/// while the object still says Running with its IPs. Likewise a sandbox that died and waits for
/// its successor's ADD. Neither is a broken pod: nothing is repaired or reported.
#[test]
fn a_pod_whose_sandbox_is_gone_is_neither_repaired_nor_reported() {
    let cluster = privileged!(Cluster::new());
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let mut sandboxes = Vec::new();
    for name in ["terminating", "restarting"] {
        let (uid, pod) = cluster.pod_with_object(MESH, name);
        ztunnel.wait_for_pod(&uid, WAIT).unwrap();
        cluster.set_running(MESH, name, &ips_of(&pod));
        cluster.wait_for_redirection(MESH, name, Some("enabled"));
        sandboxes.push((name, uid, pod));
    }
    let mut terminating: PodObject = cluster.api.get(MESH, "terminating").unwrap();
    terminating.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    );
    let runs = Loop::Reconcile.runs(&agent, "change");
    cluster.api.update(&terminating);
    for (name, uid, pod) in sandboxes {
        // The runtime's DEL, then the netns is gone.
        drop(pod);
        assert!(
            ztunnel.wait_for_del(&uid, WAIT),
            "{name}: ztunnel gets the Del"
        );
        cluster.wait_for_redirection(MESH, name, None);
    }
    // The deletion timestamp, and each pod's redirection annotation taken off at its DEL.
    Loop::Reconcile.wait_for_runs(&agent, "change", runs, 3);
    assert!(cluster.warnings("AmbientEnrollmentFailed").is_empty());
    assert_eq!(
        agent
            .metrics()
            .value(REPAIRED, &[("type", "repair"), ("result", "fail")]),
        None
    );
    agent.stop().unwrap();
}

#[test]
fn a_pod_that_cannot_be_enrolled_stops_neither_readiness_nor_the_others() {
    let cluster = privileged!(Cluster::new());
    let running = |ips: &[String]| {
        let status = running_at(ips);
        move |object: &mut PodObject| object.status = Some(status)
    };
    // Running by the API, but no network namespace on the node holds its address.
    cluster.pod_object(MESH, "broken", running(&["10.255.0.9".into()]));
    // Wired before weir-cni was in the chain: only the agent's reconcile can enroll it.
    let pod = cluster.pod(MESH, "healthy").unwrap();
    cluster.pod_object(
        MESH,
        "healthy",
        running(&[pod.ipv4().to_string(), pod.ipv6().to_string()]),
    );
    let object: PodObject = cluster.api.get(MESH, "healthy").unwrap();
    let uid = object.metadata.uid.unwrap();
    let _process = weir_tests::cgroup::PodProcess::start(
        pod.netns(),
        &uid,
        weir_tests::cgroup::CgroupDriver::Systemd,
    )
    .unwrap();

    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    assert!(
        ztunnel.wait_for_pod(&uid, WAIT).is_some(),
        "the healthy pod is enrolled"
    );
    cluster.wait_for_redirection(MESH, "healthy", Some("enabled"));
    let failed = cluster.wait_for_warnings("AmbientEnrollmentFailed");
    assert_eq!(failed.len(), 1, "{failed:#?}");
    assert_eq!(failed[0]["regarding"]["name"], "broken");
    assert_eq!(cluster.redirection(MESH, "broken"), None);
    agent.stop().unwrap();
}

#[test]
fn an_annotation_change_applies_to_a_running_pod() {
    let cluster = privileged!(Cluster::new());
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let (_, pod) = cluster.pod_with_object(MESH, "app");
    ztunnel.wait_for_pod(pod.uid(), WAIT).unwrap();
    let resolver = std::net::SocketAddr::new(
        cluster.chain.test_node().gateway_v4().into(),
        weir_common::DNS_PORT,
    );
    let answer = pod
        .run(|| weir_tests::udp_request(resolver, "query"))
        .unwrap();
    assert_eq!(
        answer.response,
        format!("{}query", weir_tests::ztunnel::DNS_REPLY_PREFIX),
        "DNS capture is on by default"
    );

    let mut object: PodObject = cluster.api.get(MESH, "app").unwrap();
    object.metadata.annotations = map(&[(DNS_CAPTURE_ANNOTATION, "false")]);
    cluster.api.update(&object);
    // Nothing answers DNS on the node's gateway: once capture is off, the query goes there.
    wait_until(
        WAIT,
        "DNS no longer captured after the annotation turned it off",
        || {
            !pod.run(|| weir_tests::udp_request(resolver, "query"))
                .is_ok_and(|answer| {
                    answer
                        .response
                        .starts_with(weir_tests::ztunnel::DNS_REPLY_PREFIX)
                })
        },
    );
    assert!(ztunnel.pod(pod.uid()).is_some(), "the pod stays enrolled");
    agent.stop().unwrap();
}

/// An annotation made invalid on a running pod is reported as at ADD, once, and the pod keeps
/// the default.
#[test]
fn an_invalid_annotation_set_on_a_running_pod_is_one_warning_event() {
    let cluster = privileged!(Cluster::new());
    let (agent, _ztunnel, pod) = cluster.running_ambient_app();
    assert!(cluster.warnings("InvalidAmbientAnnotation").is_empty());

    let mut object: PodObject = cluster.api.get(MESH, "app").unwrap();
    object.metadata.annotations = map(&[(DNS_CAPTURE_ANNOTATION, "maybe")]);
    cluster.api.update(&object);
    let warnings = cluster.wait_for_warnings("InvalidAmbientAnnotation");
    let note = warnings[0]["note"].as_str().unwrap();
    assert!(
        note.contains("maybe") && note.contains("using true"),
        "{note}"
    );
    // Other changes to the pod reconcile it again; the same problem is not reported again.
    let mut object: PodObject = cluster.api.get(MESH, "app").unwrap();
    object.metadata.labels = map(&[("app", "x")]);
    let runs = Loop::Reconcile.runs(&agent, "change");
    cluster.api.update(&object);
    Loop::Reconcile.wait_for_runs(&agent, "change", runs, 1);
    assert_eq!(cluster.warnings("InvalidAmbientAnnotation").len(), 1);
    assert_eq!(
        agent.metrics().value(
            "weir_events_suppressed_total",
            &[("reason", "InvalidAmbientAnnotation")]
        ),
        None
    );
    // DNS capture stays on, the default.
    let resolver = SocketAddr::new(cluster.chain.test_node().gateway_v4().into(), DNS_PORT);
    let answer = pod.run(|| udp_request(resolver, "query")).unwrap();
    assert!(answer.response.starts_with(DNS_REPLY_PREFIX));
    agent.stop().unwrap();
}

/// Each invalid annotation of a running pod is its own Event, whatever was reported of the pod's
/// other annotations; the same problem met again within the window is not.
#[test]
fn each_invalid_annotation_of_a_running_pod_is_its_own_warning_event() {
    let cluster = privileged!(Cluster::new());
    let (agent, _ztunnel, pod) = cluster.running_ambient_app();
    let annotate = |annotations: &[(&str, &str)]| {
        let mut object: PodObject = cluster.api.get(MESH, "app").unwrap();
        object.metadata.annotations = map(annotations);
        cluster.api.update(&object);
    };
    let reason = "InvalidAmbientAnnotation";
    let count_warnings = |count: usize| {
        wait_until(WAIT, &format!("{count} {reason} Event(s)"), || {
            let warnings = cluster.warnings(reason);
            (warnings.len() >= count).then_some(warnings)
        })
    };

    annotate(&[(DNS_CAPTURE_ANNOTATION, "maybe")]);
    count_warnings(1);
    let dns_and_bypass = [
        (DNS_CAPTURE_ANNOTATION, "maybe"),
        (BYPASS_INBOUND_ANNOTATION, "perhaps"),
    ];
    annotate(&dns_and_bypass);
    let warnings = count_warnings(2);
    let note = warnings[1]["note"].as_str().unwrap();
    assert!(
        note.contains(BYPASS_INBOUND_ANNOTATION) && note.contains("perhaps"),
        "{note}"
    );

    // The runtime's CHECK decides again and meets both problems: within the window, neither is
    // published again, and both are counted.
    runtime_check(&cluster, &pod);
    assert_eq!(cluster.warnings(reason).len(), 2);
    assert_eq!(
        agent
            .metrics()
            .value("weir_events_suppressed_total", &[("reason", reason)]),
        Some(2.0)
    );
    agent.stop().unwrap();
}

#[test]
fn a_failing_pod_is_retried_when_its_backoff_expires() {
    let cluster = privileged!(Cluster::new());
    // Running by the API, but no process of the pod holds its network namespace yet: the
    // agent cannot find it.
    let (uid, pod) = cluster.pod_with_object(MESH, "late");
    cluster.set_running(MESH, "late", &ips_of(&pod));
    let agent = cluster.start_agent_with(|config| {
        cluster_config(config).resync_interval = Duration::from_secs(3600);
    });
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    let failed = cluster.wait_for_warnings("AmbientEnrollmentFailed");
    assert_eq!(failed[0]["regarding"]["name"], "late");

    // The pod's process starts; nothing changes in the API, and no full pass comes for an hour.
    let _process = PodProcess::start(pod.netns(), &uid, CgroupDriver::Systemd).unwrap();
    assert!(
        ztunnel.wait_for_pod(&uid, 3 * WAIT).is_some(),
        "enrolled once its backoff expired"
    );
    cluster.wait_for_redirection(MESH, "late", Some("enabled"));
    agent.stop().unwrap();
}
