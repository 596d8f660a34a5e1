//! weir-agent following a cluster: the API server stand-in holds the namespaces, pods, weir's
//! DaemonSet and the node; the agent reads them through its reflectors (kube-rs, via a
//! kubeconfig file), and pods are made by the node's real CNI chain with the real datapath and
//! the ztunnel stand-in, as in `cni.rs`.
use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::{
    apps::v1::{DaemonSet, DaemonSetSpec},
    core::v1::{
        Namespace, Node as NodeObject, Pod as PodObject, PodSpec as PodObjectSpec, PodTemplateSpec,
    },
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;
use weir_agent::policy::{
    DATAPLANE_MODE_LABEL, DNS_CAPTURE_ANNOTATION, REDIRECTION_ANNOTATION, SIDECAR_STATUS_ANNOTATION,
};
use weir_tests::{
    agent::{Agent, NodeFiles},
    cni::{Command, NetworkConfigList},
    ApiServer, Fixture, PodSpec, ZdsZtunnel,
};

const WAIT: Duration = Duration::from_secs(5);
const NODE_NAME: &str = "node-a";
const MESH: &str = "mesh";

fn map(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, String>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// A pod's status once kubelet reports it running at `ips`.
fn running_at(ips: &[String]) -> k8s_openapi::api::core::v1::PodStatus {
    k8s_openapi::api::core::v1::PodStatus {
        phase: Some("Running".into()),
        pod_ips: Some(
            ips.iter()
                .map(|ip| k8s_openapi::api::core::v1::PodIP { ip: ip.clone() })
                .collect(),
        ),
        ..Default::default()
    }
}

fn meta(namespace: Option<&str>, name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: namespace.map(Into::into),
        labels: map(labels),
        ..ObjectMeta::default()
    }
}

/// A node of a cluster: the stand-in with the namespaces `mesh` (ambient), `default` and
/// `istio-system`, the Node object, and the node's files and network.
struct Cluster {
    api: ApiServer,
    files: NodeFiles,
    /// The node; its datapath is removed when dropped.
    node: Fixture,
    // Dropped last: the stand-in serves on it.
    _runtime: tokio::runtime::Runtime,
}

impl Cluster {
    fn privileged() -> Option<Self> {
        let files = NodeFiles::new().unwrap();
        let node = Fixture::privileged_with(files.node_options())?;
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let api = runtime.block_on(ApiServer::start()).unwrap();
        api.create(&Namespace {
            metadata: meta(None, MESH, &[(DATAPLANE_MODE_LABEL, "ambient")]),
            ..Namespace::default()
        });
        for namespace in ["default", "istio-system"] {
            api.create(&Namespace {
                metadata: meta(None, namespace, &[]),
                ..Namespace::default()
            });
        }
        api.create(&NodeObject {
            metadata: meta(None, NODE_NAME, &[("weir", "yes")]),
            ..NodeObject::default()
        });
        Some(Self {
            api,
            files,
            node,
            _runtime: runtime,
        })
    }

    fn start_agent(&self) -> Agent {
        let config = self
            .files
            .cluster_agent_config(self.node.node().netns(), &self.api, NODE_NAME)
            .unwrap();
        Agent::start(config).expect("agent ready once its caches synced")
    }

    /// The pod object on this node, as the scheduler would have bound it.
    fn pod_object(&self, namespace: &str, name: &str, edit: impl FnOnce(&mut PodObject)) {
        let mut pod = PodObject {
            metadata: meta(Some(namespace), name, &[]),
            spec: Some(PodObjectSpec {
                node_name: Some(NODE_NAME.into()),
                ..PodObjectSpec::default()
            }),
            ..PodObject::default()
        };
        edit(&mut pod);
        self.api.create(&pod);
    }

    /// The pod made by the node's CNI chain.
    fn pod(&self, namespace: &str, name: &str) -> anyhow::Result<weir_tests::Pod> {
        self.node.node().add_pod_with(PodSpec {
            namespace: namespace.into(),
            ..PodSpec::new(name)
        })
    }

    /// The pod object and its sandbox, made by the node's CNI chain under the uid the API
    /// server gave the object, as kubelet names it.
    fn pod_with_object(&self, namespace: &str, name: &str) -> (String, weir_tests::Pod) {
        self.pod_object(namespace, name, |_| {});
        let object: PodObject = self.api.get(namespace, name).unwrap();
        let uid = object.metadata.uid.unwrap();
        let pod = self
            .node
            .node()
            .add_pod_with(PodSpec {
                namespace: namespace.into(),
                uid: Some(uid.clone()),
                ..PodSpec::new(name)
            })
            .unwrap();
        (uid, pod)
    }

    fn redirection(&self, namespace: &str, name: &str) -> Option<String> {
        let pod: PodObject = self.api.get(namespace, name)?;
        pod.metadata
            .annotations?
            .get(REDIRECTION_ANNOTATION)
            .cloned()
    }

    fn wait_for_redirection(&self, namespace: &str, name: &str, wanted: Option<&str>) {
        let deadline = std::time::Instant::now() + WAIT;
        while self.redirection(namespace, name).as_deref() != wanted {
            assert!(
                std::time::Instant::now() < deadline,
                "{namespace}/{name}: redirection {:?}, wanted {wanted:?}",
                self.redirection(namespace, name)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// weir's DaemonSet in istio-system, its pods selecting nodes labelled `weir=yes`.
    fn daemonset(&self) {
        self.api.create(&DaemonSet {
            metadata: meta(Some("istio-system"), "weir", &[]),
            spec: DaemonSetSpec {
                template: PodTemplateSpec {
                    spec: Some(PodObjectSpec {
                        node_selector: map(&[("weir", "yes")]),
                        ..PodObjectSpec::default()
                    }),
                    ..PodTemplateSpec::default()
                },
                ..DaemonSetSpec::default()
            },
            ..DaemonSet::default()
        });
    }

    fn conflist(&self) -> NetworkConfigList {
        let conflist: Value = serde_json::from_slice(
            &std::fs::read(self.files.net_dir().join("10-weir-test.conflist")).unwrap(),
        )
        .unwrap();
        NetworkConfigList::from_json(&conflist).unwrap()
    }

    fn plugin_installed(&self) -> bool {
        self.files.bin_dir().join("weir-cni").exists()
            && self
                .conflist()
                .plugins
                .iter()
                .any(|p| p["type"] == "weir-cni")
    }

    fn warnings(&self, reason: &str) -> Vec<Value> {
        self.api
            .events()
            .into_iter()
            .filter(|event| event["reason"] == reason)
            .collect()
    }
}

#[test]
fn add_decides_from_the_cluster_cache() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
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
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();

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

#[test]
fn redirection_annotation_follows_enrollment() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
    cluster.pod_object(MESH, "app", |_| {});
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
    cluster.pod_object(MESH, "odd", |pod| {
        pod.metadata.annotations = map(&[(DNS_CAPTURE_ANNOTATION, "yes")]);
    });
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    let runtime = pod.runtime_conf();
    let list = cluster.conflist();
    let weir = list.plugins.last().unwrap();
    let config = list.plugin_config(weir, runtime, Some(pod.prev_result()));
    let binary = weir_tests::cni::find_plugin(weir, &runtime.path).unwrap();
    weir_tests::cni::invoke(
        &binary,
        Command::Check,
        runtime,
        &config,
        cluster.node.node().netns(),
    )
    .expect("CHECK passes");
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

#[test]
fn sigterm_keeps_weir_only_while_its_daemonset_selects_the_node() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
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

#[test]
fn namespace_label_enrolls_and_removes_a_running_pod() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
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
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    agent.stop().unwrap();
}

#[test]
fn opt_out_deletion_and_completion_remove_running_pods_live() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    let names = ["opting-out", "deleted", "completed"];
    let mut running = Vec::new();
    for name in names {
        let (uid, pod) = cluster.pod_with_object(MESH, name);
        ztunnel.wait_for_pod(&uid, WAIT).unwrap();
        cluster.wait_for_redirection(MESH, name, Some("enabled"));
        running.push((uid, pod));
    }
    let recorded = |uid: &str| {
        let state = std::fs::read_to_string(&agent.config.state_file).unwrap_or_default();
        state.contains(uid)
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
    let deadline = std::time::Instant::now() + WAIT;
    while running.iter().any(|(uid, _)| recorded(uid)) {
        assert!(
            std::time::Instant::now() < deadline,
            "the state file still records a removed pod"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    cluster.wait_for_redirection(MESH, "opting-out", None);
    agent.stop().unwrap();
}

#[test]
fn changes_made_while_the_watches_are_down_are_not_lost() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
    let agent = cluster.start_agent();
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
    // resumed from. The namespace leaves the mesh meanwhile.
    cluster.api.expire_history();
    cluster.api.drop_watches();
    cluster.api.update(&Namespace {
        metadata: meta(None, MESH, &[]),
        ..Namespace::default()
    });

    assert!(
        ztunnel.wait_for_del(&uid, WAIT),
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
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
    // With its DaemonSet selecting the node, a stopping agent leaves weir in place (an upgrade).
    cluster.daemonset();
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    let state = std::fs::read_to_string(&agent.config.state_file).unwrap();
    assert!(state.contains(&pods[0].0), "the live ambient pod is kept");
    for (name, (uid, _)) in names.iter().zip(&pods).skip(1) {
        assert!(!state.contains(uid.as_str()), "{name} is gone before ready");
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

#[test]
fn a_pod_that_cannot_be_enrolled_stops_neither_readiness_nor_the_others() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
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

    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    assert!(
        ztunnel.wait_for_pod(&uid, WAIT).is_some(),
        "the healthy pod is enrolled"
    );
    cluster.wait_for_redirection(MESH, "healthy", Some("enabled"));
    let deadline = std::time::Instant::now() + WAIT;
    let failed = loop {
        let failed = cluster.warnings("AmbientEnrollmentFailed");
        if !failed.is_empty() || std::time::Instant::now() > deadline {
            break failed;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(failed.len(), 1, "{failed:#?}");
    assert_eq!(failed[0]["regarding"]["name"], "broken");
    assert_eq!(cluster.redirection(MESH, "broken"), None);
    agent.stop().unwrap();
}

#[test]
fn an_annotation_change_applies_to_a_running_pod() {
    let Some(cluster) = Cluster::privileged() else {
        return;
    };
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    let (_, pod) = cluster.pod_with_object(MESH, "app");
    ztunnel.wait_for_pod(pod.uid(), WAIT).unwrap();
    let resolver = std::net::SocketAddr::new(
        cluster.node.node().gateway_v4().into(),
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
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        // Nothing answers DNS on the node's gateway: once capture is off, the query goes there.
        match pod.run(|| weir_tests::udp_request(resolver, "query")) {
            Ok(answer)
                if answer
                    .response
                    .starts_with(weir_tests::ztunnel::DNS_REPLY_PREFIX) =>
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "DNS still captured after the annotation turned it off"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => break,
        }
    }
    assert!(ztunnel.pod(pod.uid()).is_some(), "the pod stays enrolled");
    agent.stop().unwrap();
}
