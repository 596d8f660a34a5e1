//! The policy of a node without an API server (the demo, `cargo xtask run`, tests): a JSON file
//! of namespaces' and pods' labels and annotations, read anew on every decision so edits apply
//! to the next pod.
use std::{collections::BTreeMap, path::Path, path::PathBuf};

use anyhow::{Context, Result};
use futures::{future::BoxFuture, FutureExt};
use serde::{Deserialize, Serialize};
use weir_cni::ambient::ContainerFacts;

use super::{
    verdicts::VerdictWriter, Decision, Labels, PodFacts, Policy, PolicyConfig, PolicyError,
};
use crate::workload::PodName;

/// `{"namespaces": {"<ns>": {"labels": {..}}}, "pods": {"<ns>/<name>": {"labels": {..},
/// "annotations": {..}, "containers": [..]}}}`; a pod's `weir.dev/service-account` annotation
/// names its service account (default `default`). A pod's `containers` are its init containers
/// then its containers, each `{"name": .., "args": [..], "env": {"<name>": "<value>"},
/// "runAsUser": N, "runAsGroup": N}` with only `name` required: what tells a sidecar pod (an
/// `istio-proxy` container) and how it is redirected. Every key but `labels` is optional.
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
    /// Read for pods only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<Container>,
}

/// One of a pod's containers, as much as the sidecar decision reads of it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    pub name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as_user: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as_group: Option<i64>,
}

impl Container {
    fn facts(&self) -> ContainerFacts {
        ContainerFacts {
            name: self.name.clone(),
            args: self.args.clone(),
            env: (self.env.iter())
                .map(|(name, value)| (name.clone(), Some(value.clone())))
                .collect(),
            run_as_user: self.run_as_user,
            run_as_group: self.run_as_group,
        }
    }
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
            containers: meta
                .map(|p| p.containers.iter().map(Container::facts).collect())
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
    ) -> BoxFuture<'a, Result<Decision, PolicyError>> {
        let decision = self.load().map_err(PolicyError::from).and_then(|policy| {
            self.config
                .decide_mode(&policy.facts(pod, runtime_annotations))
                .map_err(|invalid| PolicyError::InvalidAnnotation(pod.clone(), invalid))
        });
        futures::future::ready(decision).boxed()
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
                "plain/out": {},
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
        assert_eq!(written.other_pods, ["plain/out"]);

        let decide = |namespace, name| {
            let (pod, runtime) = (PodName::new(namespace, name), Labels::new());
            futures::executor::block_on(source.decide(&pod, "", &runtime)).unwrap()
        };
        match decide("plain", "in") {
            Decision::Ambient(ambient) => assert_eq!(ambient.service_account, "sa"),
            other => panic!("plain/in is ambient, not {other:?}"),
        }
        assert_eq!(decide("mesh", "out"), Decision::Neither);
        assert!(matches!(decide("mesh", "new"), Decision::Ambient(_)));
    }

    #[test]
    fn a_pods_containers_come_from_the_file() {
        let policy: LocalPolicy = serde_json::from_value(serde_json::json!({
            "pods": {"shop/api": {
                "annotations": {"sidecar.istio.io/status": "{}"},
                "containers": [
                    {"name": "istio-validation"},
                    {"name": "istio-proxy", "args": ["proxy", "sidecar"],
                     "env": {"ISTIO_META_DNS_CAPTURE": "true"},
                     "runAsUser": 0, "runAsGroup": 2000},
                ],
            }},
        }))
        .unwrap();
        let facts = policy.facts(&PodName::new("shop", "api"), &Labels::new());
        assert_eq!(
            facts.containers,
            [
                ContainerFacts {
                    name: "istio-validation".into(),
                    ..ContainerFacts::default()
                },
                ContainerFacts {
                    name: "istio-proxy".into(),
                    args: vec!["proxy".into(), "sidecar".into()],
                    env: vec![("ISTIO_META_DNS_CAPTURE".into(), Some("true".into()))],
                    run_as_user: Some(0),
                    run_as_group: Some(2000),
                },
            ]
        );
        let redirect = crate::policy::sidecar::decide(&facts).unwrap().unwrap();
        assert_eq!((redirect.proxy_uid, redirect.proxy_gid), (1337, 2000));
        assert!(redirect.dns_capture);

        let round_trip: LocalPolicy =
            serde_json::from_str(&serde_json::to_string(&policy).unwrap()).unwrap();
        assert_eq!(round_trip, policy);
        let unknown = policy.facts(&PodName::new("shop", "other"), &Labels::new());
        assert!(unknown.containers.is_empty());
    }
}
