//! The node condition `weir.dev/RedirectionReady` as a user sees it on the Node: the real agent
//! follows the API server stand-in (through a kubeconfig, as in `cluster.rs`) on a test node with
//! the real CNI chain and datapath. And deploy/node-readiness/'s `NodeReadinessRule`, read as the
//! Node Readiness Controller's CRD (readiness.node.x-k8s.io/v1alpha1) defines it, gates nodes on
//! the condition the agent writes.
use std::{path::Path, time::Duration};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{Node, NodeCondition, NodeStatus, Taint},
    },
    apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, Time},
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use weir_agent::{
    cluster::node_condition::CONDITION_TYPE, config::AgentConfig, policy::PolicyConfig,
};
use weir_tests::{
    agent::{http_status, Agent},
    chain::CniChainNode,
    privileged, wait_until, ApiServer,
};

const WAIT: Duration = Duration::from_secs(10);
const NODE_NAME: &str = "node-a";

fn time(rfc3339: &str) -> Time {
    Time(rfc3339.parse().unwrap())
}

fn condition(type_: &str, status: &str, reason: &str, at: &str) -> NodeCondition {
    NodeCondition {
        type_: type_.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(format!("{type_} is {status}")),
        last_heartbeat_time: Some(time(at)),
        last_transition_time: Some(time(at)),
    }
}

/// What the kubelet reports of a healthy node.
fn kubelet_conditions() -> Vec<NodeCondition> {
    let at = "2020-01-01T00:00:00Z";
    vec![
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory", at),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure", at),
        condition("PIDPressure", "False", "KubeletHasSufficientPID", at),
        condition("Ready", "True", "KubeletReady", at),
    ]
}

/// A node of a cluster: its Node object in the stand-in, with the kubelet's conditions (and
/// weir's, when an earlier agent left one), and the node where the agent runs.
struct ClusterNode {
    api: ApiServer,
    chain: CniChainNode,
    // Dropped last: the stand-in serves on it.
    _runtime: tokio::runtime::Runtime,
}

impl ClusterNode {
    fn new(left_by_an_earlier_agent: Option<NodeCondition>) -> anyhow::Result<Self> {
        let chain = CniChainNode::new()?;
        let runtime = tokio::runtime::Runtime::new()?;
        let api = runtime.block_on(ApiServer::start())?;
        let mut conditions = kubelet_conditions();
        conditions.extend(left_by_an_earlier_agent);
        api.create(&Node {
            metadata: ObjectMeta {
                name: Some(NODE_NAME.into()),
                ..ObjectMeta::default()
            },
            status: Some(NodeStatus {
                conditions: Some(conditions),
                ..NodeStatus::default()
            }),
            ..Node::default()
        });
        Ok(Self {
            api,
            chain,
            _runtime: runtime,
        })
    }

    /// weir's DaemonSet, selecting every node: a stopping agent leaves weir in place for the
    /// next one, as in an upgrade. Without it, a stopping agent removes weir from the node.
    fn daemonset(&self) {
        let own = PolicyConfig::default().own;
        self.api.create(&DaemonSet {
            metadata: ObjectMeta {
                name: Some(own.daemonset),
                namespace: Some(own.namespace),
                ..ObjectMeta::default()
            },
            ..DaemonSet::default()
        });
    }

    fn agent_config(&self) -> AgentConfig {
        let netns = self.chain.test_node().netns();
        (self.chain.files)
            .cluster_agent_config(netns, &self.api, NODE_NAME)
            .unwrap()
    }

    fn conditions(&self) -> Vec<NodeCondition> {
        let node: Node = self.api.get("", NODE_NAME).unwrap();
        node.status.unwrap().conditions.unwrap_or_default()
    }

    /// The Node's conditions but weir's.
    fn others(&self) -> Vec<NodeCondition> {
        let mut others = self.conditions();
        others.retain(|condition| condition.type_ != CONDITION_TYPE);
        others
    }

    fn ours(&self) -> Option<NodeCondition> {
        let mut conditions = self.conditions().into_iter();
        conditions.find(|condition| condition.type_ == CONDITION_TYPE)
    }

    /// weir's condition, once its reason is `reason`.
    fn wait_for_reason(&self, reason: &str) -> NodeCondition {
        wait_until(
            WAIT,
            &format!("{CONDITION_TYPE} with reason {reason}"),
            || {
                self.ours()
                    .filter(|ours| ours.reason.as_deref() == Some(reason))
            },
        )
    }

    /// Every condition the agent wrote, in order, each checked to be a strategic merge patch on
    /// the Node's status holding weir's condition alone.
    fn written(&self) -> Vec<NodeCondition> {
        let status_path = format!("/api/v1/nodes/{NODE_NAME}/status");
        let patches = self.api.requests().into_iter();
        let patches = patches.filter(|request| request.method == "PATCH");
        patches
            .map(|patch| {
                assert_eq!(patch.path, status_path);
                assert_eq!(
                    patch.content_type.as_deref(),
                    Some("application/strategic-merge-patch+json")
                );
                let body = patch.body.expect("a JSON patch");
                let Value::Array(conditions) = &body["status"]["conditions"] else {
                    panic!("a patch of the conditions: {body}");
                };
                let only_conditions = serde_json::json!({ "status": { "conditions": conditions } });
                assert_eq!(body, only_conditions, "nothing but the conditions");
                let [ours] = &conditions[..] else {
                    panic!("one condition: {body}");
                };
                let ours: NodeCondition = serde_json::from_value(ours.clone()).unwrap();
                assert_eq!(ours.type_, CONDITION_TYPE);
                ours
            })
            .collect()
    }
}

fn status_and_reason(condition: &NodeCondition) -> (&str, &str) {
    (
        condition.status.as_str(),
        condition.reason.as_deref().unwrap_or_default(),
    )
}

#[test]
fn the_condition_is_true_once_the_agent_is_ready_and_false_once_weir_leaves_the_node() {
    let node = privileged!(ClusterNode::new(None));
    let agent = Agent::start(node.agent_config()).unwrap();
    let ready = node.wait_for_reason("AgentReady");
    assert_eq!(ready.status, "True");
    assert!(ready.message.is_some_and(|m| !m.is_empty()));
    assert!(ready.last_heartbeat_time.is_some());
    assert!(ready.last_transition_time.is_some());
    assert_eq!(
        node.others(),
        kubelet_conditions(),
        "the kubelet's untouched"
    );

    // No DaemonSet selects the node: the stopping agent removes weir.
    agent.stop().unwrap();
    let stopped = node.ours().expect("the condition stays");
    assert_eq!(status_and_reason(&stopped), ("False", "Uninstalled"));
    assert!(stopped.last_transition_time >= ready.last_transition_time);
    assert_eq!(
        node.others(),
        kubelet_conditions(),
        "the kubelet's untouched"
    );
    let written = node.written();
    let [first, .., last] = &written[..] else {
        panic!("a write at start and one at stop: {written:#?}")
    };
    assert_eq!(first.status, "False", "not ready at start: {first:?}");
    assert_eq!(last, &stopped);
}

/// An agent stopping for an upgrade says so, and the next one keeps the condition's
/// transition time while it stays False, until it is ready.
#[test]
fn an_upgrade_leaves_it_false_until_the_next_agent_is_ready() {
    let left = condition(
        CONDITION_TYPE,
        "False",
        "AgentRestarting",
        "2020-01-01T00:00:00Z",
    );
    let node = privileged!(ClusterNode::new(Some(left.clone())));
    node.daemonset();
    let agent = Agent::start(node.agent_config()).unwrap();
    let ready = node.wait_for_reason("AgentReady");
    assert_eq!(ready.status, "True");
    assert_ne!(ready.last_transition_time, left.last_transition_time);
    let first = node.written().remove(0);
    assert_eq!(first.status, "False", "not ready at start: {first:?}");
    assert_eq!(
        first.last_transition_time, left.last_transition_time,
        "still False since the earlier agent stopped"
    );
    assert_ne!(first.last_heartbeat_time, left.last_heartbeat_time);

    agent.stop().unwrap();
    let stopped = node.ours().unwrap();
    assert_eq!(status_and_reason(&stopped), ("False", "AgentRestarting"));
    assert!(stopped.last_transition_time >= ready.last_transition_time);
    assert_eq!(
        node.others(),
        kubelet_conditions(),
        "the kubelet's untouched"
    );
}

/// Until the primary CNI writes its config, weir's plugin cannot be chained: the node is not
/// ready for ambient pods, and the condition says why, as long as `/readyz` says not ready.
#[test]
fn the_condition_says_when_the_cni_config_is_missing() {
    let node = privileged!(ClusterNode::new(None));
    let conflist = node.chain.files.net_dir().join("10-weir-test.conflist");
    let aside = conflist.with_extension("aside");
    std::fs::rename(&conflist, &aside).unwrap();
    let agent = Agent::spawn(node.agent_config()).unwrap();
    let missing = node.wait_for_reason("CNIPluginNotInstalled");
    assert_eq!(missing.status, "False");
    assert_eq!(
        http_status(agent.config.health_addr, "/readyz").unwrap(),
        503
    );

    std::fs::rename(&aside, &conflist).unwrap();
    agent.wait_ready(WAIT).unwrap();
    let ready = node.wait_for_reason("AgentReady");
    assert_eq!(ready.status, "True");
    assert!(ready.last_transition_time >= missing.last_transition_time);
    agent.stop().unwrap();
}

// ---------------------------------------------------------------------------------------------
// deploy/node-readiness/

/// A NodeReadinessRule as readiness.node.x-k8s.io/v1alpha1's CRD defines it (the fields users
/// set); an unknown or misplaced field fails to parse.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NodeReadinessRule {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: RuleSpec,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RuleSpec {
    conditions: Vec<ConditionRequirement>,
    taint: Taint,
    enforcement_mode: String,
    node_selector: LabelSelector,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    dry_run: bool,
}

#[derive(Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ConditionRequirement {
    r#type: String,
    required_status: String,
}

/// A taint key: an optional DNS subdomain prefix and `/`, then a name of at most 63 characters
/// (alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric), as the API server validates
/// a Node's taints.
fn is_qualified_name(key: &str) -> bool {
    let (prefix, name) = key.split_once('/').unwrap_or(("", key));
    let alnum_ends = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
    };
    let prefix_ok = prefix.is_empty()
        || (prefix.len() <= 253
            && prefix.split('.').all(|label| {
                alnum_ends(label)
                    && label
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            }));
    let name_ok = name.len() <= 63
        && alnum_ends(name)
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    prefix_ok && name_ok
}

#[test]
fn the_example_rule_gates_weirs_nodes_on_the_condition_the_agent_writes() {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let text =
        std::fs::read_to_string(deploy.join("node-readiness/weir-readiness-rule.yaml")).unwrap();
    let document: Value = serde_norway::from_str(&text).unwrap();
    let rule: NodeReadinessRule = serde_json::from_value(document.clone()).unwrap();
    assert_eq!(
        serde_json::to_value(&rule).unwrap(),
        document,
        "every field read"
    );
    assert_eq!(rule.api_version, "readiness.node.x-k8s.io/v1alpha1");
    assert_eq!(rule.kind, "NodeReadinessRule");
    assert!(rule.metadata.name.is_some());
    let spec = &rule.spec;
    assert_eq!(
        spec.conditions,
        [ConditionRequirement {
            r#type: CONDITION_TYPE.into(),
            required_status: "True".into(),
        }]
    );
    assert!(is_qualified_name(&spec.taint.key), "{:?}", spec.taint.key);
    assert!(!is_qualified_name("readiness.k8s.io/example.com/not-ready"));
    assert!(["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&spec.taint.effect.as_str()));
    assert!(["bootstrap-only", "continuous"].contains(&spec.enforcement_mode.as_str()));
    assert!(!spec.dry_run);

    // The controller refuses an empty selector; one that picks nodes weir does not run on
    // would keep them tainted for good.
    let weir_yaml = std::fs::read_to_string(deploy.join("weir.yaml")).unwrap();
    let daemonset = serde_norway::Deserializer::from_str(&weir_yaml)
        .map(|document| Value::deserialize(document).unwrap())
        .find(|object| object["kind"] == "DaemonSet")
        .unwrap();
    let daemonset: DaemonSet = serde_json::from_value(daemonset).unwrap();
    let runs_on = daemonset.spec.template.spec.unwrap().node_selector;
    assert!(runs_on.as_ref().is_some_and(|labels| !labels.is_empty()));
    assert_eq!(spec.node_selector.match_labels, runs_on);
    assert_eq!(spec.node_selector.match_expressions, None);
}
