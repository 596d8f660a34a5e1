//! Which pods are ambient: istio-cni's rule (`enablement_selector.go`), over a pod's labels and
//! annotations and its namespace's labels. The agent decides every pod with it; the plugin
//! decides with it alone when the agent cannot be reached and the API server can, so that both
//! give the same answer for the same objects.
//!
//! A few kinds of pods are never in the mesh (host network, sidecar-injected, ztunnel's own,
//! weir's own, excluded namespaces); every other pod is in when any enablement selector matches.
//! The selectors have istio's `AMBIENT_ENABLEMENT_SELECTOR` shape, and the defaults are istio's.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub type Labels = BTreeMap<String, String>;

pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";

/// What the rule looks at for one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    pub annotations: Labels,
    pub namespace_labels: Labels,
    pub host_network: bool,
    /// The DaemonSet the pod belongs to (its ownerReference), if any.
    pub daemonset_owner: Option<String>,
    pub service_account: Option<String>,
    /// Init containers first, then containers: what istio-cni reads of them to tell a sidecar
    /// pod (the agent fills it; the plugin never decides on sidecars).
    pub containers: Vec<ContainerFacts>,
}

/// What istio-cni's sidecar path reads of one container (`ExtractPodInfo`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerFacts {
    pub name: String,
    pub args: Vec<String>,
    /// `env[].value` by name; `None` where the value comes from `valueFrom`.
    pub env: Vec<(String, Option<String>)>,
    /// The container's own `securityContext` (the pod's is not read, as in istio).
    pub run_as_user: Option<i64>,
    pub run_as_group: Option<i64>,
}

/// weir's own pods, never enrolled: its DaemonSet's pods in its namespace, and itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnPods {
    pub namespace: String,
    pub daemonset: String,
    /// This agent's pod, which may not carry its ownerReference (a static or debug pod).
    pub pod_name: Option<String>,
}

impl OwnPods {
    pub fn is_own(&self, pod: &PodFacts) -> bool {
        pod.namespace == self.namespace
            && (pod.daemonset_owner.as_deref() == Some(self.daemonset.as_str())
                || self.pod_name.as_deref() == Some(pod.name.as_str()))
    }
}

/// The kinds of pods never in the ambient mesh, whatever the enablement selectors say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NeverAmbient {
    HostNetwork,
    /// istio's injector added a sidecar (`sidecar.istio.io/status`).
    SidecarInjected,
    ExcludedNamespace,
    /// ztunnel's own pod (`app=ztunnel` in the system namespace).
    Ztunnel,
    /// weir's own pod.
    Own,
}

impl NeverAmbient {
    /// What it means, for an operator.
    pub fn describe(self) -> &'static str {
        match self {
            Self::HostNetwork => "a host-network pod",
            Self::SidecarInjected => "a sidecar-injected pod (sidecar.istio.io/status)",
            Self::ExcludedNamespace => "its namespace is excluded (--exclude-namespaces)",
            Self::Ztunnel => "ztunnel's own pod (app=ztunnel in the system namespace)",
            Self::Own => "weir's own pod",
        }
    }
}

/// The rule's node-wide settings, borrowed from whoever holds them (the agent's policy config,
/// the plugin's network config).
#[derive(Clone, Copy, Debug)]
pub struct Rule<'a> {
    /// Namespaces never enrolled (istio's default: kube-system).
    pub exclude_namespaces: &'a [String],
    /// Where ztunnel runs; its own pods (`app=ztunnel`) are never enrolled.
    pub system_namespace: &'a str,
    /// A pod is ambient when any of these matches (istio's `AMBIENT_ENABLEMENT_SELECTOR`).
    pub enablement: &'a [EnablementSelector],
    pub own: &'a OwnPods,
}

impl Rule<'_> {
    /// Whether a pod belongs in the ambient mesh: never for the kinds of pods istio leaves out,
    /// otherwise when any enablement selector matches.
    pub fn is_ambient(&self, pod: &PodFacts) -> bool {
        self.never_ambient(pod).is_none() && self.matching_selector(pod).is_some()
    }

    /// Why a pod is left out whatever the selectors say, if it is one of those kinds.
    pub fn never_ambient(&self, pod: &PodFacts) -> Option<NeverAmbient> {
        if pod.host_network {
            Some(NeverAmbient::HostNetwork)
        } else if pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
            Some(NeverAmbient::SidecarInjected)
        } else if self.exclude_namespaces.contains(&pod.namespace) {
            Some(NeverAmbient::ExcludedNamespace)
        } else if self.is_ztunnel(pod) {
            Some(NeverAmbient::Ztunnel)
        } else if self.own.is_own(pod) {
            Some(NeverAmbient::Own)
        } else {
            None
        }
    }

    /// The index of the first enablement selector that matches the pod, if any.
    pub fn matching_selector(&self, pod: &PodFacts) -> Option<usize> {
        self.enablement.iter().position(|s| s.matches(pod))
    }

    fn is_ztunnel(&self, pod: &PodFacts) -> bool {
        pod.namespace == self.system_namespace
            && pod.labels.get("app").map(String::as_str) == Some("ztunnel")
    }
}

/// A Kubernetes label selector (`metav1.LabelSelector`), in its JSON shape.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<Labels>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_expressions: Option<Vec<LabelSelectorRequirement>>,
}

/// One set-based requirement of a [`LabelSelector`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelSelectorRequirement {
    pub key: String,
    pub operator: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<String>>,
}

/// One entry of istio's `AMBIENT_ENABLEMENT_SELECTOR` (Helm `ambient.enablementSelectors`): a pod
/// matches when both its labels match `podSelector` and its namespace's labels match
/// `namespaceSelector`. An absent selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnablementSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
}

impl EnablementSelector {
    pub fn matches(&self, pod: &PodFacts) -> bool {
        selector_matches(self.pod_selector.as_ref(), &pod.labels)
            && selector_matches(self.namespace_selector.as_ref(), &pod.namespace_labels)
    }
}

/// istio's defaults: the pod label `istio.io/dataplane-mode=ambient` in any namespace, or the
/// namespace label `istio.io/dataplane-mode=ambient` unless the pod's label is `none`.
pub fn default_selectors() -> Vec<EnablementSelector> {
    let ambient = || LabelSelector {
        match_labels: Some(Labels::from([(
            DATAPLANE_MODE_LABEL.to_owned(),
            "ambient".to_owned(),
        )])),
        ..LabelSelector::default()
    };
    vec![
        EnablementSelector {
            pod_selector: Some(ambient()),
            namespace_selector: None,
        },
        EnablementSelector {
            pod_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: DATAPLANE_MODE_LABEL.to_owned(),
                    operator: "NotIn".to_owned(),
                    values: Some(vec!["none".to_owned()]),
                }]),
                ..LabelSelector::default()
            }),
            namespace_selector: Some(ambient()),
        },
    ]
}

/// Refuses what Kubernetes refuses in a selector: an unknown operator, `In`/`NotIn` without
/// values, `Exists`/`DoesNotExist` with values.
pub fn validate_selectors(selectors: &[EnablementSelector]) -> Result<(), String> {
    let requirements = selectors
        .iter()
        .flat_map(|s| [&s.pod_selector, &s.namespace_selector])
        .flatten()
        .flat_map(|s| s.match_expressions.iter().flatten());
    for requirement in requirements {
        let (key, operator) = (&requirement.key, requirement.operator.as_str());
        let values = requirement.values.as_deref().unwrap_or_default();
        match (operator, values.is_empty()) {
            ("In" | "NotIn", false) | ("Exists" | "DoesNotExist", true) => {}
            ("In" | "NotIn", true) => {
                return Err(format!("{key}: operator {operator} needs values"))
            }
            ("Exists" | "DoesNotExist", false) => {
                return Err(format!("{key}: operator {operator} takes no values"))
            }
            (other, _) => return Err(format!("{key}: unknown operator {other:?}")),
        }
    }
    Ok(())
}

/// Kubernetes label selector semantics: every `matchLabels` pair and every expression holds.
pub fn selector_matches(selector: Option<&LabelSelector>, labels: &Labels) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    selector
        .match_labels
        .iter()
        .flatten()
        .all(|(key, value)| labels.get(key) == Some(value))
        && selector.match_expressions.iter().flatten().all(|r| {
            let values = r.values.as_deref().unwrap_or_default();
            requirement_holds(&r.key, &r.operator, values, labels)
        })
}

/// One set-based requirement (`In`, `NotIn`, `Exists`, `DoesNotExist`) on `labels`; node
/// selectors share these operators.
pub fn requirement_holds(key: &str, operator: &str, values: &[String], labels: &Labels) -> bool {
    let value = labels.get(key);
    match operator {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        // Refused when parsed; a selector that cannot be understood selects nothing.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_default_selectors_are_istios_json() {
        let json = serde_json::to_value(default_selectors()).unwrap();
        assert_eq!(
            json,
            serde_json::json!([
                {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
                {"podSelector": {"matchExpressions": [{"key": "istio.io/dataplane-mode",
                                                       "operator": "NotIn", "values": ["none"]}]},
                 "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}
            ])
        );
        let back: Vec<EnablementSelector> = serde_json::from_value(json).unwrap();
        assert_eq!(back, default_selectors());
    }

    #[test]
    fn the_default_rule() {
        let own = OwnPods {
            namespace: "istio-system".into(),
            daemonset: "weir".into(),
            pod_name: None,
        };
        let (exclude, enablement) = (vec!["kube-system".to_owned()], default_selectors());
        let rule = Rule {
            exclude_namespaces: &exclude,
            system_namespace: "istio-system",
            enablement: &enablement,
            own: &own,
        };
        let pod = |ns: &[(&str, &str)], pod: &[(&str, &str)]| PodFacts {
            namespace: "app".into(),
            name: "p".into(),
            labels: labels(pod),
            namespace_labels: labels(ns),
            ..PodFacts::default()
        };
        let ambient = [(DATAPLANE_MODE_LABEL, "ambient")];
        let none = [(DATAPLANE_MODE_LABEL, "none")];
        assert!(rule.is_ambient(&pod(&ambient, &[])));
        assert!(rule.is_ambient(&pod(&[], &ambient)));
        assert!(!rule.is_ambient(&pod(&ambient, &none)));
        assert!(!rule.is_ambient(&pod(&[], &[])));
        let mut host = pod(&ambient, &ambient);
        host.host_network = true;
        assert!(!rule.is_ambient(&host));
    }

    #[test]
    fn malformed_requirements_are_refused() {
        let with = |operator: &str, values: Option<Vec<String>>| {
            vec![EnablementSelector {
                pod_selector: Some(LabelSelector {
                    match_expressions: Some(vec![LabelSelectorRequirement {
                        key: "k".into(),
                        operator: operator.into(),
                        values,
                    }]),
                    ..LabelSelector::default()
                }),
                namespace_selector: None,
            }]
        };
        assert!(validate_selectors(&with("In", Some(vec!["x".into()]))).is_ok());
        assert!(validate_selectors(&with("Exists", None)).is_ok());
        assert!(validate_selectors(&with("Near", Some(vec!["x".into()]))).is_err());
        assert!(validate_selectors(&with("In", None)).is_err());
        assert!(validate_selectors(&with("Exists", Some(vec!["x".into()]))).is_err());
    }
}
