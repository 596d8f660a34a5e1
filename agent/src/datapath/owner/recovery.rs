//! After an agent restart: the enrolled pods rebuilt from the pinned maps, and each one's
//! network namespace found again by its cookie (named namespaces, then every process's). Also
//! the orphan check over the same walk: an enrolled pod whose netns nothing holds any more.
use std::{
    collections::{HashMap as StdHashMap, HashSet},
    fs::{self, File},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::Arc,
    thread,
};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use tracing::{debug, warn};
use weir_common::{IpKey, PodConfig};

use super::{Enrolled, Owner, Reply};
use crate::datapath::{
    kernel::{netlink::Rtnl, netns},
    pod::{
        discovery,
        interface_watch::{excludes_interfaces, Interfaces},
        netns_setup::{self, prepare_pod_netns},
        sidecar_lists,
    },
    readers::snapshot,
};
use crate::workload::Workload;

/// Rebuilds the owner's index from the pinned maps after a restart.
pub(super) fn recover_pods(
    pods_map: &HashMap<MapData, u64, PodConfig>,
    pod_ips: &HashMap<MapData, IpKey, u64>,
) -> StdHashMap<String, Enrolled> {
    snapshot::pod_entries(pods_map, pod_ips)
        .into_iter()
        .map(|entry| {
            let enrolled = Enrolled {
                netns_cookie: entry.netns_cookie,
                ips: entry.ips,
                config: entry.config,
                lists: (!entry.config.has(weir_common::POD_SIDECAR))
                    .then(sidecar_lists::ListEntries::default),
                netns: None,
                // Not known after a restart: the audit looks.
                istio_rules_left: true,
                tracked_ahead_of_istio: false,
            };
            (entry.uid, enrolled)
        })
        .collect()
}

impl Owner {
    pub(super) fn adopt(
        &mut self,
        uid: &str,
        record: Option<&Workload>,
    ) -> Result<Option<OwnedFd>> {
        let Some(pod) = self.pods.get_mut(uid) else {
            return Ok(None);
        };
        let hint = record.map(|record| record.netns.as_path());
        let Some((file, path)) = find_by_cookie(&self.cookie_answers, pod.netns_cookie, hint)
        else {
            return Ok(None);
        };
        debug!(uid, path = %path.display(), "pod netns recovered");
        let handle = file.try_clone()?.into();
        pod.netns = Some(file);
        let record = record.map(|record| Workload {
            netns: path,
            ..record.clone()
        });
        self.refresh_pod_netns(uid, record.as_ref())?;
        Ok(Some(handle))
    }

    /// Answers `reply` with the enrolled pods (all, or only `only`) whose DEL never came: no
    /// process but the agent has their netns as its own, and no nsfs mount (the runtime's
    /// /var/run/netns/cni-…, in any mount namespace) is of it. What holds it otherwise (this
    /// owner's handle, ztunnel's from ZDS) keeps nothing alive that could send traffic. A pod
    /// whose netns this owner does not hold (recovered without it) is looked for by cookie in
    /// the same places.
    ///
    /// The walk over every process's namespaces and mounts takes long on a busy node, so it
    /// runs on a thread of its own (started here, in the node's netns) from what it needs of
    /// the owner, taken now: enrollments meanwhile are not held up. Its callers judge each pod
    /// again in the pod's turn, so a pod enrolled anew meanwhile is not taken for its old self.
    /// A thread that cannot start drops `reply`, which fails the request.
    pub(super) fn orphaned(&self, only: Option<&str>, reply: Reply<Orphans>) {
        let pods: Vec<(String, NetnsIdentity)> = self
            .pods
            .iter()
            .filter(|(uid, _)| only.is_none_or(|only| only == uid.as_str()))
            .filter_map(|(uid, pod)| {
                let identity = match &pod.netns {
                    // A held netns that cannot be looked at is never judged orphaned.
                    Some(netns) => {
                        let stat = nix::sys::stat::fstat(netns.as_raw_fd()).ok()?;
                        NetnsIdentity::Inode(stat.st_dev, stat.st_ino)
                    }
                    None => NetnsIdentity::Cookie(pod.netns_cookie),
                };
                Some((uid.clone(), identity))
            })
            .collect();
        let answers = Arc::clone(&self.cookie_answers);
        let walk = thread::Builder::new()
            .name("weir-orphans".into())
            .spawn(move || {
                let _ = reply.send(Ok(orphans_among(pods, &answers)));
            });
        if let Err(error) = walk {
            warn!(%error, "starting the orphan walk");
        }
    }

    /// Puts this agent's tc programs on a recovered pod (replacing the previous agent's in
    /// place, so an upgrade reaches running pods) and makes sure its return path is there. A
    /// pod whose `record` the agent has is followed for interface changes again, as when it was
    /// enrolled; one recovered unnamed is not (re-enrolling it would need what it was enrolled
    /// with).
    fn refresh_pod_netns(&mut self, uid: &str, record: Option<&Workload>) -> Result<()> {
        let Some(pod) = self.pods.get(uid) else {
            return Ok(());
        };
        let (netns_cookie, netns, config) = match &pod.netns {
            Some(netns) => (pod.netns_cookie, netns.try_clone()?, pod.config),
            None => return Ok(()),
        };
        let _inside = self
            .home
            .enter(netns.as_fd())
            .context("entering the pod netns")?;
        // Subscribed before the interfaces are read, as at enrollment.
        let subscription = match record {
            Some(record) => self.subscribe(
                uid,
                (netns_cookie, netns.as_fd()),
                excludes_interfaces(record),
            )?,
            None => None,
        };
        let mut rtnl = Rtnl::new().context("rtnetlink in the pod netns")?;
        let found = Interfaces::read(&mut rtnl, record).context("listing the pod's interfaces")?;
        let slot = self
            .pod_slots
            .slot_of(netns_cookie)
            .context("giving the pod a slot")?;
        if let Some(record) = record {
            self.make_translations(netns_cookie, &netns_setup::reroute(record, &config))?;
        }
        let handoff = self.handoff.as_ref().map(|handoff| (handoff, netns_cookie));
        prepare_pod_netns(
            &mut rtnl,
            &mut self.sysctls,
            &mut self.ebpf,
            handoff,
            (&found.links, slot),
            record.map(|record| (record, &config)),
        )?;
        if let Some(record) = record {
            self.watch(record, found, subscription);
        }
        Ok(())
    }
}

/// An enrolled pod's netns as the orphan walk tells it apart: by the (device, inode) of the
/// netns the owner holds, or by cookie for one it does not.
enum NetnsIdentity {
    Inode(u64, u64),
    Cookie(u64),
}

fn orphans_among(pods: Vec<(String, NetnsIdentity)>, answers: &netns::CookieAnswers) -> Orphans {
    let held = held_namespaces();
    let pods = pods
        .into_iter()
        .filter(|(_, netns)| match *netns {
            NetnsIdentity::Inode(device, inode) => !held.namespaces.contains(&(device, inode)),
            NetnsIdentity::Cookie(cookie) => find_by_cookie(answers, cookie, None).is_none(),
        })
        .map(|(uid, _)| uid)
        .collect();
    Orphans {
        pods,
        unsure: held.unreadable,
    }
}

/// The network namespace with `cookie` and where it was found: `hint`, a named namespace, or a
/// process's (never the agent's own, the node's).
fn find_by_cookie(
    answers: &netns::CookieAnswers,
    cookie: u64,
    hint: Option<&Path>,
) -> Option<(File, PathBuf)> {
    let candidates = hint
        .map(Path::to_path_buf)
        .into_iter()
        .chain(named_namespaces())
        .chain(other_processes().map(|process| discovery::netns_path(&process)));
    let mut seen = HashSet::new();
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
            .and_then(|_inside| netns::current_cookie(Some(answers)))
            .is_ok_and(|found| found == cookie);
        if matches {
            return Some((file, path));
        }
    }
    None
}

/// Enrolled pods that look orphaned.
#[derive(Debug, Default)]
pub struct Orphans {
    pub pods: Vec<String>,
    /// What could not be inspected (a process's namespaces or mounts that could not be read,
    /// other than a process that ended meanwhile), if anything: then any of `pods` may be held
    /// there, and keeping a dead pod is the lesser harm.
    pub unsure: Option<String>,
}

struct Held {
    /// By (device, inode).
    namespaces: HashSet<(u64, u64)>,
    unreadable: Option<String>,
}

/// Every network namespace something other than the agent keeps alive on purpose: a process's
/// own, or an nsfs mount's in any process's mount namespace (a runtime may pin it in a mount
/// namespace of its own).
fn held_namespaces() -> Held {
    use nix::{errno::Errno, sys::stat::stat};
    let mut held = Held {
        namespaces: HashSet::new(),
        unreadable: None,
    };
    let nsfs_device = match stat("/proc/self/ns/net") {
        Ok(own) => own.st_dev,
        Err(error) => {
            held.unreadable = Some(format!("/proc/self/ns/net: {error}"));
            return held;
        }
    };
    let agent = std::process::id() as i32;
    let mut mount_namespaces = HashSet::new();
    // PID 1, the node's init, runs in the node's namespaces, never a pod's; it may be beyond
    // even a privileged agent's reach (a sandbox's init with capabilities the agent lacks).
    for process in discovery::processes().filter(|process| process.pid != 1) {
        let pid = process.pid;
        let namespace = |kind: &str| stat(format!("/proc/{pid}/ns/{kind}").as_str());
        // A process that ended meanwhile holds nothing.
        let ended = |error: Errno| matches!(error, Errno::ENOENT | Errno::ESRCH);
        if pid != agent {
            match namespace("net") {
                Ok(net) => {
                    held.namespaces.insert((net.st_dev, net.st_ino));
                }
                Err(error) if ended(error) => continue,
                Err(error) => {
                    held.unreadable = Some(format!("the netns of process {pid}: {error}"));
                }
            }
        }
        let mnt = match namespace("mnt") {
            Ok(mnt) => mnt.st_ino,
            Err(error) if ended(error) => continue,
            Err(error) => {
                held.unreadable = Some(format!("the mount namespace of process {pid}: {error}"));
                continue;
            }
        };
        if !mount_namespaces.insert(mnt) {
            continue;
        }
        match process.mountinfo() {
            Ok(mounts) => held.namespaces.extend(
                mounts
                    .into_iter()
                    .filter(|mount| mount.fs_type == "nsfs")
                    .filter_map(|mount| netns_inode(&mount.root))
                    .map(|inode| (nsfs_device, inode)),
            ),
            Err(procfs::ProcError::NotFound(_)) => {
                mount_namespaces.remove(&mnt);
            }
            Err(error) => {
                held.unreadable = Some(format!("the mounts of process {pid}: {error}"));
            }
        }
    }
    held
}

/// The inode of the network namespace an nsfs mount's root names (`net:[4026532178]`).
fn netns_inode(root: &str) -> Option<u64> {
    root.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

fn other_processes() -> impl Iterator<Item = procfs::process::Process> {
    let agent = std::process::id() as i32;
    discovery::processes().filter(move |process| process.pid != agent)
}

/// The namespaces runtimes name: under /var/run/netns (containerd's `cni-<uuid>`), and any
/// other nsfs mount.
fn named_namespaces() -> impl Iterator<Item = PathBuf> {
    fs::read_dir("/var/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .chain(nsfs_mounts())
}

fn nsfs_mounts() -> impl Iterator<Item = PathBuf> {
    procfs::process::Process::myself()
        .and_then(|me| me.mountinfo())
        .into_iter()
        .flatten()
        .filter(|mount| mount.fs_type == "nsfs")
        .map(|mount| mount.mount_point)
}
