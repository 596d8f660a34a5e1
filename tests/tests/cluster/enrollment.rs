//! How a pod's ADD is decided from the cluster's caches, and what the agent tells the cluster
//! of it: the redirection annotation, Events for bad annotations, istio-cni's metrics.
use super::*;

#[test]
fn add_decides_from_the_cluster_cache() {
    let cluster = privileged!(Cluster::new());
    cluster.pod_object(MESH, "app", |_| {});
    cluster.pod_object(MESH, "opted-out", |pod| {
        pod.metadata.labels = map(&[(DATAPLANE_MODE_LABEL, "none")]);
    });
    cluster.pod_object(MESH, "sidecar", |pod| {
        pod.metadata.annotations = map(&[(SIDECAR_STATUS_ANNOTATION, "{}")]);
    });
    cluster.pod_object(MESH, "host", |pod| {
        pod.spec.as_mut().unwrap().host_network = Some(true);
    });
    cluster.pod_object("istio-system", "ztunnel-x", |pod| {
        pod.metadata.labels = map(&[("app", "ztunnel"), (DATAPLANE_MODE_LABEL, "ambient")]);
    });
    cluster.pod_object("default", "labelled", |pod| {
        pod.metadata.labels = map(&[(DATAPLANE_MODE_LABEL, "ambient")]);
    });
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();

    for (namespace, name) in [(MESH, "app"), ("default", "labelled")] {
        let pod = cluster.pod(namespace, name).unwrap();
        assert!(
            ztunnel.wait_for_pod(pod.uid(), WAIT).is_some(),
            "{namespace}/{name} is ambient"
        );
    }
    for (namespace, name) in [
        (MESH, "opted-out"),
        (MESH, "sidecar"),
        (MESH, "host"),
        ("istio-system", "ztunnel-x"),
    ] {
        let pod = cluster.pod(namespace, name).unwrap();
        assert!(
            ztunnel.pod(pod.uid()).is_none(),
            "{namespace}/{name} is not ambient"
        );
        assert_eq!(cluster.redirection(namespace, name), None);
    }

    // Not in the API server: the agent looks a few times, then asks the runtime to retry.
    let error = cluster
        .pod(MESH, "ghost")
        .expect_err("a pod the agent does not know must not start");
    let message = format!("{error:#}");
    assert!(message.contains("not known to the agent yet"), "{message}");
    assert!(message.contains("11"), "try again later: {message}");

    // The plugin's fallback follows the cluster too.
    let verdicts: Value =
        serde_json::from_slice(&std::fs::read(&agent.config.verdict_cache).unwrap()).unwrap();
    assert_eq!(verdicts["ambient_namespaces"], serde_json::json!([MESH]));
    assert!(verdicts["opted_out_pods"]
        .as_array()
        .unwrap()
        .contains(&Value::from("mesh/opted-out")));
    agent.stop().unwrap();
}

/// A pod deleted and created again under the same name: until the new one reaches the agent's
/// cache, the cached namesake's labels never decide for it.
#[test]
fn add_never_decides_from_a_namesake_with_another_uid() {
    let cluster = privileged!(Cluster::new());
    cluster.pod_object(MESH, "app", |_| {});
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let namesake = cluster.chain.test_node().add_pod_with(PodSpec {
        namespace: MESH.into(),
        uid: Some("00000000-0000-0000-0000-00000000beef".into()),
        ..PodSpec::new("app")
    });
    let message = format!("{:#}", namesake.expect_err("the namesake must wait"));
    assert!(message.contains("not known to the agent yet"), "{message}");
    assert!(message.contains("11"), "try again later: {message}");
    assert!(ztunnel
        .pod("00000000-0000-0000-0000-00000000beef")
        .is_none());
    agent.stop().unwrap();
}

#[test]
fn redirection_annotation_follows_enrollment() {
    let cluster = privileged!(Cluster::new());
    cluster.pod_object(MESH, "app", |_| {});
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let pod = cluster.pod(MESH, "app").unwrap();
    ztunnel.wait_for_pod(pod.uid(), WAIT).unwrap();
    cluster.wait_for_redirection(MESH, "app", Some("enabled"));
    let status_patch = cluster.api.requests().into_iter().any(|request| {
        request.verb == "patch"
            && request.path.ends_with("/namespaces/mesh/pods/app/status")
            && request.content_type.as_deref() == Some("application/merge-patch+json")
    });
    assert!(status_patch, "a merge patch on pods/status");

    // The runtime's DELs unenroll the pod: the annotation goes.
    drop(pod);
    cluster.wait_for_redirection(MESH, "app", None);
    agent.stop().unwrap();
}

#[test]
fn invalid_annotation_is_one_warning_event_per_window() {
    let cluster = privileged!(Cluster::new());
    cluster.pod_object(MESH, "odd", |pod| {
        pod.metadata.annotations = map(&[(DNS_CAPTURE_ANNOTATION, "yes")]);
    });
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let pod = cluster.pod(MESH, "odd").expect("enrolled with the default");
    ztunnel.wait_for_pod(pod.uid(), WAIT).unwrap();
    let warnings = cluster.warnings("InvalidAmbientAnnotation");
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    let event = &warnings[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reportingController"], "weir");
    assert_eq!(event["regarding"]["name"], "odd");
    let note = event["note"].as_str().unwrap();
    assert!(
        note.contains(DNS_CAPTURE_ANNOTATION) && note.contains("using true"),
        "{note}"
    );

    // The runtime's CHECK decides again and meets the same annotation: no second Event.
    runtime_check(&cluster, &pod);
    // kube-rs's Recorder would fold a repeat into the same Event as a series (a PATCH); weir
    // does not write it at all.
    let event_writes = cluster
        .api
        .requests()
        .into_iter()
        .filter(|request| request.path.contains("/events"))
        .count();
    assert_eq!(event_writes, 1, "one Event write, not a series");
    assert_eq!(cluster.warnings("InvalidAmbientAnnotation").len(), 1);
    agent.stop().unwrap();
}

/// The metrics istio's dashboards and alerts read keep istio-cni's names, label names (as its
/// node agent registers them) and meaning: plugin ADDs by the status its agent answers, and the
/// informers' pod and namespace events by type.
#[test]
fn istio_cni_metrics_keep_istios_names_labels_and_meaning() {
    const ISTIO_CNI: &[(&str, &[&str])] = &[
        ("istio_cni_install_ready", &[]),
        ("istio_cni_installs_total", &["result"]),
        ("istio_cni_plugin_requests_total", &["response_code"]),
        ("nodeagent_reconcile_events_total", &["type"]),
        ("ztunnel_connected", &[]),
    ];
    let cluster = privileged!(Cluster::new());
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let events = |kind| {
        agent
            .metrics()
            .value("nodeagent_reconcile_events_total", &[("type", kind)])
            .unwrap_or_default()
    };
    let (adds, updates, deletes) = (events("add"), events("update"), events("delete"));
    assert!(adds >= 2.0, "the initial lists' namespaces: {adds}");

    let (uid, _pod) = cluster.pod_with_object(MESH, "dashboarded");
    ztunnel.wait_for_pod(&uid, WAIT).unwrap();
    cluster.wait_for_redirection(MESH, "dashboarded", Some("enabled"));
    cluster
        .api
        .delete::<PodObject>(MESH, "dashboarded")
        .expect("the pod existed");
    assert!(ztunnel.wait_for_del(&uid, WAIT), "ztunnel gets the Del");

    let metrics = agent.metrics();
    for (name, labels) in ISTIO_CNI {
        assert_eq!(
            metrics.label_names(name),
            [labels.to_vec()].into(),
            "{name}: {metrics}"
        );
    }
    assert!(
        metrics.value(
            "istio_cni_plugin_requests_total",
            &[("response_code", "200")]
        ) >= Some(1.0),
        "{metrics}"
    );
    assert!(events("add") > adds, "the pod created");
    assert!(events("update") > updates, "its status annotation");
    assert_eq!(events("delete"), deletes + 1.0, "the pod deleted");
    agent.stop().unwrap();
}
