//! What the in-pod decisions of both kinds of pod share: ambient pods' ([`crate::outbound`]) and
//! sidecar pods' ([`crate::sidecar`]). The hook that asks, the decision's shape, and what either
//! does to the socket or asks of the pod's addresses.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::sockaddr,
    helpers::generated::{bpf_bind, bpf_setsockopt},
};
use weir_common::{
    Endpoint, IpKey, PodConfig, TraceHook, TraceVerdict, POD_HAS_IPV4, POD_HAS_IPV6, RETURN_MARK,
};

use crate::{
    maps::pod_with_ip,
    net::{is_v4_mapped, SockAddr},
};

const SOL_SOCKET: i32 = 1;
const SO_MARK: i32 = 36;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hook {
    /// connect(): TCP and connected UDP.
    Connect,
    /// sendmsg() with an address: unconnected UDP.
    Send,
}

impl Hook {
    #[inline(always)]
    pub(crate) fn traced(self) -> TraceHook {
        match self {
            Hook::Connect => TraceHook::Connect,
            Hook::Send => TraceHook::Sendmsg,
        }
    }
}

/// What an in-pod decision does with a call. A struct whose every field is always set, not an
/// enum with payloads: where paths of different variants meet, LLVM may copy a payload that
/// path never set from whatever register holds it, and the verifier refuses the read.
pub(crate) struct Decided {
    pub(crate) action: Action,
    /// The listener, for [`Action::SendTo`].
    pub(crate) target: Endpoint,
    pub(crate) verdict: TraceVerdict,
}

#[derive(Clone, Copy)]
pub(crate) enum Action {
    /// Sent to a proxy's listener.
    SendTo,
    /// Let through untouched, for the reason traced.
    Pass,
    /// Refused; traced where it was decided.
    Refuse,
}

impl Decided {
    #[inline(always)]
    pub(crate) fn send_to(target: Endpoint, verdict: TraceVerdict) -> Self {
        Self {
            action: Action::SendTo,
            target,
            verdict,
        }
    }

    #[inline(always)]
    pub(crate) fn pass(verdict: TraceVerdict) -> Self {
        Self {
            action: Action::Pass,
            target: Endpoint::default(),
            verdict,
        }
    }

    /// Refused for `verdict`, which the decision traced with its own log line.
    #[inline(always)]
    pub(crate) fn refused(verdict: TraceVerdict) -> Self {
        Self {
            action: Action::Refuse,
            target: Endpoint::default(),
            verdict,
        }
    }
}

/// A proxy's source-preserving dial (marked 0x539) to the app in its own pod gets the return
/// mark, so the app's replies, addressed to the spoofed client, route back to the proxy. A
/// function of its own: inlined at the ambient and the sidecar call sites, LLVM read an argument
/// register after the helper call clobbered it, which the verifier refuses.
#[inline(never)]
pub(crate) fn route_replies_back(sa: &SockAddr, netns: u64, dst: &Endpoint, hook: Hook) {
    if hook != Hook::Connect || !pod_owns(netns, &dst.ip) {
        return;
    }
    let mut mark = sa.mark() | RETURN_MARK;
    // SAFETY: bpf_setsockopt is allowed in connect hooks; the value lives on the stack.
    unsafe {
        bpf_setsockopt(
            sa.ctx as *mut c_void,
            SOL_SOCKET,
            SO_MARK,
            &mut mark as *mut u32 as *mut c_void,
            4,
        );
    }
}

/// A socket that is already bound gets EINVAL here and keeps its source: it is then captured
/// like any other traffic, which fails toward the mesh, not toward a bypass.
/// Returns the helper's result: 0, or a negative errno.
#[inline(always)]
pub(crate) fn bind<T>(sa: &SockAddr, addr: &mut T) -> i64 {
    // SAFETY: bpf_bind is allowed in connect hooks; `addr` is a sockaddr on the stack.
    unsafe {
        bpf_bind(
            sa.ctx,
            addr as *mut T as *mut sockaddr,
            size_of::<T>() as i32,
        )
    }
}

/// Whether `ip` is one of the addresses indexed for the pod: its IPs, and addresses its
/// interfaces have or were given after enrollment.
#[inline(always)]
pub(crate) fn pod_owns(netns: u64, ip: &IpKey) -> bool {
    pod_with_ip(ip) == Some(netns)
}

/// The pod's address of the same family as `like`.
#[inline(always)]
pub(crate) fn pod_address_like(pod: &PodConfig, like: &IpKey) -> Option<IpKey> {
    if is_v4_mapped(like) {
        pod.has(POD_HAS_IPV4).then(|| IpKey::from_v4(pod.ipv4))
    } else {
        pod.has(POD_HAS_IPV6).then(|| IpKey::from_v6(pod.ipv6))
    }
}
