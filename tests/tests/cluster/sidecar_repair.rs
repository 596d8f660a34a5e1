//! Sidecar pods whose istio-validation found no redirection: told apart as istio's repair
//! controller does, repaired in place once, or deleted or labelled.
use super::*;

/// The init container istio's injector adds to sidecar pods when its CNI is on: it probes the
/// redirection, and exits 126 without it.
const VALIDATION: &str = "istio-validation";

/// Where istio-cni's sidecar rules send a sidecar pod's outbound TCP: its Envoy's listener.
const ENVOY_OUTBOUND_PORT: u16 = 15001;

/// A pod as istio's injector leaves it with its CNI on: the status annotation, istio-validation
/// first among the init containers, and istio-proxy beside the app, running as 1337.
fn sidecar_injected(pod: &mut PodObject) {
    let status = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;
    pod.metadata.annotations = map(&[(SIDECAR_STATUS_ANNOTATION, status)]);
    let proxy_user = || {
        Some(SecurityContext {
            run_as_user: Some(1337),
            run_as_group: Some(1337),
            run_as_non_root: Some(true),
            ..SecurityContext::default()
        })
    };
    let args = |args: &[&str]| Some(args.iter().map(|arg| arg.to_string()).collect());
    let spec = pod.spec.as_mut().unwrap();
    spec.init_containers = Some(vec![Container {
        name: VALIDATION.into(),
        args: args(&[
            "istio-iptables",
            "-p",
            "15001",
            "-z",
            "15006",
            "-u",
            "1337",
            "-m",
            "REDIRECT",
            "-i",
            "*",
            "-x",
            "",
            "-b",
            "*",
            "-d",
            "15090,15021,15020",
            "--run-validation",
            "--skip-rule-apply",
        ]),
        security_context: proxy_user(),
        ..Container::default()
    }]);
    spec.containers = vec![
        Container {
            name: "app".into(),
            ..Container::default()
        },
        Container {
            name: "istio-proxy".into(),
            args: args(&[
                "proxy",
                "sidecar",
                "--domain",
                "$(POD_NAMESPACE).svc.cluster.local",
            ]),
            security_context: proxy_user(),
            ..Container::default()
        },
    ];
}

/// A terminated container's state, with kubelet's reason for its exit code.
fn exited(exit_code: i32) -> ContainerState {
    let reason = if exit_code == 0 { "Completed" } else { "Error" };
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code,
            reason: Some(reason.into()),
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    }
}

/// Waiting for its next restart, as kubelet backs off a crashing container.
fn crash_looping() -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some("CrashLoopBackOff".into()),
            ..ContainerStateWaiting::default()
        }),
        ..ContainerState::default()
    }
}

/// The pod's status as kubelet reports it at `ips` once its init container `name` exited with
/// `last_exit` `restarts` times, and is now `now`.
fn init_failed(
    ips: &[String],
    name: &str,
    last_exit: i32,
    now: ContainerState,
    restarts: i32,
) -> k8s_openapi::api::core::v1::PodStatus {
    k8s_openapi::api::core::v1::PodStatus {
        phase: Some("Pending".into()),
        init_container_statuses: Some(vec![ContainerStatus {
            name: name.into(),
            state: Some(now),
            last_state: Some(exited(last_exit)),
            restart_count: restarts,
            ..ContainerStatus::default()
        }]),
        ..running_at(ips)
    }
}

/// A sidecar pod on the node whose istio-validation found no redirection, as kubelet reports it
/// after its first restart.
fn broken_sidecar_pod(cluster: &Cluster, name: &str) {
    cluster.pod_object("default", name, |pod| {
        sidecar_injected(pod);
        pod.status = Some(init_failed(
            &["10.255.0.8".into()],
            VALIDATION,
            126,
            crash_looping(),
            1,
        ));
    });
}

/// With in-place repair off, the configured action acts on broken sidecar pods directly.
fn repair_off(action: BrokenPodAction) -> impl FnOnce(&mut AgentConfig) {
    move |config| {
        cluster_config(config).broken_pods = BrokenPods {
            repair_in_place: false,
            action,
        }
    }
}

#[test]
fn a_broken_sidecar_pod_is_deleted_when_in_place_repair_is_off() {
    let cluster = privileged!(Cluster::new());
    broken_sidecar_pod(&cluster, "web");
    let object: PodObject = cluster.api.get("default", "web").unwrap();
    let agent = cluster.start_agent_with(repair_off(BrokenPodAction::Delete));

    let deleted = cluster.wait_for_warnings("DeleteBrokenPod");
    assert_eq!(deleted.len(), 1, "{deleted:#?}");
    let event = &deleted[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reportingController"], "cni-repair");
    assert_eq!(event["regarding"]["name"], "web");
    let note = event["note"].as_str().unwrap();
    assert!(
        note.contains(VALIDATION) && note.contains("deleted"),
        "{note}"
    );
    assert!(cluster.api.get::<PodObject>("default", "web").is_none());
    let delete = cluster
        .api
        .requests()
        .into_iter()
        .find(|request| request.verb == "delete")
        .expect("a DELETE");
    assert_eq!(delete.path, "/api/v1/namespaces/default/pods/web");
    let preconditions = &delete.body.expect("DeleteOptions")["preconditions"];
    assert_eq!(preconditions["uid"], object.metadata.uid.unwrap().as_str());
    wait_for_metric(
        &agent,
        REPAIRED,
        &[("type", "delete"), ("result", "success")],
        1.0,
    );
    let metrics = agent.metrics();
    for result in ["success", "fail"] {
        let in_place = [("type", "repair"), ("result", result)];
        assert_eq!(
            metrics.value(REPAIRED, &in_place),
            None,
            "no in-place repair"
        );
    }
    agent.stop().unwrap();
}

#[test]
fn a_broken_sidecar_pod_is_labelled_when_in_place_repair_is_off() {
    let cluster = privileged!(Cluster::new());
    broken_sidecar_pod(&cluster, "web");
    let agent = cluster.start_agent_with(repair_off(BrokenPodAction::Label));

    let labelled = cluster.wait_for_warnings("LabelBrokenPod");
    assert_eq!(labelled.len(), 1, "{labelled:#?}");
    assert_eq!(labelled[0]["type"], "Warning");
    assert_eq!(labelled[0]["reportingController"], "cni-repair");
    assert_eq!(labelled[0]["regarding"]["name"], "web");
    let object: PodObject = cluster.api.get("default", "web").unwrap();
    let labels = object.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels.get(UNINITIALIZED_LABEL).map(String::as_str),
        Some("true")
    );
    let through_status = cluster.api.requests().into_iter().any(|request| {
        request.verb == "patch"
            && request.path == "/api/v1/namespaces/default/pods/web/status"
            && request
                .body
                .as_ref()
                .is_some_and(|body| body["metadata"]["labels"][UNINITIALIZED_LABEL] == "true")
    });
    assert!(through_status, "labelled through pods/status");
    wait_for_metric(
        &agent,
        REPAIRED,
        &[("type", "label"), ("result", "success")],
        1.0,
    );
    // Met again with its label (the patch's own watch event), it is not labelled again.
    wait_for_metric(
        &agent,
        REPAIRED,
        &[("type", "label"), ("result", "skip")],
        1.0,
    );
    assert!(cluster.api.get::<PodObject>("default", "web").is_some());
    agent.stop().unwrap();
}

/// Starts an agent that deletes broken sidecar pods, with one such pod beside the pods under
/// test, and returns once it has deleted that one: by then it has met every pod at least once.
fn delete_broken_sidecar_pods_beside_others(cluster: &Cluster) -> weir_tests::agent::Agent {
    broken_sidecar_pod(cluster, "broken");
    let agent = cluster.start_agent_with(repair_off(BrokenPodAction::Delete));
    let deleted = cluster.wait_for_warnings("DeleteBrokenPod");
    assert_eq!(deleted[0]["regarding"]["name"], "broken");
    wait_until(WAIT, "the broken pod deleted", || {
        cluster.api.get::<PodObject>("default", "broken").is_none()
    });
    // The rest of the pass that deleted it.
    Loop::SidecarRepair.wait_for_runs(&agent, "pass", 0.0, 1);
    agent
}

#[test]
fn a_sidecar_pod_whose_validation_passed_since_is_left_alone() {
    let cluster = privileged!(Cluster::new());
    // Exited 126 once, then passed: the rules came in time for its second run.
    cluster.pod_object("default", "passed", |pod| {
        sidecar_injected(pod);
        pod.status = Some(init_failed(
            &["10.255.0.9".into()],
            VALIDATION,
            126,
            exited(0),
            1,
        ));
    });
    let agent = delete_broken_sidecar_pods_beside_others(&cluster);

    assert!(cluster.api.get::<PodObject>("default", "passed").is_some());
    let deleted = cluster.warnings("DeleteBrokenPod");
    assert_eq!(deleted.len(), 1, "only the broken pod: {deleted:#?}");
    let deletes = [("type", "delete"), ("result", "success")];
    assert_eq!(agent.metrics().value(REPAIRED, &deletes), Some(1.0));
    agent.stop().unwrap();
}

#[test]
fn a_failing_init_container_is_no_broken_sidecar_pod_without_istios_markers() {
    let cluster = privileged!(Cluster::new());
    // Not a sidecar pod: an init container of its own named alike fails with the same code.
    cluster.pod_object("default", "plain", |pod| {
        pod.spec.as_mut().unwrap().init_containers = Some(vec![Container {
            name: VALIDATION.into(),
            ..Container::default()
        }]);
        pod.status = Some(init_failed(
            &["10.255.0.10".into()],
            VALIDATION,
            126,
            crash_looping(),
            3,
        ));
    });
    // A sidecar pod whose own init container fails, istio-validation having passed.
    cluster.pod_object("default", "own-init", |pod| {
        sidecar_injected(pod);
        let mut status = init_failed(
            &["10.255.0.11".into()],
            "migrate-db",
            126,
            crash_looping(),
            2,
        );
        status.init_container_statuses.as_mut().unwrap().insert(
            0,
            ContainerStatus {
                name: VALIDATION.into(),
                state: Some(exited(0)),
                ..ContainerStatus::default()
            },
        );
        pod.status = Some(status);
    });
    let agent = delete_broken_sidecar_pods_beside_others(&cluster);

    for name in ["plain", "own-init"] {
        assert!(
            cluster.api.get::<PodObject>("default", name).is_some(),
            "{name} is left alone"
        );
    }
    assert_eq!(cluster.warnings("DeleteBrokenPod").len(), 1);
    assert!(cluster.warnings("LabelBrokenPod").is_empty());
    agent.stop().unwrap();
}

/// Repaired in place (istio's default): the pod is enrolled in sidecar mode where it runs, its
/// outbound TCP reaches its own proxy from then on, and ztunnel never hears of it.
#[test]
fn a_broken_sidecar_pod_is_repaired_in_place_once() {
    let cluster = privileged!(Cluster::new());
    cluster.pod_object("default", "web", sidecar_injected);
    // Wired while weir-cni is missing from the node's chain.
    let pod = cluster.pod("default", "web").unwrap();
    let uid = pod.uid().to_owned();
    let _process = PodProcess::start(pod.netns(), &uid, CgroupDriver::Cgroupfs).unwrap();
    let proxy = EchoServer::start(
        pod.netns(),
        "istio-proxy",
        (std::net::Ipv6Addr::UNSPECIFIED, ENVOY_OUTBOUND_PORT).into(),
    )
    .unwrap();
    let server = cluster.pod("default", "server").unwrap();
    let echo = EchoServer::app(&server).unwrap();
    let target = server.app_v4();
    let reply = pod.run(|| tcp_request(target, "before")).unwrap();
    assert_eq!(
        reply.response,
        echo.reply_to("before"),
        "not redirected yet"
    );
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();

    // istio-validation found no redirection and waits for its restart.
    let broken = |restarts| {
        let mut object: PodObject = cluster.api.get("default", "web").unwrap();
        object.status = Some(init_failed(
            &ips_of(&pod),
            VALIDATION,
            126,
            crash_looping(),
            restarts,
        ));
        cluster.api.update(&object);
    };
    broken(1);
    let repaired = cluster.wait_for_warnings("RepairedPod");
    assert_eq!(repaired.len(), 1, "{repaired:#?}");
    assert_eq!(repaired[0]["reportingController"], "cni-repair");
    assert_eq!(repaired[0]["regarding"]["uid"], uid.as_str());
    wait_for_metric(
        &agent,
        REPAIRED,
        &[("type", "repair"), ("result", "success")],
        1.0,
    );
    let reply = pod.run(|| tcp_request(target, "after")).unwrap();
    assert_eq!(reply.response, proxy.reply_to("after"), "to its own proxy");
    assert!(ztunnel.pod(&uid).is_none(), "not ambient");
    assert_eq!(cluster.redirection("default", "web"), None);

    // Still broken until istio-validation runs again: not repaired twice.
    let runs = Loop::SidecarRepair.runs(&agent, "change");
    broken(2);
    Loop::SidecarRepair.wait_for_runs(&agent, "change", runs, 1);
    let attempts = agent
        .metrics()
        .value(REPAIRED, &[("type", "repair"), ("result", "success")]);
    assert_eq!(attempts, Some(1.0));
    // The reconcile loop leaves the sidecar pod's redirection alone.
    let reply = pod.run(|| tcp_request(target, "later")).unwrap();
    assert_eq!(reply.response, proxy.reply_to("later"));
    agent.stop().unwrap();
}
