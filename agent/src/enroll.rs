//! Enrollment: the one path every pod takes into the mesh and out of it.
//!
//! [`Enroller::enroll`] is where a pod is enrolled, whatever asked for it (a CNI ADD now; label
//! changes and the start-up reconcile later): redirection first, then ztunnel's Ack, then the
//! pod is reported enabled. [`Enroller::unenroll`] undoes it. Both are idempotent, and the steps
//! for one pod never interleave (a per-pod lock), while different pods proceed in parallel.
use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use anyhow::{anyhow, Context, Result};
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
use tracing::{info, warn};
use weir_cni::protocol::{Command, Request, Response, VerdictCache};

use crate::{
    datapath::Datapath,
    policy::{write_verdict_cache, Labels, LocalPolicy, PolicyConfig},
    workload::Workload,
    zds::{WorkloadInfo, ZdsError, ZdsHandle},
};

/// CNI error code for "try again later": the runtime retries the ADD.
const TRY_AGAIN_LATER: u32 = 11;
/// CNI error code for failures specific to this plugin.
const PLUGIN_ERROR: u32 = 999;

/// Where ambient policy comes from on a node without an API server.
pub struct PolicySource {
    pub config: PolicyConfig,
    pub file: PathBuf,
    /// Kept current for the plugin, which decides alone while the agent is down.
    pub verdict_cache: PathBuf,
    /// What was last written there: rewritten only on change, one writer at a time.
    pub written: Mutex<Option<VerdictCache>>,
}

impl PolicySource {
    pub fn new(config: PolicyConfig, file: PathBuf, verdict_cache: PathBuf) -> Self {
        Self {
            config,
            file,
            verdict_cache,
            written: Mutex::new(None),
        }
    }

    fn load(&self) -> Result<LocalPolicy> {
        let policy = LocalPolicy::load(&self.file)?;
        let verdicts = policy.verdict_cache(&self.config);
        let mut written = self.written.lock().unwrap();
        if written.as_ref() != Some(&verdicts) {
            write_verdict_cache(&self.verdict_cache, &verdicts)?;
            *written = Some(verdicts);
        }
        Ok(policy)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
    result: &'static str,
}

pub struct Enroller {
    datapath: Arc<Datapath>,
    zds: ZdsHandle,
    policy: PolicySource,
    status: Mutex<HashMap<String, Status>>,
    /// Enrolled pods by uid, mirrored to `state_file` on every change.
    records: Mutex<BTreeMap<String, Workload>>,
    state_file: PathBuf,
    /// One async lock per pod uid: ADD/DEL for one pod are ordered.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    events: Family<EventLabels, Counter>,
    /// Enrolled pods by status (istio's `ambient.istio.io/redirection` values).
    pods: Family<StatusLabels, Gauge>,
    /// Time to put one pod's redirection in place (the datapath's part of enrollment).
    redirect_seconds: Histogram,
}

impl Enroller {
    pub fn new(
        datapath: Arc<Datapath>,
        zds: ZdsHandle,
        policy: PolicySource,
        state_file: PathBuf,
    ) -> Result<Arc<Self>> {
        policy.load().context("loading the ambient policy")?;
        Ok(Arc::new(Self {
            datapath,
            zds,
            policy,
            status: Mutex::new(HashMap::new()),
            records: Mutex::new(BTreeMap::new()),
            state_file,
            locks: Mutex::new(HashMap::new()),
            events: Family::default(),
            pods: Family::default(),
            // 50 µs .. ~100 ms: weir's enrollment is sub-millisecond; istio's iptables ~10 ms.
            redirect_seconds: Histogram::new(exponential_buckets(50e-6, 2.0, 12)),
        }))
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "nodeagent_reconcile_events",
            "Pod events handled by the node agent, by event and result",
            self.events.clone(),
        );
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
    }

    /// After an agent restart: the pods the pinned maps still redirect are taken back, their
    /// netns found again, and registered with the ZDS server, so ztunnel's next snapshot names
    /// them (Add with the netns, or Keep when it cannot be found). They stay pending until
    /// ztunnel acks them.
    pub async fn recover(&self) -> Result<()> {
        let mut records: BTreeMap<String, Workload> = match std::fs::read(&self.state_file) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|error| {
                warn!(file = %self.state_file.display(), %error, "unreadable pod state: ignored");
                BTreeMap::new()
            }),
            Err(_) => BTreeMap::new(),
        };
        let enrolled = self.datapath_call(|d| d.enrolled()).await?;
        // Known to the state file but not to these maps: enrolled by an agent with another map
        // layout (an upgrade). They are enrolled again, into this one.
        let migrate: Vec<Workload> = records
            .values()
            .filter(|pod| !enrolled.contains(&pod.uid))
            .cloned()
            .collect();
        records.retain(|uid, _| enrolled.contains(uid));
        *self.records.lock().unwrap() = records.clone();
        for uid in enrolled {
            let record = records.get(&uid);
            let (hint, owned_uid) = (record.map(|r| r.netns.clone()), uid.clone());
            let netns = self
                .datapath_call(move |d| d.adopt(&owned_uid, hint))
                .await?;
            let info = record.map(zds_info).unwrap_or_default();
            info!(
                uid,
                netns_found = netns.is_some(),
                "recovered an enrolled pod"
            );
            let handed_over = netns.is_some();
            // Without its netns the pod is only named in snapshots (Keep): not confirmed.
            let status = match self.zds.add(&uid, info, netns.map(Arc::new)).await {
                Ok(()) if handed_over => Status::Enabled,
                _ => Status::Pending,
            };
            self.set_status(&uid, Some(status));
        }
        for pod in migrate.iter().filter(|pod| pod.netns.exists()) {
            match self.enroll(pod).await {
                Ok(_) => info!(uid = pod.uid, "pod moved to this agent's map layout"),
                Err(error) => warn!(
                    uid = pod.uid,
                    "moving the pod to this map layout: {error:#}"
                ),
            }
        }
        if let Err(error) = self.datapath_call(|d| d.retire_other_layouts()).await {
            warn!("retiring older map layouts: {error:#}");
        }
        self.save_records()
    }

    /// Records a pod's status (`None`: no longer enrolled) and updates the per-status gauge.
    fn set_status(&self, uid: &str, status: Option<Status>) {
        let mut statuses = self.status.lock().unwrap();
        match status {
            Some(status) => statuses.insert(uid.to_owned(), status),
            None => statuses.remove(uid),
        };
        for (label, wanted) in [("pending", Status::Pending), ("enabled", Status::Enabled)] {
            let count = statuses.values().filter(|s| **s == wanted).count();
            self.pods
                .get_or_create(&StatusLabels { status: label })
                .set(count as i64);
        }
    }

    fn save_records(&self) -> Result<()> {
        let records = self.records.lock().unwrap();
        if let Some(dir) = self.state_file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let temp = self.state_file.with_extension("tmp");
        std::fs::write(&temp, serde_json::to_vec(&*records)?)?;
        std::fs::rename(&temp, &self.state_file)
            .with_context(|| format!("writing {}", self.state_file.display()))
    }

    /// Completes pods that were pending when ztunnel acks them in a snapshot.
    pub async fn follow_acks(self: Arc<Self>) {
        let mut acked = self.zds.acked();
        loop {
            match acked.recv().await {
                Ok(uid) => {
                    if self.status(&uid).is_some() {
                        self.set_status(&uid, Some(Status::Enabled));
                        info!(uid, "ztunnel acked the pod: redirection enabled");
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }

    pub fn status(&self, uid: &str) -> Option<Status> {
        self.status.lock().unwrap().get(uid).copied()
    }

    /// Serves one plugin request.
    pub async fn handle(&self, request: &Request) -> Response {
        let key = if request.pod.uid.is_empty() {
            &request.container_id
        } else {
            &request.pod.uid
        };
        let lock = self.lock_for(key);
        let _ordered = lock.lock().await;
        let (event, result) = match request.command {
            Command::Add => ("add", self.cni_add(request).await),
            Command::Del => ("del", self.cni_del(request).await),
            Command::Check => ("check", self.cni_check(request).await),
        };
        let outcome = if matches!(result, Response::Ok { .. }) {
            "ok"
        } else {
            "error"
        };
        self.events
            .get_or_create(&EventLabels {
                event,
                result: outcome,
            })
            .inc();
        if request.command == Command::Del {
            self.forget_lock(key, &lock);
        }
        result
    }

    /// A deleted pod's lock goes, unless another request for it is already waiting on it.
    fn forget_lock(&self, key: &str, lock: &Arc<tokio::sync::Mutex<()>>) {
        let mut locks = self.locks.lock().unwrap();
        // Held by the map and by this request only.
        if Arc::strong_count(lock) == 2 {
            locks.remove(key);
        }
    }

    fn lock_for(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    /// Decides from policy; returns the pod to enroll, or `None` when it is not ambient.
    fn ambient_pod(&self, request: &Request) -> Result<Option<Workload>> {
        let policy = self.policy.load()?;
        let annotations: Labels = request.annotations.clone().into_iter().collect();
        let facts = policy.facts(&request.pod.namespace, &request.pod.name, &annotations);
        if !self.policy.config.is_ambient(&facts) {
            return Ok(None);
        }
        let (options, problems) = self.policy.config.options(&facts.annotations);
        for problem in problems {
            warn!(
                pod = %format!("{}/{}", request.pod.namespace, request.pod.name),
                annotation = problem.annotation,
                value = problem.value,
                used = problem.used,
                "invalid annotation value, using the default"
            );
        }
        let ips = request
            .ips
            .iter()
            .map(|ip| {
                let address = ip.address.split('/').next().unwrap_or_default();
                address
                    .parse()
                    .with_context(|| format!("pod IP {:?}", ip.address))
            })
            .collect::<Result<Vec<IpAddr>>>()?;
        let service_account = policy
            .pods
            .get(&format!("{}/{}", request.pod.namespace, request.pod.name))
            .and_then(|p| p.annotations.get("weir.dev/service-account").cloned())
            .unwrap_or_else(|| "default".into());
        Ok(Some(Workload {
            uid: request.pod.uid.clone(),
            name: request.pod.name.clone(),
            namespace: request.pod.namespace.clone(),
            netns: PathBuf::from(&request.netns),
            ips,
            options,
            service_account: Some(service_account),
        }))
    }

    async fn cni_add(&self, request: &Request) -> Response {
        let pod = match self.ambient_pod(request) {
            Ok(Some(pod)) => pod,
            Ok(None) => return Response::Ok { enrolled: false },
            Err(error) => return error_response(PLUGIN_ERROR, "cannot decide", &error),
        };
        if pod.uid.is_empty() || pod.ips.is_empty() || request.netns.is_empty() {
            return error_response(
                PLUGIN_ERROR,
                "incomplete ADD",
                &anyhow!("an ambient pod needs K8S_POD_UID, a netns and IPs from prevResult"),
            );
        }
        match self.enroll(&pod).await {
            Ok(Status::Enabled) => Response::Ok { enrolled: true },
            Ok(Status::Pending) => Response::Error {
                code: TRY_AGAIN_LATER,
                msg: format!(
                    "ztunnel has not acknowledged pod {}/{}: redirection is in place and pending",
                    pod.namespace, pod.name
                ),
                details: "the runtime retries; the pod completes when ztunnel connects".into(),
            },
            Err(error) => error_response(TRY_AGAIN_LATER, "enrollment failed", &error),
        }
    }

    async fn cni_del(&self, request: &Request) -> Response {
        if request.pod.uid.is_empty() {
            // Nothing names the pod: its maps entries go when its netns does.
            return Response::Ok { enrolled: false };
        }
        match self.unenroll(&request.pod.uid).await {
            Ok(was) => Response::Ok { enrolled: was },
            Err(error) => error_response(PLUGIN_ERROR, "unenroll failed", &error),
        }
    }

    async fn cni_check(&self, request: &Request) -> Response {
        match self.ambient_pod(request) {
            Ok(None) => Response::Ok { enrolled: false },
            Ok(Some(pod)) => match self.datapath_call(move |d| d.is_redirected(&pod.uid)).await {
                Ok(true) => Response::Ok { enrolled: true },
                Ok(false) => Response::Error {
                    code: PLUGIN_ERROR,
                    msg: format!(
                        "ambient pod {}/{} has no redirection",
                        request.pod.namespace, request.pod.name
                    ),
                    details: String::new(),
                },
                Err(error) => error_response(PLUGIN_ERROR, "check failed", &error),
            },
            Err(error) => error_response(PLUGIN_ERROR, "cannot decide", &error),
        }
    }

    /// Where a pod is enrolled: redirection in place, then ztunnel's Ack, then enabled.
    pub async fn enroll(&self, pod: &Workload) -> Result<Status> {
        let owned = pod.clone();
        let started = std::time::Instant::now();
        let netns = self.datapath_call(move |d| d.enroll(owned)).await?;
        self.redirect_seconds
            .observe(started.elapsed().as_secs_f64());
        let status = match self
            .zds
            .add(&pod.uid, zds_info(pod), Some(Arc::new(netns)))
            .await
        {
            Ok(()) => Status::Enabled,
            Err(ZdsError::NotConnected) => Status::Pending,
            Err(error) => {
                warn!(uid = pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name), %error, "ztunnel did not accept the pod");
                Status::Pending
            }
        };
        self.set_status(&pod.uid, Some(status));
        self.records
            .lock()
            .unwrap()
            .insert(pod.uid.clone(), pod.clone());
        self.save_records()?;
        info!(uid = pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name), ?status, "pod enrolled");
        Ok(status)
    }

    /// Takes a pod out: ztunnel first (so it stops proxying), then redirection. Returns whether
    /// the pod was enrolled.
    pub async fn unenroll(&self, uid: &str) -> Result<bool> {
        if let Err(error) = self.zds.del(uid).await {
            warn!(uid, %error, "ztunnel Del");
        }
        self.set_status(uid, None);
        let owned = uid.to_owned();
        let was = self.datapath_call(move |d| d.unenroll(&owned)).await?;
        if self.records.lock().unwrap().remove(uid).is_some() {
            self.save_records()?;
        }
        if was {
            info!(uid, "pod unenrolled");
        }
        Ok(was)
    }

    /// Runs a datapath call off the async workers: the datapath answers from its own thread.
    async fn datapath_call<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Datapath) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let datapath = self.datapath.clone();
        tokio::task::spawn_blocking(move || call(&datapath)).await?
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

fn error_response(code: u32, msg: &str, error: &anyhow::Error) -> Response {
    Response::Error {
        code,
        msg: msg.to_owned(),
        details: format!("{error:#}"),
    }
}
