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

mod agent_life;
mod enrollment;
mod iptables_legacy;
mod repair;
mod running_pods;
mod sidecar_repair;
mod takeover;

const WAIT: Duration = Duration::from_secs(5);
const NODE_NAME: &str = "node-a";
const MESH: &str = "mesh";
/// istio-cni's count of the broken pods the agent repaired, by `type` and `result`.
const REPAIRED: &str = "istio_cni_repair_pods_repaired_total";

/// The agent's reconcile loop, and its repair of sidecar pods: each counts its runs by trigger.
#[derive(Clone, Copy)]
enum Loop {
    Reconcile,
    SidecarRepair,
}

impl Loop {
    /// The loop's runs started by `trigger` (`change`, `pass`) so far.
    fn runs(self, agent: &Agent, trigger: &str) -> f64 {
        let metric = match self {
            Loop::Reconcile => "weir_reconcile_runs_total",
            Loop::SidecarRepair => "weir_sidecar_repair_runs_total",
        };
        (agent.metrics())
            .value(metric, &[("trigger", trigger)])
            .unwrap_or(0.0)
    }

    /// Waits until the loop has made `more` runs started by `trigger` than `since` (from
    /// [`Loop::runs`]): what it did in them is done.
    fn wait_for_runs(self, agent: &Agent, trigger: &str, since: f64, more: u32) {
        let wanted = since + f64::from(more);
        wait_until(
            WAIT,
            &format!("{more} more {trigger} runs of the loop"),
            || self.runs(agent, trigger) >= wanted,
        );
    }
}

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

    /// An agent, and a ztunnel connected to it.
    fn start_agent_and_ztunnel(&self) -> (Agent, ZdsZtunnel) {
        let agent = self.start_agent();
        let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).expect("ztunnel connects");
        (agent, ztunnel)
    }

    /// An agent, a ztunnel connected to it, and pod `app` of the mesh namespace enrolled,
    /// running and reported redirected.
    fn running_ambient_app(&self) -> (Agent, ZdsZtunnel, weir_tests::Pod) {
        let (agent, ztunnel) = self.start_agent_and_ztunnel();
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

    /// Marks the pod running at `ips` through the status subresource, as kubelet reports it:
    /// the agent's annotation, written meanwhile, stays.
    fn set_running(&self, namespace: &str, name: &str, ips: &[String]) {
        self.api
            .patch_status::<PodObject>(namespace, name, &running_at(ips));
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
