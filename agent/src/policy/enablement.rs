//! The enablement rule, as istio-cni's `enablement_selector.go` has it: a few kinds of pods are
//! never in the mesh (host network, sidecar-injected, ztunnel's own, weir's own, excluded
//! namespaces); every other pod is in when any enablement selector matches it. The selectors
//! have istio's `AMBIENT_ENABLEMENT_SELECTOR` shape, and the defaults are istio's defaults. The
//! rule itself lives in `weir_cni::ambient`, which the plugin applies when the agent is away.
use anyhow::{anyhow, Result};

pub use weir_cni::ambient::{
    default_selectors, requirement_holds, EnablementSelector, LabelSelector,
    LabelSelectorRequirement,
};
use weir_cni::ambient::{validate_selectors, Rule};

use super::{PodFacts, PolicyConfig};

/// Parses a list of selectors, YAML or JSON (JSON is YAML), refusing what Kubernetes refuses: an
/// unknown operator, `In`/`NotIn` without values, `Exists`/`DoesNotExist` with values.
pub fn parse_selectors(text: &str) -> Result<Vec<EnablementSelector>> {
    let selectors: Vec<EnablementSelector> = serde_saphyr::from_str(text)?;
    validate_selectors(&selectors).map_err(|error| anyhow!(error))?;
    Ok(selectors)
}

impl PolicyConfig {
    /// The rule as the plugin applies it too (`weir_cni::ambient`), with this node's settings.
    pub fn rule(&self) -> Rule<'_> {
        Rule {
            exclude_namespaces: &self.exclude_namespaces,
            system_namespace: &self.system_namespace,
            enablement: &self.enablement,
            own: &self.own,
        }
    }

    /// Whether a pod belongs in the ambient mesh: never for the kinds of pods istio leaves out,
    /// otherwise when any enablement selector matches.
    pub fn is_ambient(&self, pod: &PodFacts) -> bool {
        self.rule().is_ambient(pod)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{
        test_labels as labels, Labels, OwnPods, DATAPLANE_MODE_LABEL, SIDECAR_STATUS_ANNOTATION,
    };
    use weir_cni::ambient::selector_matches;

    fn pod(ns_mode: Option<&str>, pod_mode: Option<&str>) -> PodFacts {
        let mode = |m: Option<&str>| {
            m.map(|m| labels(&[(DATAPLANE_MODE_LABEL, m)]))
                .unwrap_or_default()
        };
        PodFacts {
            namespace: "app".into(),
            name: "p".into(),
            labels: mode(pod_mode),
            namespace_labels: mode(ns_mode),
            ..PodFacts::default()
        }
    }

    #[test]
    fn default_rule_is_istios() {
        let config = PolicyConfig::default();
        assert!(config.is_ambient(&pod(Some("ambient"), None)));
        assert!(config.is_ambient(&pod(Some("ambient"), Some("other"))));
        assert!(!config.is_ambient(&pod(Some("ambient"), Some("none"))));
        assert!(config.is_ambient(&pod(None, Some("ambient"))));
        assert!(config.is_ambient(&pod(Some("none"), Some("ambient"))));
        assert!(!config.is_ambient(&pod(None, None)));
        assert!(!config.is_ambient(&pod(Some("none"), None)));
        assert!(!config.is_ambient(&pod(None, Some("none"))));
    }

    #[test]
    fn host_network_and_sidecar_pods_are_never_ambient() {
        let config = PolicyConfig::default();
        let mut host = pod(Some("ambient"), Some("ambient"));
        host.host_network = true;
        assert!(!config.is_ambient(&host));
        let mut sidecar = pod(Some("ambient"), Some("ambient"));
        sidecar
            .annotations
            .insert(SIDECAR_STATUS_ANNOTATION.into(), "{}".into());
        assert!(!config.is_ambient(&sidecar));
    }

    #[test]
    fn excluded_namespaces_are_never_ambient() {
        let mut config = PolicyConfig::default();
        let mut excluded = pod(Some("ambient"), Some("ambient"));
        excluded.namespace = "kube-system".into();
        assert!(!config.is_ambient(&excluded));
        config.exclude_namespaces = vec!["app".into()];
        assert!(!config.is_ambient(&pod(Some("ambient"), None)));
        assert!(config.is_ambient(&excluded));
    }

    #[test]
    fn ztunnel_is_never_ambient_in_the_system_namespace_only() {
        let config = PolicyConfig::default();
        let mut ztunnel = pod(Some("ambient"), Some("ambient"));
        ztunnel.labels.insert("app".into(), "ztunnel".into());
        assert!(
            config.is_ambient(&ztunnel),
            "app=ztunnel elsewhere is an app"
        );
        ztunnel.namespace = "istio-system".into();
        assert!(!config.is_ambient(&ztunnel));
    }

    #[test]
    fn weirs_own_pods_are_never_ambient() {
        let config = PolicyConfig {
            own: OwnPods {
                namespace: "app".into(),
                daemonset: "weir".into(),
                pod_name: Some("weir-abcde".into()),
            },
            ..PolicyConfig::default()
        };
        let mut daemon = pod(Some("ambient"), None);
        daemon.daemonset_owner = Some("weir".into());
        assert!(!config.is_ambient(&daemon));
        daemon.daemonset_owner = Some("other".into());
        assert!(config.is_ambient(&daemon), "another DaemonSet's pod");
        let mut named = pod(Some("ambient"), None);
        named.name = "weir-abcde".into();
        assert!(!config.is_ambient(&named));
        named.namespace = "elsewhere".into();
        assert!(config.is_ambient(&named), "same name, other namespace");
    }

    #[test]
    fn any_selector_matching_is_enough() {
        let config = PolicyConfig {
            enablement: parse_selectors(
                r#"
- podSelector: {matchLabels: {team: a}}
- namespaceSelector:
    matchExpressions:
    - {key: env, operator: In, values: [prod, staging]}
  podSelector:
    matchExpressions:
    - {key: legacy, operator: DoesNotExist}
"#,
            )
            .unwrap(),
            ..PolicyConfig::default()
        };
        let facts = |pod: &[(&str, &str)], ns: &[(&str, &str)]| PodFacts {
            labels: labels(pod),
            namespace_labels: labels(ns),
            ..pod_in_app()
        };
        assert!(config.is_ambient(&facts(&[("team", "a")], &[])));
        assert!(!config.is_ambient(&facts(&[("team", "b")], &[])));
        assert!(config.is_ambient(&facts(&[], &[("env", "prod")])));
        assert!(config.is_ambient(&facts(&[], &[("env", "staging")])));
        assert!(!config.is_ambient(&facts(&[], &[("env", "dev")])));
        assert!(!config.is_ambient(&facts(&[("legacy", "")], &[("env", "prod")])));
        assert!(
            !config.is_ambient(&facts(&[(DATAPLANE_MODE_LABEL, "ambient")], &[])),
            "the defaults are replaced, not extended"
        );
    }

    fn pod_in_app() -> PodFacts {
        pod(None, None)
    }

    #[test]
    fn expressions_follow_kubernetes_semantics() {
        let holds = |operator: &str, values: &[&str], labels: &Labels| {
            let values: Vec<String> = values.iter().map(|v| v.to_string()).collect();
            requirement_holds("k", operator, &values, labels)
        };
        let (set, unset) = (labels(&[("k", "v")]), Labels::new());
        assert!(holds("In", &["v", "w"], &set));
        assert!(!holds("In", &["v"], &unset));
        assert!(!holds("NotIn", &["v"], &set));
        assert!(holds("NotIn", &["v"], &unset));
        assert!(holds("Exists", &[], &set));
        assert!(holds("DoesNotExist", &[], &unset));
        assert!(!holds("Gt", &["1"], &set));
        assert!(selector_matches(Some(&LabelSelector::default()), &unset));
    }

    #[test]
    fn the_defaults_parse_from_istios_helm_shape() {
        let parsed = parse_selectors(
            r#"[{"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
                {"podSelector": {"matchExpressions": [{"key": "istio.io/dataplane-mode",
                                  "operator": "NotIn", "values": ["none"]}]},
                 "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}]"#,
        )
        .unwrap();
        assert_eq!(parsed, default_selectors());
    }

    #[test]
    fn malformed_selectors_are_refused() {
        for text in [
            "- podSelector: {matchExpressions: [{key: k, operator: Near, values: [x]}]}",
            "- podSelector: {matchExpressions: [{key: k, operator: In}]}",
            "- podSelector: {matchExpressions: [{key: k, operator: Exists, values: [x]}]}",
            "podSelector: {}",
        ] {
            assert!(parse_selectors(text).is_err(), "{text}");
        }
    }
}
