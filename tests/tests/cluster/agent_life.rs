//! The agent's own life on a node: starting, stopping for an upgrade or for good, restarting
//! with stale pods, watches that drop, the CNI config rewritten behind its back.
use super::*;

#[test]
fn sigterm_keeps_weir_only_while_its_daemonset_selects_the_node() {
    let cluster = privileged!(Cluster::new());
    cluster.daemonset();
    cluster.start_agent().stop().unwrap();
    assert!(cluster.plugin_installed(), "an upgrade keeps the plugin");

    // The node leaves the DaemonSet's selection: the next agent to stop removes weir.
    let agent = cluster.start_agent();
    let mut node: NodeObject = cluster.api.get("", NODE_NAME).unwrap();
    node.metadata.labels = map(&[]);
    cluster.api.update(&node);
    agent.stop().unwrap();
    assert!(!cluster.plugin_installed(), "weir left the node");
}

/// An API server that does not serve access reviews leaves the agent's access unverified, not
/// denied: the agent starts (a denial refuses: check.rs).
#[test]
fn an_agent_whose_access_cannot_be_reviewed_starts() {
    let cluster = privileged!(Cluster::new());
    cluster.api.serve_no_access_reviews();
    let agent = cluster.start_agent();
    let reviews_asked = cluster
        .api
        .requests()
        .iter()
        .any(|request| request.path.ends_with("/selfsubjectaccessreviews"));
    assert!(reviews_asked, "the agent asked for an access review");
    agent.stop().unwrap();
}

#[test]
fn changes_made_while_the_watches_are_down_are_not_lost() {
    let cluster = privileged!(Cluster::new());
    // A namespace listed after the mesh's, so that the relist brings the change before its end.
    cluster.api.create(&Namespace {
        metadata: meta(None, "observability", &[]),
        ..Namespace::default()
    });
    // Only the watches may apply the change: no full pass comes during the test.
    let agent = cluster.start_agent_with(|config| {
        cluster_config(config).resync_interval = Duration::from_secs(3600);
    });
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    let (uid, _pod) = cluster.pod_with_object(MESH, "app");
    ztunnel.wait_for_pod(&uid, WAIT).unwrap();
    let lists_before = cluster
        .api
        .requests()
        .iter()
        .filter(|request| request.verb == "list")
        .count();

    // As an API server restart: the streams end, and no resourceVersion handed out so far can be
    // resumed from. The namespace leaves the mesh meanwhile. The relist then comes a namespace a
    // page, seconds apart, so the agent holds the changed namespace long before the list is
    // whole: only what it does at the list's end decides the test.
    cluster.api.limit_pages(1, Duration::from_millis(1500));
    cluster.api.expire_history();
    cluster.api.drop_watches();
    cluster.api.update(&Namespace {
        metadata: meta(None, MESH, &[]),
        ..Namespace::default()
    });

    // The watcher backs off before it relists (kube's default backoff, from 0.8 s with jitter),
    // the pages take seconds, and a loaded machine stretches both: a deadline for a change that
    // must come, not a speed.
    assert!(
        ztunnel.wait_for_del(&uid, 4 * WAIT),
        "the relist shows the namespace left the mesh"
    );
    cluster.wait_for_redirection(MESH, "app", None);
    let relists = cluster
        .api
        .requests()
        .iter()
        .filter(|request| request.verb == "list")
        .count()
        - lists_before;
    assert!(relists > 0, "the reflectors relisted after 410");
    agent.stop().unwrap();
}

#[test]
fn a_restarted_agent_is_ready_only_once_stale_pods_are_gone() {
    let cluster = privileged!(Cluster::new());
    // With its DaemonSet selecting the node, a stopping agent leaves weir in place (an upgrade).
    cluster.daemonset();
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let names = ["stays", "deleted", "opted-out"];
    let mut pods = Vec::new();
    for name in names {
        let (uid, pod) = cluster.pod_with_object(MESH, name);
        ztunnel.wait_for_pod(&uid, WAIT).unwrap();
        pods.push((uid, pod));
    }
    agent.stop().unwrap();
    drop(ztunnel);

    // While no agent runs: one pod leaves the API, another opts out.
    cluster.api.delete::<PodObject>(MESH, "deleted").unwrap();
    let mut opted_out: PodObject = cluster.api.get(MESH, "opted-out").unwrap();
    opted_out.metadata.labels = map(&[(DATAPLANE_MODE_LABEL, "none")]);
    cluster.api.update(&opted_out);

    // Ready means reconciled: at the first 200 from /readyz, only the live ambient pod is held.
    let agent = cluster.start_agent();
    let state = weir_agent::state::read(&agent.config.state_file).unwrap();
    assert!(
        state.contains_key(&pods[0].0),
        "the live ambient pod is kept"
    );
    for (name, (uid, _)) in names.iter().zip(&pods).skip(1) {
        assert!(!state.contains_key(uid), "{name} is gone before ready");
    }
    assert_eq!(
        cluster.redirection(MESH, "opted-out"),
        None,
        "the opted-out pod's annotation is removed"
    );
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    assert!(ztunnel.wait_for_pod(&pods[0].0, WAIT).is_some());
    agent.stop().unwrap();
}

/// An agent restart (an upgrade) leaves running pods' annotations alone: they stay redirected
/// and are handed back to ztunnel, so `enabled` never flaps to `pending` and back.
#[test]
fn a_restart_writes_no_annotation_for_pods_that_stay_enabled() {
    let cluster = privileged!(Cluster::new());
    cluster.daemonset();
    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    let (uid, _pod) = cluster.pod_with_object(MESH, "app");
    ztunnel.wait_for_pod(&uid, WAIT).unwrap();
    cluster.wait_for_redirection(MESH, "app", Some("enabled"));
    agent.stop().unwrap();
    drop(ztunnel);
    let status_writes = || {
        cluster
            .api
            .requests()
            .into_iter()
            .filter(|request| request.verb == "patch" && request.path.ends_with("/pods/app/status"))
            .count()
    };
    let before = status_writes();

    let (agent, ztunnel) = cluster.start_agent_and_ztunnel();
    assert!(ztunnel.wait_for_pod(&uid, WAIT).is_some(), "handed back");
    // The first pass, and the one that follows ztunnel's connection.
    Loop::Reconcile.wait_for_runs(&agent, "pass", 0.0, 2);
    assert_eq!(status_writes(), before, "no annotation write for the pod");
    assert_eq!(cluster.redirection(MESH, "app").as_deref(), Some("enabled"));
    agent.stop().unwrap();
}

#[test]
fn ztunnel_gets_its_snapshot_only_once_the_startup_pass_is_done() {
    let cluster = privileged!(Cluster::new());
    // A pod the startup pass enrolls (it started while weir-cni was missing).
    let (uid, pod) = cluster.pod_with_object(MESH, "app");
    cluster.set_running(MESH, "app", &ips_of(&pod));
    let _process = PodProcess::start(pod.netns(), &uid, CgroupDriver::Cgroupfs).unwrap();
    // Without the namespaces the caches cannot sync, so the pass cannot run.
    cluster.api.withhold_lists::<Namespace>();
    let agent = Agent::spawn(cluster.agent_config()).unwrap();
    let ztunnel = wait_until(WAIT, "the agent's ZDS socket", || {
        ZdsZtunnel::connect(&agent.config.zds_socket).ok()
    });

    // The agent has the hello and holds the snapshot: sent now, it would name no pod, and
    // ztunnel would drop every pod it runs.
    wait_for_metric(&agent, "weir_zds_held_snapshots", &[], 1.0);
    assert_eq!(ztunnel.events(), Vec::new(), "no snapshot before the pass");
    assert_ne!(
        http_status(agent.config.health_addr, "/readyz").ok(),
        Some(200)
    );

    cluster.api.answer_lists::<Namespace>();
    agent.wait_ready(2 * WAIT).unwrap();
    assert!(ztunnel.wait_for_snapshot(WAIT));
    let events = ztunnel.events();
    let added = events
        .iter()
        .position(|event| matches!(event, ZdsEvent::Add { uid: added, .. } if *added == uid));
    let sent = events
        .iter()
        .position(|event| *event == ZdsEvent::SnapshotSent);
    assert!(
        added.is_some() && added < sent,
        "the snapshot names the pod the pass enrolled: {events:?}"
    );
    cluster.wait_for_redirection(MESH, "app", Some("enabled"));
    agent.stop().unwrap();
}

#[test]
fn a_rewritten_cni_config_is_an_event_on_the_agents_pod() {
    let cluster = privileged!(Cluster::new());
    let agent = cluster.start_agent_with(|config| {
        config.policy.own.pod_name = Some("weir-x1".into());
    });
    // Another component writes the conflist again, without weir-cni.
    let file = cluster.chain.files.net_dir().join("10-weir-test.conflist");
    let mut conflist: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    conflist["plugins"]
        .as_array_mut()
        .unwrap()
        .retain(|plugin| plugin["type"] != "weir-cni");
    std::fs::write(&file, serde_json::to_vec_pretty(&conflist).unwrap()).unwrap();

    let rewritten = cluster.wait_for_warnings("CniConfigRewritten");
    assert!(cluster.plugin_installed(), "weir-cni is back in the chain");
    assert_eq!(rewritten.len(), 1, "{rewritten:#?}");
    let event = &rewritten[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reportingController"], "weir");
    assert_eq!(event["reportingInstance"], "weir-x1");
    assert_eq!(event["regarding"]["namespace"], "istio-system");
    assert_eq!(event["regarding"]["name"], "weir-x1");
    let note = event["note"].as_str().unwrap();
    assert!(note.contains(&file.display().to_string()), "{note}");
    wait_for_metric(&agent, "weir_cni_config_rewrites_total", &[], 1.0);
    agent.stop().unwrap();
}

/// The config rewritten while no agent ran (during an upgrade, say): the next agent puts
/// weir-cni back, and says so as when it runs.
#[test]
fn a_config_rewritten_while_the_agent_was_away_is_an_event_too() {
    let cluster = privileged!(Cluster::new());
    // With its DaemonSet selecting the node, a stopping agent leaves weir in place.
    cluster.daemonset();
    let own_pod = |config: &mut AgentConfig| config.policy.own.pod_name = Some("weir-x1".into());
    cluster.start_agent_with(own_pod).stop().unwrap();
    assert!(cluster.warnings("CniConfigRewritten").is_empty());
    let file = cluster.chain.files.net_dir().join("10-weir-test.conflist");
    let mut conflist: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    conflist["plugins"]
        .as_array_mut()
        .unwrap()
        .retain(|plugin| plugin["type"] != "weir-cni");
    std::fs::write(&file, serde_json::to_vec_pretty(&conflist).unwrap()).unwrap();

    let agent = cluster.start_agent_with(own_pod);
    assert!(cluster.plugin_installed(), "weir-cni is back in the chain");
    let rewritten = cluster.wait_for_warnings("CniConfigRewritten");
    assert_eq!(rewritten.len(), 1, "{rewritten:#?}");
    wait_for_metric(&agent, "weir_cni_config_rewrites_total", &[], 1.0);
    agent.stop().unwrap();
}
