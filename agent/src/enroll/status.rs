//! Enrolled pods' statuses: recorded in the state file, counted in the per-status gauge,
//! published through the [`crate::report::Reporter`], and completed when ztunnel acks a pending
//! pod.
use std::sync::Arc;

use prometheus_client::{encoding::EncodeLabelSet, metrics::gauge::Gauge};
use tracing::{info, warn, Instrument};

use super::Enroller;
use crate::workload::{PodName, Status};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StatusLabels {
    status: &'static str,
}

impl Enroller {
    /// Records a pod's status (`None`: no longer enrolled), updates the per-status gauge, and
    /// publishes the change through the reporter.
    pub(super) async fn set_status(&self, uid: &str, status: Option<(Status, PodName)>) {
        self.update_status(uid, status, true).await
    }

    /// [`Self::set_status`]; `publish: false` leaves the pod's annotation as it is.
    pub(super) async fn update_status(
        &self,
        uid: &str,
        status: Option<(Status, PodName)>,
        publish: bool,
    ) {
        if let Err(error) = self
            .state
            .set_status(uid, status.as_ref().map(|(status, _)| *status))
        {
            warn!("recording the pod's status: {error:#}");
        }
        let changed = {
            let mut statuses = self.status.lock().unwrap();
            let (previous, changed) = match status {
                Some((status, pod)) => {
                    let previous = statuses
                        .insert(uid.to_owned(), (status, pod.clone()))
                        .map(|(s, _)| s);
                    (
                        previous,
                        (previous != Some(status)).then_some((pod, Some(status))),
                    )
                }
                None => match statuses.remove(uid) {
                    Some((previous, pod)) => (Some(previous), Some((pod, None))),
                    None => (None, None),
                },
            };
            // Counted by change, not by walking every pod: a status change stays O(1).
            if let Some((_, now)) = &changed {
                if let Some(previous) = previous {
                    self.pods_with(previous).dec();
                }
                if let Some(now) = now {
                    self.pods_with(*now).inc();
                }
            }
            changed
        };
        // A pod without a name (recovered without its record) has no object to annotate.
        if let Some((pod, status)) = changed.filter(|(pod, _)| publish && !pod.name.is_empty()) {
            self.reporter.report_status(&pod, status).await;
        }
    }

    pub(super) fn pods_with(&self, status: Status) -> Gauge {
        let status = status.as_str();
        self.pods.get_or_create(&StatusLabels { status }).clone()
    }

    /// Completes pods that were pending when ztunnel acks them in a snapshot.
    pub async fn follow_acks(self: Arc<Self>) {
        let mut acked = self.zds.acked();
        loop {
            match acked.recv().await {
                // In turn with the pod's other steps, without holding up other pods' acks.
                Ok(uid) => {
                    let enroller = self.clone();
                    tokio::spawn(async move { enroller.complete(&uid).await });
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }

    /// Marks a pending pod enabled once ztunnel acked it (a pod unenrolled meanwhile stays out).
    async fn complete(&self, uid: &str) {
        self.in_turn(uid, async {
            let pod = self
                .status
                .lock()
                .unwrap()
                .get(uid)
                .map(|(_, pod)| pod.clone());
            if let Some(pod) = pod {
                self.set_status(uid, Some((Status::Enabled, pod))).await;
                info!("ztunnel acked the pod: redirection enabled");
            }
        })
        .instrument(self.pod_span(uid))
        .await
    }

    pub fn status(&self, uid: &str) -> Option<Status> {
        self.status
            .lock()
            .unwrap()
            .get(uid)
            .map(|(status, _)| *status)
    }

    /// The enrolled pods' uids, with the names their statuses are published under.
    pub fn enrolled_pods(&self) -> Vec<(String, PodName)> {
        let status = self.status.lock().unwrap();
        status
            .iter()
            .map(|(uid, (_, pod))| (uid.clone(), pod.clone()))
            .collect()
    }
}
