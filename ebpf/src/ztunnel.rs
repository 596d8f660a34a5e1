//! Telling ztunnel's sockets from a pod's. ztunnel marks every socket it opens in a pod
//! (`ZTUNNEL_MARK`), but since Linux 5.17 `SO_MARK` needs only `CAP_NET_RAW`, which pods have by
//! default: by the mark alone, a pod's socket could leave uncaptured, or listen where ztunnel
//! listens and take the connections meant for it. So a socket is ztunnel's only when it also
//! belongs to the cgroup of a ztunnel the agent saw connect (`ZTUNNEL_CGROUPS`), which no pod
//! can join: checked where a socket connects or sends, and where one binds ztunnel's listening
//! ports in an ambient pod ([`weir_bind4`], [`weir_bind6`]). tc cannot read a socket's cgroup,
//! so the bind hook marks the sockets ztunnel binds to those ports (`ZTUNNEL_LISTENS`), and tc
//! takes a listener for ztunnel's only when it carries that mark too ([`listens_for_ztunnel`]):
//! a socket that `listen()`s unbound gets its port from the kernel (autobind) without any bind
//! hook, and a pod can make that port 15006 with the namespaced `ip_local_port_range`. The agent
//! marks the listeners a ztunnel bound before the hook could (see its `ztunnels` module).
use core::ffi::c_void;

use aya_ebpf::{
    bindings::bpf_sock,
    helpers::generated::{bpf_get_current_cgroup_id, bpf_get_netns_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use weir_common::{
    HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT, POD_SIDECAR, ZTUNNEL_MARK, ZTUNNEL_MARK_MASK,
};

use crate::{
    diag::diag,
    maps::{is_ztunnels_cgroup, pod, ZTUNNEL_LISTENS},
    net::{ctx_read, SockAddr, ALLOW, DENY, SOCK_STREAM},
};

#[inline(always)]
fn has_ztunnels_mark(mark: u32) -> bool {
    mark & ZTUNNEL_MARK_MASK == ZTUNNEL_MARK
}

#[inline(always)]
fn caller_is_in_ztunnels_cgroup() -> bool {
    // SAFETY: a helper without arguments, allowed in the socket address hooks.
    is_ztunnels_cgroup(unsafe { bpf_get_current_cgroup_id() })
}

/// In a socket address hook (connect, sendmsg): whether the calling socket, with `mark`, is
/// ztunnel's. The task making the call is one of the process that opened the socket.
#[inline(always)]
pub fn calls_from_ztunnel(mark: u32) -> bool {
    has_ztunnels_mark(mark) && caller_is_in_ztunnels_cgroup()
}

/// In tc: whether a full socket listening on one of ztunnel's ports is ztunnel's: it has
/// ztunnel's mark, and ztunnel bound it (`ZTUNNEL_LISTENS`).
///
/// # Safety
///
/// `socket` is a non-null full socket (from `bpf_sk_fullsock`).
#[inline(always)]
pub unsafe fn listens_for_ztunnel(socket: *mut bpf_sock) -> bool {
    has_ztunnels_mark(ctx_read!(socket, mark)) && ZTUNNEL_LISTENS.of(socket).is_some()
}

#[cgroup_sock_addr(bind4)]
pub fn weir_bind4(ctx: SockAddrContext) -> i32 {
    keep_ztunnels_ports(&SockAddr::v4(&ctx))
}

#[cgroup_sock_addr(bind6)]
pub fn weir_bind6(ctx: SockAddrContext) -> i32 {
    keep_ztunnels_ports(&SockAddr::v6(&ctx))
}

/// In an ambient pod, only ztunnel binds TCP to the ports it listens on (15001, 15006, 15008):
/// with ztunnel away, an app listening there would be handed the pod's connections without
/// mTLS; with ztunnel there, it could share its reuseport group. What ztunnel binds there is
/// marked as its listener for tc.
#[inline(always)]
fn keep_ztunnels_ports(sa: &SockAddr) -> i32 {
    let port = sa.user_endpoint().port;
    if sa.sock_type() != SOCK_STREAM
        || (port != OUTBOUND_PORT && port != INBOUND_PORT && port != HBONE_PORT)
    {
        return ALLOW;
    }
    // SAFETY: the context pointer is valid for the program's run.
    let netns = unsafe { bpf_get_netns_cookie(sa.ctx as *mut c_void) };
    let Some(pod) = pod(netns) else {
        return ALLOW;
    };
    if pod.has(POD_SIDECAR) {
        return ALLOW;
    }
    if caller_is_in_ztunnels_cgroup() {
        // Without room for the mark, the listener is of no use to tc, and never a pod's.
        ZTUNNEL_LISTENS.set(sa.sk(), &1);
        return ALLOW;
    }
    diag!(
        warn,
        sa.ctx,
        "netns {}: bind to port {} refused: ztunnel's",
        netns,
        port
    );
    DENY
}
