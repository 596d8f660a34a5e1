//! Leftovers of killed test runs: network namespaces, bpffs pin directories and cgroup v2
//! directories named `weir-t-*`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::system;

/// What the tests name their network namespaces, bpffs pin directories and cgroups.
const PREFIX: &str = "weir-t-";
const NETNS_DIR: &str = "/run/netns";
const BPFFS: &str = "/sys/fs/bpf";

/// Remove every leftover; needs root. A leftover that cannot be removed is reported, not fatal.
pub fn run() -> Result<()> {
    for path in leftovers(Path::new(NETNS_DIR))? {
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        println!("    removing network namespace {name}");
        if let Err(err) = system::run(Command::new("ip").args(["netns", "del", &name])) {
            eprintln!("warning: {err:#}");
        }
    }
    for path in leftovers(Path::new(BPFFS))? {
        println!("    removing {}", path.display());
        // Files in bpffs go with unlink and directories with rmdir, which is what these do.
        let removed = match fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        if let Err(err) = removed {
            eprintln!("warning: cannot remove {}: {err}", path.display());
        }
    }
    if let Some(cgroup2) = cgroup2_root()? {
        for path in leftovers(&cgroup2)? {
            println!("    removing cgroup {}", path.display());
            if let Err(err) = remove_cgroup(&path) {
                eprintln!("warning: cannot remove {}: {err}", path.display());
            }
        }
    }
    Ok(())
}

/// The cgroup v2 mount point (/sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts).
fn cgroup2_root() -> Result<Option<PathBuf>> {
    let mounts = fs::read_to_string("/proc/self/mountinfo").context("cannot read mountinfo")?;
    Ok(mounts.lines().find_map(|line| {
        let (mount, filesystem) = line.split_once(" - ")?;
        let mount_point = mount.split(' ').nth(4)?;
        filesystem
            .starts_with("cgroup2 ")
            .then(|| PathBuf::from(mount_point))
    }))
}

/// A cgroup and the cgroups under it, innermost first: each goes with rmdir once it has no
/// children (its control files go with it). Its processes are the tests' `sleep`s, gone by now.
fn remove_cgroup(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_cgroup(&entry.path())?;
        }
    }
    fs::remove_dir(dir)
}

/// Sweep, through sudo when we are not root; without either, only warn.
pub fn run_privileged() -> Result<()> {
    if system::is_root() {
        return run();
    }
    if system::find_on_path("sudo").is_some() {
        let exe = std::env::current_exe().context("cannot find the xtask executable")?;
        return system::run(Command::new("sudo").arg(exe).arg("sweep"));
    }
    eprintln!(
        "warning: not root and no sudo: leftovers of killed test runs (weir-t-*) are not swept"
    );
    Ok(())
}

/// Entries of `dir` whose name starts with the test prefix; none when `dir` does not exist.
fn leftovers(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(err).with_context(|| format!("cannot list {}", dir.display())),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        if entry.file_name().to_string_lossy().starts_with(PREFIX) {
            found.push(entry.path());
        }
    }
    Ok(found)
}
