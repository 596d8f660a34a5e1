//! Which pods are ambient, and with which options: istio's rules, in one place, over labels and
//! annotations, whatever their source. [`Policy`] is what the enrollment path asks; it has two
//! implementations: [`local::LocalSource`], a policy file for a node without an API server (the
//! demo, `cargo xtask run`), and `cluster::policy::ClusterSource`, the Kubernetes API through
//! reflectors. The rule itself is in [`enablement`]; the verdict cache the plugin falls back on
//! is written by [`verdicts`].
pub mod enablement;
pub mod local;
pub mod sidecar;
pub mod verdicts;

use futures::future::BoxFuture;
use weir_cni::protocol::VerdictCache;

use crate::workload::{PodName, PodOptions, SidecarRedirect};
use enablement::EnablementSelector;

pub use weir_cni::ambient::{
    Labels, OwnPods, PodFacts, DATAPLANE_MODE_LABEL, SIDECAR_STATUS_ANNOTATION,
};
pub const BYPASS_INBOUND_ANNOTATION: &str = "ambient.istio.io/bypass-inbound-capture";
pub const DNS_CAPTURE_ANNOTATION: &str = "ambient.istio.io/dns-capture";
/// Comma-separated interface names whose incoming TCP goes to ztunnel's outbound listener.
pub const REROUTE_VIRTUAL_INTERFACES_ANNOTATION: &str = "istio.io/reroute-virtual-interfaces";
/// The pod's enrollment status (`enabled`, `pending`) as istio-cni sets it, for ztunnel's
/// peers and operators to read.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";

/// Node-wide settings of the rules.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// Namespaces never enrolled (istio's default: kube-system).
    pub exclude_namespaces: Vec<String>,
    /// Where ztunnel runs; its own pods (`app=ztunnel`) are never enrolled.
    pub system_namespace: String,
    /// DNS capture for pods without the `ambient.istio.io/dns-capture` annotation.
    pub dns_capture: bool,
    /// A pod is ambient when any of these matches (istio's `AMBIENT_ENABLEMENT_SELECTOR`).
    pub enablement: Vec<EnablementSelector>,
    pub own: OwnPods,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            exclude_namespaces: vec!["kube-system".into()],
            system_namespace: "istio-system".into(),
            dns_capture: true,
            enablement: enablement::default_selectors(),
            own: OwnPods {
                namespace: "istio-system".into(),
                daemonset: "weir".into(),
                pod_name: None,
            },
        }
    }
}

/// A problem with a pod's annotations: reported to the user (a Kubernetes Event where there is
/// an API server), while the pod gets the safe default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnnotationProblem {
    pub annotation: &'static str,
    pub value: String,
    pub used: &'static str,
}

impl PolicyConfig {
    /// The pod's redirection options from its annotations; an unparsable value keeps the default
    /// and is reported.
    pub fn options(&self, annotations: &Labels) -> (PodOptions, Vec<AnnotationProblem>) {
        let mut problems = Vec::new();
        let mut flag = |annotation: &'static str, default: bool| match annotations
            .get(annotation)
            .map(String::as_str)
        {
            None => default,
            Some("true") => true,
            Some("false") => false,
            Some(other) => {
                problems.push(AnnotationProblem {
                    annotation,
                    value: other.to_owned(),
                    used: if default { "true" } else { "false" },
                });
                default
            }
        };
        let inbound_bypass = flag(BYPASS_INBOUND_ANNOTATION, false);
        let dns_capture = flag(DNS_CAPTURE_ANNOTATION, self.dns_capture);
        let annotation = REROUTE_VIRTUAL_INTERFACES_ANNOTATION;
        let reroute_interfaces = match annotations.get(annotation) {
            None => Vec::new(),
            Some(value) => interface_names(value).unwrap_or_else(|| {
                // No guess at which names were meant: none is rerouted.
                problems.push(AnnotationProblem {
                    annotation,
                    value: value.clone(),
                    used: "no interface rerouted",
                });
                Vec::new()
            }),
        };
        let options = PodOptions {
            inbound_bypass,
            dns_capture,
            reroute_interfaces,
        };
        (options, problems)
    }

    /// The whole decision for one pod: `None` when it is not ambient.
    pub fn decide(&self, pod: &PodFacts) -> Option<AmbientPod> {
        if !self.is_ambient(pod) {
            return None;
        }
        let (options, problems) = self.options(&pod.annotations);
        Some(AmbientPod {
            options,
            service_account: pod
                .service_account
                .clone()
                .unwrap_or_else(|| "default".into()),
            problems,
        })
    }

    /// The decision for a pod at its CNI ADD: ambient, a sidecar pod to redirect to its own
    /// proxy (istio-cni's sidecar path, for pods that are not ambient), or neither.
    pub fn decide_mode(&self, pod: &PodFacts) -> Result<Decision, sidecar::InvalidAnnotation> {
        if let Some(ambient) = self.decide(pod) {
            return Ok(Decision::Ambient(ambient));
        }
        if self.exclude_namespaces.contains(&pod.namespace) || self.own.is_own(pod) {
            return Ok(Decision::Neither);
        }
        Ok(sidecar::decide(pod)?.map_or(Decision::Neither, Decision::Sidecar))
    }

    /// What the plugin needs to decide alone while the agent is down: namespaces whose pods are
    /// ambient by default, the pods that differ from their namespace, and every other pod of
    /// `pods`, so that the plugin can tell a pod known not to be ambient from one never seen.
    pub fn verdict_cache<'a>(
        &self,
        namespaces: impl IntoIterator<Item = (&'a str, &'a Labels)>,
        pods: impl IntoIterator<Item = PodFacts>,
    ) -> VerdictCache {
        let mut cache = VerdictCache::default();
        for (namespace, labels) in namespaces {
            let unlabelled_pod = PodFacts {
                namespace: namespace.to_owned(),
                namespace_labels: labels.clone(),
                ..PodFacts::default()
            };
            if self.is_ambient(&unlabelled_pod) {
                cache.ambient_namespaces.push(namespace.to_owned());
            }
        }
        for pod in pods {
            let key = format!("{}/{}", pod.namespace, pod.name);
            let namespace_ambient = cache.ambient_namespaces.contains(&pod.namespace);
            match (self.is_ambient(&pod), namespace_ambient) {
                (true, false) => cache.ambient_pods.push(key),
                (false, true) => cache.opted_out_pods.push(key),
                (false, false) => cache.other_pods.push(key),
                (true, true) => {}
            }
        }
        // Sorted, so that the same pods make the same cache and it is rewritten only on change.
        cache.ambient_namespaces.sort();
        cache.ambient_pods.sort();
        cache.opted_out_pods.sort();
        cache.other_pods.sort();
        cache
    }
}

/// An ambient pod's part of the decision: how it is redirected, what ztunnel is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmbientPod {
    pub options: PodOptions,
    pub service_account: String,
    /// Annotations that could not be read; their defaults are in `options`.
    pub problems: Vec<AnnotationProblem>,
}

/// How a pod is in the mesh, if at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Ambient(AmbientPod),
    Sidecar(SidecarRedirect),
    Neither,
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The source does not know the pod yet (the API server's news has not reached this node):
    /// the runtime should retry.
    #[error("pod {0} is not known to the agent yet")]
    NotYetKnown(PodName),
    /// A sidecar pod's annotation istio-cni would refuse: its ADD fails, as istio's does.
    #[error("pod {0}: {1}")]
    InvalidAnnotation(PodName, sidecar::InvalidAnnotation),
    #[error(transparent)]
    Failed(#[from] anyhow::Error),
}

/// Where the enrollment path learns which pods are ambient. The enrollment path holds an
/// `Arc<dyn Policy>` and never knows which source it is.
pub trait Policy: Send + Sync {
    /// The decision for one pod ([`PolicyConfig::decide_mode`]). `uid` is the one the container
    /// runtime gave (empty when it gave none): a source that knows pods by uid decides only from
    /// that pod, never from a namesake. `runtime_annotations` are the ones the runtime passed
    /// with the CNI request.
    fn decide<'a>(
        &'a self,
        pod: &'a PodName,
        uid: &'a str,
        runtime_annotations: &'a Labels,
    ) -> BoxFuture<'a, Result<Decision, PolicyError>>;

    /// Resolves once the source can answer for every pod (its caches have synced).
    fn synced(&self) -> BoxFuture<'_, ()>;
}

/// The names of a comma-separated list, as istio splits it (blanks around names and empty items
/// are ignored), sorted and without duplicates; `None` when one is not a valid Linux interface
/// name (1 to 15 bytes, no `/`, `:` or whitespace, not `.` or `..`).
/// The pod's network (CNI_IFNAME, as kubelet names it), which carries its inbound traffic.
pub const PRIMARY_INTERFACE: &str = "eth0";

/// Interfaces a pod cannot have rerouted: `lo` carries all of the pod's locally made TCP (ztunnel's
/// own dials among it), and [`PRIMARY_INTERFACE`] its inbound traffic; rerouting either would
/// send that to ztunnel's outbound listener.
const NEVER_REROUTED: [&str; 2] = ["lo", PRIMARY_INTERFACE];

fn interface_names(list: &str) -> Option<Vec<String>> {
    let mut names = Vec::new();
    for name in list
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
    {
        let valid = name.len() < libc::IFNAMSIZ
            && name != "."
            && name != ".."
            && !name.contains(|c: char| c == '/' || c == ':' || c.is_whitespace())
            && !NEVER_REROUTED.contains(&name);
        if !valid {
            return None;
        }
        names.push(name.to_owned());
    }
    names.sort();
    names.dedup();
    Some(names)
}

/// Labels from pairs, for the rules' tests.
#[cfg(test)]
pub(crate) fn test_labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{test_labels as labels, *};

    #[test]
    fn options_from_annotations_with_safe_defaults() {
        let config = PolicyConfig::default();
        let (options, problems) = config.options(&labels(&[
            (BYPASS_INBOUND_ANNOTATION, "true"),
            (DNS_CAPTURE_ANNOTATION, "false"),
        ]));
        assert!(options.inbound_bypass && !options.dns_capture);
        assert!(problems.is_empty());

        let (options, problems) = config.options(&labels(&[(DNS_CAPTURE_ANNOTATION, "yes")]));
        assert_eq!(options, PodOptions::default());
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].used, "true");
    }

    #[test]
    fn reroute_virtual_interfaces_are_a_list_of_interface_names() {
        let config = PolicyConfig::default();
        let reroute = |value: &str| {
            config.options(&labels(&[(REROUTE_VIRTUAL_INTERFACES_ANNOTATION, value)]))
        };
        let (options, problems) = reroute(" tap0, net1 ,,tap0");
        assert_eq!(options.reroute_interfaces, ["net1", "tap0"]);
        assert!(problems.is_empty());
        assert!(reroute("").0.reroute_interfaces.is_empty());

        for invalid in [
            "tap0,a/b",
            "eth0:1",
            "a name",
            "sixteen-bytes-xx",
            "..",
            "lo",
            "tap0,eth0",
        ] {
            let (options, problems) = reroute(invalid);
            assert_eq!(options, PodOptions::default(), "{invalid}");
            assert_eq!(problems.len(), 1, "{invalid}");
            assert_eq!(
                problems[0].annotation,
                REROUTE_VIRTUAL_INTERFACES_ANNOTATION
            );
            assert_eq!(problems[0].used, "no interface rerouted");
        }
    }

    #[test]
    fn decision_carries_options_service_account_and_problems() {
        let config = PolicyConfig::default();
        let pod = PodFacts {
            namespace: "app".into(),
            name: "p".into(),
            labels: labels(&[(DATAPLANE_MODE_LABEL, "ambient")]),
            annotations: labels(&[(BYPASS_INBOUND_ANNOTATION, "maybe")]),
            service_account: Some("reviews".into()),
            ..PodFacts::default()
        };
        let ambient = config.decide(&pod).unwrap();
        assert_eq!(ambient.service_account, "reviews");
        assert!(!ambient.options.inbound_bypass);
        assert_eq!(ambient.problems[0].used, "false");
        let plain = PodFacts {
            labels: Labels::new(),
            ..pod
        };
        assert_eq!(config.decide(&plain), None);
    }

    #[test]
    fn verdict_cache_names_namespaces_and_the_pods_that_differ() {
        let (mesh, plain) = (labels(&[(DATAPLANE_MODE_LABEL, "ambient")]), Labels::new());
        let pod = |namespace: &str, mode: &str, namespace_labels: &Labels| PodFacts {
            namespace: namespace.into(),
            name: mode.into(),
            labels: labels(&[(DATAPLANE_MODE_LABEL, mode)]),
            namespace_labels: namespace_labels.clone(),
            ..PodFacts::default()
        };
        let cache = PolicyConfig::default().verdict_cache(
            [("mesh", &mesh), ("plain", &plain)],
            [
                pod("plain", "unlabelled", &plain),
                pod("mesh", "none", &mesh),
                pod("plain", "ambient", &plain),
                pod("mesh", "ambient", &mesh),
                pod("plain", "none", &plain),
                // Never ambient, whatever its label says.
                pod("kube-system", "ambient", &plain),
            ],
        );
        assert_eq!(cache.ambient_namespaces, ["mesh"]);
        assert_eq!(cache.ambient_pods, ["plain/ambient"]);
        assert_eq!(cache.opted_out_pods, ["mesh/none"]);
        assert_eq!(
            cache.other_pods,
            ["kube-system/ambient", "plain/none", "plain/unlabelled"]
        );
    }
}
