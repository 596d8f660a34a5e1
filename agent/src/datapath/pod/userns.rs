//! Pods in a user namespace of their own (`hostUsers: false`). A sidecar pod's proxy runs as
//! uid and gid 1337 inside it, and istio's rules match those ids there; the programs see every
//! process's ids as the node does (`bpf_get_current_uid_gid` answers in the initial user
//! namespace). So the proxy's ids are mapped through the pod's id maps before they go into the
//! maps.
//!
//! The pod's user namespace is the one that owns its network namespace (the runtime makes the
//! netns inside it). Its maps can only be read from a process in it, and at CNI ADD there may be
//! none yet: the agent forks a child that joins the namespace, reads its maps from
//! `/proc/<child>/{uid,gid}_map` (which give the node's ids to a reader in the node's
//! namespace, whatever the nesting), and ends it.
use std::{
    fs::{self, File},
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
};

use anyhow::{Context, Result};

/// `NS_GET_USERNS` (`_IO(0xb7, 0x1)`): the user namespace that owns a namespace.
const NS_GET_USERNS: libc::c_ulong = 0xb701;

/// An id the kernel never gives a process (`(uid_t) -1`): what an id the pod does not map
/// becomes, so that it matches nobody, as istio's owner match would match nobody in the pod.
const NO_ID: u32 = u32::MAX;

/// A user namespace's uid and gid maps, as the node sees them.
#[derive(Debug, PartialEq, Eq)]
pub struct IdMaps {
    uids: Vec<IdRange>,
    gids: Vec<IdRange>,
}

/// One line of an id map: `count` ids from `inside` are the node's from `outside`.
#[derive(Debug, PartialEq, Eq)]
struct IdRange {
    inside: u32,
    outside: u32,
    count: u32,
}

impl IdMaps {
    /// The maps of the user namespace that owns the network namespace `netns`; `None` when that
    /// is the agent's own (a pod with `hostUsers: true`, every pod on most nodes).
    pub fn of_netns_owner(netns: BorrowedFd<'_>) -> Result<Option<Self>> {
        // SAFETY: an ioctl on a valid fd; the kernel returns a new fd or -1.
        let userns = unsafe { libc::ioctl(netns.as_raw_fd(), NS_GET_USERNS) };
        if userns < 0 {
            return Err(io::Error::last_os_error()).context("the pod netns's user namespace");
        }
        // SAFETY: a new fd, owned from here on.
        let userns = File::from(unsafe { OwnedFd::from_raw_fd(userns) });
        let theirs = userns.metadata()?;
        let ours = fs::metadata("/proc/self/ns/user")?;
        if (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino()) {
            return Ok(None);
        }
        let member = Member::join(userns)?;
        let read = |map: &str| -> Result<Vec<IdRange>> {
            let path = format!("/proc/{}/{map}", member.pid);
            let text = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
            parse(&text).with_context(|| format!("parsing {path}: {text:?}"))
        };
        Ok(Some(Self {
            uids: read("uid_map")?,
            gids: read("gid_map")?,
        }))
    }

    /// The node's uid for the pod's `uid`.
    pub fn uid(&self, uid: u32) -> u32 {
        outside(&self.uids, uid)
    }

    /// The node's gid for the pod's `gid`.
    pub fn gid(&self, gid: u32) -> u32 {
        outside(&self.gids, gid)
    }
}

fn outside(ranges: &[IdRange], id: u32) -> u32 {
    ranges
        .iter()
        .find(|range| id >= range.inside && id - range.inside < range.count)
        .map_or(NO_ID, |range| range.outside + (id - range.inside))
}

/// An id map's lines, `<inside> <outside> <count>` in blank-separated columns.
fn parse(text: &str) -> Result<Vec<IdRange>> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let numbers: Vec<u32> = line
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()?;
            match numbers[..] {
                [inside, outside, count] => Ok(IdRange {
                    inside,
                    outside,
                    count,
                }),
                _ => anyhow::bail!("a line of {} numbers", numbers.len()),
            }
        })
        .collect()
}

/// A child process in a user namespace, for as long as it is held; killed and reaped on drop.
struct Member {
    pid: libc::pid_t,
}

impl Member {
    /// Forks a child that joins `userns` and waits there to be killed.
    fn join(userns: File) -> Result<Self> {
        let (ready_read, ready_write) = nix::unistd::pipe()?;
        // SAFETY: the child only makes async-signal-safe calls (setns, write, pause, _exit)
        // on fds opened before the fork, as a child of a multithreaded process must.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error()).context("fork");
        }
        if pid == 0 {
            // SAFETY: see above; a forked child is single-threaded, as joining a user
            // namespace requires.
            unsafe {
                let joined = libc::setns(userns.as_raw_fd(), libc::CLONE_NEWUSER) == 0;
                let answer = [u8::from(joined)];
                libc::write(ready_write.as_raw_fd(), answer.as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        let member = Self { pid };
        drop(ready_write);
        let mut answer = [0u8; 1];
        let read = nix::unistd::read(ready_read.as_raw_fd(), &mut answer)?;
        if read != 1 || answer[0] != 1 {
            anyhow::bail!("the child could not join the pod's user namespace");
        }
        Ok(member)
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // SAFETY: our own child, reaped here and nowhere else.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_map_through_the_range_that_holds_them_and_others_to_none() {
        let maps = IdMaps {
            uids: parse("         0     100000      65536\n").unwrap(),
            gids: parse("0 200000 1000\n1000 300000 1000\n").unwrap(),
        };
        assert_eq!(maps.uid(1337), 101337);
        assert_eq!(maps.uid(0), 100000);
        assert_eq!(maps.uid(65536), NO_ID);
        assert_eq!(maps.gid(999), 200999);
        assert_eq!(maps.gid(1337), 300337);
        assert_eq!(maps.gid(2000), NO_ID);
        assert!(parse("0 1\n").is_err());
        assert!(parse("0 x 1\n").is_err());
    }
}
