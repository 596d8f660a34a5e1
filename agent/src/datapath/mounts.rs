//! The filesystems the datapath lives on: bpffs for its pins, the cgroup v2 hierarchy its socket
//! programs attach to.
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use tracing::info;

const BPF_FS_MAGIC: i64 = 0xcafe4a11;
const DEFAULT_BPF_FS: &str = "/sys/fs/bpf";

/// The cgroup v2 mount point (e.g. /sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts).
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = procfs::process::Process::myself()?.mountinfo()?;
    mounts
        .into_iter()
        .find(|mount| mount.fs_type == "cgroup2")
        .map(|mount| mount.mount_point)
        .ok_or_else(|| anyhow!("no cgroup2 mount found: weir needs the unified cgroup hierarchy"))
}

/// Makes sure `pin_root` can be created on a bpffs, mounting /sys/fs/bpf when it is not one.
pub(super) fn ensure_bpffs(pin_root: &Path) -> Result<()> {
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
