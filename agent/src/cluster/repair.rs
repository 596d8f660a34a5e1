//! Pod repair, istio's repair controller (`cni/pkg/repair`) in its ambient form. An ambient pod
//! found running without redirection is enrolled live by the reconcile loop (istio's
//! `repairPods`); where that is impossible, the action configured here applies to it instead,
//! as istio's `deletePods` and `labelPods` do. Every attempt is counted in istio's
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

use crate::policy::{Warning, UNINITIALIZED_LABEL};

/// A delete or label must not hold the pod's turn for long; it is retried with the pod.
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// What becomes of an ambient pod that runs without redirection and cannot be enrolled in
/// place (its network namespace is not found, or entering or enrolling it fails).
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
    /// (`why`). Returns the Warning to publish about it, if anything was attempted.
    pub async fn act_on(&self, pod: &Pod, why: String) -> Option<Warning> {
        let name = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        match self.action {
            BrokenPodAction::None => {
                info!(
                    pod = name,
                    "not repaired in place; --repair-broken-pods=none leaves it to the retries"
                );
                None
            }
            BrokenPodAction::Delete => {
                let failed = self.delete(pod).await.err();
                self.count(DELETE, result(&failed));
                match &failed {
                    None => info!(pod = name, "broken pod deleted"),
                    Some(error) => warn!(pod = name, "deleting the broken pod: {error}"),
                }
                Some(Warning::DeleteBrokenPod { why, failed })
            }
            BrokenPodAction::Label if pod.labels().contains_key(UNINITIALIZED_LABEL) => {
                self.count(LABEL, "skip");
                None
            }
            BrokenPodAction::Label => {
                let failed = self.label(pod).await.err();
                self.count(LABEL, result(&failed));
                match &failed {
                    None => info!(pod = name, "broken pod labelled {UNINITIALIZED_LABEL}=true"),
                    Some(error) => warn!(pod = name, "labelling the broken pod: {error}"),
                }
                Some(Warning::LabelBrokenPod { why, failed })
            }
        }
    }

    /// Deletes the pod only if it is still the object the decision was made on.
    async fn delete(&self, pod: &Pod) -> Result<(), String> {
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
    async fn label(&self, pod: &Pod) -> Result<(), String> {
        let patch = json!({"metadata": {"labels": {UNINITIALIZED_LABEL: "true"}}});
        let params = PatchParams::default();
        answered(
            self.pods(pod)
                .patch_status(&pod.name_any(), &params, &Patch::Merge(&patch)),
        )
        .await
    }

    fn pods(&self, pod: &Pod) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default())
    }
}

/// A call's outcome, with a call that gets no answer in time taken as failed.
async fn answered<T>(call: impl Future<Output = kube::Result<T>>) -> Result<(), String> {
    match tokio::time::timeout(API_TIMEOUT, call).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err(format!("no answer within {API_TIMEOUT:?}")),
    }
}

fn result(failed: &Option<String>) -> &'static str {
    if failed.is_none() {
        "success"
    } else {
        "fail"
    }
}
