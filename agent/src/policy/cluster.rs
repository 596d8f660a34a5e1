//! The policy source of a node in a cluster: decisions from the reflectors' caches of this
//! node's pods and every namespace (as istio-cni decides from its informers), the status
//! annotation and Events through the API server, and the verdict cache for the plugin rewritten
//! whenever the caches change.
use std::{sync::Arc, time::Duration};

use anyhow::Result;
use futures::{future::BoxFuture, FutureExt};
use k8s_openapi::api::core::v1::Node;
use kube::{api::Api, Client, ResourceExt};
use tokio::{sync::broadcast::error::RecvError, task::JoinSet};
use tracing::{debug, warn};

use super::{
    AmbientPod, Labels, PodFacts, PodName, PolicyConfig, PolicyError, PolicySource, VerdictWriter,
    Warning,
};
use crate::{
    cluster::{facts_of, report::Reporter, shutdown, ClusterConfig, Reflectors},
    enroll::Status,
};

/// A pod the CNI ADD names may not have reached the cache yet: istio looks 10 times, 10 ms apart.
const LOOKUP_TRIES: u32 = 10;
const LOOKUP_INTERVAL: Duration = Duration::from_millis(10);
/// A status patch or Event must not hold a pod's CNI ADD for long.
const API_TIMEOUT: Duration = Duration::from_secs(2);

pub struct ClusterSource {
    config: PolicyConfig,
    node_name: String,
    client: Client,
    reflectors: Reflectors,
    reporter: Reporter,
    /// The reflectors and the verdict cache writer; aborted when the source is dropped.
    _tasks: JoinSet<()>,
}

impl ClusterSource {
    /// Connects and starts the reflectors; answers once they have synced ([`PolicySource::synced`]).
    pub async fn start(
        config: PolicyConfig,
        cluster: &ClusterConfig,
        verdict_cache: std::path::PathBuf,
    ) -> Result<Arc<Self>> {
        let client = crate::cluster::connect(cluster).await?;
        let mut tasks = JoinSet::new();
        let reflectors = Reflectors::start(
            &client,
            &cluster.node_name,
            &config.own.namespace,
            &config.own.daemonset,
            &mut tasks,
        );
        let source = Arc::new(Self {
            reporter: Reporter::new(client.clone(), config.own.pod_name.clone()),
            config,
            node_name: cluster.node_name.clone(),
            client,
            reflectors,
            _tasks: tasks,
        });
        // Holds only a weak reference: the writer ends with the source.
        let verdicts = VerdictWriter::new(verdict_cache);
        tokio::spawn(keep_verdicts(Arc::downgrade(&source), verdicts));
        Ok(source)
    }

    /// The caches, for a reconcile loop to read and subscribe to.
    pub fn reflectors(&self) -> &Reflectors {
        &self.reflectors
    }

    /// The client it follows the cluster with, for the reconcile loop's repairs.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.reporter.register_metrics(registry);
    }

    pub fn client(&self) -> &Client {
        &self.client
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

    async fn node_labels(&self) -> Result<Labels> {
        let node = Api::<Node>::all(self.client.clone())
            .get(&self.node_name)
            .await?;
        Ok(node.labels().clone())
    }
}

/// Rewrites the plugin's verdict cache after the first sync and on every change.
async fn keep_verdicts(source: std::sync::Weak<ClusterSource>, verdicts: VerdictWriter) {
    let (mut changes, reflectors) = match source.upgrade() {
        Some(source) => (source.reflectors.changes(), source.reflectors.clone()),
        None => return,
    };
    reflectors.synced().await;
    // The change stream closes when the source (the last sender's owner) is dropped.
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

impl PolicySource for ClusterSource {
    fn decide<'a>(
        &'a self,
        pod: &'a PodName,
        uid: &'a str,
        _runtime_annotations: &'a Labels,
    ) -> BoxFuture<'a, Result<Option<AmbientPod>, PolicyError>> {
        // The pod object is the truth; the runtime's copy of its annotations adds nothing.
        async move { Ok(self.config.decide(&self.facts(pod, uid).await?)) }.boxed()
    }

    fn report_status<'a>(&'a self, pod: &'a PodName, status: Option<Status>) -> BoxFuture<'a, ()> {
        async move {
            match tokio::time::timeout(API_TIMEOUT, self.reporter.set_redirection(pod, status))
                .await
            {
                Ok(Ok(())) => debug!(%pod, ?status, "redirection annotation set"),
                Ok(Err(error)) => {
                    warn!(%pod, ?status, "setting the redirection annotation: {error:#}")
                }
                Err(_) => warn!(%pod, ?status, "setting the redirection annotation timed out"),
            }
        }
        .boxed()
    }

    fn warn<'a>(&'a self, pod: &'a PodName, warning: Warning) -> BoxFuture<'a, ()> {
        async move {
            let uid = self.reflectors.pod(pod).and_then(|p| p.uid());
            let publish = self.reporter.warn(pod, uid, &warning);
            match tokio::time::timeout(API_TIMEOUT, publish).await {
                Ok(Ok(published)) => debug!(%pod, reason = warning.reason(), published, "event"),
                Ok(Err(error)) => warn!(%pod, "publishing an event: {error:#}"),
                Err(_) => warn!(%pod, "publishing an event timed out"),
            }
        }
        .boxed()
    }

    fn synced(&self) -> BoxFuture<'_, ()> {
        self.reflectors.synced().boxed()
    }

    fn keep_node_on_exit(&self) -> BoxFuture<'_, bool> {
        async move {
            let daemonset = self.reflectors.daemonsets.state().into_iter().next();
            let node_labels = match tokio::time::timeout(API_TIMEOUT, self.node_labels()).await {
                Ok(Ok(labels)) => labels,
                // Without the node's labels an upgrade cannot be told from a removal: keeping
                // weir in place never leaves an ambient pod unredirected.
                Ok(Err(error)) => {
                    warn!(
                        "reading node {}: {error:#}; keeping weir in place",
                        self.node_name
                    );
                    return true;
                }
                Err(_) => {
                    warn!(
                        "reading node {} timed out; keeping weir in place",
                        self.node_name
                    );
                    return true;
                }
            };
            shutdown::keep_node(daemonset.as_deref(), &node_labels)
        }
        .boxed()
    }
}
