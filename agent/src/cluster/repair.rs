//! Pod repair, istio's repair controller (`cni/pkg/repair`). An ambient pod found running
//! without redirection is enrolled live by the reconcile loop, a broken sidecar pod by
//! [`super::sidecar_repair`] (istio's `repairPods`); where that is impossible, or for sidecar
//! pods switched off, the action configured here applies to it instead, as istio's `deletePods`
//! and `labelPods` do. Every attempt is counted in istio's
//! `istio_cni_repair_pods_repaired_total{type,result}`.
use std::{future::Future, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use kube::{
    api::{Api, DeleteParams, Patch, PatchParams, Preconditions},
    Client, ResourceExt,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use serde_json::json;
use tracing::{info, warn};

use crate::report::{Warning, UNINITIALIZED_LABEL};

/// A delete or label must not hold the pod's turn for long; it is retried with the pod.
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// What becomes of a broken pod: istio's three repair modes, tried in its order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BrokenPods {
    /// Broken sidecar pods are enrolled in place (istio's `repairPods`, on in its chart). An
    /// ambient pod is always enrolled live: one running unredirected is never left so.
    pub repair_in_place: bool,
    /// What becomes of a broken pod not repaired in place.
    pub action: BrokenPodAction,
}

impl Default for BrokenPods {
    fn default() -> Self {
        Self {
            repair_in_place: true,
            action: BrokenPodAction::None,
        }
    }
}

/// What becomes of a broken pod that is not enrolled in place: an ambient pod whose network
/// namespace is not found, or entering or enrolling it fails; a sidecar pod the same, or any
/// with in-place repair off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BrokenPodAction {
    /// Nothing but the in-place repair, retried with backoff and reported: istio's default
    /// (`repairPods` on, `deletePods` and `labelPods` off).
    #[default]
    None,
    /// Delete the pod, with its UID and resourceVersion as preconditions, so its owner
    /// recreates it through a chain that has weir-cni again.
    Delete,
    /// Label the pod `cni.istio.io/uninitialized=true` for its owner to act on.
    Label,
}

/// The `type` label values, as istio's repair controller counts them.
const REPAIR: &str = "repair";
const DELETE: &str = "delete";
const LABEL: &str = "label";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RepairLabels {
    r#type: &'static str,
    result: &'static str,
}

/// Shared by the ambient and the sidecar repair: one count of both, as istio's one controller.
#[derive(Clone)]
pub struct Repair {
    client: Client,
    action: BrokenPodAction,
    repaired: Family<RepairLabels, Counter>,
}

impl Repair {
    pub fn new(client: Client, action: BrokenPodAction) -> Self {
        Self {
            client,
            action,
            repaired: Family::default(),
        }
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "istio_cni_repair_pods_repaired",
            "Total number of pods repaired by repair controller",
            self.repaired.clone(),
        );
    }

    pub fn action(&self) -> BrokenPodAction {
        self.action
    }

    /// Counts one in-place repair: the pod enrolled live, or not.
    pub fn repaired_in_place(&self, success: bool) {
        self.count(REPAIR, if success { "success" } else { "fail" });
    }

    fn count(&self, r#type: &'static str, result: &'static str) {
        self.repaired
            .get_or_create(&RepairLabels { r#type, result })
            .inc();
    }

    /// Applies the configured action to a broken pod that could not be repaired in place
    /// (`why`).
    pub async fn act_on(&self, pod: &Pod, why: String) -> Acted {
        let name = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        let (kind, done, outcome) = match self.action {
            BrokenPodAction::None => {
                info!(
                    pod = name,
                    "not repaired in place; --repair-broken-pods=none leaves it to the retries"
                );
                return Acted::default();
            }
            // Deleted already: what is left goes with the pod (a real API server keeps the
            // object for its grace period).
            BrokenPodAction::Delete if pod.metadata.deletion_timestamp.is_some() => {
                self.count(DELETE, "skip");
                return Acted::gone();
            }
            BrokenPodAction::Delete => (DELETE, "deleted", self.delete(pod).await),
            BrokenPodAction::Label if pod.labels().contains_key(UNINITIALIZED_LABEL) => {
                self.count(LABEL, "skip");
                return Acted::default();
            }
            BrokenPodAction::Label => (LABEL, "labelled", self.label(pod).await),
        };
        let failed = match outcome {
            Ok(()) => None,
            // Deleted meanwhile (by this agent too, before its cache knew).
            Err(Failure::Gone) => {
                self.count(kind, "skip");
                return Acted::gone();
            }
            Err(Failure::Other(error)) => Some(error),
        };
        self.count(kind, if failed.is_none() { "success" } else { "fail" });
        match &failed {
            None => info!(pod = name, "broken pod {done}"),
            Some(error) => warn!(pod = name, "broken pod not {done}: {error}"),
        }
        let pod_gone = kind == DELETE && failed.is_none();
        let warning = if kind == DELETE {
            Warning::DeleteBrokenPod { why, failed }
        } else {
            Warning::LabelBrokenPod { why, failed }
        };
        Acted {
            warning: Some(warning),
            pod_gone,
        }
    }

    /// Deletes the pod only if it is still the object the decision was made on.
    async fn delete(&self, pod: &Pod) -> Result<(), Failure> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.uid(),
                resource_version: pod.resource_version(),
            }),
            ..DeleteParams::default()
        };
        answered(self.pods(pod).delete(&pod.name_any(), &params)).await
    }

    /// Through `pods/status`, as istio does: it may change metadata too, and the agent already
    /// patches it (the redirection annotation), so labelling needs no `patch` on pods.
    async fn label(&self, pod: &Pod) -> Result<(), Failure> {
        let patch = json!({"metadata": {"labels": {UNINITIALIZED_LABEL: "true"}}});
        let params = PatchParams::default();
        let patch = Patch::Merge(&patch);
        answered(
            self.pods(pod)
                .patch_status(&pod.name_any(), &params, &patch),
        )
        .await
    }

    fn pods(&self, pod: &Pod) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default())
    }
}

/// What the configured action did to a broken pod.
#[derive(Debug, Default)]
pub struct Acted {
    /// What to tell the pod's owner, when something was attempted.
    pub warning: Option<Warning>,
    /// The pod is deleted or being deleted: nothing is left to repair.
    pub pod_gone: bool,
}

impl Acted {
    fn gone() -> Self {
        Self {
            warning: None,
            pod_gone: true,
        }
    }
}

/// Why a call failed.
enum Failure {
    /// The pod is not there (404).
    Gone,
    /// Anything else, no answer in time included.
    Other(String),
}

async fn answered<T>(call: impl Future<Output = kube::Result<T>>) -> Result<(), Failure> {
    match tokio::time::timeout(API_TIMEOUT, call).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(kube::Error::Api(status))) if status.code == 404 => Err(Failure::Gone),
        Ok(Err(error)) => Err(Failure::Other(error.to_string())),
        Err(_) => Err(Failure::Other(format!("no answer within {API_TIMEOUT:?}"))),
    }
}
