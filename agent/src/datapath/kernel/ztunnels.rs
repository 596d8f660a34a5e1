//! The cgroups of the connected ztunnels (`ZTUNNEL_CGROUPS`). The programs take a socket for
//! ztunnel's only when it has ztunnel's mark and is in one of these: a pod can give its sockets
//! the mark (`SO_MARK` needs only `CAP_NET_RAW` from Linux 5.17), not join ztunnel's cgroup. The
//! ZDS server names each ztunnel that says hello by its process; its cgroup is added before its
//! pods are sent to it. It stays after the connection ends, for as long as there is room: a
//! ztunnel that lost its connection (or is draining) still owns its sockets, and a gone one's
//! cgroup id is never reused, so no pod can ever be in it.
//!
//! tc cannot read a socket's cgroup: it knows ztunnel's listeners by the mark the bind hook puts
//! on the sockets ztunnel binds to its ports (`ZTUNNEL_LISTENS`). Listeners ztunnel bound
//! before that (before this agent's layout of the maps, or before the datapath was loaded) get
//! the mark here, when ztunnel connects: the agent takes a copy of each of ztunnel's listening
//! sockets on those ports (`pidfd_getfd`) and marks it.
use std::{
    collections::HashMap as StdHashMap,
    fs, io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{HashMap, MapData, MapError, SkStorage},
    Ebpf,
};
use socket2::{SockRef, Type};
use tracing::{info, warn};
use weir_common::{maps, HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT, ZTUNNEL_MARK, ZTUNNEL_MARK_MASK};

use super::programs;

pub(in crate::datapath) struct ZtunnelCgroups {
    map: HashMap<MapData, u64, u8>,
    listeners: SkStorage<MapData, u8>,
    /// The cgroup2 mount, under which a process's cgroup path is found.
    hierarchy: PathBuf,
    /// Connections per cgroup.
    connections: StdHashMap<u64, usize>,
}

impl ZtunnelCgroups {
    /// The programs' map. Entries a previous agent left stay: the ztunnels they name keep their
    /// sockets told apart while they connect again.
    pub(in crate::datapath) fn take(ebpf: &mut Ebpf, hierarchy: PathBuf) -> Result<Self> {
        Ok(Self {
            map: programs::take_map(ebpf, maps::ZTUNNEL_CGROUPS)?,
            listeners: programs::take_map(ebpf, maps::ZTUNNEL_LISTENS)?,
            hierarchy,
            connections: StdHashMap::new(),
        })
    }

    /// A ztunnel, process `pid`, connected: returns the cgroup its sockets are now known by.
    /// `Err` when that cgroup cannot be read or is no identity (see [`identity_of`]): then this
    /// ztunnel is refused, and its pods wait (fail closed), for a mark alone does not tell its
    /// sockets from a pod's.
    pub(in crate::datapath) fn connected(&mut self, pid: u32) -> Result<u64> {
        let cgroup = identity_of(pid, &self.hierarchy).with_context(|| {
            format!(
                "ztunnel (pid {pid}) cannot be told from pods by its cgroup, so it is refused: \
                 run it in a cgroup v2 of its own (a container of its own on a node whose \
                 runtime gives containers cgroup v2 directories)"
            )
        })?;
        if let Err(MapError::SyscallError(_)) = self.map.insert(cgroup, 0, 0) {
            // Full of ztunnels that are no longer connected.
            self.forget_disconnected()?;
            self.map
                .insert(cgroup, 0, 0)
                .context("recording ztunnel's cgroup")?;
        }
        *self.connections.entry(cgroup).or_default() += 1;
        info!(pid, cgroup, "ztunnel's sockets are known by its cgroup");
        match mark_listeners(pid, &mut self.listeners) {
            Ok(0) => {}
            Ok(marked) => info!(pid, marked, "ztunnel's earlier listeners marked for tc"),
            // Its earlier listeners get no inbound connection (fail closed) until it listens
            // again; those it binds from now on are marked by the bind hook.
            Err(error) => warn!(
                pid,
                error = format!("{error:#}"),
                "cannot mark ztunnel's earlier listeners: they get no connection"
            ),
        }
        Ok(cgroup)
    }

    /// A connection of a ztunnel in `cgroup` ended: its entry may make room for another's.
    pub(in crate::datapath) fn disconnected(&mut self, cgroup: u64) {
        if let Some(connections) = self.connections.get_mut(&cgroup) {
            *connections -= 1;
            if *connections == 0 {
                self.connections.remove(&cgroup);
            }
        }
    }

    fn forget_disconnected(&mut self) -> Result<()> {
        let departed: Vec<u64> = self
            .map
            .keys()
            .filter_map(Result::ok)
            .filter(|cgroup| !self.connections.contains_key(cgroup))
            .collect();
        for cgroup in departed {
            remove(&mut self.map, cgroup)?;
        }
        Ok(())
    }
}

fn remove(map: &mut HashMap<MapData, u64, u8>, cgroup: u64) -> Result<()> {
    match map.remove(&cgroup) {
        Err(MapError::SyscallError(error)) if error.io_error.kind() == io::ErrorKind::NotFound => {
            Ok(())
        }
        removed => removed.context("removing a ztunnel cgroup"),
    }
}

/// Marks every TCP socket of process `pid` that listens on one of ztunnel's ports with
/// ztunnel's mark in `listeners`; returns how many. A socket is reached through a copy of the
/// process's descriptor (`pidfd_getfd`), closed right after.
fn mark_listeners(pid: u32, listeners: &mut SkStorage<MapData, u8>) -> Result<usize> {
    // SAFETY: a plain syscall; the descriptor it returns is new and owned here.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error()).context("pidfd_open");
    }
    // SAFETY: as above.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let mut marked = 0;
    for entry in fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        let is_socket = fs::read_link(entry.path())
            .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"));
        let fd = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok());
        let Some(fd) = fd.filter(|_| is_socket) else {
            continue;
        };
        // SAFETY: as above.
        let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if copy < 0 {
            // Closed meanwhile.
            continue;
        }
        // SAFETY: as above.
        let socket = unsafe { OwnedFd::from_raw_fd(copy as i32) };
        if is_ztunnels_listener(socket.as_fd()) {
            listeners
                .insert(&socket, 1, 0)
                .context("marking a listener of ztunnel's")?;
            marked += 1;
        }
    }
    Ok(marked)
}

/// Whether `socket` is a TCP listener with ztunnel's mark on one of ztunnel's ports.
fn is_ztunnels_listener(socket: BorrowedFd<'_>) -> bool {
    let socket = SockRef::from(&socket);
    let port = socket
        .local_addr()
        .ok()
        .and_then(|address| address.as_socket())
        .map(|address| address.port());
    socket.r#type().is_ok_and(|kind| kind == Type::STREAM)
        && socket.is_listener().unwrap_or(false)
        && socket
            .mark()
            .is_ok_and(|mark| mark & ZTUNNEL_MARK_MASK == ZTUNNEL_MARK)
        && matches!(port, Some(OUTBOUND_PORT | INBOUND_PORT | HBONE_PORT))
}

/// The cgroup (v2) id of process `pid` as an identity only its processes can have: not the
/// hierarchy's root, where every process is that has no cgroup v2 of its own (on a node with the
/// hybrid hierarchy, or whose runtime gives containers none), and not a cgroup with cgroups
/// below it, whose processes may be anyone's.
pub(crate) fn identity_of(pid: u32, hierarchy: &Path) -> Result<u64> {
    let path = cgroup_path_of(pid)?;
    if path.trim_matches('/').is_empty() {
        bail!("process {pid} is in the root of the cgroup v2 hierarchy, with every process that has no cgroup v2 of its own");
    }
    let dir = hierarchy.join(path.trim_start_matches('/'));
    let below = fs::read_dir(&dir)
        .with_context(|| format!("{}", dir.display()))?
        .filter_map(Result::ok)
        .any(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()));
    if below {
        bail!("process {pid}'s cgroup {path} has cgroups below it");
    }
    cgroup_id(hierarchy, &path)
}

/// The path of process `pid`'s cgroup (v2), read in the node's cgroup namespace (pid 1's, the
/// agent running with the node's pids): in a container's own, another container's path starts
/// with `/..`, and the container's own is `/`.
fn cgroup_path_of(pid: u32) -> Result<String> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                enter_node_cgroup_namespace()?;
                cgroup_path(pid)
            })
            .join()
            .map_err(|_| anyhow!("reading the cgroup of {pid} panicked"))?
    })
}

/// The id of the cgroup at `path` (as `/proc/<pid>/cgroup` shows it, from the hierarchy's root)
/// in the cgroup v2 `hierarchy`: its directory's inode number.
pub(in crate::datapath) fn cgroup_id(hierarchy: &Path, path: &str) -> Result<u64> {
    let dir = hierarchy.join(path.trim_start_matches('/'));
    let metadata = fs::metadata(&dir).with_context(|| format!("{}", dir.display()))?;
    Ok(metadata.ino())
}

/// Moves the calling thread (only) into pid 1's cgroup namespace, unless it is there or pid 1's
/// cannot be opened (then the agent's own is taken for the node's, and a path that leaves it is
/// refused in [`cgroup_path`]).
fn enter_node_cgroup_namespace() -> Result<()> {
    let node = match fs::File::open("/proc/1/ns/cgroup") {
        Ok(node) => node,
        Err(error) if error.kind() == io::ErrorKind::PermissionDenied => return Ok(()),
        Err(error) => return Err(error).context("opening /proc/1/ns/cgroup"),
    };
    let own = fs::metadata("/proc/thread-self/ns/cgroup")?;
    if node.metadata()?.ino() == own.ino() {
        return Ok(());
    }
    nix::sched::setns(&node, nix::sched::CloneFlags::CLONE_NEWCGROUP)
        .context("entering the node's cgroup namespace")
}

fn cgroup_path(pid: u32) -> Result<String> {
    let cgroups = procfs::process::Process::new(pid as i32)
        .and_then(|process| process.cgroups())
        .with_context(|| format!("reading /proc/{pid}/cgroup"))?;
    let path = cgroups
        .into_iter()
        .find(|cgroup| cgroup.hierarchy == 0)
        .map(|cgroup| cgroup.pathname)
        .ok_or_else(|| anyhow!("process {pid} is in no cgroup v2"))?;
    if path.starts_with("/..") {
        bail!("process {pid}'s cgroup {path} is outside this cgroup namespace");
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_cgroup_is_its_directorys_inode() {
        let hierarchy = super::super::mounts::cgroup2_root().unwrap();
        let path = cgroup_path_of(std::process::id()).unwrap();
        let own = cgroup_id(&hierarchy, &path).unwrap();
        let dir = hierarchy.join(path.trim_start_matches('/'));
        assert_eq!(own, fs::metadata(dir).unwrap().ino());
    }
}
