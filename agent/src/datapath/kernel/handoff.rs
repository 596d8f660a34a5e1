//! The socket lookup hand-off, for kernels before 6.5: there tc cannot `bpf_sk_assign` a packet
//! to ztunnel's listeners (a reuseport group), so the kernel side's tc program stores the listener
//! for each new inbound connection and an sk_lookup program in the pod's netns hands it over
//! (see the kernel side's `handoff` module). This attaches that program to each pod's netns,
//! through a link pinned by the netns cookie so it outlives an agent restart, and removes it when
//! the pod goes. Pods carry `POD_SOCKET_LOOKUP_HANDOFF` so the tc program knows the link is there;
//! without it a new connection is dropped, never delivered around ztunnel.
use std::{
    fs::{self, File},
    io,
    os::fd::AsFd,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, Context, Result};
use aya::{programs::SkLookup, Ebpf};
use aya_obj::generated::bpf_attach_type::BPF_SK_LOOKUP;
use tracing::{debug, info};
use weir_common::programs::HANDOFF;

use super::{programs, support::Kernel};

/// The first kernel whose tc `bpf_sk_assign` takes a listener in a reuseport group.
const TC_ASSIGNS_REUSEPORT: (u32, u32) = (6, 5);

pub(in crate::datapath) struct Handoff {
    pins: PathBuf,
}

/// Whether tc assigns new inbound connections to ztunnel's listeners on `kernel` itself.
fn tc_assigns(kernel: &Kernel) -> bool {
    let (major, minor) = TC_ASSIGNS_REUSEPORT;
    kernel.is_at_least(major, minor)
}

/// How new inbound connections reach ztunnel's listeners on the running kernel: `tc` (assigned
/// from tc) or `sk_lookup` (handed over through the socket lookup); `unknown` when its release
/// cannot be read.
pub(crate) fn running_inbound_path() -> &'static str {
    match Kernel::read() {
        Ok(kernel) if tc_assigns(&kernel) => "tc",
        Ok(_) => "sk_lookup",
        Err(_) => "unknown",
    }
}

impl Handoff {
    /// The hand-off, on a kernel that needs it; its links pinned under `links_dir`.
    pub(in crate::datapath) fn for_kernel(
        kernel: &Kernel,
        links_dir: &Path,
    ) -> Result<Option<Self>> {
        if tc_assigns(kernel) {
            return Ok(None);
        }
        let (major, minor) = TC_ASSIGNS_REUSEPORT;
        let pins = links_dir.join("handoff");
        fs::create_dir_all(&pins).with_context(|| format!("creating {}", pins.display()))?;
        info!(
            kernel = kernel.release,
            "Linux {major}.{minor} and later assign new inbound connections to ztunnel from tc; \
             on this kernel they are handed over through the socket lookup (sk_lookup, one link \
             per pod)"
        );
        Ok(Some(Self { pins }))
    }

    /// Attaches the hand-off program to the calling thread's netns (a pod's), or moves the pod's
    /// pinned link to this agent's program.
    pub(in crate::datapath) fn attach(&self, ebpf: &Ebpf, netns_cookie: u64) -> Result<()> {
        let netns = File::open("/proc/thread-self/ns/net").context("opening the pod's netns")?;
        let program: &SkLookup = ebpf
            .program(HANDOFF)
            .ok_or_else(|| anyhow!("program {HANDOFF} missing"))?
            .try_into()?;
        programs::attach_pinned(
            program.fd()?.as_fd(),
            netns.as_fd(),
            BPF_SK_LOOKUP as u32,
            &self.pin(netns_cookie),
        )
        .context("attaching the socket lookup hand-off")
    }

    /// Removes the pod's link, if it has one; its netns may be gone already.
    pub(in crate::datapath) fn detach(&self, netns_cookie: u64) {
        match fs::remove_file(self.pin(netns_cookie)) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => debug!(netns_cookie, %error, "removing the hand-off link"),
        }
    }

    fn pin(&self, netns_cookie: u64) -> PathBuf {
        self.pins.join(netns_cookie.to_string())
    }
}
