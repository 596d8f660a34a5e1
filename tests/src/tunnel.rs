//! A point-to-point link without an Ethernet header between two network namespaces, as a
//! tunnel of the pod's own (wireguard, ipip, a VPN client's tun) gives it one: a tun device in
//! each, and a relay that moves each IP packet one writes out into the other.

use std::{
    fs::{File, OpenOptions},
    io::{self, Read, Write},
    net::Ipv4Addr,
    os::fd::{AsFd, AsRawFd},
    process::Command,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::{self, JoinHandle},
    time::Duration,
};

use anyhow::{Context, Result};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::netns::{ip, NetNs};

const TUN_DEVICE: &str = "/dev/net/tun";
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;
/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// Both ends of the link; the relay stops when it is dropped.
pub struct Tunnel {
    stop: Arc<AtomicBool>,
    relays: Vec<JoinHandle<()>>,
}

impl Tunnel {
    /// A tun device named `name` in `a` with address `a_ip`, one in `b` with `b_ip`, each the
    /// other's peer, up, and the relay between them running.
    pub fn between(
        name: &str,
        (a, a_ip): (&NetNs, Ipv4Addr),
        (b, b_ip): (&NetNs, Ipv4Addr),
    ) -> Result<Self> {
        let a_end = a.run(|| open_tun(name)).context("tun device in a")?;
        let b_end = b.run(|| open_tun(name)).context("tun device in b")?;
        for (netns, local, peer) in [(a, a_ip, b_ip), (b, b_ip, a_ip)] {
            let (local, peer) = (local.to_string(), peer.to_string());
            ip(&[
                "-n",
                netns.name(),
                "addr",
                "add",
                &local,
                "peer",
                &peer,
                "dev",
                name,
            ])?;
            ip(&["-n", netns.name(), "link", "set", name, "up"])?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let relays = vec![
            relay(a_end.try_clone()?, b_end.try_clone()?, stop.clone()),
            relay(b_end, a_end, stop.clone()),
        ];
        Ok(Self { stop, relays })
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for relay in self.relays.drain(..) {
            let _ = relay.join();
        }
    }
}

/// A tun device (no packet information header: reads and writes are bare IP packets) in the
/// calling thread's netns.
fn open_tun(name: &str) -> io::Result<File> {
    let open = || OpenOptions::new().read(true).write(true).open(TUN_DEVICE);
    let file = match open() {
        // Where tun is a module not loaded yet (the kernel matrix's guests), its device node
        // appears with it.
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            Command::new("modprobe").arg("tun").status()?;
            open()?
        }
        opened => opened?,
    };
    // struct ifreq: the name, then the flags.
    let mut request = [0u8; 40];
    request[..name.len()].copy_from_slice(name.as_bytes());
    request[16..18].copy_from_slice(&(IFF_TUN | IFF_NO_PI).to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which `request` is as large as.
    if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF as _, request.as_mut_ptr()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Moves every packet read from `from` into `to` until `stop`.
fn relay(mut from: File, mut to: File, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut packet = vec![0u8; 65536];
        while !stop.load(Ordering::Relaxed) {
            let mut fds = [PollFd::new(from.as_fd(), PollFlags::POLLIN)];
            let timeout = PollTimeout::try_from(Duration::from_millis(50)).unwrap();
            if !matches!(poll(&mut fds, timeout), Ok(n) if n > 0) {
                continue;
            }
            match from.read(&mut packet) {
                Ok(len) => {
                    let _ = to.write(&packet[..len]);
                }
                Err(_) => return,
            }
        }
    })
}
