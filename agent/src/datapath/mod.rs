//! The datapath owner: the only code that touches weir's BPF objects.
//!
//! It runs on one dedicated OS thread (network namespace switches are per thread, so they must
//! never happen on a tokio worker) and is driven through [`Datapath`], a cheap handle that sends
//! it commands. It loads the programs once, pins maps and links under the pin root so redirection
//! survives an agent restart, and on start takes over pinned links with `BPF_LINK_UPDATE` rather
//! than detach-then-attach, so there is never a window without redirection.
//!
//! `Owner::enroll` (in `pods.rs`) is where a pod is enrolled, all inside the pod's netns: the
//! return path, then the map entries that switch redirection on, then the tc program (which never
//! runs before the maps name the pod). Unenroll removes the map entries first. Both are
//! idempotent.
//!
//! [`pinned_pods`] is the one reader that needs no owner: it opens the pinned maps read-only, for
//! an operator's `weir-agent pods` next to a running agent.
mod audit;
mod discovery;
mod handoff;
pub(crate) mod kernel;
mod layouts;
pub(crate) mod mounts;
mod pods;
mod programs;
mod recovery;
mod snapshot;
mod trace_maps;
mod watch;

pub use snapshot::{pinned_pods, PinnedPod};
pub use trace_maps::TraceMaps;

use std::{
    collections::HashMap as StdHashMap,
    fs::{self, File},
    future::Future,
    net::IpAddr,
    os::{
        fd::{AsFd, OwnedFd},
        unix::fs::PermissionsExt,
    },
    path::{Path, PathBuf},
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    task::Poll,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, PerCpuHashMap},
    Ebpf,
};
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;
use tracing::{info, warn};
use weir_common::{maps, IpKey, NodeConfig, PodConfig, PodCounters, ABI_VERSION};

use crate::{netlink, netns, workload::Workload};

pub use discovery::PodNetns;
pub use mounts::cgroup2_root;
pub use pods::Unenrollable;
pub use recovery::Orphans;

#[derive(Clone, Debug)]
pub struct DatapathConfig {
    /// bpffs directory for weir's pins (mounted at /sys/fs/bpf if that is not yet a bpffs).
    pub pin_root: PathBuf,
    /// The cgroup v2 directory whose sockets weir sees; `None`: the cgroup2 mount's root.
    pub cgroup: Option<PathBuf>,
    /// The node's network namespace (kubelet probes come from there); `None`: the agent's own.
    pub node_netns: Option<PathBuf>,
    /// Give TCP from the node to enrolled pods the probe source, so kubelet probes reach the app.
    pub probe_bypass: bool,
    /// Turn on the programs' diagnostics (aya-log): their records go to the `log` crate, at
    /// target `weir_ebpf::<module>`. Off, they cost one load and one branch.
    pub bpf_log: bool,
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self {
            pin_root: PathBuf::from("/sys/fs/bpf/weir"),
            cgroup: None,
            node_netns: None,
            probe_bypass: true,
            bpf_log: false,
        }
    }
}

/// Where the owner answers a command: a oneshot, so an async caller awaits it on its own task
/// while the owner, a plain thread, sends without a runtime.
type Reply<T> = oneshot::Sender<Result<T>>;

/// A command with the span it was given in: the owner thread's log lines about a pod carry the
/// pod's fields, as the caller's do.
type Traced = (tracing::Span, Command);

enum Command {
    Enroll(Workload, EnrollNetns, Reply<OwnedFd>),
    Unenroll(String, Reply<bool>),
    Counters(String, Reply<Option<PodCounters>>),
    IsRedirected(String, Reply<bool>),
    Adopt(String, Option<Workload>, Reply<Option<OwnedFd>>),
    FindRunningPod {
        uid: String,
        ips: Vec<IpAddr>,
        hint: Option<PathBuf>,
        reply: Reply<Option<PodNetns>>,
    },
    RetireOtherLayouts(Reply<()>),
    Orphaned(Option<String>, Reply<Orphans>),
    /// From the watcher: an enrolled pod's links or addresses changed.
    InterfacesChanged {
        uid: String,
        netns_cookie: u64,
    },
    Enrolled(Reply<Vec<String>>),
    Audit(Reply<Vec<&'static str>>),
    Stop {
        uninstall: bool,
        reply: Reply<()>,
    },
}

/// Handle to the datapath owner thread. Each call sends the owner a command and returns its
/// [`Request`]: awaited in async code, [`Request::wait`]ed for on a plain thread.
pub struct Datapath {
    commands: mpsc::Sender<Traced>,
    thread: thread::JoinHandle<()>,
    enroll_steps: pods::EnrollSteps,
    mismatches: audit::Mismatches,
    /// Set while the pods' interface watch runs.
    watching: Arc<AtomicBool>,
}

impl Datapath {
    /// Loads (or takes over) the datapath and starts its owner thread.
    pub fn start(config: DatapathConfig) -> Result<Self> {
        let (commands, inbox) = mpsc::channel();
        let (ready_tx, ready) = mpsc::sync_channel(1);
        let changes = commands.clone();
        let enroll_steps = pods::EnrollSteps::default();
        let steps = enroll_steps.clone();
        let mismatches = audit::Mismatches::default();
        let counted = mismatches.clone();
        let watching = Arc::new(AtomicBool::new(false));
        let watch_alive = watching.clone();
        let thread = thread::Builder::new()
            .name("weir-datapath".into())
            .spawn(
                move || match Owner::open(&config, changes, steps, counted, watch_alive) {
                    Ok(mut owner) => {
                        let _ = ready_tx.send(Ok(()));
                        let stopped = owner.serve(inbox);
                        // Answered once the owner is dropped: whoever stopped it may load the
                        // datapath again, and finds its programs and pins released.
                        drop(owner);
                        if let Some((reply, result)) = stopped {
                            let _ = reply.send(result);
                        }
                    }
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                    }
                },
            )
            .context("spawning the datapath thread")?;
        ready
            .recv()
            .map_err(|_| anyhow!("the datapath thread died while starting"))??;
        Ok(Self {
            commands,
            thread,
            enroll_steps,
            mismatches,
            watching,
        })
    }

    /// Whether the owner thread and the pods' interface watch are running; `Err` says which is
    /// not. Either stopped leaves pods without what the agent promises (changes applied, new
    /// addresses captured), so the agent is then not live.
    pub fn health(&self) -> Result<(), String> {
        if self.thread.is_finished() {
            return Err("the datapath thread has stopped".into());
        }
        if !self.watching.load(Ordering::Relaxed) {
            return Err("the pods' interface watch has stopped".into());
        }
        Ok(())
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        self.enroll_steps.register(registry);
        self.mismatches.register(registry);
    }

    /// Sends the owner a command, in the caller's span. A command the owner never takes (its
    /// thread is gone) drops its reply with it, which the request reports.
    fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Request<T> {
        let (reply, answer) = oneshot::channel();
        let _ = self
            .commands
            .send((tracing::Span::current(), command(reply)));
        Request(answer)
    }

    /// Redirects the pod's traffic to ztunnel, in the netns at its path (as the runtime gives
    /// it). Idempotent: enrolling again applies new options. Returns a handle on the pod's netns
    /// (the one the datapath holds), for ztunnel.
    pub fn enroll(&self, pod: Workload) -> Request<OwnedFd> {
        self.enroll_in(pod, EnrollNetns::Path)
    }

    /// [`Self::enroll`] in the given network namespace. A failed attempt undoes only what it
    /// wrote: a pod enrolled before stays redirected as it was. The node's own netns is refused.
    pub fn enroll_in(&self, pod: Workload, netns: EnrollNetns) -> Request<OwnedFd> {
        self.ask(|reply| Command::Enroll(pod, netns, reply))
    }

    /// Removes the pod's redirection; `Ok(false)` when it was not enrolled.
    pub fn unenroll(&self, uid: &str) -> Request<bool> {
        self.ask(|reply| Command::Unenroll(uid.to_owned(), reply))
    }

    /// The pod's counters summed over CPUs, `None` when it is not enrolled.
    pub fn counters(&self, uid: &str) -> Request<Option<PodCounters>> {
        self.ask(|reply| Command::Counters(uid.to_owned(), reply))
    }

    /// Whether the pod's redirection is in the kernel as enrolled (its map entries are intact).
    pub fn is_redirected(&self, uid: &str) -> Request<bool> {
        self.ask(|reply| Command::IsRedirected(uid.to_owned(), reply))
    }

    /// Finds the network namespace of a pod recovered from the pinned maps (after an agent
    /// restart), holds it, and returns a handle for ztunnel; `None` when it is gone. `record` is
    /// the pod as the agent enrolled it: its netns path is tried first; without it, or when it
    /// no longer matches, the runtime's named namespaces (/var/run/netns) and every process's
    /// netns under /proc are checked. A match is by netns cookie, which is exact. With a
    /// record the pod's interface changes are followed again, as after its enrollment.
    pub fn adopt(&self, uid: &str, record: Option<Workload>) -> Request<Option<OwnedFd>> {
        self.ask(|reply| Command::Adopt(uid.to_owned(), record, reply))
    }

    /// Finds the network namespace of a running pod that is not enrolled (to enroll it live):
    /// `hint` (the agent's own record of it) when one of `ips` is on an interface there,
    /// otherwise the netns of the oldest process on the node whose cgroup names pod `uid`
    /// (either cgroup driver) and that holds one of `ips`; never the node's own. `None` when no
    /// such namespace exists.
    pub fn find_running_pod(
        &self,
        uid: &str,
        ips: &[IpAddr],
        hint: Option<PathBuf>,
    ) -> Request<Option<PodNetns>> {
        self.ask(|reply| Command::FindRunningPod {
            uid: uid.to_owned(),
            ips: ips.to_vec(),
            hint,
            reply,
        })
    }

    /// After an upgrade across map layouts: removes every pod this datapath now holds from the
    /// other layouts' maps, and each other layout (its maps and links) once no pod is left in it.
    /// Until then its programs keep redirecting the pods only it knows: never a gap.
    pub fn retire_other_layouts(&self) -> Request<()> {
        self.ask(Command::RetireOtherLayouts)
    }

    /// Enrolled pods (all, or only `only`) whose netns nothing but weir and ztunnel holds any
    /// more: no other process has it as its own and no nsfs mount, in any mount namespace, is of
    /// it. Their DEL never came; their traffic cannot either. `unsure` says what could not be
    /// inspected: then none of them is certainly orphaned.
    pub fn orphaned(&self, only: Option<String>) -> Request<Orphans> {
        self.ask(|reply| Command::Orphaned(only, reply))
    }

    /// Compares the maps with the enrolled pods now (the owner also does every
    /// [`AUDIT_INTERVAL`]): writes back missing entries of enrolled pods, and returns the kind of
    /// each mismatch found (`weir_datapath_mismatches_total`).
    pub fn audit(&self) -> Request<Vec<&'static str>> {
        self.ask(Command::Audit)
    }

    /// Uids of the enrolled pods.
    pub fn enrolled(&self) -> Request<Vec<String>> {
        self.ask(Command::Enrolled)
    }

    /// Stops the owner and leaves the datapath in place: pods stay redirected, and the next
    /// start takes over. This is what an agent restart or upgrade does.
    pub fn shutdown(&self) -> Request<()> {
        self.stop(false)
    }

    /// Unenrolls every pod, detaches every program and removes all pins.
    pub fn uninstall(&self) -> Request<()> {
        self.stop(true)
    }

    /// Answered once the owner is gone (see [`Datapath::start`]).
    fn stop(&self, uninstall: bool) -> Request<()> {
        self.ask(|reply| Command::Stop { uninstall, reply })
    }
}

/// A command the owner thread was sent, and its answer to come. `.await` it in async code: the
/// task waits on the owner's reply itself, no blocking thread in between.
#[must_use = "the command is sent either way; only its answer is in the request"]
pub struct Request<T>(oneshot::Receiver<Result<T>>);

impl<T> Request<T> {
    /// Blocks the calling thread for the answer, for code outside any async runtime.
    ///
    /// # Panics
    ///
    /// Within an async runtime (blocking one of its threads); `.await` the request there.
    pub fn wait(self) -> Result<T> {
        self.0.blocking_recv().map_err(|_| owner_gone())?
    }
}

impl<T> Future for Request<T> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Result<T>> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|answer| answer.map_err(|_| owner_gone())?)
    }
}

fn owner_gone() -> anyhow::Error {
    anyhow!("the datapath thread is gone")
}

/// How often the owner compares the maps with the pods it enrolled.
pub const AUDIT_INTERVAL: Duration = Duration::from_secs(30);

/// Where the maps of this build's layout are pinned.
fn maps_dir(pin_root: &Path) -> PathBuf {
    pin_root.join(format!("abi-{ABI_VERSION}"))
}

/// Which network namespace an enrollment redirects.
#[derive(Debug)]
pub enum EnrollNetns {
    /// The one at the pod's `netns` path, opened now: what the runtime just gave (a CNI ADD).
    Path,
    /// The one the datapath holds for the enrolled pod. A recorded path may name another
    /// namespace by now (a `/proc/<pid>/ns/net` after the PID was reused), so it is never
    /// reopened to change a pod.
    Held,
    /// One the caller found and holds (a running pod enrolled live).
    Found(OwnedFd),
}

/// One enrolled pod as the owner tracks it.
struct Enrolled {
    netns_cookie: u64,
    ips: Vec<IpKey>,
    /// Its `PODS` entry as written, to restore it when a later attempt fails.
    config: PodConfig,
    /// Held so per-pod state can be undone while the pod lives; `None` for pods found in the
    /// pinned maps after a restart.
    netns: Option<File>,
}

struct Owner {
    /// Keeps the programs loaded (and the tc program attachable) for the owner's lifetime.
    ebpf: Ebpf,
    /// Reads the programs' log records while logging is on; dropped with the owner.
    _bpf_log: Option<tokio::runtime::Runtime>,
    pods_map: HashMap<MapData, u64, PodConfig>,
    pod_ips: HashMap<MapData, IpKey, u64>,
    counters: PerCpuHashMap<MapData, u64, PodCounters>,
    pods: StdHashMap<String, Enrolled>,
    /// Enrolled pods' interface subscriptions, by uid (pods recovered after a restart are
    /// followed once enrolled again).
    watches: StdHashMap<String, watch::Watch>,
    watcher: watch::Watcher,
    pin_root: PathBuf,
    probe_bypass: bool,
    /// Where the kernel needs it (before 6.5): the per-pod socket lookup hand-off.
    handoff: Option<handoff::Handoff>,
    /// How the netns cookie is learnt on kernels without `SO_NETNS_COOKIE` (before 5.14).
    cookie_answers: netns::CookieAnswers,
    enroll_steps: pods::EnrollSteps,
    mismatches: audit::Mismatches,
    sysctls: netns::ReplyMarkSysctls,
    /// The thread's own netns (the node's), which enrolling and unenrolling come back to.
    home: netns::Home,
    /// Its cookie: never enrolled as a pod's, whatever path or process claims it.
    node_netns_cookie: u64,
}

impl Owner {
    fn open(
        config: &DatapathConfig,
        changes: mpsc::Sender<Traced>,
        enroll_steps: pods::EnrollSteps,
        mismatches: audit::Mismatches,
        watching: Arc<AtomicBool>,
    ) -> Result<Self> {
        if let Some(node) = &config.node_netns {
            let file = File::open(node).with_context(|| format!("opening {}", node.display()))?;
            // This thread lives in the node's netns from now on.
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("entering {}", node.display()))?;
        }
        let kernel = kernel::Kernel::running()?;
        mounts::ensure_bpffs(&config.pin_root)?;
        let maps_dir = maps_dir(&config.pin_root);
        // Links are versioned with the maps: an agent with another layout attaches its own set
        // and never takes over programs that read maps it does not write.
        let links_dir = maps_dir.join("links");
        for dir in [&maps_dir, &links_dir] {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        // Root only: a pinned map or link opened by anyone else could switch a pod's
        // redirection off.
        for dir in [&config.pin_root, &maps_dir, &links_dir] {
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                .with_context(|| format!("making {} root-only", dir.display()))?;
        }
        let mut ebpf = programs::load(&maps_dir, config.bpf_log)?;
        let bpf_log = config
            .bpf_log
            .then(|| programs::read_bpf_log(&mut ebpf))
            .transpose()?;
        let cgroup_path = match &config.cgroup {
            Some(path) => path.clone(),
            None => mounts::cgroup2_root()?,
        };
        programs::attach(&mut ebpf, &cgroup_path, &links_dir)?;
        let cookie_answers: netns::CookieAnswers =
            programs::take_map(&mut ebpf, maps::NETNS_COOKIES)?;
        let handoff = handoff::Handoff::for_kernel(&kernel, &links_dir)?;

        let mut node_config: Array<MapData, NodeConfig> =
            programs::take_map(&mut ebpf, maps::NODE_CONFIG)?;
        let node_netns_cookie = netns::current_cookie(Some(&cookie_answers))?;
        let host_netns_cookie = if config.probe_bypass {
            netlink::install_probe_source().context("making the probe source address local")?;
            node_netns_cookie
        } else {
            0
        };
        node_config.set(0, NodeConfig { host_netns_cookie }, 0)?;

        let pods_map: HashMap<MapData, u64, PodConfig> = programs::take_map(&mut ebpf, maps::PODS)?;
        let pod_ips: HashMap<MapData, IpKey, u64> = programs::take_map(&mut ebpf, maps::POD_IPS)?;
        let counters = programs::take_map(&mut ebpf, maps::POD_COUNTERS)?;
        let pods = recovery::recover_pods(&pods_map, &pod_ips);
        info!(
            pin_root = %config.pin_root.display(),
            cgroup = %cgroup_path.display(),
            recovered = pods.len(),
            "datapath ready"
        );
        Ok(Self {
            ebpf,
            _bpf_log: bpf_log,
            pods_map,
            pod_ips,
            counters,
            pods,
            watches: StdHashMap::new(),
            watcher: watch::Watcher::start(changes, watching)?,
            pin_root: config.pin_root.clone(),
            probe_bypass: config.probe_bypass,
            handoff,
            cookie_answers,
            enroll_steps,
            mismatches,
            sysctls: netns::ReplyMarkSysctls::new(),
            home: netns::Home::current().context("the datapath thread's netns")?,
            node_netns_cookie,
        })
    }

    /// Answers commands until it is stopped: then returns the stop's reply and result, to send
    /// once the owner is dropped. `None` when every handle is gone.
    fn serve(&mut self, inbox: mpsc::Receiver<Traced>) -> Option<(Reply<()>, Result<()>)> {
        let mut next_audit = Instant::now() + AUDIT_INTERVAL;
        loop {
            let (span, command) =
                match inbox.recv_timeout(next_audit.saturating_duration_since(Instant::now())) {
                    Ok(traced) => traced,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.audit();
                        next_audit = Instant::now() + AUDIT_INTERVAL;
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                };
            let _caller = span.enter();
            match command {
                Command::Enroll(pod, netns, reply) => {
                    let _ = reply.send(self.enroll(&pod, netns));
                }
                Command::Unenroll(uid, reply) => {
                    let _ = reply.send(self.unenroll(&uid));
                }
                Command::Counters(uid, reply) => {
                    let _ = reply.send(self.pod_counters(&uid));
                }
                Command::Adopt(uid, record, reply) => {
                    let _ = reply.send(self.adopt(&uid, record.as_ref()));
                }
                Command::FindRunningPod {
                    uid,
                    ips,
                    hint,
                    reply,
                } => {
                    let found = discovery::find_running_pod(&uid, &ips, hint.as_deref());
                    let _ = reply.send(found);
                }
                Command::InterfacesChanged { uid, netns_cookie } => {
                    self.interfaces_changed(&uid, netns_cookie);
                }
                Command::RetireOtherLayouts(reply) => {
                    let _ = reply.send(self.retire_other_layouts());
                }
                Command::IsRedirected(uid, reply) => {
                    let _ = reply.send(Ok(self.is_redirected(&uid)));
                }
                Command::Orphaned(only, reply) => {
                    let _ = reply.send(Ok(self.orphaned(only.as_deref())));
                }
                Command::Audit(reply) => {
                    let _ = reply.send(Ok(self.audit()));
                }
                Command::Enrolled(reply) => {
                    let _ = reply.send(Ok(self.pods.keys().cloned().collect()));
                }
                Command::Stop { uninstall, reply } => {
                    let result = if uninstall { self.uninstall() } else { Ok(()) };
                    return Some((reply, result));
                }
            }
        }
    }

    fn uninstall(&mut self) -> Result<()> {
        let uids: Vec<String> = self.pods.keys().cloned().collect();
        for uid in uids {
            self.unenroll(&uid)?;
        }
        if self.probe_bypass {
            if let Err(error) = netlink::remove_probe_source() {
                warn!(%error, "removing the probe source address");
            }
        }
        // Unpinning the links detaches the programs once no fd holds them; maps go with
        // their pins once the programs are gone.
        fs::remove_dir_all(&self.pin_root)
            .with_context(|| format!("removing {}", self.pin_root.display()))?;
        info!(pin_root = %self.pin_root.display(), "datapath uninstalled");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request<T>() -> (Reply<T>, Request<T>) {
        let (reply, answer) = oneshot::channel();
        (reply, Request(answer))
    }

    #[test]
    fn a_plain_thread_answers_both_an_awaiting_task_and_a_waiting_thread() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (reply, awaited) = request();
        let owner = thread::spawn(move || reply.send(Ok(7)));
        assert_eq!(runtime.block_on(awaited).unwrap(), 7);
        owner.join().unwrap().unwrap();

        let (reply, waited) = request();
        let owner = thread::spawn(move || reply.send(Ok(8)));
        assert_eq!(waited.wait().unwrap(), 8);
        owner.join().unwrap().unwrap();
    }

    #[test]
    fn a_request_the_owner_never_answers_says_the_thread_is_gone() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (reply, awaited) = request::<()>();
        drop(reply);
        let error = runtime.block_on(awaited).unwrap_err();
        assert_eq!(error.to_string(), "the datapath thread is gone");

        let (reply, waited) = request::<()>();
        thread::spawn(move || drop(reply)).join().unwrap();
        let error = waited.wait().unwrap_err();
        assert_eq!(error.to_string(), "the datapath thread is gone");
    }
}
