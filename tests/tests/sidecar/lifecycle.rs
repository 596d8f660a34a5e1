//! A sidecar pod's enrollment over its life: a bad annotation refused by name, DEL leaving no
//! entry, the agent's restart keeping it redirected, a user-namespaced proxy known by its ids.
use super::*;

#[test]
fn an_invalid_sidecar_annotation_fails_the_add_naming_it() {
    let bad = sidecar_pod(&[("sidecar.istio.io/interceptionMode", "NONE")], &[]);
    let Some(node) = Node::with_sidecar_pods(&[("bad", bad)]) else {
        return;
    };
    let agent = node.start_agent();
    let failed = node
        .test_node()
        .try_add_pod(PodSpec {
            namespace: "default".into(),
            ..PodSpec::new("bad")
        })
        .unwrap()
        .expect_err("the ADD fails");
    let error = format!("{:#}", failed.error);
    assert!(
        error.contains("sidecar.istio.io/interceptionMode"),
        "{error}"
    );
    let failed_pods = [("mode", "sidecar"), ("state", "failed")];
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value("weir_pods", &failed_pods),
        Some(1.0),
        "{metrics}"
    );
    // The runtime tears the sandbox down with a DEL: the pod is no longer a failure to see.
    drop(failed);
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value("weir_pods", &failed_pods),
        Some(0.0),
        "{metrics}"
    );
    agent.stop().unwrap();
}

#[test]
fn del_unenrolls_a_sidecar_pod_and_leaves_no_entry() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    // 15020, 15021, 15090 inbound; 15020 outbound.
    assert_eq!(port_entries(&node, &pod), 4);
    weir_only(
        &node,
        Command::Del,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .unwrap();
    assert_eq!(port_entries(&node, &pod), 0);
    assert_eq!(run_validation(&pod), 126, "the pod is no longer redirected");
    agent.stop().unwrap();
}

/// The pod stays redirected while no agent runs; the next agent takes it back from the pinned
/// maps without telling ztunnel of it, and a DEL then removes every entry of its lists, which
/// that agent had to find in the maps.
#[test]
fn a_restart_keeps_a_sidecar_pod_redirected_and_away_from_ztunnel() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    agent.stop().unwrap();
    assert_eq!(run_validation(&pod), 0, "redirected while no agent runs");

    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    assert!(ztunnel.wait_for_snapshot(WAIT));
    let named = ztunnel
        .events()
        .into_iter()
        .any(|e| e.uid() == Some(pod.uid()));
    assert!(!named, "ztunnel never hears of a sidecar pod");
    let listed = listed_pods(&agent);
    let row = listed.iter().find(|row| row["uid"] == pod.uid()).unwrap();
    assert_eq!(row["mode"], "sidecar", "{row:#}");
    assert_eq!(run_validation(&pod), 0);

    weir_only(
        &node,
        Command::Del,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .unwrap();
    assert_eq!(port_entries(&node, &pod), 0);
    assert_eq!(run_validation(&pod), 126);
    agent.stop().unwrap();
}

/// The pod's entries in the pinned `SIDECAR_PORTS`, as bpftool would find them.
fn port_entries(node: &Node, pod: &Pod) -> usize {
    let cookie = pod.netns().cookie().unwrap();
    let map = node.test_node().pinned_map(maps::SIDECAR_PORTS).unwrap();
    let ports: aya::maps::HashMap<_, PortKey, u8> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(map)).unwrap();
    ports
        .keys()
        .filter_map(Result::ok)
        .filter(|key| key.netns_cookie == cookie)
        .count()
}

/// A pod in a user namespace of its own (`hostUsers: false`): its proxy and istio-validation
/// run as 1337 there, which the node sees as another id. weir maps the proxy's ids through the
/// pod's maps: istio-validation passes as the pod's 1337, and the node's 1337, which is nobody
/// in the pod, is not taken for the proxy.
#[test]
fn a_user_namespaced_pods_proxy_is_known_by_its_ids_in_the_pod() {
    let Some(node) = Node::with_sidecar_pods(&[("userns", sidecar_pod(&[], &[]))]) else {
        return;
    };
    let agent = node.start_agent();
    let pod = node
        .test_node()
        .add_pod_with(PodSpec {
            namespace: "default".into(),
            user_namespace: Some(100_000),
            ..PodSpec::new("userns")
        })
        .unwrap();
    assert_eq!(run_validation_in(&pod, true), 0, "as the pod's proxy");
    assert_eq!(run_validation_in(&pod, false), 126, "as the node's 1337");
    agent.stop().unwrap();
}
