//! The owner thread's state: the loaded programs, the maps, the enrolled pods; how it starts
//! (loading or taking over the datapath), answers commands, and uninstalls.
use std::{
    collections::HashMap as StdHashMap,
    fs::{self, File},
    net::{Ipv4Addr, Ipv6Addr},
    os::{fd::AsFd, unix::fs::PermissionsExt},
    path::PathBuf,
    sync::{atomic::AtomicBool, mpsc, Arc},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, PerCpuHashMap},
    Ebpf,
};
use tracing::{info, warn};
use weir_common::{maps, IpKey, NodeConfig, PodConfig, PodCounters};

use super::{audit, bpf_log, recovery, tasks, Command, Reply, Traced};
use crate::datapath::{
    kernel::{handoff, mounts, netlink, netns, programs, support, ztunnels},
    maps_dir,
    pod::{
        discovery, enroll_steps, interface_watch, istio_rules, sidecar_lists, slots, translations,
    },
    DatapathConfig, ProbeSource, AUDIT_INTERVAL,
};

/// One enrolled pod as the owner tracks it.
pub(in crate::datapath) struct Enrolled {
    pub(in crate::datapath) netns_cookie: u64,
    pub(in crate::datapath) ips: Vec<IpKey>,
    /// Its `PODS` entry as written, to restore it when a later attempt fails.
    pub(in crate::datapath) config: PodConfig,
    /// Its sidecar list entries; `None` where not known (a sidecar pod found in the pinned maps
    /// after a restart), and looked for in the maps when needed.
    pub(in crate::datapath) lists: Option<sidecar_lists::ListEntries>,
    /// Held so per-pod state can be undone while the pod lives; `None` for pods found in the
    /// pinned maps after a restart.
    pub(in crate::datapath) netns: Option<File>,
    /// Some of istio's in-pod rules may still be there (its return path, kept for connections
    /// made under istio's rules before weir took the pod over): the audit looks again until
    /// nothing is left.
    pub(in crate::datapath) istio_rules_left: bool,
    /// Being handed back to istio-cni: conntrack follows its connections already
    /// (`istio_rules::track_ahead_of_istio`).
    pub(in crate::datapath) tracked_ahead_of_istio: bool,
}

pub(in crate::datapath) struct Owner {
    /// Keeps the programs loaded (and the tc program attachable) for the owner's lifetime.
    pub(in crate::datapath) ebpf: Ebpf,
    /// Reads the programs' log records while logging is on; stopped with the owner.
    _bpf_log: Option<tasks::Task>,
    pub(in crate::datapath) pods_map: HashMap<MapData, u64, PodConfig>,
    pub(in crate::datapath) pod_ips: HashMap<MapData, IpKey, u64>,
    pub(in crate::datapath) pod_slots: slots::PodSlots,
    pub(in crate::datapath) counters: PerCpuHashMap<MapData, u64, PodCounters>,
    pub(in crate::datapath) sidecar_lists: sidecar_lists::SidecarLists,
    /// REDIRECT-mode sidecar pods' translation maps, one per pod (see `weir_nat_in`).
    pub(in crate::datapath) translations: translations::Translations,
    pub(in crate::datapath) pods: StdHashMap<String, Enrolled>,
    /// Enrolled pods' interface subscriptions, by uid (pods recovered after a restart are
    /// followed once enrolled again).
    pub(in crate::datapath) watches: StdHashMap<String, interface_watch::Watch>,
    pub(in crate::datapath) watcher: interface_watch::Watcher,
    pub(in crate::datapath) pin_root: PathBuf,
    /// The probe source addresses this agent made local, to remove on uninstall.
    probe_source: Option<(Ipv4Addr, Ipv6Addr)>,
    /// The node's settings the programs read (`NODE_CONFIG`).
    node_config: Array<MapData, NodeConfig>,
    /// The cgroup the probe source is kept to (kubelet's), by path: a restarted kubelet's cgroup
    /// is a new one, with a new id, which the programs must be given.
    probe_cgroup: Option<ProbeCgroup>,
    /// The connected ztunnels' cgroups, by which the programs know ztunnel's sockets.
    ztunnels: ztunnels::ZtunnelCgroups,
    /// Where the kernel needs it (before 6.5): the per-pod socket lookup hand-off.
    pub(in crate::datapath) handoff: Option<handoff::Handoff>,
    /// How the netns cookie is learnt on kernels without `SO_NETNS_COOKIE` (before 5.14); shared
    /// with the orphan walk's thread.
    pub(in crate::datapath) cookie_answers: Arc<netns::CookieAnswers>,
    pub(in crate::datapath) enroll_steps: enroll_steps::EnrollSteps,
    pub(in crate::datapath) mismatches: audit::Mismatches,
    pub(in crate::datapath) sysctls: netns::ReplyMarkSysctls,
    /// The thread's own netns (the node's), which enrolling and unenrolling come back to.
    pub(in crate::datapath) home: netns::Home,
    /// Its cookie: never enrolled as a pod's, whatever path or process claims it.
    pub(in crate::datapath) node_netns_cookie: u64,
    /// Where the watch and the log reader run; last, so their tasks stop before it goes.
    _tasks: tasks::Tasks,
}

impl Owner {
    pub(in crate::datapath) fn open(
        config: &DatapathConfig,
        changes: mpsc::Sender<Traced>,
        enroll_steps: enroll_steps::EnrollSteps,
        mismatches: audit::Mismatches,
        watching: Arc<AtomicBool>,
        tasks: tasks::Tasks,
    ) -> Result<Self> {
        if let Some(node) = &config.node_netns {
            let file = File::open(node).with_context(|| format!("opening {}", node.display()))?;
            // This thread lives in the node's netns from now on.
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("entering {}", node.display()))?;
        }
        let kernel = support::Kernel::running()?;
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
        translations::pin_empty(&maps_dir.join(maps::REROUTE_NAT))?;
        let mut ebpf = programs::load(&maps_dir, config.bpf_log)?;
        let bpf_log = config
            .bpf_log
            .then(|| bpf_log::read_bpf_log(&mut ebpf, &tasks))
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
        let probe_source = config.probe_bypass.then_some(&config.probe_source);
        let node = node_settings(node_netns_cookie, probe_source)?;
        if let Some(probe) = probe_source {
            netlink::install_probe_source(probe.v4, probe.v6)
                .context("making the probe source address local")?;
        }
        // An earlier agent's probe source that this one does not use is the node's no more.
        let earlier = node_config.get(&0, 0).ok().filter(|earlier| {
            earlier.host_netns_cookie != 0
                && (earlier.probe_source_v4, earlier.probe_source_v6)
                    != (node.probe_source_v4, node.probe_source_v6)
        });
        if let Some(earlier) = earlier {
            netlink::remove_probe_source(
                earlier.probe_source_v4.into(),
                earlier.probe_source_v6.into(),
            )
            .context("removing an earlier probe source address")?;
        }
        node_config.set(0, node, 0)?;
        let probe_cgroup = match probe_source.and_then(|probe| probe.cgroup.clone()) {
            Some(path) => Some(ProbeCgroup {
                path,
                hierarchy: mounts::cgroup2_root()?,
            }),
            None => None,
        };

        let pods_map: HashMap<MapData, u64, PodConfig> = programs::take_map(&mut ebpf, maps::PODS)?;
        let pod_ips: HashMap<MapData, IpKey, u64> = programs::take_map(&mut ebpf, maps::POD_IPS)?;
        let pod_slots = slots::PodSlots::take(&mut ebpf, &pods_map)?;
        let counters = programs::take_map(&mut ebpf, maps::POD_COUNTERS)?;
        let sidecar_lists = sidecar_lists::SidecarLists::take(&mut ebpf)?;
        let translations = translations::Translations::take(&mut ebpf, &pods_map)?;
        let ztunnels = ztunnels::ZtunnelCgroups::take(&mut ebpf, mounts::cgroup2_root()?)?;
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
            pod_slots,
            counters,
            sidecar_lists,
            translations,
            pods,
            watches: StdHashMap::new(),
            watcher: interface_watch::Watcher::start(changes, watching, &tasks)?,
            pin_root: config.pin_root.clone(),
            probe_source: probe_source.map(|probe| (probe.v4, probe.v6)),
            node_config,
            probe_cgroup,
            ztunnels,
            handoff,
            cookie_answers: Arc::new(cookie_answers),
            enroll_steps,
            mismatches,
            sysctls: netns::ReplyMarkSysctls::new(),
            home: netns::Home::current().context("the datapath thread's netns")?,
            node_netns_cookie,
            _tasks: tasks,
        })
    }

    /// Answers commands until it is stopped: then returns the stop's reply and result, to send
    /// once the owner is dropped. `None` when every handle is gone.
    pub(in crate::datapath) fn serve(
        &mut self,
        inbox: mpsc::Receiver<Traced>,
    ) -> Option<(Reply<()>, Result<()>)> {
        let mut next_audit = Instant::now() + AUDIT_INTERVAL;
        let mut next_probe_check = Instant::now() + PROBE_CGROUP_CHECK_INTERVAL;
        loop {
            let wake = match self.probe_cgroup {
                Some(_) => next_audit.min(next_probe_check),
                None => next_audit,
            };
            let (span, command) =
                match inbox.recv_timeout(wake.saturating_duration_since(Instant::now())) {
                    Ok(traced) => traced,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let now = Instant::now();
                        if now >= next_probe_check {
                            self.follow_probe_cgroup();
                            next_probe_check = now + PROBE_CGROUP_CHECK_INTERVAL;
                        }
                        if now >= next_audit {
                            self.audit();
                            next_audit = now + AUDIT_INTERVAL;
                        }
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
                Command::HandBack(uid, reply) => {
                    let _ = reply.send(self.hand_back(&uid));
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
                Command::Orphaned(only, reply) => self.orphaned(only.as_deref(), reply),
                Command::Audit(reply) => {
                    let _ = reply.send(Ok(self.audit()));
                }
                Command::ZtunnelConnected(pid, reply) => {
                    let _ = reply.send(self.ztunnels.connected(pid));
                }
                Command::ZtunnelDisconnected(cgroup, reply) => {
                    self.ztunnels.disconnected(cgroup);
                    let _ = reply.send(Ok(()));
                }
                Command::RemoveIstioCniProbeSnat(reply) => {
                    let removed = istio_rules::remove_probe_snat();
                    let _ = reply.send(removed.context("removing istio-cni's probe SNAT"));
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

    /// Gives the programs the probe source cgroup's id again if its path now names another
    /// cgroup (kubelet restarted: systemd made its cgroup anew). A path that names none for now
    /// keeps the last id, which no process can be in any more.
    pub(in crate::datapath) fn follow_probe_cgroup(&mut self) -> bool {
        let Some(probe) = &self.probe_cgroup else {
            return false;
        };
        let Ok(id) = ztunnels::cgroup_id(&probe.hierarchy, &probe.path) else {
            return false;
        };
        let Ok(mut node) = self.node_config.get(&0, 0) else {
            return false;
        };
        if node.probe_cgroup == id {
            return false;
        }
        info!(
            path = probe.path,
            id, "the probe source's cgroup is a new one: following it"
        );
        node.probe_cgroup = id;
        if let Err(error) = self.node_config.set(0, node, 0) {
            warn!(error = %error, "giving the programs the probe source's new cgroup");
            return false;
        }
        self.mismatches.count(audit::PROBE_CGROUP_MOVED);
        true
    }

    fn uninstall(&mut self) -> Result<()> {
        let uids: Vec<String> = self.pods.keys().cloned().collect();
        for uid in uids {
            self.unenroll(&uid)?;
        }
        if let Some((v4, v6)) = self.probe_source {
            if let Err(error) = netlink::remove_probe_source(v4, v6) {
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

/// How often the owner looks whether the probe source's cgroup was made anew: a restarted
/// kubelet's probes get the probe source again within this.
const PROBE_CGROUP_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The cgroup the probe source is kept to, by its path in the cgroup v2 hierarchy.
struct ProbeCgroup {
    path: String,
    hierarchy: PathBuf,
}

/// What the programs read of the node: its netns cookie and the probe source (`None`: the
/// bypass is off, all zero), with the id of the cgroup the probe source is kept to.
fn node_settings(node_netns_cookie: u64, probe: Option<&ProbeSource>) -> Result<NodeConfig> {
    let Some(probe) = probe else {
        return Ok(NodeConfig::default());
    };
    let probe_cgroup = match &probe.cgroup {
        Some(path) => ztunnels::cgroup_id(&mounts::cgroup2_root()?, path)
            .with_context(|| format!("the probe source's cgroup {path}"))?,
        None => 0,
    };
    Ok(NodeConfig {
        host_netns_cookie: node_netns_cookie,
        probe_cgroup,
        probe_source_v6: probe.v6.octets(),
        probe_source_v4: probe.v4.octets(),
        _pad: [0; 4],
    })
}
