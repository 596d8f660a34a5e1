//! [`Datapath`], the handle the rest of the agent drives the owner thread through: each call is
//! a command on the owner's channel, answered through a [`Request`].
use std::{
    future::Future,
    net::IpAddr,
    os::fd::OwnedFd,
    path::PathBuf,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    task::Poll,
    thread,
};

use anyhow::{anyhow, Context, Result};
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;
use weir_common::PodCounters;

use super::{audit, tasks, Owner};
use crate::datapath::{pod::enroll_steps, DatapathConfig, EnrollNetns, Orphans, PodNetns};
use crate::workload::Workload;

/// Where the owner answers a command: a oneshot, so an async caller awaits it on its own task
/// while the owner, a plain thread, sends without a runtime.
pub(in crate::datapath) type Reply<T> = oneshot::Sender<Result<T>>;

/// A command with the span it was given in: the owner thread's log lines about a pod carry the
/// pod's fields, as the caller's do.
pub(in crate::datapath) type Traced = (tracing::Span, Command);

pub(in crate::datapath) enum Command {
    Enroll(Workload, EnrollNetns, Reply<OwnedFd>),
    Unenroll(String, Reply<bool>),
    HandBack(String, Reply<bool>),
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
    ZtunnelConnected(u32, Reply<u64>),
    ZtunnelDisconnected(u64, Reply<()>),
    Enrolled(Reply<Vec<String>>),
    RemoveIstioCniProbeSnat(Reply<Vec<String>>),
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
    enroll_steps: enroll_steps::EnrollSteps,
    mismatches: audit::Mismatches,
    /// Set while the pods' interface watch runs.
    watching: Arc<AtomicBool>,
}

impl Datapath {
    /// Loads (or takes over) the datapath and starts its owner thread.
    pub fn start(config: DatapathConfig) -> Result<Self> {
        // Unbounded, yet bounded by its producers: every command but the watcher's is a call
        // whose caller awaits its answer (a CNI request the runtime made, a sweep, a scrape), or
        // one per ZDS connection ended; the watcher's are at most one per followed pod
        // (`interface_watch::PendingRereads`).
        let (commands, inbox) = mpsc::channel();
        let (ready_tx, ready) = mpsc::sync_channel(1);
        let changes = commands.clone();
        let enroll_steps = enroll_steps::EnrollSteps::default();
        let steps = enroll_steps.clone();
        let mismatches = audit::Mismatches::default();
        let counted = mismatches.clone();
        let watching = Arc::new(AtomicBool::new(false));
        let watch_alive = watching.clone();
        let tasks = tasks::Tasks::of_caller()?;
        let thread = thread::Builder::new()
            .name("weir-datapath".into())
            .spawn(move || {
                match Owner::open(&config, changes, steps, counted, watch_alive, tasks) {
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
                }
            })
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

    /// Compares the maps, and each enrolled pod's tc filters and return path, with what was
    /// enrolled now (the owner also does every [`crate::datapath::AUDIT_INTERVAL`]): puts back
    /// what is missing, and returns the kind of each mismatch found
    /// (`weir_datapath_mismatches_total`).
    pub fn audit(&self) -> Request<Vec<&'static str>> {
        self.ask(Command::Audit)
    }

    /// A ztunnel, process `pid`, connected: from now on the programs take the sockets it opens
    /// in pods for ztunnel's (they have ztunnel's mark and its cgroup). Returns the cgroup, for
    /// [`Self::ztunnel_disconnected`].
    pub fn ztunnel_connected(&self, pid: u32) -> Request<u64> {
        self.ask(|reply| Command::ZtunnelConnected(pid, reply))
    }

    /// A connection of a ztunnel in `cgroup` ended. Its sockets stay ztunnel's (it may be
    /// draining, or about to connect again); its entry may make room for another ztunnel's.
    pub fn ztunnel_disconnected(&self, cgroup: u64) -> Request<()> {
        self.ask(|reply| Command::ZtunnelDisconnected(cgroup, reply))
    }

    /// Leaves the enrolled ambient pod `uid` to istio's in-pod rules if they redirect it now
    /// (istio-cni's agent taking the node back): weir's programs and entries for it go, its
    /// return path stays. Answers whether the pod is no longer weir's.
    pub fn hand_back(&self, uid: &str) -> Request<bool> {
        self.ask(|reply| Command::HandBack(uid.to_owned(), reply))
    }

    /// Removes istio-cni's probe SNAT from the node, from the node's netns (see
    /// [`crate::datapath::istio_rules::remove_probe_snat`]); answers what went.
    pub fn remove_istio_cni_probe_snat(&self) -> Request<Vec<String>> {
        self.ask(Command::RemoveIstioCniProbeSnat)
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
