//! Per-thread network namespace switching and the per-namespace facts weir needs.
//!
//! `setns(CLONE_NEWNET)` changes the namespace of the calling thread only. Everything here acts on
//! the calling thread's current namespace, so the datapath thread enters a pod with [`enter`] and
//! calls these (and [`crate::netlink`]) while the guard lives.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::marker::PhantomData;
use std::net::IpAddr;
use std::os::fd::{BorrowedFd, OwnedFd};

use nix::sched::{setns, CloneFlags};

use crate::netlink::Rtnl;

/// The calling thread's network namespace, as a path that resolves per thread (`/proc/self` would
/// name the main thread's).
pub(crate) const THREAD_NETNS: &str = "/proc/thread-self/ns/net";

/// The calling thread is inside another network namespace until this is dropped, which switches it
/// back to the one it came from.
///
/// If switching back fails, the process aborts: the thread would otherwise go on in the pod's
/// namespace, and whatever it did next for another pod or for the node (map updates keyed by the
/// wrong cookie, routes in the wrong pod) would silently corrupt state. A panic is not enough, as
/// the thread can survive it (`catch_unwind`, a pool that respawns tasks), and a restarted agent
/// rebuilds its state idempotently anyway. Switching to a namespace whose fd we hold open has no
/// failure mode in practice short of the kernel running out of memory.
///
/// Not `Send`: it must be dropped on the thread that entered.
#[must_use = "the thread leaves the namespace again when the guard is dropped"]
pub struct NetnsGuard {
    home: OwnedFd,
    _not_send: PhantomData<*const ()>,
}

/// Moves the calling thread into the network namespace `target` (an fd of `/proc/<pid>/ns/net` or a
/// bind mount of one) until the returned guard is dropped. On error the thread has not moved.
pub fn enter(target: BorrowedFd<'_>) -> io::Result<NetnsGuard> {
    let home = File::open(THREAD_NETNS)?.into();
    setns(target, CloneFlags::CLONE_NEWNET)?;
    Ok(NetnsGuard {
        home,
        _not_send: PhantomData,
    })
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        if let Err(err) = setns(&self.home, CloneFlags::CLONE_NEWNET) {
            tracing::error!(%err, "cannot switch this thread back to its network namespace; aborting");
            std::process::abort();
        }
    }
}

/// The cookie of the calling thread's network namespace: what `bpf_get_netns_cookie` returns for
/// sockets in it.
pub fn current_cookie() -> io::Result<u64> {
    Rtnl::new()?.netns_cookie()
}

/// The sysctls that carry marks across the pod's reply path, each set to 1:
/// - `tcp_fwmark_accept` (it covers IPv6 too): accepted sockets inherit the mark of the SYN, so
///   the app's replies to ztunnel's source-preserving dials carry the return mark;
/// - `fwmark_reflect`, v4 and v6: the kernel's own replies (the RST of a closed port, ICMP errors)
///   carry the mark of the packet they answer, so a refusal of ztunnel's dial returns to ztunnel
///   at once instead of leaving by eth0 toward the client's address (istio's connmark restore
///   does the same; without it ztunnel waits out its connect deadline).
pub const REPLY_MARK_SYSCTLS: [&str; 3] = [
    "/proc/sys/net/ipv4/tcp_fwmark_accept",
    "/proc/sys/net/ipv4/fwmark_reflect",
    "/proc/sys/net/ipv6/fwmark_reflect",
];

/// Sets [`REPLY_MARK_SYSCTLS`] in the calling thread's network namespace, a family's
/// `fwmark_reflect` only where the pod has addresses of that family (ztunnel dials a pod at its
/// IPs; each write costs tens of microseconds of a pod's enrollment). `/proc/sys/net` resolves
/// against the namespace of the task that opens it, so on the datapath thread these are the pod's
/// sysctls.
pub fn set_reply_mark_sysctls(ipv4: bool, ipv6: bool) -> io::Result<()> {
    let [accept, reflect_v4, reflect_v6] = REPLY_MARK_SYSCTLS;
    let wanted = [(accept, true), (reflect_v4, ipv4), (reflect_v6, ipv6)];
    for sysctl in wanted
        .into_iter()
        .filter_map(|(sysctl, wanted)| wanted.then_some(sysctl))
    {
        let written = OpenOptions::new()
            .write(true)
            .open(sysctl)
            .and_then(|mut file| file.write_all(b"1"));
        match written {
            // A kernel without IPv6 has no IPv6 replies to mark.
            Err(error) if error.kind() == io::ErrorKind::NotFound && sysctl.contains("/ipv6/") => {}
            Err(error) => return Err(io::Error::new(error.kind(), format!("{sysctl}: {error}"))),
            Ok(()) => {}
        }
    }
    Ok(())
}

/// See [`Rtnl::non_loopback_addresses`], for the calling thread's network namespace.
pub fn non_loopback_addresses() -> io::Result<Vec<IpAddr>> {
    Rtnl::new()?.non_loopback_addresses()
}

/// See [`Rtnl::non_loopback_interfaces`], for the calling thread's network namespace.
pub fn non_loopback_interfaces() -> io::Result<Vec<(u32, String)>> {
    Rtnl::new()?.non_loopback_interfaces()
}

/// Throwaway namespaces for tests; the machine's own namespaces are never touched.
#[cfg(test)]
pub(crate) mod testing {
    use std::fs::File;
    use std::os::fd::OwnedFd;
    use std::process::Command;

    use nix::sched::{unshare, CloneFlags};

    /// The test's namespaces, made by `context`: these tests need root. Without it they skip
    /// (`None`), except in CI, where a skip would pass for a success.
    pub(crate) fn privileged<T>(context: impl FnOnce() -> T) -> Option<T> {
        // SAFETY: geteuid cannot fail and touches no memory.
        if unsafe { libc::geteuid() } == 0 {
            return Some(context());
        }
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "netns tests need root"
        );
        eprintln!("skipping: netns tests need root");
        None
    }

    /// A fresh network namespace with `lo` up, as a pod has it. It lives as long as the fd.
    pub(crate) fn scratch_netns() -> OwnedFd {
        std::thread::spawn(|| {
            unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
            ip(&["link", "set", "lo", "up"]);
            File::open(super::THREAD_NETNS)
                .expect("open own netns")
                .into()
        })
        .join()
        .expect("netns thread")
    }

    /// Runs `ip` in the calling thread's namespace (a child inherits its parent thread's).
    pub(crate) fn ip(args: &[&str]) -> String {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;

    use super::testing::{ip, privileged, scratch_netns};
    use super::*;

    fn reply_mark_sysctls() -> Vec<String> {
        REPLY_MARK_SYSCTLS
            .iter()
            .map(|path| std::fs::read_to_string(path).unwrap().trim().to_owned())
            .collect()
    }

    #[test]
    fn enter_switches_and_restores() {
        let Some((a, b)) = privileged(|| (scratch_netns(), scratch_netns())) else {
            return;
        };
        let home = current_cookie().unwrap();
        let cookie_a = {
            let _guard = enter(a.as_fd()).unwrap();
            let here = std::fs::metadata(THREAD_NETNS).unwrap().ino();
            assert_eq!(
                here,
                File::from(a.try_clone().unwrap()).metadata().unwrap().ino()
            );
            let cookie = current_cookie().unwrap();
            assert_eq!(
                cookie,
                current_cookie().unwrap(),
                "stable within a namespace"
            );
            assert_ne!(cookie, home);
            cookie
        };
        assert_eq!(current_cookie().unwrap(), home, "back home after drop");
        let cookie_b = {
            let _guard = enter(b.as_fd()).unwrap();
            current_cookie().unwrap()
        };
        assert_ne!(cookie_a, cookie_b);
        assert_eq!(current_cookie().unwrap(), home);

        // Not a namespace: refused, and the thread stays where it was.
        let not_netns = File::open("/").unwrap();
        assert!(enter(not_netns.as_fd()).is_err());
        assert_eq!(current_cookie().unwrap(), home);
    }

    #[test]
    fn reply_mark_sysctls_are_per_namespace() {
        let Some((a, b)) = privileged(|| (scratch_netns(), scratch_netns())) else {
            return;
        };
        let home = reply_mark_sysctls();
        {
            let _guard = enter(a.as_fd()).unwrap();
            set_reply_mark_sysctls(true, true).unwrap();
            assert_eq!(reply_mark_sysctls(), ["1", "1", "1"]);
        }
        assert_eq!(
            reply_mark_sysctls(),
            home,
            "the test's own namespace is untouched"
        );
        let _guard = enter(b.as_fd()).unwrap();
        assert_eq!(
            reply_mark_sysctls(),
            ["0", "0", "0"],
            "another namespace is untouched"
        );
    }

    #[test]
    fn non_loopback_interfaces_are_this_namespaces() {
        let Some(netns) = privileged(scratch_netns) else {
            return;
        };
        let _guard = enter(netns.as_fd()).unwrap();
        assert_eq!(non_loopback_interfaces().unwrap(), []);

        ip(&[
            "link", "add", "weir-t0", "type", "veth", "peer", "name", "weir-t1",
        ]);
        let index = |name: &str| -> u32 {
            let line = ip(&["-o", "link", "show", "dev", name]);
            line.split(':').next().unwrap().parse().unwrap()
        };
        let mut found = non_loopback_interfaces().unwrap();
        let mut expected = ["weir-t0", "weir-t1"].map(|name| (index(name), name.to_owned()));
        found.sort();
        expected.sort();
        assert_eq!(found, expected);
    }
}
