//! A pod's process as kubelet and the runtime place it: inside the pod's network namespace and
//! inside a cgroup (v2) whose path names the pod's UID in one of kubelet's two forms. Each one
//! gets its own `weir-t-*` cgroup directory (swept by `cargo xtask sweep` if a run is killed).

use std::ffi::CString;
use std::fs;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result};
use nix::sched::CloneFlags;
use weir_agent::datapath::cgroup2_root;

use crate::{ids, NetNs};

/// How kubelet names a pod's cgroup.
#[derive(Clone, Copy, Debug)]
pub enum CgroupDriver {
    /// `kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/cri-containerd-<id>.scope`
    Systemd,
    /// `kubepods/besteffort/pod<uid>/<container id>`
    Cgroupfs,
}

/// A `sleep` in a network namespace and in a best-effort pod's container cgroup; killed, and its
/// cgroups removed, on drop.
pub struct PodProcess {
    child: Child,
    /// Every directory made, outermost first.
    cgroups: Vec<PathBuf>,
}

impl PodProcess {
    /// Starts the process in `netns`, then moves it into pod `uid`'s cgroup.
    pub fn start(netns: &NetNs, uid: &str, driver: CgroupDriver) -> Result<Self> {
        let container = ids::container_id();
        let segments = match driver {
            CgroupDriver::Systemd => {
                let uid = uid.replace('-', "_");
                vec![
                    "kubepods.slice".to_owned(),
                    "kubepods-besteffort.slice".to_owned(),
                    format!("kubepods-besteffort-pod{uid}.slice"),
                    format!("cri-containerd-{container}.scope"),
                ]
            }
            CgroupDriver::Cgroupfs => vec![
                "kubepods".to_owned(),
                "besteffort".to_owned(),
                format!("pod{uid}"),
                container,
            ],
        };
        let netns_fd = netns.as_fd().as_raw_fd();
        let mut command = Command::new("sleep");
        command.arg("60").stdin(Stdio::null());
        // SAFETY: the child only makes the setns syscall before exec; the fd stays open in the
        // parent (borrowed from `netns`) until spawn returns, which is after the exec.
        unsafe {
            command.pre_exec(move || {
                let netns = std::os::fd::BorrowedFd::borrow_raw(netns_fd);
                nix::sched::setns(netns, CloneFlags::CLONE_NEWNET).map_err(Into::into)
            });
        }
        let child = command.spawn().context("starting sleep in the pod")?;
        let mut process = Self {
            child,
            cgroups: Vec::new(),
        };
        let mut dir = cgroup2_root()?.join(ids::unique_name("cgroup"));
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        process.cgroups.push(dir.clone());
        for segment in segments {
            dir.push(segment);
            fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            process.cgroups.push(dir.clone());
        }
        fs::write(dir.join("cgroup.procs"), process.pid().to_string())
            .with_context(|| format!("moving the process into {}", dir.display()))?;
        Ok(process)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A cgroup goes with rmdir once it has no processes and no children.
        for dir in self.cgroups.iter().rev() {
            if let Err(err) = fs::remove_dir(dir) {
                eprintln!("warning: cannot remove {}: {err}", dir.display());
            }
        }
    }
}

/// Runs `command` to its end inside `netns` and in a cgroup of its own, as a pod's process runs:
/// apart from this test process, whose cgroup its ztunnel stand-ins make ztunnel's.
pub fn output_apart_from_ztunnel(netns: &NetNs, command: Command) -> Result<Output> {
    let cgroup = TestCgroup::new()?;
    output_in_cgroup(netns, &cgroup.dir, command)
}

/// Puts this process in a cgroup (v2) of its own, as kubelet puts ztunnel's container, unless
/// it is in one already: the harness's ztunnel stand-ins run in this process, and weir refuses a
/// ztunnel whose cgroup is the hierarchy's root (where every process is on a node with the
/// hybrid hierarchy) or has cgroups below it. The whole process moves, once; the directory,
/// left behind, is swept by `cargo xtask sweep`.
pub fn in_a_cgroup_of_its_own() -> Result<()> {
    static MOVED: OnceLock<Result<(), String>> = OnceLock::new();
    MOVED
        .get_or_init(|| move_to_a_cgroup_of_its_own().map_err(|error| format!("{error:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn move_to_a_cgroup_of_its_own() -> Result<()> {
    let root = cgroup2_root()?;
    let own = fs::read_to_string("/proc/self/cgroup")?
        .lines()
        .find_map(|line| line.strip_prefix("0::").map(str::to_owned))
        .context("this process is in no cgroup v2")?;
    let dir = root.join(own.trim_start_matches('/'));
    let has_cgroups_below = fs::read_dir(&dir)?
        .filter_map(Result::ok)
        .any(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()));
    if !own.trim_matches('/').is_empty() && !has_cgroups_below {
        return Ok(());
    }
    let cgroup = root.join(ids::unique_name("ztunnel"));
    fs::create_dir(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
    fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
        .with_context(|| format!("moving this process into {}", cgroup.display()))
}

/// A cgroup (v2) directory of the test's own, removed on drop (it must be empty by then).
pub struct TestCgroup {
    pub dir: PathBuf,
}

impl TestCgroup {
    pub fn new() -> Result<Self> {
        let dir = cgroup2_root()?.join(ids::unique_name("cgroup"));
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self { dir })
    }

    /// Removes it and makes it again at the same path, as systemd does for a restarted
    /// service: a new cgroup, with a new id. It must be empty.
    pub fn make_again(&self) -> Result<()> {
        fs::remove_dir(&self.dir).with_context(|| format!("removing {}", self.dir.display()))?;
        fs::create_dir(&self.dir).with_context(|| format!("creating {}", self.dir.display()))
    }

    /// Its path as `/proc/<pid>/cgroup` shows it for a process in it.
    pub fn path(&self) -> String {
        let name = self.dir.file_name().unwrap().to_string_lossy();
        format!("/{name}")
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Err(err) = fs::remove_dir(&self.dir) {
            eprintln!("warning: cannot remove {}: {err}", self.dir.display());
        }
    }
}

/// Runs `command` to its end inside `netns` and in the cgroup (v2) directory `cgroup`.
pub fn output_in_cgroup(netns: &NetNs, cgroup: &Path, mut command: Command) -> Result<Output> {
    let procs = CString::new(cgroup.join("cgroup.procs").into_os_string().into_vec())?;
    let netns_fd = netns.as_fd().as_raw_fd();
    // SAFETY: the child makes only async-signal-safe syscalls before exec, on memory prepared
    // before the fork; the netns fd stays open in the parent until the child has exec'd.
    unsafe {
        command.pre_exec(move || {
            let procs = libc::open(procs.as_ptr(), libc::O_WRONLY);
            let moved = procs >= 0 && libc::write(procs, b"0".as_ptr().cast(), 1) == 1;
            if !moved || libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(procs);
            Ok(())
        });
    }
    command
        .output()
        .with_context(|| format!("running the command in {}", cgroup.display()))
}
