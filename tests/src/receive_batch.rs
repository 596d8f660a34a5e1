//! Receive batches, as macvlan, ipvlan, SR-IOV interfaces or a veth with XDP make them: the
//! kernel runs tc for every packet of a GRO or NAPI list before the socket lookup of any.
//!
//! A veth delivers packet by packet, unless an XDP program is attached to it: then it receives
//! through NAPI and GRO, in lists. [`XdpPass`] attaches one that passes every packet, loaded
//! straight through the `bpf` syscall (two instructions: no object file, no loader), and
//! [`delay_egress`] holds a pod's outgoing packets for a while with netem, so that SYNs sent
//! together leave, and arrive, together.
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;

use anyhow::bail;

use crate::Pod;

/// Whether this kernel is older than 6.5, where tc cannot assign reuseport listeners and hands
/// new connections to ztunnel through the socket lookup instead.
pub fn kernel_needs_the_handoff() -> bool {
    let release = nix::sys::utsname::uname().expect("uname");
    let release = release.release().to_string_lossy();
    let mut numbers = release
        .split(['.', '-'])
        .map(|n| n.parse::<u32>().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) < (6, 5)
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
const XDP_PASS: i32 = 2;

/// An XDP program that passes every packet, attached to a pod's interface while this lives.
pub struct XdpPass {
    _link: OwnedFd,
}

impl XdpPass {
    /// Attaches it (native mode, through a BPF link) to `interface` in `pod`.
    pub fn attach(pod: &Pod, interface: &str) -> io::Result<Self> {
        let program = load_xdp_pass()?;
        // The kernel finds the interface by its index in the caller's netns.
        let link = pod.run(|| {
            let ifindex = nix::net::if_::if_nametoindex(interface)?;
            let mut attr = [0u8; 128];
            attr[0..4].copy_from_slice(&(program.as_raw_fd() as u32).to_ne_bytes());
            attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
            attr[8..12].copy_from_slice(&BPF_XDP.to_ne_bytes());
            bpf(BPF_LINK_CREATE, &mut attr)
        })?;
        Ok(Self { _link: link })
    }
}

/// `r0 = XDP_PASS; exit`.
fn load_xdp_pass() -> io::Result<OwnedFd> {
    let mut instructions = [0u8; 16];
    // BPF_ALU64 | BPF_MOV | BPF_K, dst r0, imm XDP_PASS.
    instructions[0] = 0xb7;
    instructions[4..8].copy_from_slice(&XDP_PASS.to_ne_bytes());
    // BPF_JMP | BPF_EXIT.
    instructions[8] = 0x95;
    let license = c"GPL";
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(instructions.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // expected_attach_type, as link creation checks it.
    attr[68..72].copy_from_slice(&BPF_XDP.to_ne_bytes());
    bpf(BPF_PROG_LOAD, &mut attr)
}

fn bpf(command: libc::c_long, attr: &mut [u8; 128]) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a zero-padded `union bpf_attr` of the size passed; the pointers in it
    // point to buffers that outlive the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, command, attr.as_mut_ptr(), attr.len()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just returned, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Holds every packet `pod` sends on `eth0` for `millis` milliseconds (netem), so that packets
/// sent together arrive at the other end in one burst. `false` where the kernel has no netem.
pub fn delay_egress(pod: &Pod, millis: u32) -> anyhow::Result<bool> {
    let delay = format!("{millis}ms");
    let args = [
        "qdisc", "add", "dev", "eth0", "root", "netem", "delay", &delay,
    ];
    // The child is forked from the thread in the pod's netns, and runs there.
    let output = pod.run(|| Command::new("tc").args(args).output())?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        if stderr.contains("qdisc kind is unknown") {
            return Ok(false);
        }
        bail!("`tc {}` failed: {}", args.join(" "), stderr.trim());
    }
    Ok(true)
}
