//! Enrollment: the one path every pod takes into the mesh and out of it.
//!
//! [`Enroller::enroll`] is where a pod is enrolled, whatever asked for it (a CNI ADD, the
//! reconcile loop, recovery at start): redirection first, then ztunnel's Ack, then the pod is
//! reported enabled. [`Enroller::unenroll`] undoes it. Both are idempotent, and the steps for one
//! pod never interleave ([`Enroller::in_turn`]), while different pods proceed in parallel.
//!
//! Beside that path: recovery after a restart ([`recovery`]), CNI GC and the orphan sweep
//! ([`orphans`]), and the pods' statuses, published through the [`Reporter`] (in a cluster, the
//! pod's `ambient.istio.io/redirection` annotation) ([`status`]).
mod metrics;
mod orphans;
mod recovery;
mod status;

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    net::IpAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use anyhow::Result;
use prometheus_client::{
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};
use tracing::{info, warn, Span};

use crate::{
    datapath::{Datapath, EnrollNetns, PodNetns},
    logging::pod_span,
    report::Reporter,
    state::StateFile,
    workload::{Mode, PodName, PodOptions, SidecarRedirect, Status, Workload},
    zds::{WorkloadInfo, ZdsError, ZdsHandle},
};
use status::StatusLabels;

pub struct Enroller {
    datapath: Arc<Datapath>,
    zds: ZdsHandle,
    /// Enrolled pods by uid, with the name their status is published under.
    status: Mutex<HashMap<String, (Status, PodName)>>,
    /// Where statuses are published (the pod's annotation in a cluster).
    reporter: Arc<dyn Reporter>,
    /// Enrolled pods, for the next agent.
    state: StateFile,
    /// One async lock per pod: the steps for one pod are ordered.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Enrolled pods by status (istio's `ambient.istio.io/redirection` values).
    pods: Family<StatusLabels, Gauge>,
    /// Time to put one pod's redirection in place (the datapath's part of enrollment).
    redirect_seconds: Histogram,
    /// Time of whole enrollments, by mode and result.
    enroll_seconds: metrics::EnrollSeconds,
    /// Pods whose last enrollment failed and that are not enrolled, with their mode: until they
    /// are enrolled, their sandbox is removed or they leave the cluster.
    failed: Mutex<HashMap<String, Mode>>,
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
    /// Running pods another node agent redirected, named to ztunnel with Keep until they are
    /// taken over ([`Enroller::keep_for_ztunnel`]), with their names.
    kept: Mutex<HashMap<String, PodName>>,
}

impl Enroller {
    pub fn new(
        datapath: Arc<Datapath>,
        zds: ZdsHandle,
        reporter: Arc<dyn Reporter>,
        state_file: PathBuf,
    ) -> Arc<Self> {
        Arc::new(Self {
            datapath,
            zds,
            status: Mutex::new(HashMap::new()),
            reporter,
            state: StateFile::open(state_file),
            locks: Mutex::new(HashMap::new()),
            pods: Family::default(),
            // 50 µs .. ~100 ms: weir's enrollment is sub-millisecond; istio's iptables ~10 ms.
            redirect_seconds: Histogram::new(exponential_buckets(50e-6, 2.0, 12)),
            enroll_seconds: metrics::enroll_seconds(),
            failed: Mutex::default(),
            recovery_failures: Counter::default(),
            orphans_removed: Counter::default(),
            orphans_kept: Counter::default(),
            removed_sandboxes: Mutex::default(),
            kept: Mutex::default(),
        })
    }

    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
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
            "weir_enroll_seconds",
            "Time of one pod's whole enrollment (redirection, then ztunnel's answer for an \
             ambient pod), by mode and result",
            self.enroll_seconds.clone(),
        );
        registry.register_collector(Box::new(metrics::PodsByState(self.clone())));
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
                Some(record.pod)
            })
            .unwrap_or_default();
        pod_span(&name.namespace, &name.name, uid)
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

    /// Enrolls a running pod in place, outside any CNI ADD: its netns found from the agent's
    /// record or /proc by its addresses. It keeps the attachment an earlier ADD recorded.
    pub async fn enroll_running(&self, pod: RunningPod) -> Result<()> {
        let record = self.record(&pod.uid);
        let attachment = record.as_ref().and_then(|record| record.attachment.clone());
        let hint = record.map(|record| record.netns);
        let found = self.find_running_pod(&pod.uid, &pod.ips, hint).await?;
        let found = found.ok_or_else(|| {
            anyhow::anyhow!("no network namespace on this node holds the pod's addresses")
        })?;
        let workload = Workload {
            uid: pod.uid,
            pod: pod.name,
            service_account: pod.service_account,
            netns: found.path.clone(),
            ips: pod.ips,
            options: pod.options,
            attachment,
            sidecar: pod.sidecar,
        };
        self.enroll_in(&workload, EnrollNetns::Found(found.netns))
            .await?;
        self.kept.lock().unwrap().remove(&workload.uid);
        info!(mode = workload.mode().as_str(), "running pod enrolled");
        Ok(())
    }

    /// Whether a ztunnel is connected to this agent: then the datapath knows its sockets (its
    /// cgroup is recorded before it counts as connected), and a pod enrolled now never has
    /// ztunnel's own connections redirected back to ztunnel.
    pub fn ztunnel_connected(&self) -> bool {
        *self.zds.connections().borrow() > 0
    }

    /// Changes of how many ztunnels are connected.
    pub fn ztunnel_connections(&self) -> tokio::sync::watch::Receiver<usize> {
        self.zds.connections()
    }

    /// Names a running pod that another node agent (istio-cni's) handed to ztunnel in every
    /// snapshot, with Keep: the ztunnel that comes over from that agent keeps the pod's proxy,
    /// and its connections, until this agent takes the pod over.
    /// Returns whether the pod was not named so before.
    pub async fn keep_for_ztunnel(&self, pod: &RunningPod) -> Result<bool> {
        let info = zds_info(&pod.name, pod.service_account.as_deref());
        self.zds.add(&pod.uid, info, None).await?;
        let kept = self
            .kept
            .lock()
            .unwrap()
            .insert(pod.uid.clone(), pod.name.clone());
        Ok(kept.is_none())
    }

    /// The pods [`Self::keep_for_ztunnel`] names, with their names.
    pub fn kept_pods(&self) -> Vec<(String, PodName)> {
        let kept = self.kept.lock().unwrap();
        kept.iter()
            .map(|(uid, name)| (uid.clone(), name.clone()))
            .collect()
    }

    /// Stops naming a pod [`Self::keep_for_ztunnel`] named, and tells ztunnel to drop it; nothing
    /// for a pod it never named.
    pub async fn release_kept(&self, uid: &str) -> Result<()> {
        if self.kept.lock().unwrap().remove(uid).is_some() {
            self.zds.del(uid).await?;
        }
        Ok(())
    }

    /// Enrolls a pod in the netns at its path, as the runtime gives it.
    pub async fn enroll(&self, pod: &Workload) -> Result<Status> {
        self.enroll_in(pod, EnrollNetns::Path).await
    }

    /// Where a pod is enrolled: redirection in place, then ztunnel's Ack, then enabled. A
    /// sidecar pod ([`Workload::sidecar`]) is done once redirected.
    pub async fn enroll_in(&self, pod: &Workload, netns: EnrollNetns) -> Result<Status> {
        let started = std::time::Instant::now();
        let result = self.redirect_and_hand_over(pod, netns).await;
        let mode = pod.mode();
        metrics::observe(
            &self.enroll_seconds,
            mode,
            result.is_ok(),
            started.elapsed().as_secs_f64(),
        );
        match &result {
            Ok(_) => drop(self.failed.lock().unwrap().remove(&pod.uid)),
            Err(_) => self.count_failed(&pod.uid, mode),
        }
        result
    }

    /// Counts the pod as failed (`weir_pods{state="failed"}`) after an enrollment that failed or
    /// was refused, until it is enrolled, its sandbox removed or it leaves the cluster. A pod
    /// enrolled before stays redirected as it was, and counted as enrolled.
    pub fn count_failed(&self, uid: &str, mode: Mode) {
        if !self.state.contains(uid) {
            self.failed.lock().unwrap().insert(uid.to_owned(), mode);
        }
    }

    async fn redirect_and_hand_over(&self, pod: &Workload, netns: EnrollNetns) -> Result<Status> {
        let started = std::time::Instant::now();
        let netns = self.datapath.enroll_in(pod.clone(), netns).await?;
        self.redirect_seconds
            .observe(started.elapsed().as_secs_f64());
        fail::fail_point!("enroll-redirected");
        self.removed_sandboxes.lock().unwrap().remove(&pod.uid);
        if pod.sidecar.is_some() {
            // Its proxy is in the pod: ztunnel never hears of it, and it has no ambient status
            // to publish. Redirected is all there is to it.
            self.state.insert(pod, Status::Enabled)?;
            info!(mode = "sidecar", "pod enrolled");
            return Ok(Status::Enabled);
        }
        let status = match self
            .zds
            .add(
                &pod.uid,
                zds_info(&pod.pod, pod.service_account.as_deref()),
                Some(Arc::new(netns)),
            )
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
        // nothing more (the other way round, a re-enrolled pod would cost two journal lines).
        let recorded = self.state.insert(pod, status);
        self.set_status(&pod.uid, Some((status, pod.pod.clone())))
            .await;
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
        let sidecar = self.state.get(uid).is_some_and(|pod| pod.sidecar.is_some());
        if !sidecar {
            if let Err(error) = self.zds.del(uid).await {
                warn!(%error, "ztunnel Del");
            }
        }
        self.set_status(uid, None).await;
        self.failed.lock().unwrap().remove(uid);
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

    /// Forgets the removed sandboxes and failed enrollments of pods `keep` does not keep (gone
    /// from the cluster).
    pub fn forget_pods_gone(&self, keep: impl Fn(&str) -> bool) {
        self.removed_sandboxes
            .lock()
            .unwrap()
            .retain(|uid| keep(uid));
        self.failed.lock().unwrap().retain(|uid, _| keep(uid));
    }

    /// Whether the pod's redirection is in the kernel as enrolled.
    pub async fn is_redirected(&self, uid: &str) -> Result<bool> {
        self.datapath.is_redirected(uid).await
    }
}

/// A running pod to enroll in place ([`Enroller::enroll_running`]): what its enrollment needs
/// but its netns, which is found.
pub struct RunningPod {
    pub uid: String,
    pub name: PodName,
    pub service_account: Option<String>,
    pub ips: Vec<IpAddr>,
    pub options: PodOptions,
    /// Set for a sidecar pod.
    pub sidecar: Option<SidecarRedirect>,
}

/// What ztunnel is told about a pod.
fn zds_info(pod: &PodName, service_account: Option<&str>) -> WorkloadInfo {
    WorkloadInfo {
        name: pod.name.clone(),
        namespace: pod.namespace.clone(),
        service_account: service_account.unwrap_or_default().to_owned(),
    }
}
