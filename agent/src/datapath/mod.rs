//! The datapath owner: the only code that touches weir's BPF objects.
//!
//! It runs on one dedicated OS thread, `weir-datapath` (network namespace switches are per
//! thread, so they must never happen on a tokio worker, and the thread holds every BPF object),
//! and is driven through [`Datapath`], a cheap handle that sends it commands. It loads the
//! programs once, pins maps and links under the pin root so redirection survives an agent
//! restart, and on start takes over pinned links with `BPF_LINK_UPDATE` rather than
//! detach-then-attach, so there is never a window without redirection. Its two waits on sockets
//! (the pods' interface changes, the programs' log records) are tasks on the caller's runtime
//! (`owner/tasks.rs`), not threads.
//!
//! `Owner::enroll` (in `pod/enroll.rs`) is where a pod is enrolled, all inside the pod's netns:
//! the reply-mark sysctls, then the map entries that switch redirection on, then the return path
//! and the tc program (which never runs before the maps name the pod). Unenroll removes the map
//! entries first. Both are idempotent.
//!
//! [`pinned_pods`] is the one reader that needs no owner: it opens the pinned maps read-only, for
//! an operator's `weir-agent pods` next to a running agent.
//!
//! The files, by role:
//!
//! - `owner/`: the owner thread and the handle that drives it: its state, start and command loop
//!   (`thread.rs`), the [`Datapath`] handle and its commands (`handle.rs`), the tasks that wait
//!   on its sockets (`tasks.rs`, `bpf_log.rs`), the audit (`audit.rs`), recovery after a restart
//!   and the orphan check (`recovery.rs`), and retiring other map layouts (`layouts.rs`).
//! - `pod/`: a pod's enrollment: `Owner::enroll` and unenrollment (`enroll.rs`) and the timing of
//!   its steps (`enroll_steps.rs`); a pod's map entries (`config.rs`), slot (`slots.rs`), sidecar
//!   port and range lists (`sidecar_lists.rs`), translation map (`translations.rs`), user
//!   namespace (`userns.rs`); what enrollment puts in its netns (`netns_setup.rs`); the watch on
//!   its interfaces (`interface_watch.rs`); finding a running pod's netns (`discovery.rs`); and
//!   istio's in-pod rules it takes over (`istio_rules.rs`).
//! - `kernel/`: the kernel and weir's objects in it: what the running kernel supports
//!   (`support.rs`), the programs (`programs.rs`), the bpf syscalls aya lacks (`bpf_sys.rs`),
//!   bpffs and cgroup2 (`mounts.rs`), the socket lookup hand-off (`handoff.rs`), the ztunnels'
//!   cgroups (`ztunnels.rs`), network namespaces (`netns.rs`) and rtnetlink (`netlink/`).
//! - `readers/`: what reads the pinned maps without an owner: the pods and map fill
//!   (`snapshot.rs`), the trace maps (`trace_maps.rs`).
pub(crate) mod kernel;
mod owner;
mod pod;
mod readers;

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    time::Duration,
};

use weir_common::{ABI_VERSION, PROBE_SOURCE_V4, PROBE_SOURCE_V6};

pub(crate) use kernel::{
    handoff::running_inbound_path, ztunnels::identity_of as cgroup_identity_of,
};
pub use kernel::{mounts::cgroup2_root, netlink, netns};
pub use owner::{
    handle::{Datapath, Request},
    recovery::Orphans,
};
pub use pod::{
    config::{ip_addr, ip_key, Unenrollable},
    discovery::PodNetns,
    istio_rules,
};
pub use readers::{
    snapshot::{
        denials, map_dump, map_fill, pinned_pods, MapDump, MapFill, PinnedLookups, PinnedPod,
    },
    trace_maps::TraceMaps,
};

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
    /// The probe source, and whose connections get it.
    pub probe_source: ProbeSource,
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
            probe_source: ProbeSource::default(),
            bpf_log: false,
        }
    }
}

/// The addresses the node's probes to enrolled pods leave from (istio's `HOST_PROBE_SNAT_IP` and
/// `HOST_PROBE_SNAT_IPV6`), which the pods let through to the app, and whose connections get them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSource {
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    /// Only sockets of this cgroup get the probe source: kubelet's, as `/proc/<kubelet
    /// pid>/cgroup` shows it (`/system.slice/kubelet.service`, or `/kubelet.slice/...`).
    /// `None`: every TCP connection from the node's netns to a pod's address.
    pub cgroup: Option<String>,
}

impl Default for ProbeSource {
    fn default() -> Self {
        Self {
            v4: PROBE_SOURCE_V4.into(),
            v6: PROBE_SOURCE_V6.into(),
            cgroup: None,
        }
    }
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
