//! Which pods are ambient, and with which options: istio's rules, in one place, over labels and
//! annotations, whatever their source (the Kubernetes API, or a local policy file for a node
//! without one).
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Mutex,
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tracing::warn;
use weir_cni::protocol::VerdictCache;

use crate::workload::PodOptions;

pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";
pub const BYPASS_INBOUND_ANNOTATION: &str = "ambient.istio.io/bypass-inbound-capture";
pub const DNS_CAPTURE_ANNOTATION: &str = "ambient.istio.io/dns-capture";

pub type Labels = BTreeMap<String, String>;

/// What the rules look at for one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    pub annotations: Labels,
    pub namespace_labels: Labels,
    pub host_network: bool,
}

/// Node-wide settings of the rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Namespaces never enrolled (istio's default: kube-system).
    pub exclude_namespaces: Vec<String>,
    /// Where ztunnel runs; its own pods (`app=ztunnel`) are never enrolled.
    pub system_namespace: String,
    /// DNS capture for pods without the `ambient.istio.io/dns-capture` annotation.
    pub dns_capture: bool,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            exclude_namespaces: vec!["kube-system".into()],
            system_namespace: "istio-system".into(),
            dns_capture: true,
        }
    }
}

fn label<'a>(labels: &'a Labels, key: &str) -> Option<&'a str> {
    labels.get(key).map(String::as_str)
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
    /// istio's ambient selection: opt-outs first, then the pod label, then the namespace label.
    pub fn is_ambient(&self, pod: &PodFacts) -> bool {
        let never = pod.host_network
            || pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION)
            || self.exclude_namespaces.contains(&pod.namespace)
            || (pod.namespace == self.system_namespace
                && label(&pod.labels, "app") == Some("ztunnel"))
            || label(&pod.labels, "app.kubernetes.io/name") == Some("weir");
        if never {
            return false;
        }
        match label(&pod.labels, DATAPLANE_MODE_LABEL) {
            Some("ambient") => true,
            Some("none") => false,
            _ => label(&pod.namespace_labels, DATAPLANE_MODE_LABEL) == Some("ambient"),
        }
    }

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
        let options = PodOptions {
            inbound_bypass: flag(BYPASS_INBOUND_ANNOTATION, false),
            dns_capture: flag(DNS_CAPTURE_ANNOTATION, self.dns_capture),
        };
        (options, problems)
    }
}

/// Labels and annotations for a node without an API server: the demo, `cargo xtask run`, tests.
/// JSON: `{"namespaces": {"<ns>": {"labels": {..}}}, "pods": {"<ns>/<name>": {"labels": {..},
/// "annotations": {..}}}}`. Read anew on every decision, so edits apply to the next pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalPolicy {
    #[serde(default)]
    pub namespaces: BTreeMap<String, ObjectMeta>,
    #[serde(default)]
    pub pods: BTreeMap<String, ObjectMeta>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    #[serde(default)]
    pub labels: Labels,
    #[serde(default)]
    pub annotations: Labels,
}

impl LocalPolicy {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading policy file {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("parsing policy file {}", path.display()))
    }

    /// The facts for a pod; annotations the runtime passed win over the file's.
    pub fn facts(&self, namespace: &str, name: &str, runtime_annotations: &Labels) -> PodFacts {
        let pod = self.pods.get(&format!("{namespace}/{name}"));
        let mut annotations = pod.map(|p| p.annotations.clone()).unwrap_or_default();
        annotations.extend(runtime_annotations.clone());
        PodFacts {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            labels: pod.map(|p| p.labels.clone()).unwrap_or_default(),
            annotations,
            namespace_labels: self
                .namespaces
                .get(namespace)
                .map(|n| n.labels.clone())
                .unwrap_or_default(),
            host_network: false,
        }
    }

    /// What the plugin needs to decide alone while the agent is down.
    pub fn verdict_cache(&self, config: &PolicyConfig) -> VerdictCache {
        let mut cache = VerdictCache::default();
        for (namespace, meta) in &self.namespaces {
            let facts = PodFacts {
                namespace: namespace.clone(),
                namespace_labels: meta.labels.clone(),
                ..PodFacts::default()
            };
            if config.is_ambient(&facts) {
                cache.ambient_namespaces.push(namespace.clone());
            }
        }
        for key in self.pods.keys() {
            let Some((namespace, name)) = key.split_once('/') else {
                warn!(key, "policy file pod key is not namespace/name");
                continue;
            };
            let ambient = config.is_ambient(&self.facts(namespace, name, &Labels::new()));
            let namespace_ambient = cache.ambient_namespaces.iter().any(|n| n == namespace);
            match (ambient, namespace_ambient) {
                (true, false) => cache.ambient_pods.push(key.clone()),
                (false, true) => cache.opted_out_pods.push(key.clone()),
                _ => {}
            }
        }
        cache
    }
}

/// Where ambient policy comes from on a node without an API server.
pub struct PolicySource {
    pub config: PolicyConfig,
    pub file: PathBuf,
    /// Kept current for the plugin, which decides alone while the agent is down.
    pub verdict_cache: PathBuf,
    /// What was last written there: rewritten only on change, one writer at a time.
    pub written: Mutex<Option<VerdictCache>>,
}

impl PolicySource {
    pub fn new(config: PolicyConfig, file: PathBuf, verdict_cache: PathBuf) -> Self {
        Self {
            config,
            file,
            verdict_cache,
            written: Mutex::new(None),
        }
    }

    /// The policy as the file has it now; the verdict cache is kept in step with it.
    pub fn load(&self) -> Result<LocalPolicy> {
        let policy = LocalPolicy::load(&self.file)?;
        let verdicts = policy.verdict_cache(&self.config);
        let mut written = self.written.lock().unwrap();
        if written.as_ref() != Some(&verdicts) {
            write_verdict_cache(&self.verdict_cache, &verdicts)?;
            *written = Some(verdicts);
        }
        Ok(policy)
    }
}

/// Writes the verdict cache atomically (temp file + rename): the plugin may read it any time.
pub fn write_verdict_cache(path: &Path, cache: &VerdictCache) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temp = path.with_extension("tmp");
    std::fs::write(&temp, serde_json::to_vec_pretty(cache)?)?;
    std::fs::rename(&temp, path).with_context(|| format!("writing {}", path.display()))
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

    fn pod(ns_mode: Option<&str>, pod_mode: Option<&str>) -> PodFacts {
        PodFacts {
            namespace: "app".into(),
            name: "p".into(),
            labels: pod_mode
                .map(|m| labels(&[(DATAPLANE_MODE_LABEL, m)]))
                .unwrap_or_default(),
            namespace_labels: ns_mode
                .map(|m| labels(&[(DATAPLANE_MODE_LABEL, m)]))
                .unwrap_or_default(),
            ..PodFacts::default()
        }
    }

    #[test]
    fn istio_selection_rules() {
        let config = PolicyConfig::default();
        assert!(config.is_ambient(&pod(Some("ambient"), None)));
        assert!(!config.is_ambient(&pod(Some("ambient"), Some("none"))));
        assert!(config.is_ambient(&pod(None, Some("ambient"))));
        assert!(!config.is_ambient(&pod(None, None)));

        let mut sidecar = pod(Some("ambient"), None);
        sidecar
            .annotations
            .insert(SIDECAR_STATUS_ANNOTATION.into(), "{}".into());
        assert!(!config.is_ambient(&sidecar));

        let mut host = pod(Some("ambient"), None);
        host.host_network = true;
        assert!(!config.is_ambient(&host));

        let mut excluded = pod(None, Some("ambient"));
        excluded.namespace = "kube-system".into();
        assert!(!config.is_ambient(&excluded));

        let mut ztunnel = pod(None, Some("ambient"));
        ztunnel.namespace = "istio-system".into();
        ztunnel.labels.insert("app".into(), "ztunnel".into());
        assert!(!config.is_ambient(&ztunnel));
    }

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
    fn verdict_cache_from_a_local_policy() {
        let policy: LocalPolicy = serde_json::from_value(serde_json::json!({
            "namespaces": {"mesh": {"labels": {DATAPLANE_MODE_LABEL: "ambient"}}, "plain": {}},
            "pods": {
                "mesh/out": {"labels": {DATAPLANE_MODE_LABEL: "none"}},
                "plain/in": {"labels": {DATAPLANE_MODE_LABEL: "ambient"}}
            }
        }))
        .unwrap();
        let cache = policy.verdict_cache(&PolicyConfig::default());
        assert_eq!(cache.ambient_namespaces, ["mesh"]);
        assert_eq!(cache.ambient_pods, ["plain/in"]);
        assert_eq!(cache.opted_out_pods, ["mesh/out"]);
    }
}
