//! The node condition [`CONDITION_TYPE`] on this node's Node: `True` while the agent redirects
//! the node's pods (the moment `/readyz` answers 200), `False` with the reason otherwise, so that
//! a controller that taints nodes by their conditions (Kubernetes' Node Readiness Controller, with
//! a `NodeReadinessRule`) keeps new pods off a node until weir serves it.
//!
//! Written with a strategic merge patch on the `nodes/status` subresource holding this one
//! condition: the API server merges a Node's conditions by `type`, so the kubelet's own conditions
//! and every other reporter's are left as they are. The agent writes on every change of its
//! readiness and, unchanged, every [`HEARTBEAT_INTERVAL`] (`lastHeartbeatTime`), as node agents
//! refresh theirs; `lastTransitionTime` moves only when the status does, across agents too (the
//! first write reads the one already on the Node).
use std::{sync::Arc, time::Duration};

use anyhow::{Context, Result};
use k8s_openapi::{
    api::core::v1::{Node, NodeCondition},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    api::{Api, Patch, PatchParams},
    Client,
};
use tokio::sync::{watch, Mutex};
use tracing::{info, warn};

use crate::readiness::Readiness;

/// The condition's type: weir's domain, and what it says of the node.
pub const CONDITION_TYPE: &str = "weir.dev/RedirectionReady";

/// How often an unchanged condition is written again, with a new `lastHeartbeatTime`: the
/// kubelet's own rate for unchanged node status (`nodeStatusReportFrequency`).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5 * 60);

/// One request to the API server; also what the agent's stop waits at most per request.
const API_TIMEOUT: Duration = Duration::from_secs(2);
/// A failed write is retried after this, doubling up to [`RETRY_MAX`]; a change of readiness is
/// written at once.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// What the condition says: its status, reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub ready: bool,
    /// CamelCase, for machines.
    pub reason: &'static str,
    /// For people.
    pub message: &'static str,
}

impl Condition {
    pub fn of(readiness: Readiness) -> Self {
        match readiness {
            Readiness::Ready => Self {
                ready: true,
                reason: "AgentReady",
                message: "weir-agent redirects this node's pods: its caches are synced, its first \
                          reconcile pass is done and its CNI plugin is in the node's CNI config",
            },
            Readiness::Starting => Self {
                ready: false,
                reason: "AgentStarting",
                message: "weir-agent is starting: waiting for its caches to sync and its first \
                          reconcile pass",
            },
            Readiness::PluginNotInstalled => Self {
                ready: false,
                reason: "CNIPluginNotInstalled",
                message: "weir's CNI plugin is not in the node's CNI config: the primary CNI has \
                          written no config yet, or installing failed (the agent's log says \
                          which); new ambient pods would start without redirection",
            },
        }
    }

    /// What an agent that stops leaves: `removed`, weir left the node (its DaemonSet no longer
    /// runs here, or `--uninstall-on-exit`); otherwise the next agent takes over (an upgrade).
    pub fn stopped(removed: bool) -> Self {
        if removed {
            Self {
                ready: false,
                reason: "Uninstalled",
                message: "weir was removed from this node: its CNI plugin and the redirection of \
                          pods are gone",
            }
        } else {
            Self {
                ready: false,
                reason: "AgentRestarting",
                message: "weir-agent stopped and the next one takes over (an upgrade or a \
                          restart): running pods stay redirected, new ambient pods wait for it",
            }
        }
    }

    fn status(&self) -> &'static str {
        if self.ready {
            "True"
        } else {
            "False"
        }
    }
}

/// The status and transition time of the condition on the Node, as last read or written.
#[derive(Clone, Debug)]
enum OnNode {
    /// Not read yet, or not known since a write that got no answer: the next write reads it.
    Unread,
    Absent,
    Present {
        status: String,
        since: Option<Time>,
    },
}

/// Writes the condition to the Node `node_name`. Cheap to clone; clones share what they wrote.
#[derive(Clone)]
pub struct NodeConditionWriter {
    nodes: Api<Node>,
    node_name: String,
    heartbeat_interval: Duration,
    /// Held through each write, so that writes never cross and each knows the one before.
    on_node: Arc<Mutex<OnNode>>,
}

impl NodeConditionWriter {
    pub fn new(client: &Client, node_name: &str, heartbeat_interval: Duration) -> Self {
        Self {
            nodes: Api::all(client.clone()),
            node_name: node_name.to_owned(),
            heartbeat_interval,
            on_node: Arc::new(Mutex::new(OnNode::Unread)),
        }
    }

    /// Writes the condition `readiness` calls for, at once and whenever it changes, and again
    /// every heartbeat interval; retries a failed write with backoff. Returns when `readiness`'s
    /// sender is gone.
    pub async fn follow(self, mut readiness: watch::Receiver<Readiness>) {
        let mut retry = RETRY_MIN;
        loop {
            let condition = Condition::of(*readiness.borrow_and_update());
            let next_write = match self.write(&condition).await {
                Ok(()) => {
                    retry = RETRY_MIN;
                    self.heartbeat_interval
                }
                Err(error) => {
                    let wait = retry;
                    warn!(
                        node = self.node_name,
                        "writing node condition {CONDITION_TYPE}: {error:#}; retrying in {wait:?}"
                    );
                    retry = (retry * 2).min(RETRY_MAX);
                    wait
                }
            };
            tokio::select! {
                changed = readiness.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(next_write) => {}
            }
        }
    }

    /// The condition an agent leaves as it stops ([`Condition::stopped`]); a failure is logged,
    /// never holds the stop for long.
    pub async fn write_stopped(&self, removed: bool) {
        let condition = Condition::stopped(removed);
        match self.write(&condition).await {
            Ok(()) => info!(
                reason = condition.reason,
                "node condition {CONDITION_TYPE} set to False"
            ),
            Err(error) => warn!(
                node = self.node_name,
                "writing node condition {CONDITION_TYPE} at stop: {error:#}"
            ),
        }
    }

    async fn write(&self, condition: &Condition) -> Result<()> {
        let mut on_node = self.on_node.lock().await;
        if let OnNode::Unread = *on_node {
            *on_node = self.read().await?;
        }
        let now = Time(Timestamp::now());
        let since = match &*on_node {
            OnNode::Present { status, since } if status == condition.status() => since.clone(),
            _ => Some(now.clone()),
        };
        let written = NodeCondition {
            type_: CONDITION_TYPE.to_owned(),
            status: condition.status().to_owned(),
            reason: Some(condition.reason.to_owned()),
            message: Some(condition.message.to_owned()),
            last_heartbeat_time: Some(now),
            last_transition_time: since.clone(),
        };
        let patch = Patch::Strategic(serde_json::json!({ "status": { "conditions": [written] } }));
        let params = PatchParams::default();
        let request = self.nodes.patch_status(&self.node_name, &params, &patch);
        // Unknown until the API server answers: a write cut short (its task stopped at
        // shutdown, no answer in time) may have been applied, and the next write must not take
        // its transition time from what the Node held before it.
        *on_node = OnNode::Unread;
        tokio::time::timeout(API_TIMEOUT, request)
            .await
            .with_context(|| format!("no answer within {API_TIMEOUT:?}"))?
            .with_context(|| format!("patching the status of node {}", self.node_name))?;
        *on_node = OnNode::Present {
            status: condition.status().to_owned(),
            since,
        };
        Ok(())
    }

    /// The condition as the Node holds it now, left by an earlier agent or none.
    async fn read(&self) -> Result<OnNode> {
        let node = tokio::time::timeout(API_TIMEOUT, self.nodes.get(&self.node_name))
            .await
            .with_context(|| format!("no answer within {API_TIMEOUT:?}"))?
            .with_context(|| format!("reading node {}", self.node_name))?;
        let conditions = node.status.and_then(|status| status.conditions);
        let ours = conditions
            .into_iter()
            .flatten()
            .find(|condition| condition.type_ == CONDITION_TYPE);
        Ok(match ours {
            Some(condition) => OnNode::Present {
                status: condition.status,
                since: condition.last_transition_time,
            },
            None => OnNode::Absent,
        })
    }
}
