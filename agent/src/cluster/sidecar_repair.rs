//! Sidecar pod repair: istio's repair controller (`cni/pkg/repair`) for the pods whose traffic
//! goes to their own istio-proxy. A sidecar pod whose sandbox was wired while weir-cni was
//! missing from the chain runs without redirection, and says so itself: its `istio-validation`
//! init container probes the redirection, exits 126 when there is none, and is restarted by
//! kubelet with backoff, so from its first restart the pod carries that exit code in its
//! `lastState`. Exactly the pods istio's filter picks are broken ([`is_broken`]).
//!
//! istio's modes, the first enabled one acting: such a pod is enrolled in place once
//! (`repairPods`), and the next restart of istio-validation passes; where in-place repair is
//! off, or fails, the configured action applies ([`Repair::act_on`]: `deletePods`, `labelPods`).
//! It follows the same pod cache as the reconcile loop: a broken pod is met again each time
//! kubelet restarts its istio-validation, and on every full pass.
use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::ResourceExt;
use tokio::sync::broadcast::error::RecvError;
use tracing::{debug, info, warn, Instrument};

use super::{facts_of, ips_of, repair::Repair, Change, LoopRuns, Reflectors};
use crate::{
    enroll::{Enroller, RunningPod},
    logging::pod_span,
    policy::{sidecar, SIDECAR_STATUS_ANNOTATION},
    report::{Reporter, Warning},
    workload::PodName,
};

/// The init container istio's injector adds to sidecar pods when its CNI is on.
pub const VALIDATION_CONTAINER: &str = "istio-validation";
/// istio-validation's exit code when its probe finds no redirection (istio's
/// `ValidationErrorCode`).
pub const VALIDATION_FAILED: i32 = 126;

/// Whether a pod is a broken sidecar pod, as istio's repair controller (`matchesFilter`) tells
/// one with its defaults: the sidecar status annotation, and an istio-validation whose last run
/// failed validation and that has not passed since, whatever its message.
pub fn is_broken(pod: &Pod) -> bool {
    if !pod.annotations().contains_key(SIDECAR_STATUS_ANNOTATION) {
        return false;
    }
    let statuses = pod
        .status
        .as_ref()
        .and_then(|status| status.init_container_statuses.as_ref());
    statuses
        .into_iter()
        .flatten()
        .any(|status| status.name == VALIDATION_CONTAINER && failed_validation(status))
}

fn failed_validation(status: &ContainerStatus) -> bool {
    let now = status.state.as_ref().and_then(|s| s.terminated.as_ref());
    // A container that exited successfully is never broken, whatever came before.
    if now.is_some_and(|now| now.exit_code == 0 || now.reason.as_deref() == Some("Completed")) {
        return false;
    }
    let last = status
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref());
    last.is_some_and(|last| last.exit_code == VALIDATION_FAILED)
}

pub struct SidecarRepair {
    enroller: Arc<Enroller>,
    reflectors: Reflectors,
    reporter: Arc<dyn Reporter>,
    repair: Repair,
    /// istio's `repairPods`.
    in_place: bool,
    resync_interval: Duration,
    /// The pods repaired in place, by uid: each only once, as istio. Until its istio-validation
    /// passes on its next restart, a repaired pod still looks broken.
    repaired: Mutex<HashSet<String>>,
    runs: LoopRuns,
}

/// How an in-place repair went.
enum InPlace {
    Repaired,
    /// Not weir's to redirect, or not yet: nothing counted.
    Skipped(&'static str),
    Failed(anyhow::Error),
}

impl SidecarRepair {
    pub fn new(
        enroller: Arc<Enroller>,
        reflectors: Reflectors,
        reporter: Arc<dyn Reporter>,
        repair: Repair,
        in_place: bool,
        resync_interval: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            enroller,
            reflectors,
            reporter,
            repair,
            in_place,
            resync_interval,
            repaired: Mutex::new(HashSet::new()),
            runs: LoopRuns::default(),
        })
    }

    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.runs.register(
            registry,
            "weir_sidecar_repair_runs",
            "Runs of the sidecar pods' repair, counted once done, by what started them: a pod's \
             change from the watches, or a full pass",
        );
    }

    /// Runs until the agent stops.
    pub async fn run(self: Arc<Self>) {
        // Subscribed before the sync, so nothing that changes during the first pass is missed.
        let mut changes = self.reflectors.changes();
        self.reflectors.synced().await;
        self.full_pass().await;
        let mut resync = tokio::time::interval(self.resync_interval);
        resync.reset();
        loop {
            tokio::select! {
                change = changes.recv() => match change {
                    Ok(Change::Pod(name)) => {
                        if let Some(pod) = self.reflectors.pod(&name) {
                            self.check(&pod).await;
                        }
                        self.runs.ran("change");
                    }
                    Ok(Change::Namespace(_) | Change::DaemonSet) => {}
                    // Changes were missed: only the store knows them now.
                    Ok(Change::Relisted) | Err(RecvError::Lagged(_)) => self.full_pass().await,
                    Err(RecvError::Closed) => return,
                },
                _ = resync.tick() => self.full_pass().await,
            }
        }
    }

    async fn full_pass(&self) {
        let pods = self.reflectors.pods.state();
        let known: HashSet<String> = pods.iter().filter_map(|pod| pod.uid()).collect();
        self.repaired
            .lock()
            .unwrap()
            .retain(|uid| known.contains(uid));
        for pod in &pods {
            self.check(pod).await;
        }
        self.runs.ran("pass");
    }

    /// Repairs the pod if it is a broken sidecar pod, in istio's order of modes.
    async fn check(&self, pod: &Pod) {
        if !is_broken(pod) {
            return;
        }
        let Some(uid) = pod.uid() else { return };
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        // Nothing runs in it any more, or it goes already.
        if matches!(phase, Some("Succeeded" | "Failed"))
            || pod.metadata.deletion_timestamp.is_some()
        {
            return;
        }
        if self.in_place && self.repaired.lock().unwrap().contains(&uid) {
            return;
        }
        let name = PodName::new(&pod.namespace().unwrap_or_default(), &pod.name_any());
        let span = pod_span(&name.namespace, &name.name, &uid);
        self.repair_broken(&uid, &name, pod).instrument(span).await
    }

    async fn repair_broken(&self, uid: &str, name: &PodName, pod: &Pod) {
        let failed = if self.in_place {
            match self.repair_in_place(uid, name, pod).await {
                InPlace::Repaired => {
                    self.repair.repaired_in_place(true);
                    self.repaired.lock().unwrap().insert(uid.to_owned());
                    warn!("the sidecar pod ran without weir's redirection: repaired in place");
                    self.reporter.warn(name, Warning::RepairedPod).await;
                    return;
                }
                InPlace::Skipped(why) => {
                    info!("broken sidecar pod not repaired in place: {why}");
                    return;
                }
                InPlace::Failed(error) => {
                    self.repair.repaired_in_place(false);
                    warn!("repairing the broken sidecar pod in place: {error:#}");
                    Some(error)
                }
            }
        } else {
            None
        };
        if failed.is_none() && self.repair.action() == super::repair::BrokenPodAction::None {
            debug!("broken sidecar pod left alone: no repair mode is on");
            return;
        }
        let why = match &failed {
            Some(error) => format!("{error:#}"),
            None => format!(
                "its {VALIDATION_CONTAINER} init container exited with {VALIDATION_FAILED}, and \
                 in-place repair is off"
            ),
        };
        let acted = self.repair.act_on(pod, why).await;
        // Without an act to tell of, the failure is the news, as for an ambient pod.
        let warning = match (acted.warning, failed) {
            (Some(warning), _) => warning,
            (None, Some(error)) => Warning::SidecarRedirectionFailed(format!("{error:#}")),
            (None, None) => return,
        };
        self.reporter.warn(name, warning).await;
    }

    async fn repair_in_place(&self, uid: &str, name: &PodName, pod: &Pod) -> InPlace {
        let namespace_labels = self
            .reflectors
            .namespace_labels(&name.namespace)
            .unwrap_or_default();
        let facts = facts_of(pod, namespace_labels);
        // istio-cni's own refusal of an annotation is the failure, as at the pod's ADD.
        let redirect = match sidecar::decide(&facts) {
            Ok(Some(redirect)) => redirect,
            Ok(None) => return InPlace::Skipped("istio-cni would not redirect it"),
            Err(invalid) => return InPlace::Failed(invalid.into()),
        };
        if self.enroller.sandbox_removed(uid) {
            return InPlace::Skipped("its sandbox is gone; the next one's ADD enrolls it");
        }
        let ips = ips_of(pod);
        if ips.is_empty() {
            return InPlace::Skipped("no address reported yet");
        }
        let running = RunningPod {
            uid: uid.to_owned(),
            name: name.clone(),
            service_account: facts.service_account,
            ips,
            options: redirect.options(),
            sidecar: Some(redirect),
        };
        let enrolled = self
            .enroller
            .in_turn(uid, self.enroller.enroll_running(running));
        match enrolled.await {
            Ok(()) => InPlace::Repaired,
            Err(error) => InPlace::Failed(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStateWaiting, PodStatus,
    };

    fn terminated(exit_code: i32, reason: &str) -> ContainerState {
        ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code,
                reason: Some(reason.into()),
                ..ContainerStateTerminated::default()
            }),
            ..ContainerState::default()
        }
    }

    fn waiting() -> ContainerState {
        ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some("CrashLoopBackOff".into()),
                ..ContainerStateWaiting::default()
            }),
            ..ContainerState::default()
        }
    }

    fn pod(sidecar: bool, name: &str, state: ContainerState, last: Option<i32>) -> Pod {
        let mut pod = Pod::default();
        if sidecar {
            pod.annotations_mut()
                .insert(SIDECAR_STATUS_ANNOTATION.into(), "{}".into());
        }
        pod.status = Some(PodStatus {
            init_container_statuses: Some(vec![ContainerStatus {
                name: name.into(),
                state: Some(state),
                last_state: last.map(|code| terminated(code, "Error")),
                ..ContainerStatus::default()
            }]),
            ..PodStatus::default()
        });
        pod
    }

    #[test]
    fn broken_is_istios_filter() {
        let validation = VALIDATION_CONTAINER;
        assert!(is_broken(&pod(true, validation, waiting(), Some(126))));
        // Running again after the failure: not passed yet.
        let running = ContainerState::default();
        assert!(is_broken(&pod(true, validation, running, Some(126))));
        assert!(is_broken(&pod(
            true,
            validation,
            terminated(126, "Error"),
            Some(126)
        )));

        assert!(!is_broken(&pod(false, validation, waiting(), Some(126))));
        assert!(!is_broken(&pod(true, "istio-init", waiting(), Some(126))));
        assert!(!is_broken(&pod(true, validation, waiting(), Some(1))));
        assert!(!is_broken(&pod(true, validation, waiting(), None)));
        let passed = terminated(0, "Completed");
        assert!(!is_broken(&pod(true, validation, passed, Some(126))));
        let completed = terminated(3, "Completed");
        assert!(!is_broken(&pod(true, validation, completed, Some(126))));
        assert!(!is_broken(&Pod::default()));
    }
}
