//! The reconcile loop: what the cluster says each pod on this node should be, made so while pods
//! run. Label flips enroll or remove running pods, annotation changes apply live, terminated and
//! deleted pods are removed, and pods the API server no longer knows are dropped. It is driven by
//! the reflectors' changes and a periodic full pass, and acts through the [`Enroller`] in turn
//! with any CNI ADD or DEL for the same pod. One pod's failure is logged, reported and retried
//! with its own backoff, when that expires; the others go on.
//!
//! Repair, as istio's repair controller in its ambient form ([`super::repair`]): an ambient pod
//! that runs (has its addresses) without being enrolled is broken, unless this agent saw it out
//! of the mesh before. The pod's addresses appear only once its sandbox is wired, after the
//! whole CNI chain ran: with weir-cni in the chain, the ADD enrolled the pod or failed (and the
//! runtime tore the sandbox down and retries). So a pod that was ambient all along and runs
//! unenrolled started while weir-cni was missing from the chain, or before weir was on the
//! node; while a pod seen out of the mesh and found ambient later was flipped in by a label,
//! and is simply enrolled live. (A label flipped while no agent ran cannot be told apart: that
//! pod counts as broken.) A broken pod is enrolled live like any other, counted and reported as
//! repaired; where that fails, `--repair-broken-pods` says what becomes of it.
use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::Result;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use prometheus_client::{metrics::counter::Counter, registry::Registry};
use tokio::sync::{broadcast::error::RecvError, watch};
use tracing::{debug, info, warn, Instrument};

use super::{facts_of, ips_of, repair::Repair, Change, LoopRuns, Reflectors};
use crate::{
    datapath::{Datapath, EnrollNetns},
    enroll::{Enroller, RunningPod},
    install::files::istio_cni_configs,
    logging::pod_span,
    policy::{AmbientPod, AnnotationProblem, PolicyConfig, REDIRECTION_ANNOTATION},
    report::{report_problems, Reporter, Warning},
    workload::{PodName, Status, Workload},
};

/// A failing pod is retried after this, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(300);

pub struct Reconciler {
    enroller: Arc<Enroller>,
    reflectors: Reflectors,
    policy: PolicyConfig,
    reporter: Arc<dyn Reporter>,
    resync_interval: Duration,
    repair: Repair,
    /// Failing pods by uid: how long they wait now, and until when.
    backoff: Mutex<HashMap<String, (Duration, Instant)>>,
    /// Pods this agent has seen out of the mesh: found ambient and unenrolled later, one of
    /// them was flipped in, not broken.
    seen_out: Mutex<HashSet<String>>,
    /// The invalid annotations each ambient pod had when last reconciled: a new one is reported
    /// as at ADD, once, not on every pass.
    annotation_problems: Mutex<HashMap<String, Vec<AnnotationProblem>>>,
    failures: Counter,
    taken_over: Counter,
    runs: LoopRuns,
    /// Where istio-cni's probe SNAT is to go from the node once it is weir's; `None` on an
    /// agent that is to hand the node back to istio-cni.
    probe_snat: Option<ProbeSnat>,
    /// Set once it went (or there was none): looked for once per agent life.
    probe_snat_gone: AtomicBool,
}

/// istio-cni's probe SNAT on a node weir took over (see
/// [`crate::datapath::istio_rules::remove_probe_snat`]): what removes it, and the CNI config
/// directory istio-cni's plugin must have left first.
pub struct ProbeSnat {
    pub datapath: Arc<Datapath>,
    pub net_dir: PathBuf,
}

/// What one pod should be, from the API server's view of it.
enum Wanted {
    /// Ambient and running: enrolled with these options, at these addresses (the object, for
    /// what repair does to it).
    Enrolled(AmbientPod, Vec<IpAddr>, Arc<Pod>),
    /// Not ambient, terminated, or gone: not enrolled.
    Out,
    /// Being deleted: left as it is. An enrolled pod stays captured through its grace period
    /// until its sandbox's DEL; one that is not is never enrolled or repaired now.
    Terminating,
}

impl Reconciler {
    pub fn new(
        enroller: Arc<Enroller>,
        reflectors: Reflectors,
        policy: PolicyConfig,
        reporter: Arc<dyn Reporter>,
        resync_interval: Duration,
        repair: Repair,
        probe_snat: Option<ProbeSnat>,
    ) -> Arc<Self> {
        Arc::new(Self {
            enroller,
            reflectors,
            policy,
            reporter,
            resync_interval,
            repair,
            backoff: Mutex::new(HashMap::new()),
            seen_out: Mutex::new(HashSet::new()),
            annotation_problems: Mutex::new(HashMap::new()),
            failures: Counter::default(),
            taken_over: Counter::default(),
            runs: LoopRuns::default(),
            probe_snat,
            probe_snat_gone: AtomicBool::new(false),
        })
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "weir_reconcile_failures",
            "Pods the reconcile loop could not bring to what the cluster asks (each is retried)",
            self.failures.clone(),
        );
        self.runs.register(
            registry,
            "weir_reconcile_runs",
            "Runs of the reconcile loop, counted once done, by what started them: a change from \
             the watches, a full pass, or pods whose backoff expired",
        );
        registry.register(
            "weir_pods_taken_over",
            "Running pods another node agent (istio-cni's) redirected, taken over in place",
            self.taken_over.clone(),
        );
        self.repair.register_metrics(registry);
    }

    /// Runs until the agent stops. `first_pass` turns true once the caches have synced and one
    /// full pass is done: before that the node is not ready.
    pub async fn run(self: Arc<Self>, first_pass: watch::Sender<bool>) {
        // Subscribed before the sync, so nothing that changes during the first pass is missed.
        let mut changes = self.reflectors.changes();
        self.reflectors.synced().await;
        self.full_pass().await;
        first_pass.send_replace(true);
        let mut resync = tokio::time::interval(self.resync_interval);
        resync.reset();
        let mut ztunnels = self.enroller.ztunnel_connections();
        loop {
            let next_retry = self.next_retry();
            tokio::select! {
                // Pods taken over from another node agent wait for a ztunnel.
                Ok(()) = ztunnels.changed() => {
                    if *ztunnels.borrow_and_update() > 0 {
                        self.full_pass().await;
                    }
                }
                change = changes.recv() => match change {
                    Ok(Change::Pod(pod)) => {
                        self.reconcile_named(&pod).await;
                        self.runs.ran("change");
                    }
                    Ok(Change::Namespace(namespace)) => {
                        self.reconcile_namespace(&namespace).await;
                        self.runs.ran("change");
                    }
                    Ok(Change::DaemonSet) => {}
                    Ok(Change::Relisted) => self.full_pass().await,
                    // Changes were missed: only the stores know them now.
                    Err(RecvError::Lagged(_)) => self.full_pass().await,
                    Err(RecvError::Closed) => return,
                },
                _ = resync.tick() => self.full_pass().await,
                () = sleep_until(next_retry) => {
                    self.retry_due().await;
                    self.runs.ran("retry");
                }
            }
        }
    }

    /// Every pod on the node, and every enrolled pod the API server does not know.
    async fn full_pass(&self) {
        let pods = self.reflectors.pods.state();
        let known: HashSet<String> = pods.iter().filter_map(|pod| pod.uid()).collect();
        self.backoff
            .lock()
            .unwrap()
            .retain(|uid, _| known.contains(uid));
        self.seen_out
            .lock()
            .unwrap()
            .retain(|uid| known.contains(uid));
        self.enroller.forget_pods_gone(|uid| known.contains(uid));
        self.annotation_problems
            .lock()
            .unwrap()
            .retain(|uid, _| known.contains(uid));
        self.reconcile_selected(&pods, |_| true).await;
        self.remove_istio_cni_probe_snat().await;
        self.runs.ran("pass");
        debug!(pods = pods.len(), "full reconcile pass done");
    }

    /// Removes istio-cni's probe SNAT from the node once the node is weir's: ztunnel is
    /// connected to this agent (istio-cni's no longer serves it), no pod waits to be taken over
    /// or fails, and istio-cni's plugin is out of the CNI config. Until then a pod istio's rules
    /// alone redirect may be there, whose probes need it; from then on weir's programs give
    /// kubelet's probes their source themselves. Once per agent life.
    async fn remove_istio_cni_probe_snat(&self) {
        let Some(ProbeSnat { datapath, net_dir }) = &self.probe_snat else {
            return;
        };
        if self.probe_snat_gone.load(Ordering::Relaxed) {
            return;
        }
        let node_is_weirs = self.enroller.ztunnel_connected()
            && self.enroller.kept_pods().is_empty()
            && self.backoff.lock().unwrap().is_empty()
            && istio_cni_configs(net_dir).is_empty();
        if !node_is_weirs {
            return;
        }
        match datapath.remove_istio_cni_probe_snat().await {
            Ok(removed) => {
                if !removed.is_empty() {
                    info!(
                        ?removed,
                        "istio-cni's probe SNAT removed from the node: no pod is left to \
                         istio's rules, and weir's programs give kubelet's probes their source"
                    );
                }
                self.probe_snat_gone.store(true, Ordering::Relaxed);
            }
            Err(error) => warn!("{error:#}; tried again at the next full pass"),
        }
    }

    /// When the earliest backoff expires, if any pod is failing.
    fn next_retry(&self) -> Option<Instant> {
        let backoff = self.backoff.lock().unwrap();
        backoff.values().map(|(_, until)| *until).min()
    }

    /// The failing pods whose backoff has expired, tried again.
    async fn retry_due(&self) {
        let now = Instant::now();
        let due: HashSet<String> = {
            let backoff = self.backoff.lock().unwrap();
            let expired = backoff.iter().filter(|(_, (_, until))| *until <= now);
            expired.map(|(uid, _)| uid.clone()).collect()
        };
        let pods = self.reflectors.pods.state();
        self.reconcile_selected(&pods, |uid| due.contains(uid))
            .await;
        // A pod tried again either succeeded (no entry) or waits anew; one that is neither in
        // the cache nor enrolled any more had nothing to try, and must not wake the loop again.
        self.backoff
            .lock()
            .unwrap()
            .retain(|uid, (_, until)| !due.contains(uid) || *until > now);
    }

    /// The pods among `pods` that `selected` picks by uid, and the enrolled pods it picks that
    /// are not among them (the API server no longer knows them).
    async fn reconcile_selected(&self, pods: &[Arc<Pod>], selected: impl Fn(&str) -> bool) {
        let mut known = HashSet::new();
        for pod in pods {
            let Some(uid) = pod.uid() else { continue };
            if selected(&uid) {
                self.reconcile(pod).await;
            }
            known.insert(uid);
        }
        for (uid, name) in self.enrolled_or_kept() {
            if !known.contains(&uid) && selected(&uid) {
                self.apply(&uid, &name, Wanted::Out).await;
            }
        }
    }

    /// The pods this agent enrolled, and those it names to ztunnel until it takes them over.
    fn enrolled_or_kept(&self) -> Vec<(String, PodName)> {
        let mut pods = self.enroller.enrolled_pods();
        pods.extend(self.enroller.kept_pods());
        pods
    }

    async fn reconcile_namespace(&self, namespace: &str) {
        for pod in self.reflectors.pods.state() {
            if pod.namespace().as_deref() == Some(namespace) {
                self.reconcile(&pod).await;
            }
        }
    }

    /// A pod named by a change: in the cache, or deleted (then whatever is enrolled under its
    /// name goes).
    async fn reconcile_named(&self, name: &PodName) {
        match self.reflectors.pod(name) {
            Some(pod) => self.reconcile(&pod).await,
            None => {
                let gone = self.enrolled_or_kept();
                for (uid, _) in gone.iter().filter(|(_, enrolled)| enrolled == name) {
                    self.apply(uid, name, Wanted::Out).await;
                }
            }
        }
    }

    async fn reconcile(&self, pod: &Arc<Pod>) {
        let Some(uid) = pod.uid() else { return };
        let namespace = pod.namespace().unwrap_or_default();
        let name = PodName::new(&namespace, &pod.name_any());
        let wanted = self.wanted(pod);
        // Out only by what is known: a pod met before its namespace reached the cache proves
        // nothing about being ambient.
        let namespace_known = self.reflectors.namespace_labels(&namespace).is_some();
        if matches!(wanted, Wanted::Out) && namespace_known {
            self.seen_out.lock().unwrap().insert(uid.clone());
        }
        self.apply(&uid, &name, wanted).await;
    }

    fn wanted(&self, pod: &Arc<Pod>) -> Wanted {
        let status = pod.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            return Wanted::Out;
        }
        if pod.metadata.deletion_timestamp.is_some() {
            return Wanted::Terminating;
        }
        let namespace = pod.namespace().unwrap_or_default();
        let namespace_labels = self
            .reflectors
            .namespace_labels(&namespace)
            .unwrap_or_default();
        match self.policy.decide(&facts_of(pod, namespace_labels)) {
            None => Wanted::Out,
            Some(ambient) => Wanted::Enrolled(ambient, ips_of(pod), pod.clone()),
        }
    }

    /// Brings one pod to `wanted`, in turn with its other steps; a failure is reported and
    /// retried later with backoff.
    async fn apply(&self, uid: &str, name: &PodName, wanted: Wanted) {
        if !self.due(uid) {
            return;
        }
        async {
            let result = self
                .enroller
                .in_turn(uid, self.converge(uid, name, wanted))
                .await;
            match result {
                Ok(()) => drop(self.backoff.lock().unwrap().remove(uid)),
                Err(error) => {
                    self.failures.inc();
                    let wait = self.back_off(uid);
                    warn!(retry_in = ?wait, "reconciling the pod: {error:#}");
                    self.reporter
                        .warn(name, Warning::EnrollmentFailed(format!("{error:#}")))
                        .await;
                }
            }
        }
        .instrument(pod_span(&name.namespace, &name.name, uid))
        .await
    }

    async fn converge(&self, uid: &str, name: &PodName, wanted: Wanted) -> Result<()> {
        let enrolled = self.enroller.status(uid).is_some();
        match wanted {
            Wanted::Out if enrolled => {
                self.enroller.unenroll(uid).await?;
                info!("pod no longer ambient: removed");
            }
            // A pod named with Keep while it waited to be taken over, gone since: ztunnel drops
            // its proxy.
            Wanted::Out => self.enroller.release_kept(uid).await?,
            Wanted::Terminating => {}
            Wanted::Enrolled(..) if !enrolled && self.enroller.sandbox_removed(uid) => {
                // The runtime removed its sandbox (a DEL) and the next one's ADD enrolls it: a
                // pod between sandboxes is not broken.
            }
            Wanted::Enrolled(ambient, ips, object) => {
                self.report_new_problems(uid, name, &ambient, enrolled)
                    .await;
                let record = self.enroller.record(uid);
                if let Some(record) = record.as_ref().filter(|_| enrolled) {
                    if record.options != ambient.options {
                        let updated = Workload {
                            options: ambient.options.clone(),
                            ..record.clone()
                        };
                        self.enroller.enroll_in(&updated, EnrollNetns::Held).await?;
                        info!(options = ?ambient.options, "pod options applied live");
                    }
                    return Ok(());
                }
                if ips.is_empty() {
                    // No address or sandbox yet: its CNI ADD enrolls it.
                    return Ok(());
                }
                // istio-cni's agent annotates the pods it redirects, as weir does; one this agent
                // never enrolled is being taken over from it.
                let handed_over = object
                    .annotations()
                    .get(REDIRECTION_ANNOTATION)
                    .is_some_and(|value| value == Status::Enabled.as_str());
                let broken = !handed_over && !self.seen_out.lock().unwrap().contains(uid);
                let running = RunningPod {
                    uid: uid.to_owned(),
                    name: name.clone(),
                    service_account: Some(ambient.service_account),
                    ips,
                    options: ambient.options,
                    sidecar: None,
                };
                if handed_over && !self.enroller.ztunnel_connected() {
                    // Its rules redirect it to ztunnel until then; enrolled now, ztunnel's own
                    // connections out of the pod would be redirected too, since only a ztunnel
                    // connected to this agent is known to the datapath.
                    if self.enroller.keep_for_ztunnel(&running).await? {
                        info!(
                            "pod redirected by another node agent (istio-cni): taken over once \
                             ztunnel connects to this agent, which keeps its proxy meanwhile"
                        );
                    }
                    return Ok(());
                }
                let enrolled = self.enroller.enroll_running(running).await;
                if broken {
                    return self.repaired(name, &object, enrolled).await;
                }
                enrolled?;
                if handed_over {
                    self.taken_over.inc();
                    info!("pod taken over from another node agent (istio-cni) in place");
                    self.reporter.warn(name, Warning::TakenOver).await;
                }
            }
        }
        Ok(())
    }

    /// Reports the pod's invalid annotations that it did not have when last reconciled. Those
    /// of a pod enrolled by its ADD were reported there.
    async fn report_new_problems(
        &self,
        uid: &str,
        name: &PodName,
        ambient: &AmbientPod,
        enrolled: bool,
    ) {
        let previous = self
            .annotation_problems
            .lock()
            .unwrap()
            .insert(uid.to_owned(), ambient.problems.clone());
        let known = match previous {
            Some(previous) => previous,
            None if enrolled => return,
            None => Vec::new(),
        };
        let new: Vec<AnnotationProblem> = ambient
            .problems
            .iter()
            .filter(|problem| !known.contains(problem))
            .cloned()
            .collect();
        report_problems(&*self.reporter, name, &new).await;
    }

    /// Accounts for the in-place repair of a broken pod; where it failed, the configured
    /// action applies. A pod deleted by it is done with; otherwise the failure stands, and the
    /// pod is retried with backoff.
    async fn repaired(&self, name: &PodName, object: &Pod, enrolled: Result<()>) -> Result<()> {
        self.repair.repaired_in_place(enrolled.is_ok());
        let Err(error) = enrolled else {
            warn!("the pod ran without weir's redirection: repaired in place");
            self.reporter.warn(name, Warning::RepairedPod).await;
            return Ok(());
        };
        let acted = self.repair.act_on(object, format!("{error:#}")).await;
        if let Some(warning) = acted.warning {
            self.reporter.warn(name, warning).await;
        }
        if acted.pod_gone {
            Ok(())
        } else {
            Err(error)
        }
    }

    /// Whether a pod that failed before may be tried again now.
    fn due(&self, uid: &str) -> bool {
        let backoff = self.backoff.lock().unwrap();
        backoff
            .get(uid)
            .is_none_or(|(_, until)| Instant::now() >= *until)
    }

    /// Records a failure; returns how long the pod now waits.
    fn back_off(&self, uid: &str) -> Duration {
        let mut backoff = self.backoff.lock().unwrap();
        let wait = backoff
            .get(uid)
            .map_or(FIRST_BACKOFF, |(wait, _)| (*wait * 2).min(MAX_BACKOFF));
        backoff.insert(uid.to_owned(), (wait, Instant::now() + wait));
        wait
    }
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}
