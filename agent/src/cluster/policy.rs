//! The policy of a node in a cluster: decisions from the reflectors' caches of this node's pods
//! and every namespace (as istio-cni decides from its informers), and the verdict cache for the
//! plugin rewritten whenever the caches change.
use std::{path::PathBuf, sync::Arc, time::Duration};

use futures::{future::BoxFuture, FutureExt};
use kube::{Client, ResourceExt};
use tokio::{sync::broadcast::error::RecvError, task::JoinSet};
use tracing::warn;

use super::{facts_of, Reflectors};
use crate::{
    policy::{
        verdicts::VerdictWriter, Decision, Labels, PodFacts, Policy, PolicyConfig, PolicyError,
    },
    workload::PodName,
};

/// A pod the CNI ADD names may not have reached the cache yet: istio looks 10 times, 10 ms apart.
const LOOKUP_TRIES: u32 = 10;
const LOOKUP_INTERVAL: Duration = Duration::from_millis(10);

pub struct ClusterSource {
    config: PolicyConfig,
    reflectors: Reflectors,
    /// The reflectors and the verdict cache writer; aborted when the source is dropped.
    _tasks: JoinSet<()>,
}

impl ClusterSource {
    /// Starts the reflectors of `node_name`; answers once they have synced ([`Policy::synced`]).
    pub fn start(
        config: PolicyConfig,
        client: &Client,
        node_name: &str,
        verdict_cache: PathBuf,
    ) -> Arc<Self> {
        let mut tasks = JoinSet::new();
        let reflectors = Reflectors::start(
            client,
            node_name,
            &config.own.namespace,
            &config.own.daemonset,
            &mut tasks,
        );
        let source = Arc::new(Self {
            config,
            reflectors,
            _tasks: tasks,
        });
        // Holds only a weak reference: the writer ends with the source.
        let verdicts = VerdictWriter::new(verdict_cache);
        tokio::spawn(keep_verdicts(Arc::downgrade(&source), verdicts));
        source
    }

    /// The caches, for a reconcile loop to read and subscribe to.
    pub fn reflectors(&self) -> &Reflectors {
        &self.reflectors
    }

    /// The pod's facts from the caches, waiting briefly for a pod or namespace not there yet.
    /// A cached pod of that name with another uid is a namesake (deleted, and the new one not
    /// in the cache yet): its labels never decide for the runtime's pod.
    async fn facts(&self, pod: &PodName, uid: &str) -> Result<PodFacts, PolicyError> {
        for attempt in 1..=LOOKUP_TRIES {
            let object = self
                .reflectors
                .pod(pod)
                .filter(|object| uid.is_empty() || object.uid().as_deref() == Some(uid));
            let namespace_labels = self.reflectors.namespace_labels(&pod.namespace);
            if let (Some(object), Some(namespace_labels)) = (object, namespace_labels) {
                return Ok(facts_of(&object, namespace_labels));
            }
            if attempt < LOOKUP_TRIES {
                tokio::time::sleep(LOOKUP_INTERVAL).await;
            }
        }
        Err(PolicyError::NotYetKnown(pod.clone()))
    }

    fn verdict_cache(&self) -> weir_cni::protocol::VerdictCache {
        let namespaces = self.reflectors.namespaces.state();
        let pods = self.reflectors.pods.state();
        let namespace_labels =
            |name: &str| self.reflectors.namespace_labels(name).unwrap_or_default();
        self.config.verdict_cache(
            namespaces
                .iter()
                .map(|n| (n.metadata.name.as_deref().unwrap_or_default(), n.labels())),
            pods.iter()
                .map(|pod| facts_of(pod, namespace_labels(&pod.namespace().unwrap_or_default()))),
        )
    }
}

/// Rewrites the plugin's verdict cache after the first sync and on every change.
async fn keep_verdicts(source: std::sync::Weak<ClusterSource>, verdicts: VerdictWriter) {
    let (mut changes, reflectors) = match source.upgrade() {
        Some(source) => (source.reflectors.changes(), source.reflectors.clone()),
        None => return,
    };
    reflectors.synced().await;
    // The change stream closes once the source and every other holder of the reflectors (the
    // last senders' owners) are dropped.
    drop(reflectors);
    loop {
        let Some(source) = source.upgrade() else {
            return;
        };
        if let Err(error) = verdicts.write(source.verdict_cache()) {
            warn!("writing the verdict cache: {error:#}");
        }
        drop(source);
        match changes.recv().await {
            Ok(_) | Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
    }
}

impl Policy for ClusterSource {
    fn decide<'a>(
        &'a self,
        pod: &'a PodName,
        uid: &'a str,
        _runtime_annotations: &'a Labels,
    ) -> BoxFuture<'a, Result<Decision, PolicyError>> {
        // The pod object is the truth; the runtime's copy of its annotations adds nothing.
        async move {
            self.config
                .decide_mode(&self.facts(pod, uid).await?)
                .map_err(|invalid| PolicyError::InvalidAnnotation(pod.clone(), invalid))
        }
        .boxed()
    }

    fn synced(&self) -> BoxFuture<'_, ()> {
        self.reflectors.synced().boxed()
    }
}
