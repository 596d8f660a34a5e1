//! Enrollment: the one path every pod takes into the mesh and out of it.
//!
//! [`Enroller::enroll`] is where a pod is enrolled, whatever asked for it (a CNI ADD now; label
//! changes and the start-up reconcile later): redirection first, then ztunnel's Ack, then the
//! pod is reported enabled. [`Enroller::unenroll`] undoes it. Both are idempotent, and the steps
//! for one pod never interleave ([`Enroller::in_turn`]), while different pods proceed in
//! parallel. Every status change is published through the policy source (in a cluster, the
//! pod's `ambient.istio.io/redirection` annotation).
use std::{
    collections::{HashMap, HashSet},
    future::Future,
    net::IpAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{bail, Result};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};
use serde::{Deserialize, Serialize};
use tracing::{info, warn, Instrument, Span};
use weir_cni::protocol::Attachment;

use crate::{
    datapath::{Datapath, EnrollNetns, PodNetns},
    logging::pod_span,
    policy::{PodName, PolicySource},
    state::StateFile,
    workload::Workload,
    zds::{WorkloadInfo, ZdsError, ZdsHandle},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Redirected, waiting for ztunnel's Ack (istio's `ambient.istio.io/redirection=pending`).
    Pending,
    /// Redirected and acked by ztunnel (`enabled`).
    Enabled,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: &'static str,
}

pub struct Enroller {
    datapath: Arc<Datapath>,
    zds: ZdsHandle,
    /// Enrolled pods by uid, with the name their status is published under.
    status: Mutex<HashMap<String, (Status, PodName)>>,
    /// Where statuses are published (the pod's annotation in a cluster).
    policy: Arc<dyn PolicySource>,
    /// Enrolled pods, for the next agent.
    state: StateFile,
    /// One async lock per pod: the steps for one pod are ordered.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Enrolled pods by status (istio's `ambient.istio.io/redirection` values).
    pods: Family<StatusLabels, Gauge>,
    /// Time to put one pod's redirection in place (the datapath's part of enrollment).
    redirect_seconds: Histogram,
    /// Pods (or state records) a restart could not fully recover.
    recovery_failures: Counter,
    /// Pods unenrolled because nothing but weir and ztunnel held their netns any more.
    orphans_removed: Counter,
    /// Pods that looked orphaned (to the sweep or GC) but were kept: their netns could be held
    /// where the agent could not look.
    orphans_kept: Counter,
    /// Pods whose sandbox the runtime removed (a DEL) and that no ADD enrolled since: between
    /// sandboxes, or going away, never broken.
    removed_sandboxes: Mutex<HashSet<String>>,
}

impl Enroller {
    pub fn new(
        datapath: Arc<Datapath>,
        zds: ZdsHandle,
        policy: Arc<dyn PolicySource>,
        state_file: PathBuf,
    ) -> Arc<Self> {
        Arc::new(Self {
            datapath,
            zds,
            status: Mutex::new(HashMap::new()),
            policy,
            state: StateFile::open(state_file),
            locks: Mutex::new(HashMap::new()),
            pods: Family::default(),
            // 50 µs .. ~100 ms: weir's enrollment is sub-millisecond; istio's iptables ~10 ms.
            redirect_seconds: Histogram::new(exponential_buckets(50e-6, 2.0, 12)),
            recovery_failures: Counter::default(),
            orphans_removed: Counter::default(),
            orphans_kept: Counter::default(),
            removed_sandboxes: Mutex::default(),
        })
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        // Both series from the start, at 0: they are counted by change from here.
        for status in [Status::Pending, Status::Enabled] {
            self.pods_with(status);
        }
        registry.register(
            "weir_redirect_seconds",
            "Time to put one pod's redirection in place (maps, tc, routing)",
            self.redirect_seconds.clone(),
        );
        registry.register(
            "weir_enrolled_pods",
            "Enrolled pods by status: pending (redirected, ztunnel has not acked) or enabled",
            self.pods.clone(),
        );
        registry.register(
            "weir_recovery_failures",
            "Pods or state records an agent start could not recover (the agent serves the rest)",
            self.recovery_failures.clone(),
        );
        registry.register(
            "weir_orphans_removed",
            "Enrolled pods unenrolled because no process and no mount held their netns any more",
            self.orphans_removed.clone(),
        );
        registry.register(
            "weir_orphans_kept",
            "Enrolled pods that looked orphaned (to the orphan sweep or CNI GC) but were kept: \
             their netns could be held where the agent could not look",
            self.orphans_kept.clone(),
        );
    }

    /// After an agent restart: the pods the pinned maps still redirect are taken back, their
    /// netns found again, and registered with the ZDS server, so ztunnel's next snapshot names
    /// them (Add with the netns, or Keep when it cannot be found). They stay pending until
    /// ztunnel acks them.
    ///
    /// One pod never stops the start: a record that cannot be read, or a pod whose netns cannot
    /// be taken back, is logged and counted, and the pod is recovered as far as it can be. It
    /// stays redirected and named to ztunnel (Keep): removing its map entries would let a pod
    /// that still runs send traffic around the mesh. The orphan sweep removes it once nothing
    /// holds its netns, and a DEL or GC does as for any pod.
    pub async fn recover(&self) -> Result<()> {
        for why in self.state.unreadable() {
            self.recovery_failures.inc();
            warn!("recovery: unreadable pod state, recovered from the maps unnamed: {why}");
        }
        let enrolled = self.datapath.enrolled().await?;
        // Known to the state file but not to these maps: enrolled by an agent with another map
        // layout (an upgrade). They are enrolled again, into this one.
        let migrate = self
            .state
            .drop_unless(|uid| enrolled.iter().any(|known| known == uid));
        for uid in enrolled {
            self.recover_pod(&uid).instrument(self.pod_span(&uid)).await;
        }
        for pod in migrate.iter().filter(|pod| pod.netns.exists()) {
            async {
                match self.enroll(pod).await {
                    Ok(_) => info!("pod moved to this agent's map layout"),
                    Err(error) => warn!("moving the pod to this map layout: {error:#}"),
                }
            }
            .instrument(pod_span(&pod.namespace, &pod.name, &pod.uid))
            .await;
        }
        if let Err(error) = self.datapath.retire_other_layouts().await {
            warn!("retiring older map layouts: {error:#}");
        }
        // A clean file for the next agent: without the migrated pods and what could not be read.
        if let Err(error) = self.state.save() {
            warn!("recording the recovered pods: {error:#}");
        }
        Ok(())
    }

    /// Takes back one pod the pinned maps still redirect (see [`Self::recover`]).
    async fn recover_pod(&self, uid: &str) {
        let record = self.state.get(uid);
        let netns = match self.datapath.adopt(uid, record.clone()).await {
            Ok(netns) => netns,
            Err(error) => {
                self.recovery_failures.inc();
                warn!("recovery: taking the pod's netns back failed: {error:#}");
                None
            }
        };
        let info: WorkloadInfo = record.as_ref().map(zds_info).unwrap_or_default();
        let name = PodName::new(&info.namespace, &info.name);
        info!(netns_found = netns.is_some(), "recovered an enrolled pod");
        let handed_over = netns.is_some();
        let recorded = self.state.status(uid);
        // Without its netns the pod is only named in snapshots (Keep): not confirmed. With
        // it, a pod that was enabled stays so: still redirected, and in the snapshot the
        // next ztunnel connection gets.
        let status = match self.zds.add(uid, info, netns.map(Arc::new)).await {
            Ok(()) if handed_over => Status::Enabled,
            Err(ZdsError::NotConnected) if handed_over => recorded.unwrap_or(Status::Pending),
            _ => Status::Pending,
        };
        // The annotation already says what the record does: no write for it.
        let publish = recorded != Some(status);
        self.update_status(uid, Some((status, name)), publish).await;
    }

    /// CNI GC: unenrolls every pod enrolled through an attachment the runtime no longer lists
    /// and whose netns nothing holds any more: a runtime's list alone never takes a live pod's
    /// capture away.
    /// A pod enrolled without one (live, or recorded by an older agent) is not the runtime's to
    /// judge and stays; the orphan sweep covers it. Each pod is decided in its turn from its
    /// current record, so one re-added meanwhile under a new container stays. A failing pod
    /// does not stop the others; every failure is reported.
    pub async fn collect_garbage(&self, valid: &[Attachment]) -> Result<usize> {
        let valid: HashSet<&Attachment> = valid.iter().collect();
        let stale = |pod: &Workload| {
            pod.attachment
                .as_ref()
                .is_some_and(|attachment| !valid.contains(attachment))
        };
        let candidates: Vec<String> = self
            .state
            .workloads()
            .into_iter()
            .filter(|pod| stale(pod))
            .map(|pod| pod.uid)
            .collect();
        let mut removed = 0;
        let mut failures = Vec::new();
        for uid in candidates {
            let span = self.pod_span(&uid);
            let outcome = self
                .in_turn(&uid, async {
                    match self.state.get(&uid) {
                        Some(pod) if stale(&pod) => {
                            if !self.certainly_orphaned(&uid).await? {
                                info!(
                                    "GC: the runtime no longer lists the pod's attachment, but \
                                     its netns is still held: kept"
                                );
                                return Ok(false);
                            }
                            self.unenroll(&uid).await.map(|_| true)
                        }
                        _ => Ok(false),
                    }
                })
                .instrument(span.clone())
                .await;
            match outcome {
                Ok(true) => {
                    removed += 1;
                    span.in_scope(|| {
                        info!("GC: the runtime no longer has the pod's attachment: unenrolled")
                    });
                }
                Ok(false) => {}
                Err(error) => failures.push(format!("{uid}: {error:#}")),
            }
        }
        if !failures.is_empty() {
            bail!(
                "{} stale pods could not be unenrolled: {}",
                failures.len(),
                failures.join("; ")
            );
        }
        Ok(removed)
    }

    /// Every `interval`, unenrolls the pods whose DEL never came: nothing but weir and ztunnel
    /// holds their netns (see [`Datapath::orphaned`]).
    pub async fn sweep_orphans(self: Arc<Self>, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            if let Err(error) = self.sweep_orphans_once().await {
                warn!("orphan sweep: {error:#}");
            }
        }
    }

    async fn sweep_orphans_once(&self) -> Result<()> {
        let candidates = self.datapath.orphaned(None).await?;
        if let Some(unsure) = candidates.unsure {
            self.orphans_kept.inc_by(candidates.pods.len() as u64);
            if !candidates.pods.is_empty() {
                warn!(
                    pods = ?candidates.pods,
                    "orphan sweep: not every namespace holder could be inspected ({unsure}): \
                     kept"
                );
            }
            return Ok(());
        }
        for uid in candidates.pods {
            let span = self.pod_span(&uid);
            // Checked again in the pod's turn: an ADD meanwhile (a new sandbox for the same
            // pod) holds a new netns, and that pod must stay.
            let removed = self
                .in_turn(&uid, async {
                    if !self.certainly_orphaned(&uid).await? {
                        return Ok(false);
                    }
                    self.unenroll(&uid).await
                })
                .instrument(span.clone())
                .await;
            span.in_scope(|| match removed {
                Ok(true) => {
                    self.orphans_removed.inc();
                    info!("orphan sweep: nothing holds the pod's netns: unenrolled");
                }
                Ok(false) => {}
                Err(error) => warn!("orphan sweep: unenrolling: {error:#}"),
            });
        }
        Ok(())
    }

    /// Whether nothing but weir and ztunnel holds the pod's netns, as far as every holder could
    /// be inspected; a pod that could be held where the agent cannot look counts as kept.
    async fn certainly_orphaned(&self, uid: &str) -> Result<bool> {
        let orphans = self.datapath.orphaned(Some(uid.to_owned())).await?;
        let looks_orphaned = !orphans.pods.is_empty();
        if let (true, Some(unsure)) = (looks_orphaned, &orphans.unsure) {
            self.orphans_kept.inc();
            warn!("not every namespace holder could be inspected ({unsure}): the pod is kept");
            return Ok(false);
        }
        Ok(looks_orphaned)
    }

    /// Records a pod's status (`None`: no longer enrolled), updates the per-status gauge, and
    /// publishes the change through the policy source.
    async fn set_status(&self, uid: &str, status: Option<(Status, PodName)>) {
        self.update_status(uid, status, true).await
    }

    /// [`Self::set_status`]; `publish: false` leaves the pod's annotation as it is.
    async fn update_status(&self, uid: &str, status: Option<(Status, PodName)>, publish: bool) {
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
            self.policy.report_status(&pod, status).await;
        }
    }

    fn pods_with(&self, status: Status) -> Gauge {
        let status = match status {
            Status::Pending => "pending",
            Status::Enabled => "enabled",
        };
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

    /// [`pod_span`] for the pod with this uid, named as the agent knows it (enrolled, or in its
    /// record).
    fn pod_span(&self, uid: &str) -> Span {
        let enrolled = self
            .status
            .lock()
            .unwrap()
            .get(uid)
            .map(|(_, pod)| pod.clone());
        let name = enrolled
            .or_else(|| {
                let record = self.state.get(uid)?;
                Some(PodName::new(&record.namespace, &record.name))
            })
            .unwrap_or_default();
        pod_span(&name.namespace, &name.name, uid)
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

    /// What the agent recorded of an enrolled pod (its netns path, addresses and options).
    pub fn record(&self, uid: &str) -> Option<Workload> {
        self.state.get(uid)
    }

    /// Folds the state file's journal into its snapshot, at a clean stop: the next agent reads
    /// one file.
    pub fn save_state(&self) -> Result<()> {
        self.state.save()
    }

    /// A running pod's netns, to enroll it live (see [`Datapath::find_running_pod`]).
    pub async fn find_running_pod(
        &self,
        uid: &str,
        ips: &[IpAddr],
        hint: Option<PathBuf>,
    ) -> Result<Option<PodNetns>> {
        self.datapath.find_running_pod(uid, ips, hint).await
    }

    /// Runs one step for a pod (keyed by its uid, or whatever names it) once every earlier step
    /// for it has finished: the steps for one pod never interleave.
    pub async fn in_turn<T>(&self, key: &str, step: impl Future<Output = T>) -> T {
        let lock = self
            .locks
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default()
            .clone();
        let result = {
            let _turn = lock.lock().await;
            step.await
        };
        let mut locks = self.locks.lock().unwrap();
        // Held by the map and this step only: no step for the pod is waiting, so the lock goes.
        if Arc::strong_count(&lock) == 2 {
            locks.remove(key);
        }
        result
    }

    /// Enrolls a pod in the netns at its path, as the runtime gives it.
    pub async fn enroll(&self, pod: &Workload) -> Result<Status> {
        self.enroll_in(pod, EnrollNetns::Path).await
    }

    /// Where a pod is enrolled: redirection in place, then ztunnel's Ack, then enabled.
    pub async fn enroll_in(&self, pod: &Workload, netns: EnrollNetns) -> Result<Status> {
        let started = std::time::Instant::now();
        let netns = self.datapath.enroll_in(pod.clone(), netns).await?;
        self.redirect_seconds
            .observe(started.elapsed().as_secs_f64());
        fail::fail_point!("enroll-redirected");
        self.removed_sandboxes.lock().unwrap().remove(&pod.uid);
        let status = match self
            .zds
            .add(&pod.uid, zds_info(pod), Some(Arc::new(netns)))
            .await
        {
            Ok(()) => Status::Enabled,
            Err(ZdsError::NotConnected) => Status::Pending,
            Err(error) => {
                warn!(%error, "ztunnel did not accept the pod");
                Status::Pending
            }
        };
        fail::fail_point!("enroll-acked");
        // The record first: it carries the status, so recording the status after it writes
        // nothing more (the other way round, a re-enrolled pod cost two journal lines).
        let recorded = self.state.insert(pod, status);
        let name = PodName::new(&pod.namespace, &pod.name);
        self.set_status(&pod.uid, Some((status, name))).await;
        recorded?;
        info!(?status, "pod enrolled");
        Ok(status)
    }

    /// The runtime's DEL of one of a pod's sandboxes (`container_id`): unenrolls the pod unless
    /// its record names another sandbox. When kubelet gives a pod a new sandbox it removes the old
    /// one after the new one's ADD, and that DEL must not take the live sandbox's redirection
    /// away. Returns whether the pod was unenrolled.
    pub async fn unenroll_sandbox(&self, uid: &str, container_id: &str) -> Result<bool> {
        let current = self.state.get(uid).and_then(|pod| pod.attachment);
        if let Some(current) = current {
            if !container_id.is_empty() && current.container_id != container_id {
                info!(
                    deleted = container_id,
                    live = current.container_id,
                    "CNI DEL for a sandbox the pod has left: the live one stays redirected"
                );
                return Ok(false);
            }
        }
        self.removed_sandboxes
            .lock()
            .unwrap()
            .insert(uid.to_owned());
        self.unenroll(uid).await
    }

    /// Takes a pod out: ztunnel first (so it stops proxying), then redirection. Returns whether
    /// the pod was enrolled.
    pub async fn unenroll(&self, uid: &str) -> Result<bool> {
        if let Err(error) = self.zds.del(uid).await {
            warn!(%error, "ztunnel Del");
        }
        self.set_status(uid, None).await;
        let was = self.datapath.unenroll(uid).await?;
        self.state.remove(uid)?;
        if was {
            info!("pod unenrolled");
        }
        Ok(was)
    }

    /// Whether the runtime removed the pod's sandbox and no ADD enrolled it since.
    pub fn sandbox_removed(&self, uid: &str) -> bool {
        self.removed_sandboxes.lock().unwrap().contains(uid)
    }

    /// Forgets the removed sandboxes of pods `keep` does not keep (gone from the cluster).
    pub fn forget_removed_sandboxes(&self, keep: impl Fn(&str) -> bool) {
        self.removed_sandboxes
            .lock()
            .unwrap()
            .retain(|uid| keep(uid));
    }

    /// Whether the pod's redirection is in the kernel as enrolled.
    pub async fn is_redirected(&self, uid: &str) -> Result<bool> {
        self.datapath.is_redirected(uid).await
    }
}

/// What ztunnel is told about a pod.
fn zds_info(pod: &Workload) -> WorkloadInfo {
    WorkloadInfo {
        name: pod.name.clone(),
        namespace: pod.namespace.clone(),
        service_account: pod.service_account.clone().unwrap_or_default(),
    }
}
