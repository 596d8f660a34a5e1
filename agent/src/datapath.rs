//! The datapath owner: the only code that touches weir's BPF objects.
//!
//! It runs on one dedicated OS thread (network namespace switches are per thread, so they must
//! never happen on a tokio worker) and is driven through [`Datapath`], a cheap handle that sends
//! it commands. It loads the programs once, pins maps and links under the pin root so redirection
//! survives an agent restart, and on start takes over pinned links with `BPF_LINK_UPDATE` rather
//! than detach-then-attach, so there is never a window without redirection.
//!
//! [`Owner::enroll`] is where a pod is enrolled: per-pod setup inside the pod's netns first (tc
//! program, return-path routing), then the map entries that switch redirection on. Unenroll runs
//! the other way round. Both are idempotent.
use std::{
    collections::HashMap as StdHashMap,
    fs::{self, File},
    io,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::mpsc,
    thread,
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, PerCpuHashMap},
    programs::{
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcAttachType},
        Program, SchedClassifier,
    },
    Ebpf, EbpfLoader,
};
use tracing::{debug, info, warn};
use weir_common::{
    globals, maps, programs, IpKey, NodeConfig, PodConfig, PodCounters, ABI_VERSION,
    POD_DNS_CAPTURE, POD_HAS_IPV4, POD_HAS_IPV6, POD_INBOUND_BYPASS, POD_UID_LEN,
};

use crate::{bpf_sys, netlink, netns, workload::Workload};

/// The compiled kernel side, embedded so the agent is one self-contained binary.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("WEIR_EBPF_OBJECT"));

/// Our tc filter's place on a pod interface: fixed, so re-enrolling replaces it in place and
/// unenrolling removes exactly it.
const TC_PRIORITY: u16 = 1;
const TC_HANDLE: u32 = 0x5745;

const BPF_NOEXIST: u64 = 1;
const BPF_FS_MAGIC: i64 = 0xcafe4a11;
const DEFAULT_BPF_FS: &str = "/sys/fs/bpf";

/// The cgroup hooks, each attached once at the root cgroup: (program, attach type).
const CGROUP_HOOKS: [(&str, u32); 10] = [
    (programs::CONNECT4, 10),     // BPF_CGROUP_INET4_CONNECT
    (programs::CONNECT6, 11),     // BPF_CGROUP_INET6_CONNECT
    (programs::SENDMSG4, 14),     // BPF_CGROUP_UDP4_SENDMSG
    (programs::SENDMSG6, 15),     // BPF_CGROUP_UDP6_SENDMSG
    (programs::RECVMSG4, 19),     // BPF_CGROUP_UDP4_RECVMSG
    (programs::RECVMSG6, 20),     // BPF_CGROUP_UDP6_RECVMSG
    (programs::GETPEERNAME4, 29), // BPF_CGROUP_INET4_GETPEERNAME
    (programs::GETPEERNAME6, 30), // BPF_CGROUP_INET6_GETPEERNAME
    (programs::SOCKOPS, 3),       // BPF_CGROUP_SOCK_OPS
    (programs::GETSOCKOPT, 21),   // BPF_CGROUP_GETSOCKOPT
];

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

type Reply<T> = mpsc::SyncSender<Result<T>>;

enum Command {
    Enroll(Workload, Reply<OwnedFd>),
    Unenroll(String, Reply<bool>),
    Counters(String, Reply<Option<PodCounters>>),
    IsRedirected(String, Reply<bool>),
    Adopt(String, Option<PathBuf>, Reply<Option<OwnedFd>>),
    RetireOtherLayouts(Reply<()>),
    Enrolled(Reply<Vec<String>>),
    Stop { uninstall: bool, reply: Reply<()> },
}

/// Handle to the datapath owner thread.
pub struct Datapath {
    commands: mpsc::Sender<Command>,
    thread: std::sync::Mutex<Option<thread::JoinHandle<()>>>,
}

impl Datapath {
    /// Loads (or takes over) the datapath and starts its owner thread.
    pub fn start(config: DatapathConfig) -> Result<Self> {
        let (commands, inbox) = mpsc::channel();
        let (ready_tx, ready) = mpsc::sync_channel(1);
        let thread = thread::Builder::new()
            .name("weir-datapath".into())
            .spawn(move || match Owner::open(&config) {
                Ok(mut owner) => {
                    let _ = ready_tx.send(Ok(()));
                    owner.serve(inbox);
                }
                Err(error) => {
                    let _ = ready_tx.send(Err(error));
                }
            })
            .context("spawning the datapath thread")?;
        ready
            .recv()
            .map_err(|_| anyhow!("the datapath thread died while starting"))??;
        Ok(Self {
            commands,
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.commands
            .send(command(reply))
            .map_err(|_| anyhow!("the datapath thread is gone"))?;
        answer
            .recv()
            .map_err(|_| anyhow!("the datapath thread is gone"))?
    }

    /// Redirects the pod's traffic to ztunnel. Idempotent: enrolling again applies new options.
    /// Returns a handle on the pod's netns (the one the datapath holds), for ztunnel.
    pub fn enroll(&self, pod: Workload) -> Result<OwnedFd> {
        self.ask(|reply| Command::Enroll(pod, reply))
    }

    /// Removes the pod's redirection; `Ok(false)` when it was not enrolled.
    pub fn unenroll(&self, uid: &str) -> Result<bool> {
        self.ask(|reply| Command::Unenroll(uid.to_owned(), reply))
    }

    /// The pod's counters summed over CPUs, `None` when it is not enrolled.
    pub fn counters(&self, uid: &str) -> Result<Option<PodCounters>> {
        self.ask(|reply| Command::Counters(uid.to_owned(), reply))
    }

    /// Whether the pod's redirection is in the kernel as enrolled (its map entries are intact).
    pub fn is_redirected(&self, uid: &str) -> Result<bool> {
        self.ask(|reply| Command::IsRedirected(uid.to_owned(), reply))
    }

    /// Finds the network namespace of a pod recovered from the pinned maps (after an agent
    /// restart), holds it, and returns a handle for ztunnel; `None` when it is gone. `hint` is
    /// the netns path recorded at enrollment; without it, or when it no longer matches, the
    /// runtime's named namespaces (/var/run/netns) and every process's netns under /proc are
    /// checked. A match is by netns cookie, which is exact.
    pub fn adopt(&self, uid: &str, hint: Option<PathBuf>) -> Result<Option<OwnedFd>> {
        self.ask(|reply| Command::Adopt(uid.to_owned(), hint, reply))
    }

    /// After an upgrade across map layouts: removes every pod this datapath now holds from the
    /// other layouts' maps, and each other layout (its maps and links) once no pod is left in it.
    /// Until then its programs keep redirecting the pods only it knows: never a gap.
    pub fn retire_other_layouts(&self) -> Result<()> {
        self.ask(Command::RetireOtherLayouts)
    }

    /// Uids of the enrolled pods.
    pub fn enrolled(&self) -> Result<Vec<String>> {
        self.ask(Command::Enrolled)
    }

    /// Stops the owner and leaves the datapath in place: pods stay redirected, and the next
    /// start takes over. This is what an agent restart or upgrade does.
    pub fn shutdown(&self) -> Result<()> {
        self.stop(false)
    }

    /// Unenrolls every pod, detaches every program and removes all pins.
    pub fn uninstall(&self) -> Result<()> {
        self.stop(true)
    }

    fn stop(&self, uninstall: bool) -> Result<()> {
        let result = self.ask(|reply| Command::Stop { uninstall, reply });
        if let Some(thread) = self.thread.lock().unwrap().take() {
            let _ = thread.join();
        }
        result
    }
}

/// One enrolled pod as the owner tracks it.
struct Enrolled {
    netns_cookie: u64,
    ips: Vec<IpKey>,
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
    pin_root: PathBuf,
    probe_bypass: bool,
}

impl Owner {
    fn open(config: &DatapathConfig) -> Result<Self> {
        if let Some(node) = &config.node_netns {
            let file = File::open(node).with_context(|| format!("opening {}", node.display()))?;
            // This thread lives in the node's netns from now on.
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("entering {}", node.display()))?;
        }
        ensure_bpffs(&config.pin_root)?;
        let maps_dir = config.pin_root.join(format!("abi-{ABI_VERSION}"));
        // Links are versioned with the maps: an agent with another layout attaches its own set
        // and never takes over programs that read maps it does not write.
        let links_dir = maps_dir.join("links");
        for dir in [&maps_dir, &links_dir] {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut loader = EbpfLoader::new();
        // Socket storage (SOCKET_ORIG_DST) is kernel-only: aya has no userspace type for it.
        loader.map_pin_path(&maps_dir).allow_unsupported_maps();
        if config.bpf_log {
            loader.set_global(globals::LOG_ENABLED, &1u8, true);
        }
        let mut ebpf = loader
            .load(EBPF_OBJECT)
            .context("loading weir's eBPF object")?;
        let bpf_log = config
            .bpf_log
            .then(|| read_bpf_log(&mut ebpf))
            .transpose()?;

        let cgroup_path = match &config.cgroup {
            Some(path) => path.clone(),
            None => cgroup2_root()?,
        };
        let cgroup = File::open(&cgroup_path)
            .with_context(|| format!("opening cgroup {}", cgroup_path.display()))?;
        for (name, attach_type) in CGROUP_HOOKS {
            let program = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the object"))?;
            load(program).with_context(|| format!("loading {name}"))?;
            let prog_fd = program.fd().context("program fd")?.as_fd();
            attach_pinned(prog_fd, &cgroup, attach_type, &links_dir.join(name))
                .with_context(|| format!("attaching {name} to {}", cgroup_path.display()))?;
        }
        let inbound: &mut SchedClassifier = ebpf
            .program_mut(programs::INBOUND)
            .ok_or_else(|| anyhow!("program {} missing", programs::INBOUND))?
            .try_into()?;
        inbound.load().context("loading the tc program")?;

        let mut node_config: Array<MapData, NodeConfig> = take_map(&mut ebpf, maps::NODE_CONFIG)?;
        let host_netns_cookie = if config.probe_bypass {
            netlink::install_probe_source().context("making the probe source address local")?;
            netns::current_cookie()?
        } else {
            0
        };
        node_config.set(0, NodeConfig { host_netns_cookie }, 0)?;

        let pods_map: HashMap<MapData, u64, PodConfig> = take_map(&mut ebpf, maps::PODS)?;
        let pod_ips: HashMap<MapData, IpKey, u64> = take_map(&mut ebpf, maps::POD_IPS)?;
        let counters = take_map(&mut ebpf, maps::POD_COUNTERS)?;
        let pods = recover_pods(&pods_map, &pod_ips);
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
            pin_root: config.pin_root.clone(),
            probe_bypass: config.probe_bypass,
        })
    }

    fn serve(&mut self, inbox: mpsc::Receiver<Command>) {
        while let Ok(command) = inbox.recv() {
            match command {
                Command::Enroll(pod, reply) => {
                    let _ = reply.send(self.enroll(&pod));
                }
                Command::Unenroll(uid, reply) => {
                    let _ = reply.send(self.unenroll(&uid));
                }
                Command::Counters(uid, reply) => {
                    let _ = reply.send(self.pod_counters(&uid));
                }
                Command::Adopt(uid, hint, reply) => {
                    let _ = reply.send(self.adopt(&uid, hint.as_deref()));
                }
                Command::RetireOtherLayouts(reply) => {
                    let _ = reply.send(self.retire_other_layouts());
                }
                Command::IsRedirected(uid, reply) => {
                    let _ = reply.send(Ok(self.is_redirected(&uid)));
                }
                Command::Enrolled(reply) => {
                    let _ = reply.send(Ok(self.pods.keys().cloned().collect()));
                }
                Command::Stop { uninstall, reply } => {
                    let result = if uninstall { self.uninstall() } else { Ok(()) };
                    let _ = reply.send(result);
                    return;
                }
            }
        }
    }

    /// Where a pod is enrolled.
    fn enroll(&mut self, pod: &Workload) -> Result<OwnedFd> {
        let config = pod_config(pod)?;
        let ips: Vec<IpKey> = pod.ips.iter().map(|ip| ip_key(*ip)).collect();
        let netns_file = File::open(&pod.netns)
            .with_context(|| format!("opening pod netns {}", pod.netns.display()))?;

        // 1. Inside the pod: the tc program (inert until the maps name the pod) and the reply
        //    path. On failure, undo what was done here, and take out a pod that was enrolled
        //    before: never half-redirected.
        let netns_cookie = {
            let _inside = netns::enter(netns_file.as_fd()).context("entering the pod netns")?;
            let cookie = netns::current_cookie()?;
            let prepared = prepare_pod_netns(self.inbound_program()?);
            if let Err(error) = prepared {
                undo_pod_netns();
                self.remove_map_entries(&pod.uid);
                return Err(error.context(format!("preparing pod {}", pod.uid)));
            }
            cookie
        };

        // 2. A pod re-enrolled with another netns (sandbox recreated) drops its old entries.
        if let Some(previous) = self.pods.get(&pod.uid) {
            if previous.netns_cookie != netns_cookie || previous.ips != ips {
                self.remove_map_entries(&pod.uid);
            }
        }

        // 3. The map entries switch redirection on; counters first so no event is lost, the IP
        //    index last since the tc program looks pods up through it.
        let written = self.write_map_entries(netns_cookie, &config, &ips);
        if let Err(error) = written {
            // All or nothing: the pod is now not enrolled at all (also if it was before).
            self.remove_entries(netns_cookie, &ips);
            self.pods.remove(&pod.uid);
            let _inside = netns::enter(netns_file.as_fd())?;
            undo_pod_netns();
            return Err(error.context(format!("writing the maps for pod {}", pod.uid)));
        }
        debug!(uid = %pod.uid, netns_cookie, "pod enrolled");
        let handle = netns_file.try_clone()?.into();
        self.pods.insert(
            pod.uid.clone(),
            Enrolled {
                netns_cookie,
                ips,
                netns: Some(netns_file),
            },
        );
        Ok(handle)
    }

    fn write_map_entries(
        &mut self,
        netns_cookie: u64,
        config: &PodConfig,
        ips: &[IpKey],
    ) -> Result<()> {
        // BPF_NOEXIST: a re-enrolled pod keeps its counts. (Existence is not checked with a
        // lookup: aya 0.13's per-CPU `get` answers zeros for a missing key.)
        let zero = vec![PodCounters::default(); aya::util::nr_cpus().map_err(|(_, e)| e)?];
        match self.counters.insert(
            netns_cookie,
            aya::maps::PerCpuValues::try_from(zero)?,
            BPF_NOEXIST,
        ) {
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.kind() == io::ErrorKind::AlreadyExists => {}
            other => other?,
        }
        self.pods_map.insert(netns_cookie, *config, 0)?;
        for ip in ips {
            self.pod_ips.insert(*ip, netns_cookie, 0)?;
        }
        Ok(())
    }

    fn unenroll(&mut self, uid: &str) -> Result<bool> {
        if !self.pods.contains_key(uid) {
            return Ok(false);
        }
        // Maps first: redirection stops at once, whatever happens next.
        let netns = self.remove_map_entries(uid);
        if let Some(netns) = netns {
            // The netns may already be gone with the pod; then so is everything in it.
            match netns::enter(netns.as_fd()) {
                Ok(_inside) => undo_pod_netns(),
                Err(error) => debug!(uid, %error, "pod netns not entered for cleanup"),
            }
        }
        debug!(uid, "pod unenrolled");
        Ok(true)
    }

    /// Removes a pod's map entries and forgets it; returns its netns handle, if held.
    fn remove_map_entries(&mut self, uid: &str) -> Option<File> {
        let pod = self.pods.remove(uid)?;
        self.remove_entries(pod.netns_cookie, &pod.ips);
        pod.netns
    }

    fn remove_entries(&mut self, netns_cookie: u64, ips: &[IpKey]) {
        for ip in ips {
            // Only our own entry: another pod may have been given the IP since.
            if self.pod_ips.get(ip, 0).ok() == Some(netns_cookie) {
                let _ = self.pod_ips.remove(ip);
            }
        }
        let _ = self.pods_map.remove(&netns_cookie);
        let _ = self.counters.remove(&netns_cookie);
    }

    fn pod_counters(&self, uid: &str) -> Result<Option<PodCounters>> {
        let Some(pod) = self.pods.get(uid) else {
            return Ok(None);
        };
        let per_cpu = self.counters.get(&pod.netns_cookie, 0)?;
        Ok(Some(per_cpu.iter().fold(
            PodCounters::default(),
            |sum, c| PodCounters {
                outbound: sum.outbound + c.outbound,
                inbound: sum.inbound + c.inbound,
                dns: sum.dns + c.dns,
                bypassed: sum.bypassed + c.bypassed,
            },
        )))
    }

    fn adopt(&mut self, uid: &str, hint: Option<&Path>) -> Result<Option<OwnedFd>> {
        let Some(pod) = self.pods.get_mut(uid) else {
            return Ok(None);
        };
        let cookie = pod.netns_cookie;
        let candidates = hint
            .map(Path::to_path_buf)
            .into_iter()
            .chain(named_namespaces())
            .chain(process_namespaces());
        let mut seen = std::collections::HashSet::new();
        for path in candidates {
            let Ok(file) = File::open(&path) else {
                continue;
            };
            let Ok(stat) = nix::sys::stat::fstat(file.as_raw_fd()) else {
                continue;
            };
            if !seen.insert((stat.st_dev, stat.st_ino)) {
                continue;
            }
            let matches = netns::enter(file.as_fd())
                .and_then(|_inside| netns::current_cookie())
                .is_ok_and(|found| found == cookie);
            if matches {
                debug!(uid, path = %path.display(), "pod netns recovered");
                let handle = file.try_clone()?.into();
                pod.netns = Some(file);
                self.refresh_pod_netns(uid)?;
                return Ok(Some(handle));
            }
        }
        Ok(None)
    }

    /// Puts this agent's tc program on a recovered pod (replacing the previous agent's in
    /// place, so an upgrade reaches running pods) and makes sure its return path is there.
    fn refresh_pod_netns(&mut self, uid: &str) -> Result<()> {
        let netns = match self.pods.get(uid).and_then(|pod| pod.netns.as_ref()) {
            Some(netns) => netns.try_clone()?,
            None => return Ok(()),
        };
        let _inside = netns::enter(netns.as_fd()).context("entering the pod netns")?;
        prepare_pod_netns(self.inbound_program()?)
    }

    fn retire_other_layouts(&self) -> Result<()> {
        let current = format!("abi-{ABI_VERSION}");
        for entry in fs::read_dir(&self.pin_root)? {
            let dir = entry?.path();
            let name = dir
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if !name.starts_with("abi-") || name == current {
                continue;
            }
            // Every layout keys PODS by netns cookie (see weir_common::maps::PODS).
            let pods = bpf_sys::open_pinned(&dir.join(maps::PODS))
                .with_context(|| format!("opening {}/{}", dir.display(), maps::PODS))?;
            for pod in self.pods.values() {
                bpf_sys::map_delete(pods.as_fd(), &pod.netns_cookie.to_ne_bytes())?;
            }
            if bpf_sys::map_is_empty(pods.as_fd(), size_of::<u64>())? {
                fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
                info!(
                    layout = name,
                    "retired an older map layout: its pods are migrated"
                );
            } else {
                warn!(
                    layout = name,
                    "pods this agent does not know are still enrolled in an older map layout: \
                     kept (their redirection stays) until they are gone"
                );
            }
        }
        Ok(())
    }

    fn is_redirected(&self, uid: &str) -> bool {
        let Some(pod) = self.pods.get(uid) else {
            return false;
        };
        let config_intact = self
            .pods_map
            .get(&pod.netns_cookie, 0)
            .is_ok_and(|config| config.uid.starts_with(uid.as_bytes()));
        config_intact
            && pod
                .ips
                .iter()
                .all(|ip| self.pod_ips.get(ip, 0).ok() == Some(pod.netns_cookie))
    }

    fn inbound_program(&mut self) -> Result<&mut SchedClassifier> {
        Ok(self
            .ebpf
            .program_mut(programs::INBOUND)
            .ok_or_else(|| anyhow!("program {} missing", programs::INBOUND))?
            .try_into()?)
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

/// Forwards the programs' aya-log records to the `log` crate. aya-log reads them in tokio tasks
/// and this thread has no runtime, so the reader gets a one-worker runtime of its own.
fn read_bpf_log(ebpf: &mut Ebpf) -> Result<tokio::runtime::Runtime> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("weir-bpf-log")
        .enable_io()
        .build()
        .context("starting the eBPF log reader")?;
    {
        let _entered = runtime.enter();
        aya_log::EbpfLogger::init(ebpf).context("reading the eBPF programs' logs")?;
    }
    info!("eBPF diagnostics on (log target weir_ebpf)");
    Ok(runtime)
}

/// Per-pod setup inside the pod's netns (the calling thread is in it).
fn prepare_pod_netns(inbound: &mut SchedClassifier) -> Result<()> {
    for (_, interface) in netns::non_loopback_interfaces()? {
        attach_inbound(inbound, &interface).with_context(|| format!("tc on {interface}"))?;
    }
    netlink::install_return_path().context("return-path routing")?;
    netns::set_tcp_fwmark_accept().context("tcp_fwmark_accept")?;
    Ok(())
}

/// Best effort: called on rollback and unenroll, where the pod may be half set up or gone.
fn undo_pod_netns() {
    if let Ok(interfaces) = netns::non_loopback_interfaces() {
        for (_, interface) in interfaces {
            if let Ok(link) = SchedClassifierLink::attached(
                &interface,
                TcAttachType::Ingress,
                TC_PRIORITY,
                TC_HANDLE,
            ) {
                let _ = aya::programs::Link::detach(link);
            }
        }
    }
    if let Err(error) = netlink::remove_return_path() {
        debug!(%error, "removing the return path");
    }
}

/// Attaches the inbound program as a classic cls_bpf filter: a TCX link costs a
/// `synchronize_rcu()` under the rtnl lock per pod (~16 ms), a netlink filter does not.
fn attach_inbound(inbound: &mut SchedClassifier, interface: &str) -> Result<()> {
    if let Err(error) = tc::qdisc_add_clsact(interface) {
        if error.kind() != io::ErrorKind::AlreadyExists {
            return Err(error).context("adding the clsact qdisc");
        }
    }
    let options = TcAttachOptions::Netlink(NlOptions {
        priority: TC_PRIORITY,
        handle: TC_HANDLE,
    });
    let link_id = match inbound.attach_with_options(interface, TcAttachType::Ingress, options) {
        Ok(id) => id,
        // Already attached (re-enroll, or an earlier agent): replace the program in place.
        Err(_) => {
            let existing = SchedClassifierLink::attached(
                interface,
                TcAttachType::Ingress,
                TC_PRIORITY,
                TC_HANDLE,
            )?;
            inbound.attach_to_link(existing)?
        }
    };
    // The filter lives in the pod's netns, not in this process: dropping aya's link would
    // detach it, so it is released instead (it holds no file descriptor).
    std::mem::forget(inbound.take_link(link_id)?);
    Ok(())
}

/// Attaches a cgroup program through a pinned link, or moves an existing pinned link to it.
fn attach_pinned(
    prog: std::os::fd::BorrowedFd<'_>,
    cgroup: &File,
    attach_type: u32,
    pin: &Path,
) -> Result<()> {
    match bpf_sys::open_pinned(pin) {
        Ok(link) => bpf_sys::update(link.as_fd(), prog).context("BPF_LINK_UPDATE"),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            let link =
                bpf_sys::create(prog, cgroup.as_fd(), attach_type).context("BPF_LINK_CREATE")?;
            bpf_sys::pin(link.as_fd(), pin).context("pinning the link")
        }
        Err(error) => Err(error).context("opening the pinned link"),
    }
}

fn load(program: &mut Program) -> Result<()> {
    match program {
        Program::CgroupSockAddr(p) => p.load()?,
        Program::SockOps(p) => p.load()?,
        Program::CgroupSockopt(p) => p.load()?,
        _ => bail!("unexpected program type"),
    }
    Ok(())
}

fn take_map<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &str,
) -> Result<T> {
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| anyhow!("map {name} missing from the object"))?;
    Ok(T::try_from(map)?)
}

fn pod_config(pod: &Workload) -> Result<PodConfig> {
    if pod.uid.is_empty() || pod.uid.len() > POD_UID_LEN {
        bail!("pod uid {:?} must be 1 to {POD_UID_LEN} bytes", pod.uid);
    }
    if pod.ips.is_empty() {
        bail!("pod {} has no IP", pod.uid);
    }
    let mut config = PodConfig {
        flags: 0,
        ipv4: [0; 4],
        ipv6: [0; 16],
        uid: [0; POD_UID_LEN],
    };
    config.uid[..pod.uid.len()].copy_from_slice(pod.uid.as_bytes());
    for ip in &pod.ips {
        match ip {
            IpAddr::V4(v4) if !config.has(POD_HAS_IPV4) => {
                config.ipv4 = v4.octets();
                config.flags |= POD_HAS_IPV4;
            }
            IpAddr::V6(v6) if !config.has(POD_HAS_IPV6) => {
                config.ipv6 = v6.octets();
                config.flags |= POD_HAS_IPV6;
            }
            _ => {}
        }
    }
    if pod.options.inbound_bypass {
        config.flags |= POD_INBOUND_BYPASS;
    }
    if pod.options.dns_capture {
        config.flags |= POD_DNS_CAPTURE;
    }
    Ok(config)
}

fn ip_key(ip: IpAddr) -> IpKey {
    match ip {
        IpAddr::V4(v4) => IpKey::from_v4(v4.octets()),
        IpAddr::V6(v6) => IpKey::from_v6(v6.octets()),
    }
}

/// Rebuilds the owner's index from the pinned maps after a restart.
fn recover_pods(
    pods_map: &HashMap<MapData, u64, PodConfig>,
    pod_ips: &HashMap<MapData, IpKey, u64>,
) -> StdHashMap<String, Enrolled> {
    let mut ips_by_cookie: StdHashMap<u64, Vec<IpKey>> = StdHashMap::new();
    for (ip, cookie) in pod_ips.iter().flatten() {
        ips_by_cookie.entry(cookie).or_default().push(ip);
    }
    pods_map
        .iter()
        .flatten()
        .map(|(netns_cookie, config)| {
            let uid_len = config
                .uid
                .iter()
                .position(|b| *b == 0)
                .unwrap_or(POD_UID_LEN);
            let uid = String::from_utf8_lossy(&config.uid[..uid_len]).into_owned();
            let ips = ips_by_cookie.remove(&netns_cookie).unwrap_or_default();
            (
                uid,
                Enrolled {
                    netns_cookie,
                    ips,
                    netns: None,
                },
            )
        })
        .collect()
}

/// The namespaces runtimes name under /var/run/netns (containerd's `cni-<uuid>`).
fn named_namespaces() -> impl Iterator<Item = PathBuf> {
    fs::read_dir("/var/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
}

/// Every process's network namespace, as `/proc/<pid>/ns/net` paths.
fn process_namespaces() -> impl Iterator<Item = PathBuf> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .map(|entry| entry.path().join("ns/net"))
}

/// The cgroup v2 mount point (e.g. /sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts).
fn cgroup2_root() -> Result<PathBuf> {
    let mounts = procfs::process::Process::myself()?.mountinfo()?;
    mounts
        .into_iter()
        .find(|mount| mount.fs_type == "cgroup2")
        .map(|mount| mount.mount_point)
        .ok_or_else(|| anyhow!("no cgroup2 mount found: weir needs the unified cgroup hierarchy"))
}

/// Makes sure `pin_root` can be created on a bpffs, mounting /sys/fs/bpf when it is not one.
fn ensure_bpffs(pin_root: &Path) -> Result<()> {
    let is_bpffs = |path: &Path| {
        nix::sys::statfs::statfs(path)
            .map(|fs| fs.filesystem_type().0 == BPF_FS_MAGIC)
            .unwrap_or(false)
    };
    let default = Path::new(DEFAULT_BPF_FS);
    if pin_root.starts_with(default) && !is_bpffs(default) {
        nix::mount::mount(
            Some("bpf"),
            default,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .context("mounting bpffs at /sys/fs/bpf")?;
        info!("mounted bpffs at /sys/fs/bpf");
    }
    let existing = pin_root.ancestors().find(|p| p.exists()).unwrap_or(default);
    if !is_bpffs(existing) {
        bail!("{} is not on a bpffs", pin_root.display());
    }
    Ok(())
}
