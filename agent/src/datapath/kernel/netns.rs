//! Per-thread network namespace switching and the per-namespace facts weir needs.
//!
//! `setns(CLONE_NEWNET)` changes the namespace of the calling thread only. Everything here acts on
//! the calling thread's current namespace, so the datapath thread enters a pod with [`enter`] and
//! calls these (and [`super::netlink`]) while the guard lives; only [`pod_ips`] enters the pod on
//! a thread of its own.

use std::fs::File;
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::rc::Rc;

use anyhow::Context;
use aya::maps::{MapData, SkStorage};
use weir_common::{NETNS_COOKIE_PORT, PROBE_SOURCE_V4};

use nix::sched::{setns, CloneFlags};

use super::netlink::Rtnl;
use crate::datapath::pod::config::Unenrollable;

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
/// Not `Send` (an `Rc`): it must be dropped on the thread that entered.
#[must_use = "the thread leaves the namespace again when the guard is dropped"]
pub struct NetnsGuard {
    home: Home,
}

/// A thread's own network namespace, held open to come back to from [`Home::enter`]. Opening it
/// anew for every switch (a procfs path walk) costs about 20 µs on a cold cache, a tenth of a
/// pod's enrollment: a thread that switches for every pod keeps one.
#[derive(Clone)]
pub struct Home(Rc<OwnedFd>);

impl Home {
    /// The calling thread's current network namespace.
    pub fn current() -> io::Result<Self> {
        Ok(Self(Rc::new(File::open(THREAD_NETNS)?.into())))
    }

    /// Moves the calling thread, which must be in this namespace, into the network namespace
    /// `target` (an fd of `/proc/<pid>/ns/net` or a bind mount of one) until the returned guard
    /// is dropped. On error the thread has not moved.
    pub fn enter(&self, target: BorrowedFd<'_>) -> io::Result<NetnsGuard> {
        setns(target, CloneFlags::CLONE_NEWNET)?;
        Ok(NetnsGuard { home: self.clone() })
    }
}

/// [`Home::enter`] from the calling thread's current namespace.
pub fn enter(target: BorrowedFd<'_>) -> io::Result<NetnsGuard> {
    Home::current()?.enter(target)
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        if let Err(err) = setns(&*self.home.0, CloneFlags::CLONE_NEWNET) {
            tracing::error!(%err, "cannot switch this thread back to its network namespace; aborting");
            std::process::abort();
        }
    }
}

/// The interface of a pod's default network: runtimes name it so, kubelet reports its addresses
/// as the pod's IPs, and Multus names the default network so too.
pub const POD_INTERFACE: &str = "eth0";

/// The pod's IPs as its network namespace at `path` holds them: the addresses on
/// [`POD_INTERFACE`], loopback and link-local ones left out, for a CNI request that names none
/// (weir-cni as a network of its own has no `prevResult`). Read on a thread made for it, so no
/// pooled thread is ever left in a pod's namespace. No namespace at the path is an
/// [`Unenrollable`] error.
pub fn pod_ips(path: &Path) -> anyhow::Result<Vec<IpAddr>> {
    let netns = File::open(path).map_err(|error| Unenrollable::on_open(path, error))?;
    let path = path.to_owned();
    std::thread::Builder::new()
        .name("weir-pod-ips".into())
        .spawn(move || {
            let _inside =
                enter(netns.as_fd()).map_err(|error| Unenrollable::on_enter(&path, error))?;
            Rtnl::new()
                .and_then(|mut rtnl| rtnl.routable_addresses_of(POD_INTERFACE))
                .with_context(|| format!("listing the addresses on the pod's {POD_INTERFACE}"))
        })
        .context("starting a thread to read the pod's addresses")?
        .join()
        .map_err(|_| anyhow::anyhow!("the thread reading the pod's addresses panicked"))?
}

/// Where weir's connect hook answers the netns cookie question: the datapath's `NETNS_COOKIES`.
pub type CookieAnswers = SkStorage<MapData, u64>;

/// The cookie of the calling thread's network namespace: what `bpf_get_netns_cookie` returns for
/// sockets in it. `SO_NETNS_COOKIE` tells it from 5.14; before, weir's own connect hook does,
/// into `answers`, once the datapath is attached.
pub fn current_cookie(answers: Option<&CookieAnswers>) -> io::Result<u64> {
    cookie_of(udp_socket()?.as_fd(), answers)
}

/// [`current_cookie`], asked on `socket`, one the caller already made in the calling thread's
/// network namespace (enrollment's rtnetlink socket): no socket of its own where the kernel has
/// `SO_NETNS_COOKIE`.
pub fn cookie_of(socket: BorrowedFd<'_>, answers: Option<&CookieAnswers>) -> io::Result<u64> {
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for writes and `len` is `cookie`'s size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        return Ok(cookie);
    }
    let error = io::Error::last_os_error();
    if error.raw_os_error() != Some(libc::ENOPROTOOPT) {
        return Err(error);
    }
    cookie_from_connect_hook(answers)
}

fn udp_socket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Linux before 5.14: a connect to the question's address, which the hook refuses after storing
/// the cookie on the socket.
fn cookie_from_connect_hook(answers: Option<&CookieAnswers>) -> io::Result<u64> {
    let answers = answers.ok_or_else(|| {
        io::Error::other(
            "this kernel has no SO_NETNS_COOKIE (Linux 5.14), and weir's datapath is not \
             attached to tell it",
        )
    })?;
    let socket = udp_socket()?;
    let question = SocketAddrV4::new(PROBE_SOURCE_V4.into(), NETNS_COOKIE_PORT);
    let _refused = rustix::net::connect(&socket, &question);
    answers.get(&socket, 0).map_err(|error| {
        io::Error::other(format!(
            "weir's connect hook did not tell the netns cookie: {error}"
        ))
    })
}

/// The sysctls that carry marks across the pod's reply path, each set to 1, as paths under
/// `/proc/sys`:
/// - `tcp_fwmark_accept` (it covers IPv6 too): accepted sockets inherit the mark of the SYN, so
///   the app's replies to ztunnel's source-preserving dials carry the return mark;
/// - `fwmark_reflect`, v4 and v6: the kernel's own replies (the RST of a closed port, ICMP errors)
///   carry the mark of the packet they answer, so a refusal of ztunnel's dial returns to ztunnel
///   at once instead of leaving by eth0 toward the client's address (istio's connmark restore
///   does the same; without it ztunnel waits out its connect deadline).
pub const REPLY_MARK_SYSCTLS: [&str; 3] = [
    "net/ipv4/tcp_fwmark_accept",
    "net/ipv4/fwmark_reflect",
    "net/ipv6/fwmark_reflect",
];

/// Pods whose sysctls are written (set or reset) through one procfs mount before a fresh one
/// replaces it.
const PODS_PER_PROCFS: usize = 128;

/// Writes [`REPLY_MARK_SYSCTLS`] in the calling thread's network namespace (`/proc/sys/net`
/// resolves against the namespace of the task that opens it, so on the datapath thread inside a
/// pod these are the pod's).
///
/// Through a procfs mount of weir's own, detached (made with `fsopen`/`fsmount` and attached
/// nowhere, so nobody else sees it), replaced every [`PODS_PER_PROCFS`] pods. Why: every network
/// namespace that opened `/proc/sys/net/...` leaves its own dentries for those names in one
/// dcache hash chain of the procfs, and each later lookup walks the chain comparing every
/// namespace's entry (`proc_sys_compare`). Through the node's `/proc` a pod's sysctls cost a walk
/// over every living pod: at 5,000 pods, most of an enrollment's CPU. A fresh mount starts with
/// an empty chain, and dropping one drops its dentries.
pub struct ReplyMarkSysctls {
    /// The root of the current mount; `None` where the mount API is refused (an older kernel, a
    /// seccomp profile): then `/proc/sys`, slower on a node with many pods.
    procfs: Option<OwnedFd>,
    /// Namespaces written through any mount, by `set` and `reset` alike: a reset's walk leaves
    /// the same dentries as a set's.
    namespaces_written: usize,
    pods_per_procfs: usize,
}

impl ReplyMarkSysctls {
    pub fn new() -> Self {
        Self::replacing_every(PODS_PER_PROCFS)
    }

    fn replacing_every(pods_per_procfs: usize) -> Self {
        Self {
            procfs: None,
            namespaces_written: 0,
            pods_per_procfs,
        }
    }

    /// Sets them in the calling thread's network namespace, a family's `fwmark_reflect` only
    /// where the pod has addresses of that family (ztunnel dials a pod at its IPs).
    pub fn set(&mut self, ipv4: bool, ipv6: bool) -> io::Result<()> {
        let [accept, reflect_v4, reflect_v6] = REPLY_MARK_SYSCTLS;
        let wanted = [(accept, true), (reflect_v4, ipv4), (reflect_v6, ipv6)];
        self.write(
            wanted
                .into_iter()
                .filter_map(|(sysctl, wanted)| wanted.then_some(sysctl)),
            b"1",
        )
    }

    /// Puts them back to the kernel's defaults (off) in the calling thread's network namespace,
    /// when a pod is unenrolled.
    pub fn reset(&mut self) -> io::Result<()> {
        self.write(REPLY_MARK_SYSCTLS.into_iter(), b"0")
    }

    fn write<'a>(
        &mut self,
        sysctls: impl Iterator<Item = &'a str>,
        value: &[u8],
    ) -> io::Result<()> {
        if self.namespaces_written.is_multiple_of(self.pods_per_procfs) {
            self.procfs = match private_procfs() {
                Ok(root) => Some(root),
                Err(error) => {
                    if self.namespaces_written == 0 {
                        tracing::warn!(%error, "no procfs mount of weir's own: sysctls through /proc/sys");
                    }
                    None
                }
            };
        }
        self.namespaces_written += 1;
        for sysctl in sysctls {
            match self.write_one(sysctl, value) {
                // A kernel without IPv6 has no IPv6 replies to mark.
                Err(error)
                    if error.kind() == io::ErrorKind::NotFound && sysctl.contains("/ipv6/") => {}
                Err(error) => {
                    return Err(io::Error::new(error.kind(), format!("{sysctl}: {error}")))
                }
                Ok(()) => {}
            }
        }
        Ok(())
    }

    fn write_one(&self, sysctl: &str, value: &[u8]) -> io::Result<()> {
        let flags = rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC;
        let file = match &self.procfs {
            Some(root) => rustix::fs::openat(
                root,
                format!("sys/{sysctl}"),
                flags,
                rustix::fs::Mode::empty(),
            )?,
            None => rustix::fs::open(
                format!("/proc/sys/{sysctl}"),
                flags,
                rustix::fs::Mode::empty(),
            )?,
        };
        File::from(file).write_all(value)
    }
}

impl Default for ReplyMarkSysctls {
    fn default() -> Self {
        Self::new()
    }
}

/// The root of a new procfs instance, mounted nowhere.
fn private_procfs() -> io::Result<OwnedFd> {
    use rustix::mount::{
        fsconfig_create, fsmount, fsopen, FsMountFlags, FsOpenFlags, MountAttrFlags,
    };
    let context = fsopen("proc", FsOpenFlags::FSOPEN_CLOEXEC)?;
    fsconfig_create(&context)?;
    let attributes = MountAttrFlags::MOUNT_ATTR_NOSUID
        | MountAttrFlags::MOUNT_ATTR_NODEV
        | MountAttrFlags::MOUNT_ATTR_NOEXEC;
    Ok(fsmount(
        &context,
        FsMountFlags::FSMOUNT_CLOEXEC,
        attributes,
    )?)
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

    use super::testing::{self, privileged, scratch_netns};
    use super::*;

    fn reply_mark_sysctls() -> Vec<String> {
        REPLY_MARK_SYSCTLS
            .iter()
            .map(|path| {
                std::fs::read_to_string(format!("/proc/sys/{path}"))
                    .unwrap()
                    .trim()
                    .to_owned()
            })
            .collect()
    }

    #[test]
    fn enter_switches_and_restores() {
        let Some((a, b)) = privileged(|| (scratch_netns(), scratch_netns())) else {
            return;
        };
        let home = current_cookie(None).unwrap();
        let cookie_a = {
            let _guard = enter(a.as_fd()).unwrap();
            let here = std::fs::metadata(THREAD_NETNS).unwrap().ino();
            assert_eq!(
                here,
                File::from(a.try_clone().unwrap()).metadata().unwrap().ino()
            );
            let cookie = current_cookie(None).unwrap();
            assert_eq!(
                cookie,
                current_cookie(None).unwrap(),
                "stable within a namespace"
            );
            assert_ne!(cookie, home);
            cookie
        };
        assert_eq!(current_cookie(None).unwrap(), home, "back home after drop");
        let cookie_b = {
            let _guard = enter(b.as_fd()).unwrap();
            current_cookie(None).unwrap()
        };
        assert_ne!(cookie_a, cookie_b);
        assert_eq!(current_cookie(None).unwrap(), home);

        // Not a namespace: refused, and the thread stays where it was.
        let not_netns = File::open("/").unwrap();
        assert!(enter(not_netns.as_fd()).is_err());
        assert_eq!(current_cookie(None).unwrap(), home);
    }

    #[test]
    fn pod_ips_are_the_routable_addresses_on_the_pods_eth0() {
        let Some(pod) = privileged(scratch_netns) else {
            return;
        };
        {
            let _inside = enter(pod.as_fd()).unwrap();
            testing::ip(&[
                "link", "add", "eth0", "type", "veth", "peer", "name", "weir-t1",
            ]);
            testing::ip(&["addr", "add", "10.1.0.5/24", "dev", "eth0"]);
            testing::ip(&["addr", "add", "169.254.1.5/16", "dev", "eth0"]);
        }
        let home = current_cookie(None).unwrap();
        let path = format!("/proc/self/fd/{}", pod.as_raw_fd());
        let ips = pod_ips(Path::new(&path)).unwrap();
        assert_eq!(ips, [IpAddr::from([10, 1, 0, 5])]);
        assert_eq!(current_cookie(None).unwrap(), home);

        let unenrollable = |path: &str| {
            let error = pod_ips(Path::new(path)).unwrap_err();
            error.downcast::<Unenrollable>().unwrap()
        };
        assert!(matches!(
            unenrollable("/var/run/netns/weir-no-such-netns"),
            Unenrollable::NetnsMissing(_)
        ));
        assert!(matches!(unenrollable("/"), Unenrollable::NotANetns(_)));
    }

    #[test]
    fn reply_mark_sysctls_per_namespace_through_unseen_procfs_mounts_renewed_as_pods_go() {
        let Some(namespaces) = privileged(|| [(); 5].map(|_| scratch_netns())) else {
            return;
        };
        let mounts = || std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let (home, mounts_before) = (reply_mark_sysctls(), mounts());
        let mount_id = |sysctls: &ReplyMarkSysctls| {
            let root = sysctls
                .procfs
                .as_ref()
                .expect("written through weir's own mount");
            let flags = rustix::fs::AtFlags::EMPTY_PATH;
            rustix::fs::statx(root, "", flags, rustix::fs::StatxFlags::MNT_ID)
                .unwrap()
                .stx_mnt_id
        };
        // A fresh mount every other pod: both the first mount and its replacements write.
        let mut sysctls = ReplyMarkSysctls::replacing_every(2);
        let (enrolled, untouched) = namespaces.split_at(4);
        let mut set_through = Vec::new();
        for (n, netns) in enrolled.iter().enumerate() {
            let _guard = enter(netns.as_fd()).unwrap();
            let ipv6 = n % 2 == 0;
            sysctls.set(true, ipv6).unwrap();
            let ipv6 = if ipv6 { "1" } else { "0" };
            assert_eq!(reply_mark_sysctls(), ["1", "1", ipv6], "pod {n}");
            set_through.push(mount_id(&sysctls));
            assert_eq!(mounts(), mounts_before, "a mount attached nowhere");
        }
        assert_eq!(set_through[0], set_through[1]);
        assert_ne!(
            set_through[1], set_through[2],
            "a fresh mount after two pods"
        );
        // Unenrollment walks the same names: its pods count toward a mount's replacement, or
        // one mount would collect every unenrolled pod's dentries.
        let mut reset_through = Vec::new();
        for (n, netns) in enrolled.iter().enumerate() {
            let _guard = enter(netns.as_fd()).unwrap();
            sysctls.reset().unwrap();
            assert_eq!(reply_mark_sysctls(), ["0", "0", "0"], "pod {n}");
            reset_through.push(mount_id(&sysctls));
        }
        // Mount IDs are reused once free; a mount still lives while its replacement is made.
        assert_ne!(
            set_through[3], reset_through[0],
            "a fresh mount after two pods"
        );
        assert_eq!(reset_through[0], reset_through[1]);
        assert_ne!(
            reset_through[1], reset_through[2],
            "a fresh mount after two pods"
        );
        assert_eq!(
            reply_mark_sysctls(),
            home,
            "the test's own namespace is untouched"
        );
        let _guard = enter(untouched[0].as_fd()).unwrap();
        assert_eq!(
            reply_mark_sysctls(),
            ["0", "0", "0"],
            "another namespace is untouched"
        );
    }
}
