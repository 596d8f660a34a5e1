//! weir-agent following a cluster: the API server stand-in holds the namespaces, pods, weir's
//! DaemonSet and the node; the agent reads them through its reflectors (kube-rs, via a
//! kubeconfig file), and pods are made by the node's real CNI chain with the real datapath and
//! the ztunnel stand-in, as in `cni.rs`.
use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use k8s_openapi::api::{
    apps::v1::{DaemonSet, DaemonSetSpec},
    core::v1::{
        Container, ContainerState, ContainerStateTerminated, ContainerStateWaiting,
        ContainerStatus, Namespace, Node as NodeObject, Pod as PodObject, PodSpec as PodObjectSpec,
        PodTemplateSpec, SecurityContext,
    },
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;
use weir_agent::{
    cluster::{
        repair::{BrokenPodAction, BrokenPods},
        ClusterConfig,
    },
    config::{AgentConfig, SourceConfig},
    policy::{
        BYPASS_INBOUND_ANNOTATION, DATAPLANE_MODE_LABEL, DNS_CAPTURE_ANNOTATION,
        REDIRECTION_ANNOTATION, SIDECAR_STATUS_ANNOTATION,
    },
    report::UNINITIALIZED_LABEL,
};
use weir_common::{DNS_PORT, OUTBOUND_PORT};
use weir_tests::privileged;
use weir_tests::{
    agent::{http_status, Agent},
    cgroup::{CgroupDriver, PodProcess},
    chain::{wait_for_metric, weir_conflist, CniChainNode},
    cni::Command,
    tcp_request, udp_request,
    ztunnel::DNS_REPLY_PREFIX,
    ApiServer, EchoServer, PodSpec, ZdsEvent, ZdsZtunnel,
};
use weir_tests::{try_wait_until, wait_until};

const WAIT: Duration = Duration::from_secs(5);
const NODE_NAME: &str = "node-a";
const MESH: &str = "mesh";
/// istio-cni's count of the broken pods the agent repaired, by `type` and `result`.
const REPAIRED: &str = "istio_cni_repair_pods_repaired_total";

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
/// `istio-system`, the Node object, and the node, where the agent follows the stand-in.
struct Cluster {
    api: ApiServer,
    /// The node; its datapath is removed when dropped.
    chain: CniChainNode,
    // Dropped last: the stand-in serves on it.
    _runtime: tokio::runtime::Runtime,
}

impl Cluster {
    fn new() -> anyhow::Result<Self> {
        let chain = CniChainNode::new()?;
        let runtime = tokio::runtime::Runtime::new()?;
        let api = runtime.block_on(ApiServer::start())?;
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
        Ok(Self {
            api,
            chain,
            _runtime: runtime,
        })
    }

    fn start_agent(&self) -> Agent {
        self.start_agent_with(|_| {})
    }

    /// An agent, a ztunnel connected to it, and pod `app` of the mesh namespace enrolled,
    /// running and reported redirected.
    fn running_ambient_app(&self) -> (Agent, ZdsZtunnel, weir_tests::Pod) {
        let agent = self.start_agent();
        let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
        let (uid, pod) = self.pod_with_object(MESH, "app");
        ztunnel.wait_for_pod(&uid, WAIT).unwrap();
        self.set_running(MESH, "app", &ips_of(&pod));
        self.wait_for_redirection(MESH, "app", Some("enabled"));
        (agent, ztunnel, pod)
    }

    /// The agent, configured as `edit` changes the usual configuration.
    fn start_agent_with(&self, edit: impl FnOnce(&mut AgentConfig)) -> Agent {
        let mut config = self.agent_config();
        edit(&mut config);
        Agent::start(config).expect("agent ready once its caches synced")
    }

    fn agent_config(&self) -> AgentConfig {
        self.chain
            .files
            .cluster_agent_config(self.chain.test_node().netns(), &self.api, NODE_NAME)
            .unwrap()
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
    /// A sandbox for the pod, under the uid of its object when the API server has one.
    fn pod(&self, namespace: &str, name: &str) -> anyhow::Result<weir_tests::Pod> {
        let object: Option<PodObject> = self.api.get(namespace, name);
        self.chain.test_node().add_pod_with(PodSpec {
            namespace: namespace.into(),
            uid: object.and_then(|object| object.metadata.uid),
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
            .chain
            .test_node()
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
        let done = || self.redirection(namespace, name).as_deref() == wanted;
        if try_wait_until(WAIT, done).is_none() {
            panic!(
                "{namespace}/{name}: redirection {:?}, wanted {wanted:?}",
                self.redirection(namespace, name)
            );
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

    fn plugin_installed(&self) -> bool {
        self.chain.files.bin_dir().join("weir-cni").exists()
            && weir_conflist(&self.chain)
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

    /// The Events with `reason`, once there is one.
    fn wait_for_warnings(&self, reason: &str) -> Vec<Value> {
        wait_until(WAIT, &format!("a {reason} Event"), || {
            let warnings = self.warnings(reason);
            (!warnings.is_empty()).then_some(warnings)
        })
    }

    /// Marks the pod running at `ips`, as kubelet reports it.
    fn set_running(&self, namespace: &str, name: &str, ips: &[String]) {
        let mut object: PodObject = self.api.get(namespace, name).unwrap();
        object.status = Some(running_at(ips));
        self.api.update(&object);
    }
}

/// The cluster part of an agent's configuration.
fn cluster_config(config: &mut AgentConfig) -> &mut ClusterConfig {
    match &mut config.source {
        SourceConfig::Cluster(cluster) => cluster,
        SourceConfig::File(_) => unreachable!("a cluster agent follows the API server"),
    }
}

fn ips_of(pod: &weir_tests::Pod) -> [String; 2] {
    [pod.ipv4().to_string(), pod.ipv6().to_string()]
}

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

/// A pod deleted and created again under the same name: until the new one reaches the agent's
/// cache, the cached namesake's labels never decide for it.
#[test]
fn add_never_decides_from_a_namesake_with_another_uid() {
    let cluster = privileged!(Cluster::new());
    cluster.pod_object(MESH, "app", |_| {});
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    let cluster = privileged!(Cluster::new());
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
    // Seen out of the mesh before: flipped in by its namespace's label, not a repair.
    assert_eq!(cluster.warnings("RepairedPod"), Vec::<Value>::new());
    let repairs = [("type", "repair"), ("result", "success")];
    assert_eq!(agent.metrics().value(REPAIRED, &repairs), None);
    agent.stop().unwrap();
}

#[test]
fn opt_out_deletion_and_completion_remove_running_pods_live() {
    let cluster = privileged!(Cluster::new());
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
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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

/// kubelet's order for a pod going away: deletionTimestamp, then the sandbox stops (CNI DEL)
/// while the object still says Running with its IPs. Likewise a sandbox that died and waits for
/// its successor's ADD. Neither is a broken pod: nothing is repaired or reported.
#[test]
fn a_pod_whose_sandbox_is_gone_is_neither_repaired_nor_reported() {
    let cluster = privileged!(Cluster::new());
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    // Whatever the reconcile loop does with these pods, it does at once on the watch events.
    std::thread::sleep(Duration::from_secs(2));
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
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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

    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    assert!(ztunnel.wait_for_pod(&uid, WAIT).is_some(), "handed back");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(status_writes(), before, "no annotation write for the pod");
    assert_eq!(cluster.redirection(MESH, "app").as_deref(), Some("enabled"));
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

    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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
    cluster.api.update(&object);
    std::thread::sleep(Duration::from_millis(500));
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
fn a_pod_that_started_without_weir_cni_is_repaired_live_with_an_event() {
    let cluster = privileged!(Cluster::new());
    // Bound to the node, and wired while weir-cni is missing from the node's chain (the agent
    // has not put it there yet): the real bridge plugin only.
    let (uid, pod) = cluster.pod_with_object(MESH, "app");
    let _process = PodProcess::start(pod.netns(), &uid, CgroupDriver::Cgroupfs).unwrap();
    let server = cluster.pod("default", "server").unwrap();
    let echo = EchoServer::app(&server).unwrap();
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();

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
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
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

    // Time for a snapshot that must not come: it would name no pod, and ztunnel would drop
    // every pod it runs.
    std::thread::sleep(Duration::from_millis(500));
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
    std::thread::sleep(Duration::from_millis(500));
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
    let agent = cluster.start_agent();
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();

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
    broken(2);
    std::thread::sleep(Duration::from_secs(1));
    let attempts = agent
        .metrics()
        .value(REPAIRED, &[("type", "repair"), ("result", "success")]);
    assert_eq!(attempts, Some(1.0));
    // The reconcile loop leaves the sidecar pod's redirection alone.
    let reply = pod.run(|| tcp_request(target, "later")).unwrap();
    assert_eq!(reply.response, proxy.reply_to("later"));
    agent.stop().unwrap();
}

/// The runtime's CNI CHECK of `pod` through weir's plugin, which must pass.
fn runtime_check(cluster: &Cluster, pod: &weir_tests::Pod) {
    let runtime = pod.runtime_conf();
    let list = weir_conflist(&cluster.chain);
    let weir = list.plugins.last().unwrap();
    let config = list.plugin_config(weir, runtime, Some(pod.prev_result()));
    let binary = weir_tests::cni::find_plugin(weir, &runtime.path).unwrap();
    weir_tests::cni::invoke(
        &binary,
        Command::Check,
        runtime,
        &config,
        cluster.chain.test_node().netns(),
    )
    .expect("CHECK passes");
}

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
    take_over_from_istio_cni(false);
}

/// The same, with weir's agent restarted while the pods wait for ztunnel (killed midway): the
/// new agent names them in its snapshots again, from the cluster's word alone.
#[test]
fn a_takeover_from_istio_cni_survives_a_restart_midway() {
    take_over_from_istio_cni(true);
}

fn take_over_from_istio_cni(restart_midway: bool) {
    use weir_agent::datapath::{istio_rules::IstioRules, netlink::Rtnl};
    use weir_common::INBOUND_PORT;
    use weir_tests::istio_cni::{self, IstioCniAgent};
    use weir_tests::traffic::exchange_line;
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
    let istio = IstioCniAgent::start(&config.zds_socket).unwrap();
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
    let conflist = cluster.chain.files.net_dir().join("10-weir-test.conflist");
    let mut chain: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    chain["plugins"]
        .as_array_mut()
        .unwrap()
        .push(istio_cni::plugin_entry());
    std::fs::write(&conflist, serde_json::to_vec_pretty(&chain).unwrap()).unwrap();

    let held_in = client
        .run(|| std::net::TcpStream::connect(app.app_v4()))
        .unwrap();
    let held_out = app
        .run(|| std::net::TcpStream::connect(server.app_v4()))
        .unwrap();
    let exchange = |stream: &std::net::TcpStream, echo: &EchoServer, line: &str| {
        assert_eq!(
            exchange_line(stream, line).unwrap(),
            echo.reply_to(line),
            "{line}"
        );
    };
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
    for (direction, connections) in [("in", loop_in.stop()), ("out", loop_out.stop())] {
        let failed: Vec<_> = connections.iter().filter(|c| c.outcome.is_err()).collect();
        assert!(failed.is_empty(), "{direction}: {failed:?}");
    }
    let events = ztunnel.events();
    assert!(
        events.iter().all(|event| !matches!(
            event,
            ZdsEvent::Del { uid: dropped } | ZdsEvent::Drained { uid: dropped } if *dropped == uid
        )),
        "{events:?}"
    );
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
    agent.stop().unwrap();
}
