//! Finding the network namespace of a pod that is already running, to enroll it live (its
//! namespace was labelled, or it started while weir-cni was missing from the chain), as istio-cni
//! does (`nodeagent/podcgroupns_linux.go`): the agent's own record first, then every process on
//! the node whose cgroup names the pod. Also the /proc walk that recovery shares.
use std::{
    collections::{hash_map::Entry, HashMap},
    fs::{self, File},
    net::IpAddr,
    os::fd::{AsFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use procfs::process::Process;
use tracing::debug;

use crate::datapath::kernel::{netlink, netns};

/// A running pod's network namespace, held open, and where it was found: the hint, or a
/// `/proc/<pid>/ns/net`.
#[derive(Debug)]
pub struct PodNetns {
    pub netns: OwnedFd,
    pub path: PathBuf,
}

/// Every process on the node, in /proc's order.
pub(in crate::datapath) fn processes() -> impl Iterator<Item = Process> {
    procfs::process::all_processes()
        .into_iter()
        .flatten()
        .flatten()
}

pub(in crate::datapath) fn netns_path(process: &Process) -> PathBuf {
    PathBuf::from(format!("/proc/{}/ns/net", process.pid))
}

/// A network namespace's identity without opening it.
type NetnsId = (u64, u64);

fn netns_id(path: &Path) -> nix::Result<NetnsId> {
    let stat = nix::sys::stat::stat(path)?;
    Ok((stat.st_dev, stat.st_ino))
}

/// A namespace that holds the pod's IPs, and the start time (clock ticks after boot) of the
/// oldest process of the pod in it.
struct Candidate {
    netns: File,
    path: PathBuf,
    started: u64,
}

/// Runs on the datapath thread, whose netns is the node's: that one is never a pod's, though
/// processes in it may sit in a pod's cgroup (CRI-O's conmon does).
pub(in crate::datapath) fn find_running_pod(
    uid: &str,
    ips: &[IpAddr],
    hint: Option<&Path>,
) -> Result<Option<PodNetns>> {
    if let Some(hint) = hint {
        // A stale or wrong record is not fatal: the walk below may still find the pod.
        let checked = File::open(hint)
            .map_err(anyhow::Error::from)
            .and_then(|netns| Ok(holds_any(&netns, ips)?.then_some(netns)));
        match checked {
            Ok(Some(netns)) => {
                return Ok(Some(PodNetns {
                    netns: netns.into(),
                    path: hint.to_path_buf(),
                }));
            }
            Ok(None) => debug!(uid, hint = %hint.display(), "the hint does not hold the pod's IPs"),
            Err(error) => debug!(
                uid,
                hint = %hint.display(),
                error = format!("{error:#}"),
                "the hint cannot be checked"
            ),
        }
    }
    let node = netns_id(Path::new(netns::THREAD_NETNS)).context("the node's netns")?;
    // Per namespace: `None` once it is known not to hold the pod's IPs.
    let mut judged: HashMap<NetnsId, Option<Candidate>> = HashMap::new();
    for process in processes() {
        let path = netns_path(&process);
        let Ok(id) = netns_id(&path) else {
            continue;
        };
        if id == node || matches!(judged.get(&id), Some(None)) {
            continue;
        }
        let in_pod = fs::read_to_string(format!("/proc/{}/cgroup", process.pid))
            .is_ok_and(|cgroups| cgroup_names_pod(&cgroups, uid));
        if !in_pod {
            continue;
        }
        let Ok(started) = process.stat().map(|stat| stat.starttime) else {
            continue;
        };
        match judged.entry(id) {
            Entry::Occupied(mut seen) => {
                if let Some(candidate) = seen.get_mut() {
                    candidate.started = candidate.started.min(started);
                }
            }
            Entry::Vacant(unseen) => {
                // The process may be gone by now; then so is what it could tell.
                let Ok(netns) = File::open(&path) else {
                    continue;
                };
                // A PID reused by another pod's process, or a namespace the pod's container
                // made for itself, is in the pod's cgroup but not its network (istio #61211).
                let candidate = holds_any(&netns, ips)?.then_some(Candidate {
                    netns,
                    path,
                    started,
                });
                unseen.insert(candidate);
            }
        }
    }
    // The pod's sandbox (pause) process came first; younger namespaces in its cgroup are its
    // containers' own (istio #55170). Dropping the others closes them (#61178).
    let oldest = judged
        .into_values()
        .flatten()
        .min_by_key(|candidate| candidate.started);
    if let Some(found) = &oldest {
        debug!(uid, path = %found.path.display(), "running pod's netns found");
    }
    Ok(oldest.map(|found| PodNetns {
        netns: found.netns.into(),
        path: found.path,
    }))
}

/// Whether one of `ips` is on an interface inside `netns`.
fn holds_any(netns: &File, ips: &[IpAddr]) -> Result<bool> {
    let _inside = netns::enter(netns.as_fd()).context("entering a candidate netns")?;
    let addresses = netlink::non_loopback_addresses().context("listing a candidate's addresses")?;
    Ok(ips.iter().any(|ip| addresses.contains(ip)))
}

/// Whether a process's cgroups (the text of its `/proc/<pid>/cgroup`, v2 or v1 lines) put it in
/// pod `uid`'s cgroup as kubelet names it, for every QoS class (guaranteed pods have no QoS
/// level):
/// - systemd driver: `kubepods-besteffort-pod<uid with _ for ->.slice`, holding the runtime's
///   `cri-containerd-<id>.scope` or `crio-<id>.scope`; kind nests it as `kubelet-kubepods-…`;
/// - cgroupfs driver: `/kubepods/besteffort/pod<uid>/<container id>`.
///
/// The pod's segment is looked for anywhere in the path: seen from another cgroup namespace,
/// paths start with `/..`.
pub(super) fn cgroup_names_pod(cgroups: &str, uid: &str) -> bool {
    if uid.is_empty() {
        return false;
    }
    let systemd_uid = uid.replace('-', "_");
    let names_pod = |segment: &str| {
        let systemd_parent = segment
            .strip_suffix(".slice")
            .and_then(|slice| slice.strip_suffix(systemd_uid.as_str()))
            .and_then(|slice| slice.strip_suffix("-pod"));
        segment.strip_prefix("pod") == Some(uid)
            || systemd_parent.is_some_and(|parent| {
                ["kubepods", "kubepods-besteffort", "kubepods-burstable"]
                    .iter()
                    .any(|qos_slice| parent.ends_with(qos_slice))
            })
    };
    cgroups
        .lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .flat_map(|path| path.split('/'))
        .any(names_pod)
}

#[cfg(test)]
mod tests {
    use super::cgroup_names_pod;

    const UID: &str = "5f0c8e2a-3b1d-4c6e-9a7f-1d2e3f4a5b6c";
    const CONTAINER: &str = "8d1b6c4e0f3a2b9c7d5e1f0a3b6c9d2e4f7a0b3c6d9e2f5a8b1c4d7e0f3a6b9c";

    #[test]
    fn cgroup_names_pod_in_every_driver_runtime_and_qos_class() {
        let uid_ = UID.replace('-', "_");
        let other_uid_ = "5f0c8e2a_3b1d_4c6e_9a7f_1d2e3f4a5b6d";
        let cases = [
            // systemd driver, containerd, each QoS class.
            (
                format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{CONTAINER}.scope\n"),
                true,
            ),
            (
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{CONTAINER}.scope\n"),
                true,
            ),
            (
                format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{CONTAINER}.scope\n"),
                true,
            ),
            // systemd driver, CRI-O: the container, and conmon (in the host netns, skipped there).
            (
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/crio-{CONTAINER}.scope\n"),
                true,
            ),
            (
                format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/crio-conmon-{CONTAINER}.scope\n"),
                true,
            ),
            // kind: kubelet's slices nested in the node container's.
            (
                format!("0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{uid_}.slice/cri-containerd-{CONTAINER}.scope\n"),
                true,
            ),
            // Read from inside another cgroup namespace (the agent's container).
            (
                format!("0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{CONTAINER}.scope\n"),
                true,
            ),
            // cgroupfs driver, each QoS class.
            (format!("0::/kubepods/besteffort/pod{UID}/{CONTAINER}\n"), true),
            (format!("0::/kubepods/burstable/pod{UID}/{CONTAINER}\n"), true),
            (format!("0::/kubepods/pod{UID}/{CONTAINER}\n"), true),
            // cgroup v1 (hybrid) lines: the pod is named by the controllers' hierarchies.
            (
                format!("12:memory:/kubepods/burstable/pod{UID}/{CONTAINER}\n11:pids:/kubepods/burstable/pod{UID}/{CONTAINER}\n0::/\n"),
                true,
            ),
            (
                format!("1:name=systemd:/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{CONTAINER}.scope\n0::/\n"),
                true,
            ),
            // Another pod; one whose uid has ours as a prefix.
            (
                format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{other_uid_}.slice/cri-containerd-{CONTAINER}.scope\n"),
                false,
            ),
            (format!("0::/kubepods/besteffort/pod{UID}0/{CONTAINER}\n"), false),
            // systemd's form is escaped: a slice with dashes in the uid is not kubelet's.
            (
                format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID}.slice/cri-containerd-{CONTAINER}.scope\n"),
                false,
            ),
            // The uid outside a pod segment, or in a slice that is not kubelet's.
            (format!("0::/system.slice/containerd.service/{UID}\n"), false),
            (format!("0::/system.slice/backup-pod{uid_}.slice\n"), false),
            // The host's processes.
            ("0::/init.scope\n".to_owned(), false),
            ("0::/system.slice/kubelet.service\n".to_owned(), false),
            (String::new(), false),
        ];
        for (cgroups, expected) in cases {
            assert_eq!(cgroup_names_pod(&cgroups, UID), expected, "{cgroups}");
        }
    }

    #[test]
    fn an_empty_uid_names_no_pod() {
        assert!(!cgroup_names_pod("0::/kubepods/besteffort/pod/abc\n", ""));
    }
}
