//! Named network namespaces, and running code inside one.
//!
//! `setns` changes the namespace of the calling thread only, so code "inside" a namespace runs on
//! a fresh OS thread that enters it first; the test's own thread never moves. Sockets belong to
//! the namespace of the thread that created them and keep it wherever they are used afterwards,
//! and threads spawned from an entered thread start in its namespace.

use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::thread::{self, JoinHandle};

use anyhow::{bail, Context, Result};
use aya::maps::{Map, MapData, SkStorage};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::CloneFlags;
use weir_common::{maps, ABI_VERSION};

use crate::{ids, try_wait_until};

/// Where `ip netns` keeps its bind mounts.
pub const NETNS_DIR: &str = "/var/run/netns";

/// `SO_NETNS_COOKIE` (Linux 5.14): the 64-bit cookie of the socket's network namespace, the key
/// weir's eBPF programs find a pod by (`bpf_get_netns_cookie`).
const SO_NETNS_COOKIE: libc::c_int = 71;

/// A named network namespace (`/var/run/netns/<name>`), deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    path: PathBuf,
    file: File,
}

impl NetNs {
    /// Creates `weir-t-<unique id>-<role>` as `ip netns add` does, in this process (its exec
    /// costs a tenth of a second in the emulated guests, several times per test). Only `lo`
    /// exists in it, down.
    pub fn create(role: &str) -> Result<Self> {
        let name = ids::unique_name(role);
        let path = Path::new(NETNS_DIR).join(&name);
        share_netns_dir()?;
        File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        // A thread of its own unshares: only the calling thread moves to the new netns.
        let mounted = thread::scope(|scope| {
            scope
                .spawn(|| {
                    nix::sched::unshare(CloneFlags::CLONE_NEWNET)?;
                    mount(
                        Some("/proc/thread-self/ns/net"),
                        &path,
                        None::<&str>,
                        MsFlags::MS_BIND,
                        None::<&str>,
                    )
                })
                .join()
                .expect("the unsharing thread does not panic")
        });
        if let Err(error) = mounted {
            let _ = fs::remove_file(&path);
            return Err(error).with_context(|| format!("cannot make the netns {name}"));
        }
        Self::open_named(name)
    }

    /// The namespace mounted at `name`, deleted if it cannot be opened.
    fn open_named(name: String) -> Result<Self> {
        let path = Path::new(NETNS_DIR).join(&name);
        match File::open(&path) {
            Ok(file) => Ok(Self { name, path, file }),
            Err(err) => {
                let _ = delete(&path);
                Err(err).with_context(|| format!("cannot open {}", path.display()))
            }
        }
    }

    /// Like [`NetNs::create`], but owned by a user namespace of its own that maps ids 0 to 65535
    /// to the node's from `first_id`, as a runtime makes the netns of a pod with
    /// `hostUsers: false`. No process is left in that user namespace.
    pub fn create_in_user_namespace(role: &str, first_id: u32) -> Result<Self> {
        let name = ids::unique_name(role);
        let mut holder = Command::new("unshare")
            .args(["--user", "--net", "sleep", "60"])
            .spawn()
            .context("cannot run unshare (util-linux)")?;
        // In its namespaces once unshare has exec'd sleep; the maps are written from here, as
        // root of the node's user namespace may.
        let proc = PathBuf::from(format!("/proc/{}", holder.id()));
        let started = try_wait_until(std::time::Duration::from_secs(10), || {
            fs::read_to_string(proc.join("comm")).is_ok_and(|comm| comm.trim() == "sleep")
        });
        let map = format!("0 {first_id} 65536\n");
        let attached = match started {
            Some(()) => fs::write(proc.join("uid_map"), &map)
                .and_then(|()| fs::write(proc.join("gid_map"), &map))
                .context("writing the id maps")
                .and_then(|()| ip(&["netns", "attach", &name, &holder.id().to_string()])),
            None => Err(anyhow::anyhow!("unshare did not start")),
        };
        let _ = holder.kill();
        let _ = holder.wait();
        attached?;
        Self::open_named(name)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/var/run/netns/<name>`: what a runtime passes plugins as `CNI_NETNS`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new handle on the namespace, e.g. to hand it to a ztunnel (stand-in) as ZDS does.
    pub fn open(&self) -> io::Result<File> {
        self.file.try_clone()
    }

    /// Runs `f` inside the namespace, on a fresh thread, and returns its result; a panic in `f`
    /// propagates to the caller.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        run_in(self.as_fd(), f)
    }

    /// Starts `f` inside the namespace on a named thread that outlives this call (servers).
    pub fn spawn<T: Send + 'static>(
        &self,
        thread_name: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<JoinHandle<T>> {
        spawn_in(self.as_fd().try_clone_to_owned()?, thread_name, f)
    }

    /// The namespace's cookie, read with `getsockopt(SO_NETNS_COOKIE)` on a socket made inside;
    /// before Linux 5.14, which has no such option, asked as weir asks it.
    pub fn cookie(&self) -> io::Result<u64> {
        self.run(|| {
            let probe = std::net::UdpSocket::bind("127.0.0.1:0")?;
            match netns_cookie(&probe) {
                Err(error) if error.raw_os_error() == Some(libc::ENOPROTOOPT) => {
                    cookie_from_a_weir_datapath()
                }
                other => other,
            }
        })
    }

    /// Writes a sysctl of this namespace (`net.ipv6.conf.all.accept_dad` style key): `/proc/sys/net`
    /// shows the namespace of the thread that opens it, so the write happens from inside.
    pub fn sysctl(&self, key: &str, value: &str) -> io::Result<()> {
        let path = Path::new("/proc/sys").join(key.replace('.', "/"));
        self.run(|| fs::write(&path, value))
            .map_err(|err| io::Error::new(err.kind(), format!("{}: {err}", path.display())))
    }
}

impl AsFd for NetNs {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(err) = delete(&self.path) {
            eprintln!("warning: deleting {}: {err}", self.path.display());
        }
    }
}

/// Makes [`NETNS_DIR`] a shared mount point, as `ip netns` does, so that the namespaces mounted
/// there are seen from mount namespaces made later (`ip netns exec`'s). Once per process: the
/// tests' threads would otherwise stack their bind mounts.
fn share_netns_dir() -> Result<()> {
    static SHARED: Mutex<bool> = Mutex::new(false);
    let mut shared_once = SHARED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if *shared_once {
        return Ok(());
    }
    fs::create_dir_all(NETNS_DIR).with_context(|| format!("cannot create {NETNS_DIR}"))?;
    let shared = || {
        mount(
            None::<&str>,
            NETNS_DIR,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    if shared() == Err(nix::errno::Errno::EINVAL) {
        // Not a mount point yet.
        mount(
            Some(NETNS_DIR),
            NETNS_DIR,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )?;
        shared()?;
    }
    *shared_once = true;
    Ok(())
}

/// Deletes a netns mounted at `path`, as `ip netns del` does: the namespace goes once nothing
/// else holds it.
fn delete(path: &Path) -> io::Result<()> {
    umount2(path, MntFlags::MNT_DETACH)?;
    fs::remove_file(path)
}

/// The user namespace that owns the network namespace `netns` (`NS_GET_USERNS`).
pub fn owning_user_namespace(netns: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    const NS_GET_USERNS: libc::c_ulong = 0xb701;
    // SAFETY: an ioctl on a valid fd; the kernel returns a new fd or -1.
    let fd = unsafe { libc::ioctl(netns.as_raw_fd(), NS_GET_USERNS) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd, owned from here on.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Moves the calling thread into the network namespace `netns`.
pub fn enter(netns: BorrowedFd<'_>) -> io::Result<()> {
    nix::sched::setns(netns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)
}

/// Runs `f` on a fresh thread inside `netns` and returns its result; panics propagate.
pub fn run_in<T: Send>(netns: BorrowedFd<'_>, f: impl FnOnce() -> T + Send) -> T {
    thread::scope(|scope| {
        let inside = scope.spawn(move || {
            enter(netns).unwrap_or_else(|err| panic!("cannot enter network namespace: {err}"));
            f()
        });
        inside
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Starts `f` on a named thread inside `netns`; the thread keeps the namespace alive while it runs.
pub fn spawn_in<T: Send + 'static>(
    netns: OwnedFd,
    thread_name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<JoinHandle<T>> {
    thread::Builder::new()
        .name(thread_name.to_owned())
        .spawn(move || {
            enter(netns.as_fd())
                .unwrap_or_else(|err| panic!("cannot enter network namespace: {err}"));
            drop(netns);
            f()
        })
}

/// The cookie of the network namespace `socket` belongs to.
pub fn netns_cookie(socket: &impl AsFd) -> io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the buffer is a valid u64 and `len` holds its size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// The calling thread's netns cookie from the connect hook of a weir datapath pinned under
/// `/sys/fs/bpf` (weir's own way before Linux 5.14): only the maps of an attached one answer.
fn cookie_from_a_weir_datapath() -> io::Result<u64> {
    let answers = Path::new(&format!("abi-{ABI_VERSION}")).join(maps::NETNS_COOKIES);
    for pin_root in fs::read_dir("/sys/fs/bpf")? {
        let Ok(map) = MapData::from_pin(pin_root?.path().join(&answers)) else {
            continue;
        };
        let Ok(answers) = SkStorage::try_from(Map::SkStorage(map)) else {
            continue;
        };
        if let Ok(cookie) = weir_agent::datapath::netns::current_cookie(Some(&answers)) {
            return Ok(cookie);
        }
    }
    Err(io::Error::other(
        "no SO_NETNS_COOKIE on this kernel (Linux 5.14), and no weir datapath attached to tell it",
    ))
}

/// Runs `ip <args>`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    ip_output(args).map(drop)
}

/// Runs `ip <args>` and returns what it printed, failing with its stderr.
pub fn ip_output(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run `ip` (iproute2)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
