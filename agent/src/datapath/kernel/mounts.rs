//! The filesystems the datapath lives on: bpffs for its pins, the cgroup v2 hierarchy its socket
//! programs attach to.
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use tracing::info;

const BPF_FS_MAGIC: i64 = 0xcafe4a11;
const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;
pub(crate) const DEFAULT_BPF_FS: &str = "/sys/fs/bpf";

/// The cgroup v2 mount point (e.g. /sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts).
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = procfs::process::Process::myself()?.mountinfo()?;
    mounts
        .into_iter()
        .find(|mount| mount.fs_type == "cgroup2")
        .map(|mount| mount.mount_point)
        .ok_or_else(|| anyhow!("no cgroup2 mount found: weir needs the unified cgroup hierarchy"))
}

/// Whether `path` is a directory of the cgroup v2 hierarchy.
pub(crate) fn is_cgroup2(path: &Path) -> bool {
    is_fs(path, CGROUP2_SUPER_MAGIC)
}

fn is_fs(path: &Path, magic: i64) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|fs| fs.filesystem_type().0 == magic)
}

/// Where weir's pins would be made.
pub(crate) enum PinRootFs {
    /// The pin root, or the nearest of its ancestors that exists (named), is on a bpffs.
    Bpffs(PathBuf),
    /// The pin root is under /sys/fs/bpf, which is no bpffs yet: the agent mounts one there.
    Unmounted,
    /// The pin root, or the nearest of its ancestors that exists (named), is on another file
    /// system.
    Other(PathBuf),
}

pub(crate) fn pin_root_fs(pin_root: &Path) -> PinRootFs {
    let default = Path::new(DEFAULT_BPF_FS);
    if pin_root.starts_with(default) && !is_fs(default, BPF_FS_MAGIC) {
        return PinRootFs::Unmounted;
    }
    let existing = pin_root.ancestors().find(|p| p.exists()).unwrap_or(default);
    if is_fs(existing, BPF_FS_MAGIC) {
        PinRootFs::Bpffs(existing.to_owned())
    } else {
        PinRootFs::Other(existing.to_owned())
    }
}

/// Makes sure `pin_root` can be created on a bpffs, mounting /sys/fs/bpf when it is not one.
pub(in crate::datapath) fn ensure_bpffs(pin_root: &Path) -> Result<()> {
    if let PinRootFs::Unmounted = pin_root_fs(pin_root) {
        nix::mount::mount(
            Some("bpf"),
            DEFAULT_BPF_FS,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .context("mounting bpffs at /sys/fs/bpf")?;
        info!("mounted bpffs at /sys/fs/bpf");
    }
    match pin_root_fs(pin_root) {
        PinRootFs::Bpffs(_) => Ok(()),
        PinRootFs::Unmounted | PinRootFs::Other(_) => {
            bail!("{} is not on a bpffs", pin_root.display())
        }
    }
}
