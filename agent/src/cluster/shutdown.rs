//! The SIGTERM rule (istio's `ShouldStopCleanup`): an agent stopping because its DaemonSet is
//! being upgraded leaves the CNI config, the plugin and the datapath for the next agent; one
//! stopping because weir is leaving the node (the DaemonSet deleted, or no longer scheduled
//! here) removes them, as `--uninstall-on-exit` does.
use std::time::Duration;

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm},
};
use kube::{api::Api, Client, ResourceExt};
use tracing::warn;

use super::Reflectors;
use crate::policy::{enablement::requirement_holds, Labels};

/// Reading the node must not hold the agent's stop for long.
const API_TIMEOUT: Duration = Duration::from_secs(2);

/// On SIGTERM: whether to leave weir in place on `node_name` for the next agent (an upgrade),
/// rather than removing it ([`keep_node`] over the cached DaemonSet and the node's labels).
pub async fn keep_node_on_exit(client: &Client, node_name: &str, reflectors: &Reflectors) -> bool {
    let daemonset = reflectors.daemonsets.state().into_iter().next();
    let node = Api::<Node>::all(client.clone());
    let node_labels = match tokio::time::timeout(API_TIMEOUT, node.get(node_name)).await {
        Ok(Ok(node)) => node.labels().clone(),
        // Without the node's labels an upgrade cannot be told from a removal: keeping weir in
        // place never leaves an ambient pod unredirected.
        Ok(Err(error)) => {
            let error = anyhow::Error::from(error);
            warn!("reading node {node_name}: {error:#}; keeping weir in place");
            return true;
        }
        Err(_) => {
            warn!("reading node {node_name} timed out; keeping weir in place");
            return true;
        }
    };
    keep_node(daemonset.as_deref(), &node_labels)
}

/// Whether weir stays on the node: its DaemonSet exists, is not being deleted, and its pod
/// template would still be scheduled on a node with `node_labels` (nodeSelector, and the required
/// node affinity's label expressions).
pub fn keep_node(daemonset: Option<&DaemonSet>, node_labels: &Labels) -> bool {
    let Some(daemonset) = daemonset else {
        return false;
    };
    if daemonset.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let Some(pod) = daemonset.spec.template.spec.as_ref() else {
        return true;
    };
    let selected = pod
        .node_selector
        .iter()
        .flatten()
        .all(|(key, value)| node_labels.get(key) == Some(value));
    let required_terms = pod
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .map(|selector| selector.node_selector_terms.as_slice());
    selected
        && required_terms.is_none_or(|terms| terms.iter().any(|t| term_matches(t, node_labels)))
}

/// Node selector terms are ORed; a term's expressions are ANDed. `matchFields` (only
/// `metadata.name` exists) is left out: a DaemonSet pinned to nodes by name is not a rollout.
fn term_matches(term: &NodeSelectorTerm, node_labels: &Labels) -> bool {
    term.match_expressions
        .iter()
        .flatten()
        .all(|requirement| node_requirement_holds(requirement, node_labels))
}

/// Label selectors' operators, and node selectors' own numeric `Gt` and `Lt`.
fn node_requirement_holds(requirement: &NodeSelectorRequirement, labels: &Labels) -> bool {
    let values = requirement.values.as_deref().unwrap_or_default();
    let number = |text: &str| text.parse::<i64>().ok();
    let compare = |ordering| {
        let label = labels.get(&requirement.key).and_then(|v| number(v));
        let bound = values.first().and_then(|v| number(v));
        matches!((label, bound), (Some(label), Some(bound)) if label.cmp(&bound) == ordering)
    };
    match requirement.operator.as_str() {
        "Gt" => compare(std::cmp::Ordering::Greater),
        "Lt" => compare(std::cmp::Ordering::Less),
        operator => requirement_holds(&requirement.key, operator, values, labels),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_labels as labels;
    use k8s_openapi::{
        api::{
            apps::v1::DaemonSetSpec,
            core::v1::{Affinity, NodeAffinity, NodeSelector, PodSpec, PodTemplateSpec},
        },
        apimachinery::pkg::apis::meta::v1::Time,
        jiff::Timestamp,
    };

    fn daemonset(pod: PodSpec) -> DaemonSet {
        DaemonSet {
            spec: DaemonSetSpec {
                template: PodTemplateSpec {
                    spec: Some(pod),
                    ..PodTemplateSpec::default()
                },
                ..DaemonSetSpec::default()
            },
            ..DaemonSet::default()
        }
    }

    fn affinity(expressions: &[(&str, &str, &[&str])]) -> PodSpec {
        let requirements = expressions
            .iter()
            .map(|(key, operator, values)| NodeSelectorRequirement {
                key: key.to_string(),
                operator: operator.to_string(),
                values: Some(values.iter().map(|v| v.to_string()).collect()),
            })
            .collect();
        PodSpec {
            affinity: Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_expressions: Some(requirements),
                            match_fields: None,
                        }],
                    }),
                    ..NodeAffinity::default()
                }),
                ..Affinity::default()
            }),
            ..PodSpec::default()
        }
    }

    #[test]
    fn an_upgrade_keeps_weir_on_the_node() {
        let node = labels(&[("kubernetes.io/os", "linux")]);
        assert!(keep_node(Some(&daemonset(PodSpec::default())), &node));
        let selecting = PodSpec {
            node_selector: Some(labels(&[("kubernetes.io/os", "linux")])),
            ..PodSpec::default()
        };
        assert!(keep_node(Some(&daemonset(selecting)), &node));
    }

    #[test]
    fn a_deleted_or_deleting_daemonset_removes_weir() {
        let node = Labels::new();
        assert!(!keep_node(None, &node));
        let mut deleting = daemonset(PodSpec::default());
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert!(!keep_node(Some(&deleting), &node));
    }

    #[test]
    fn a_daemonset_no_longer_selecting_the_node_removes_weir() {
        let node = labels(&[("pool", "a"), ("cores", "8")]);
        let elsewhere = PodSpec {
            node_selector: Some(labels(&[("pool", "b")])),
            ..PodSpec::default()
        };
        assert!(!keep_node(Some(&daemonset(elsewhere)), &node));
        let keep = |expressions: &[(&str, &str, &[&str])]| {
            keep_node(Some(&daemonset(affinity(expressions))), &node)
        };
        assert!(keep(&[("pool", "In", &["a", "c"])]));
        assert!(!keep(&[("pool", "NotIn", &["a"])]));
        assert!(keep(&[
            ("pool", "Exists", &[]),
            ("gpu", "DoesNotExist", &[])
        ]));
        assert!(!keep(&[("gpu", "Exists", &[])]));
        assert!(keep(&[("cores", "Gt", &["4"])]));
        assert!(!keep(&[("cores", "Lt", &["4"])]));
        assert!(!keep(&[("pool", "Gt", &["4"])]), "not a number");
    }
}
