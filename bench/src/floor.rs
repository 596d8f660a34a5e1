//! The kernel floor of one pod's enrollment: the kernel work weir cannot do without, issued bare
//! from the bench's own thread through the agent's own building blocks. weir's enroll less this is
//! the agent's own overhead: the split a profile of enrollment needs.

use std::{
    fs::File,
    io,
    os::fd::{AsFd, FromRawFd, OwnedFd},
};

use anyhow::{Context, Result};
use weir_agent::datapath::{
    netlink::{Link, PodSetup, Reroute, Rtnl, TcProgram},
    netns::{Home, ReplyMarkSysctls},
};
use weir_tests::Pod;

pub struct KernelFloor {
    program: OwnedFd,
    sysctls: ReplyMarkSysctls,
    home: Home,
}

impl KernelFloor {
    pub fn new() -> Result<Self> {
        Ok(Self {
            program: pass_program().context("loading a pass-through tc program")?,
            sysctls: ReplyMarkSysctls::new(),
            home: Home::current()?,
        })
    }

    /// In `pod`'s netns: an rtnetlink socket and the netns cookie, the reply-mark sysctls, the
    /// return path, then the ingress qdisc and a cls_bpf filter on eth0, as weir makes them. Left
    /// out: the link and address dumps, the map entries, the interface subscription, weir's
    /// records and the hand-off to its thread.
    pub fn enroll(&mut self, pod: &Pod) -> Result<()> {
        let netns = File::open(pod.netns_path())?;
        let _inside = self.home.enter(netns.as_fd())?;
        let mut rtnl = Rtnl::new()?;
        weir_agent::datapath::netns::current_cookie(None)?;
        // The bench's pods have both families, as weir writes them for those pods.
        self.sysctls.set(true, true)?;
        rtnl.set_up_return_path(false)?;
        let eth0 = nix::net::if_::if_nametoindex("eth0")?;
        // In the inbound program's place, the one an Ethernet interface gets.
        let program = TcProgram {
            fd: self.program.as_fd(),
            name: weir_common::programs::INBOUND,
        };
        rtnl.attach_programs(&PodSetup {
            interfaces: &[Link {
                index: eth0,
                name: "eth0".to_owned(),
                ethernet: true,
            }],
            rerouted: Reroute::NONE,
            programs: &[program],
            slot: 1,
        })?;
        Ok(())
    }
}

/// `r0 = TC_ACT_OK; exit`: a filter's creation costs the same whatever its program does.
fn pass_program() -> io::Result<OwnedFd> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
    // `mov64 r0, 0` and `exit`, one 8-byte instruction each.
    let instructions: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    // The prefix of `union bpf_attr` that BPF_PROG_LOAD reads; the rest stays zero.
    #[repr(C)]
    #[derive(Default)]
    struct ProgLoadAttr {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
    }
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_SCHED_CLS,
        insn_cnt: instructions.len() as u32,
        insns: instructions.as_ptr() as u64,
        license: license.as_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: `attr` is laid out as the kernel's prefix for this command, and the pointers in it
    // outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            &raw mut attr,
            size_of::<ProgLoadAttr>() as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
