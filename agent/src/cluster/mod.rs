//! The Kubernetes side of the agent, as istio-cni's node agent follows the cluster: reflectors
//! over the pods on this node, all namespaces and weir's own DaemonSet ([`Reflectors`]), the
//! policy that decides from these caches ([`policy`]), the status annotation and Events on pods
//! ([`report`]), the reconcile loop ([`reconcile`]) with pod repair ([`repair`]), the repair of
//! broken sidecar pods ([`sidecar_repair`]), the SIGTERM rule ([`shutdown`]), and the node
//! condition that tells whether the agent serves the node ([`node_condition`]). The caches keep
//! only what the agent reads of each object ([`prune`]).
pub mod node_condition;
pub mod policy;
mod prune;
pub mod reconcile;
pub mod repair;
pub mod report;
pub mod shutdown;
pub mod sidecar_repair;

use std::{
    collections::HashSet,
    fmt::Debug,
    hash::Hash,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};
use futures::{future::join3, StreamExt};
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Namespace, Pod, PodSpec},
};
use kube::{
    api::Api,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        reflector::{self, ObjectRef, Store},
        watcher, WatchStreamExt,
    },
    Client, Resource, ResourceExt,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use serde::de::DeserializeOwned;
use tokio::{
    sync::{broadcast, watch},
    task::JoinSet,
};
use tracing::warn;

use weir_cni::ambient::ContainerFacts;

use crate::{
    policy::{Labels, PodFacts},
    workload::PodName,
};

/// How the agent finds the API server and itself in it.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// A kubeconfig file; without one, the in-cluster config (service account) or `KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// The node this agent serves (the pods' `spec.nodeName`).
    pub node_name: String,
    /// How often every pod on the node is checked again, changes or not.
    pub resync_interval: Duration,
    /// What becomes of a pod running without redirection: ambient, or sidecar as its
    /// istio-validation tells.
    pub broken_pods: repair::BrokenPods,
}

/// A kube client for `config`.
pub async fn connect(config: &ClusterConfig) -> Result<Client> {
    client(config.kubeconfig.as_deref()).await
}

/// A kube client from `kubeconfig`, or the in-cluster service account without one.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client> {
    let kube_config = match kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no in-cluster config or KUBECONFIG")?,
    };
    Client::try_from(kube_config).context("building the Kubernetes client")
}

/// Something in the caches changed; a reconcile loop subscribes with [`Reflectors::changes`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Pod(PodName),
    Namespace(String),
    DaemonSet,
    /// A watch relisted (at start, or after the API server forgot its resourceVersion): the
    /// store now holds the whole new list, which reached it at once at the list's end.
    Relisted,
}

/// The runs of a loop that follows the caches' [`Change`]s, by what started each: `change` (a
/// pod's or a namespace's), `pass` (every pod: the first pass, a resync, a relist, a ztunnel
/// that connected) or `retry` (pods whose backoff expired). Counted once a run is done, so that
/// what it did can be waited on.
#[derive(Clone, Default)]
pub struct LoopRuns(Family<RunLabels, Counter>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabels {
    trigger: &'static str,
}

impl LoopRuns {
    pub fn register(&self, registry: &mut Registry, name: &str, help: &str) {
        registry.register(name, help, self.0.clone());
    }

    pub fn ran(&self, trigger: &'static str) {
        self.0.get_or_create(&RunLabels { trigger }).inc();
    }
}

/// The caches the agent decides from, kept current by watches that relist when the API server
/// has forgotten their resourceVersion (410), and the stream of their changes.
#[derive(Clone)]
pub struct Reflectors {
    pub pods: Store<Pod>,
    pub namespaces: Store<Namespace>,
    pub daemonsets: Store<DaemonSet>,
    changes: broadcast::Sender<Change>,
    synced: watch::Receiver<bool>,
    informer_events: InformerEvents,
}

impl Reflectors {
    /// Starts the watches as tasks of `tasks`: pods with `spec.nodeName=<node>`, every
    /// namespace, and the DaemonSet `daemonset` in `namespace`.
    pub fn start(
        client: &Client,
        node_name: &str,
        namespace: &str,
        daemonset: &str,
        tasks: &mut JoinSet<()>,
    ) -> Self {
        let (changes, _) = broadcast::channel(1024);
        let informer_events = InformerEvents::default();
        let pods = reflect(
            Api::all(client.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={node_name}")),
            prune::pod,
            |pod: &Pod| {
                Change::Pod(PodName::new(
                    &pod.namespace().unwrap_or_default(),
                    &pod.name_any(),
                ))
            },
            &changes,
            Some(&informer_events),
            tasks,
        );
        let namespaces = reflect(
            Api::all(client.clone()),
            watcher::Config::default(),
            prune::namespace,
            |namespace: &Namespace| Change::Namespace(namespace.name_any()),
            &changes,
            Some(&informer_events),
            tasks,
        );
        let daemonsets = reflect(
            Api::namespaced(client.clone(), namespace),
            watcher::Config::default().fields(&format!("metadata.name={daemonset}")),
            prune::daemonset,
            |_: &DaemonSet| Change::DaemonSet,
            &changes,
            None,
            tasks,
        );
        // A store's `wait_until_ready` wakes only its latest waiter (one oneshot underneath), so
        // one task waits for all three and everyone else watches its verdict.
        let (synced_tx, synced) = watch::channel(false);
        let stores = (pods.clone(), namespaces.clone(), daemonsets.clone());
        tasks.spawn(async move {
            let all = join3(
                stores.0.wait_until_ready(),
                stores.1.wait_until_ready(),
                stores.2.wait_until_ready(),
            );
            if let (Ok(()), Ok(()), Ok(())) = all.await {
                synced_tx.send_replace(true);
            }
        });
        Self {
            pods,
            namespaces,
            daemonsets,
            changes,
            synced,
            informer_events,
        }
    }

    /// Registers `nodeagent_reconcile_events_total{type}`, istio-cni's count of its informers'
    /// pod and namespace events.
    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "nodeagent_reconcile_events",
            "The total number of node agent reconcile events.",
            self.informer_events.0.clone(),
        );
    }

    /// Every change from now on (a lagging receiver should re-read the stores).
    pub fn changes(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    /// Resolves once every cache holds its first complete list.
    pub async fn synced(&self) {
        let mut synced = self.synced.clone();
        // An error means the watches ended with the agent: nothing left to wait for.
        let _ = synced.wait_for(|synced| *synced).await;
    }

    pub fn pod(&self, pod: &PodName) -> Option<std::sync::Arc<Pod>> {
        self.pods
            .get(&ObjectRef::new(&pod.name).within(&pod.namespace))
    }

    pub fn namespace_labels(&self, namespace: &str) -> Option<Labels> {
        let namespace = self.namespaces.get(&ObjectRef::new(namespace))?;
        Some(namespace.labels().clone())
    }
}

/// A reflector over `api` feeding a store with each object as `prune` leaves it, announcing each
/// object it applies or deletes, and the end of each relist. The objects of a relist reach the
/// store only together, at its end: announced one by one as they arrive, a reader would find the
/// store's copy from before.
fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    prune: fn(&mut K),
    change_of: fn(&K) -> Change,
    changes: &broadcast::Sender<Change>,
    informer_events: Option<&InformerEvents>,
    tasks: &mut JoinSet<()>,
) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let changes = changes.clone();
    let mut event_types = informer_events.map(|events| EventTypes::new(events.clone()));
    let events = reflector::reflector(writer, watcher(api, config).modify(prune)).default_backoff();
    // The first list is the initial sync, which the reconciler's first full pass covers.
    let mut listed = false;
    tasks.spawn(events.for_each(move |event| {
        if let (Some(types), Ok(event)) = (&mut event_types, &event) {
            types.count(event);
        }
        // Nobody listening yet is fine: the stores hold the state.
        match event {
            Ok(watcher::Event::Apply(object) | watcher::Event::Delete(object)) => {
                drop(changes.send(change_of(&object)))
            }
            Ok(watcher::Event::InitDone) if !listed => {
                listed = true;
                return_freed_memory();
            }
            Ok(watcher::Event::InitDone) => {
                return_freed_memory();
                drop(changes.send(Change::Relisted))
            }
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Err(error) => warn!(kind = K::kind(&()).as_ref(), %error, "watch failed; retrying"),
        }
        futures::future::ready(())
    }));
    reader
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventTypeLabel {
    r#type: &'static str,
}

/// The events of the pod and namespace reflectors, by `type` as an informer tells them:
/// `add` (an object first seen, the initial list's included), `update` (a change to one seen
/// before), `delete` (gone, also when a relist no longer holds it).
#[derive(Clone, Default)]
struct InformerEvents(Family<EventTypeLabel, Counter>);

/// What one reflector has seen, to tell an add from an update as an informer does.
struct EventTypes<K: Resource<DynamicType = ()>> {
    known: HashSet<ObjectRef<K>>,
    relisted: HashSet<ObjectRef<K>>,
    events: InformerEvents,
}

impl<K> EventTypes<K>
where
    K: Resource<DynamicType = ()>,
    ObjectRef<K>: Hash + Eq,
{
    fn new(events: InformerEvents) -> Self {
        Self {
            known: HashSet::new(),
            relisted: HashSet::new(),
            events,
        }
    }

    fn count(&mut self, event: &watcher::Event<K>) {
        match event {
            watcher::Event::Apply(object) => self.applied(ObjectRef::from_obj(object)),
            watcher::Event::Delete(object) => {
                self.known.remove(&ObjectRef::from_obj(object));
                self.inc("delete");
            }
            watcher::Event::Init => self.relisted.clear(),
            watcher::Event::InitApply(object) => {
                let key = ObjectRef::from_obj(object);
                self.relisted.insert(key.clone());
                self.applied(key);
            }
            watcher::Event::InitDone => {
                let gone = self.known.difference(&self.relisted).count();
                for _ in 0..gone {
                    self.inc("delete");
                }
                self.known = std::mem::take(&mut self.relisted);
            }
        }
    }

    fn applied(&mut self, key: ObjectRef<K>) {
        let first_seen = self.known.insert(key);
        self.inc(if first_seen { "add" } else { "update" });
    }

    fn inc(&self, r#type: &'static str) {
        self.events
            .0
            .get_or_create(&EventTypeLabel { r#type })
            .inc();
    }
}

/// A list's objects arrive whole and are kept pruned: what they freed lies in the allocator's
/// arenas between the objects kept, where glibc keeps it from the kernel until asked. Without
/// this, a node's pods as the API server sends them leave the agent twice the memory.
fn return_freed_memory() {
    // SAFETY: malloc_trim only walks the allocator's own free lists; no pointer is handed over.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// What the rules look at, from the pod object and its namespace's labels.
pub fn facts_of(pod: &Pod, namespace_labels: Labels) -> PodFacts {
    let spec = pod.spec.as_ref();
    PodFacts {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        labels: pod.labels().clone(),
        annotations: pod.annotations().clone(),
        namespace_labels,
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        daemonset_owner: pod
            .owner_references()
            .iter()
            .find(|owner| owner.kind == "DaemonSet")
            .map(|owner| owner.name.clone()),
        service_account: spec.and_then(|s| s.service_account_name.clone()),
        containers: spec.map(containers_of).unwrap_or_default(),
    }
}

/// The addresses the API server reports for the pod (`status.podIPs`).
pub fn ips_of(pod: &Pod) -> Vec<std::net::IpAddr> {
    let ips = pod.status.as_ref().and_then(|s| s.pod_ips.as_ref());
    ips.into_iter()
        .flatten()
        .filter_map(|ip| ip.ip.parse().ok())
        .collect()
}

/// Init containers first, then containers, as istio-cni scans them.
fn containers_of(spec: &PodSpec) -> Vec<ContainerFacts> {
    let init = spec.init_containers.iter().flatten();
    init.chain(&spec.containers)
        .map(|container| {
            let security = container.security_context.as_ref();
            ContainerFacts {
                name: container.name.clone(),
                args: container.args.clone().unwrap_or_default(),
                env: (container.env.iter().flatten())
                    .map(|var| {
                        // The API server leaves out an empty value; only valueFrom has none.
                        let value = (var.value.clone())
                            .or_else(|| var.value_from.is_none().then(String::new));
                        (var.name.clone(), value)
                    })
                    .collect(),
                run_as_user: security.and_then(|s| s.run_as_user),
                run_as_group: security.and_then(|s| s.run_as_group),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespace(name: &str) -> Namespace {
        let mut namespace = Namespace::default();
        namespace.metadata.name = Some(name.into());
        namespace
    }

    fn counted(events: &InformerEvents) -> [u64; 3] {
        ["add", "update", "delete"]
            .map(|r#type| events.0.get_or_create(&EventTypeLabel { r#type }).get())
    }

    #[test]
    fn events_are_told_apart_as_an_informer_tells_them() {
        let events = InformerEvents::default();
        let mut types = EventTypes::new(events.clone());
        let (a, b, c) = (namespace("a"), namespace("b"), namespace("c"));
        types.count(&watcher::Event::Init);
        types.count(&watcher::Event::InitApply(a.clone()));
        types.count(&watcher::Event::InitApply(b.clone()));
        types.count(&watcher::Event::InitDone);
        assert_eq!(counted(&events), [2, 0, 0], "the first list: adds");
        types.count(&watcher::Event::Apply(a.clone()));
        types.count(&watcher::Event::Apply(c.clone()));
        types.count(&watcher::Event::Delete(c));
        assert_eq!(counted(&events), [3, 1, 1]);
        // A relist: a is still there, b is gone.
        types.count(&watcher::Event::Init);
        types.count(&watcher::Event::InitApply(a));
        types.count(&watcher::Event::InitDone);
        assert_eq!(counted(&events), [3, 2, 2]);
        types.count(&watcher::Event::Apply(b));
        assert_eq!(counted(&events), [4, 2, 2], "b is new again");
    }

    #[test]
    fn the_type_label_is_named_type() {
        let events = InformerEvents::default();
        let mut registry = Registry::default();
        registry.register("nodeagent_reconcile_events", "", events.0.clone());
        events
            .0
            .get_or_create(&EventTypeLabel { r#type: "add" })
            .inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"nodeagent_reconcile_events_total{type="add"} 1"#),
            "{text}"
        );
    }
}
