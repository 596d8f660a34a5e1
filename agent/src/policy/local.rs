//! The policy of a node without an API server (the demo, `cargo xtask run`, tests): a JSON file
//! of namespaces' and pods' labels and annotations, read anew on every decision so edits apply
//! to the next pod.
use std::{collections::BTreeMap, path::Path, path::PathBuf};

use anyhow::{Context, Result};
use futures::{future::BoxFuture, FutureExt};
use serde::{Deserialize, Serialize};

use super::{
    verdicts::VerdictWriter, AmbientPod, Labels, PodFacts, Policy, PolicyConfig, PolicyError,
};
use crate::workload::PodName;

/// `{"namespaces": {"<ns>": {"labels": {..}}}, "pods": {"<ns>/<name>": {"labels": {..},
/// "annotations": {..}}}}`; a pod's `weir.dev/service-account` annotation names its service
/// account (default `default`).
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

/// Where a policy file names a pod's service account.
const SERVICE_ACCOUNT_ANNOTATION: &str = "weir.dev/service-account";

impl LocalPolicy {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading policy file {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("parsing policy file {}", path.display()))
    }

    /// The facts for a pod; annotations the runtime passed win over the file's.
    pub fn facts(&self, pod: &PodName, runtime_annotations: &Labels) -> PodFacts {
        let meta = self.pods.get(&pod.to_string());
        let mut annotations = meta.map(|p| p.annotations.clone()).unwrap_or_default();
        annotations.extend(runtime_annotations.clone());
        PodFacts {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            labels: meta.map(|p| p.labels.clone()).unwrap_or_default(),
            service_account: annotations.get(SERVICE_ACCOUNT_ANNOTATION).cloned(),
            annotations,
            namespace_labels: self
                .namespaces
                .get(&pod.namespace)
                .map(|n| n.labels.clone())
                .unwrap_or_default(),
            ..PodFacts::default()
        }
    }

    fn pod_facts(&self) -> impl Iterator<Item = PodFacts> + '_ {
        self.pods
            .keys()
            .filter_map(|key| match key.split_once('/') {
                Some((namespace, name)) => {
                    Some(self.facts(&PodName::new(namespace, name), &Labels::new()))
                }
                None => {
                    tracing::warn!(key, "policy file pod key is not namespace/name");
                    None
                }
            })
    }
}

/// The local file as a [`Policy`]; the verdict cache is kept in step with the file.
pub struct LocalSource {
    config: PolicyConfig,
    file: PathBuf,
    verdicts: VerdictWriter,
}

impl LocalSource {
    /// Fails when the file cannot be read now: a typo should stop the agent, not every pod.
    pub fn new(config: PolicyConfig, file: PathBuf, verdict_cache: PathBuf) -> Result<Self> {
        let source = Self {
            config,
            file,
            verdicts: VerdictWriter::new(verdict_cache),
        };
        source.load().context("loading the ambient policy")?;
        Ok(source)
    }

    fn load(&self) -> Result<LocalPolicy> {
        let policy = LocalPolicy::load(&self.file)?;
        let namespaces = policy
            .namespaces
            .iter()
            .map(|(n, m)| (n.as_str(), &m.labels));
        self.verdicts
            .write(self.config.verdict_cache(namespaces, policy.pod_facts()))?;
        Ok(policy)
    }
}

impl Policy for LocalSource {
    fn decide<'a>(
        &'a self,
        pod: &'a PodName,
        _uid: &'a str,
        runtime_annotations: &'a Labels,
    ) -> BoxFuture<'a, Result<Option<AmbientPod>, PolicyError>> {
        let decision = self
            .load()
            .map(|policy| self.config.decide(&policy.facts(pod, runtime_annotations)));
        futures::future::ready(decision.map_err(PolicyError::from)).boxed()
    }

    fn synced(&self) -> BoxFuture<'_, ()> {
        futures::future::ready(()).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::DATAPLANE_MODE_LABEL;

    #[test]
    fn verdict_cache_from_a_policy_file() {
        let dir = tempfile::tempdir().unwrap();
        let (file, cache) = (dir.path().join("policy.json"), dir.path().join("v.json"));
        let policy = serde_json::json!({
            "namespaces": {"mesh": {"labels": {DATAPLANE_MODE_LABEL: "ambient"}}, "plain": {}},
            "pods": {
                "mesh/out": {"labels": {DATAPLANE_MODE_LABEL: "none"}},
                "plain/in": {"labels": {DATAPLANE_MODE_LABEL: "ambient"},
                             "annotations": {SERVICE_ACCOUNT_ANNOTATION: "sa"}}
            }
        });
        std::fs::write(&file, policy.to_string()).unwrap();
        let source = LocalSource::new(PolicyConfig::default(), file, cache.clone()).unwrap();
        let written: weir_cni::protocol::VerdictCache =
            serde_json::from_slice(&std::fs::read(cache).unwrap()).unwrap();
        assert_eq!(written.ambient_namespaces, ["mesh"]);
        assert_eq!(written.ambient_pods, ["plain/in"]);
        assert_eq!(written.opted_out_pods, ["mesh/out"]);

        let decide = |namespace, name| {
            let (pod, runtime) = (PodName::new(namespace, name), Labels::new());
            futures::executor::block_on(source.decide(&pod, "", &runtime)).unwrap()
        };
        assert_eq!(decide("plain", "in").unwrap().service_account, "sa");
        assert!(decide("mesh", "out").is_none());
        assert!(decide("mesh", "new").is_some());
    }
}
