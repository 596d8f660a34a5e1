//! Outbound: the app's sockets inside an enrolled pod, and the node's sockets toward such a pod.
use core::ffi::c_void;

use aya_ebpf::{
    helpers::generated::{bpf_get_current_cgroup_id, bpf_get_netns_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use weir_common::{
    Endpoint, IpKey, PodConfig, TraceHook, TraceVerdict, DNS_PORT, DNS_PROXY_PORT, INBOUND_PORT,
    NETNS_COOKIE_PORT, OUTBOUND_PORT, POD_DNS_CAPTURE, POD_HAS_IPV4, POD_HAS_IPV6, POD_SIDECAR,
    PROBE_SOURCE_V4,
};

use crate::{
    diag::{diag, ip},
    in_pod::{bind, pod_address_like, pod_owns, route_replies_back, Action, Decided, Hook},
    maps::{count, is_probe_source, node_config, pod, pod_with_ip, NETNS_COOKIES, SOCKET_ORIG_DST},
    net::{
        is_loopback, is_v4_mapped, loopback_like, same_ip, SockAddr, SockaddrIn, SockaddrIn6,
        ALLOW, DENY, SOCK_DGRAM, SOCK_STREAM,
    },
    sidecar,
    trace::{trace, PodAddress, Side, NOWHERE, TCP, UDP},
    ztunnel,
};

/// Which peer a getpeername or recvmsg call is shown.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shown {
    /// getpeername: a connection redirected to the outbound listener or the DNS proxy.
    Peer,
    /// recvmsg: a datagram, which only ztunnel's DNS proxy answers in a redirected pod.
    Datagram,
}

#[cgroup_sock_addr(connect4)]
pub fn weir_connect4(ctx: SockAddrContext) -> i32 {
    on_outbound(SockAddr::v4(&ctx), Hook::Connect)
}

#[cgroup_sock_addr(connect6)]
pub fn weir_connect6(ctx: SockAddrContext) -> i32 {
    on_outbound(SockAddr::v6(&ctx), Hook::Connect)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn weir_sendmsg4(ctx: SockAddrContext) -> i32 {
    on_outbound(SockAddr::v4(&ctx), Hook::Send)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn weir_sendmsg6(ctx: SockAddrContext) -> i32 {
    on_outbound(SockAddr::v6(&ctx), Hook::Send)
}

#[cgroup_sock_addr(getpeername4)]
pub fn weir_getpeername4(ctx: SockAddrContext) -> i32 {
    show_original_peer(SockAddr::v4(&ctx), Shown::Peer)
}

#[cgroup_sock_addr(getpeername6)]
pub fn weir_getpeername6(ctx: SockAddrContext) -> i32 {
    show_original_peer(SockAddr::v6(&ctx), Shown::Peer)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn weir_recvmsg4(ctx: SockAddrContext) -> i32 {
    show_original_peer(SockAddr::v4(&ctx), Shown::Datagram)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn weir_recvmsg6(ctx: SockAddrContext) -> i32 {
    show_original_peer(SockAddr::v6(&ctx), Shown::Datagram)
}

#[inline(always)]
fn on_outbound(sa: SockAddr, hook: Hook) -> i32 {
    // These hooks run for every socket on the node. An unconnected datagram can only be
    // redirected to the DNS proxy or refused toward the probe source: anything else leaves
    // before the netns cookie and the map lookups, as it would with no programs.
    // Read once, here: LLVM may otherwise compute the context's field addresses ahead of the
    // family branch for one of several reads, which the verifier rejects.
    let dst = sa.user_endpoint();
    if hook == Hook::Send && dst.port != DNS_PORT && !is_probe_source(&dst.ip) {
        return ALLOW;
    }
    // SAFETY: helper valid in sock_addr programs.
    let netns = unsafe { bpf_get_netns_cookie(sa.ctx as *mut c_void) };
    if hook == Hook::Connect && is_netns_cookie_question(&sa, &dst) {
        return answer_netns_cookie(&sa, netns);
    }
    let Some(pod) = pod(netns) else {
        return outside_pods(&sa, netns, hook, &dst);
    };
    let decided = if pod.has(POD_SIDECAR) {
        sidecar::outbound(&sa, netns, hook, &dst)
    } else {
        redirect(&sa, netns, hook, &dst)
    };
    // One place rewrites the address, and one traces a pass, for both kinds of pods: LLVM
    // merges the context stores of several into one through a computed pointer, which the
    // verifier rejects, and every inlined copy of a record costs stack (5.10 counts 512 bytes
    // for the whole call chain).
    match decided.action {
        Action::SendTo => send_to(
            &sa,
            netns,
            pod,
            hook,
            &dst,
            &decided.target,
            decided.verdict,
        ),
        Action::Pass => {
            trace_outbound(&sa, netns, pod, hook, &dst, decided.verdict, NOWHERE);
            ALLOW
        }
        Action::Refuse => DENY,
    }
}

/// A call from a netns weir has not enrolled: the node's own gets the probe source toward the
/// pods it probes. The probe source address is local on the node (the probes' replies return to
/// it), so from any other netns (pods weir leaves alone, other sandboxes) it would reach the
/// node's wildcard listeners: refused.
#[inline(always)]
fn outside_pods(sa: &SockAddr, netns: u64, hook: Hook, dst: &Endpoint) -> i32 {
    if !is_probe_source(&dst.ip) {
        if hook == Hook::Connect {
            give_probe_source(sa, netns, dst);
        }
        return ALLOW;
    }
    // A probe source address is one only while the bypass is on.
    if node_config().is_some_and(|node| node.host_netns_cookie == netns) {
        return ALLOW;
    }
    log_probe_address_refused(sa, netns, dst);
    DENY
}

#[inline(always)]
fn log_probe_address_refused(sa: &SockAddr, netns: u64, dst: &Endpoint) {
    diag!(
        warn,
        sa.ctx,
        "netns {}: {:i}:{} refused: the probe source address",
        netns,
        ip(&dst.ip),
        dst.port
    );
}

/// The in-pod decision for an ambient pod, istio's ISTIO_OUTPUT chain without conntrack.
#[inline(always)]
fn redirect(sa: &SockAddr, netns: u64, hook: Hook, dst: &Endpoint) -> Decided {
    let Some(pod) = pod(netns) else {
        return Decided::pass(TraceVerdict::PassUncaptured);
    };
    if is_probe_source(&dst.ip) {
        // Local on the node (the probes' replies return to it), so any node listener on a
        // wildcard address answers there: refused, never a way around ztunnel, for ztunnel's
        // own dials too.
        log_probe_address_refused(sa, netns, dst);
        trace_outbound(
            sa,
            netns,
            pod,
            hook,
            dst,
            TraceVerdict::RefuseProbeAddress,
            NOWHERE,
        );
        return Decided::refused(TraceVerdict::RefuseProbeAddress);
    }
    if ztunnel::calls_from_ztunnel(sa.mark()) {
        // ztunnel's own socket: never redirected.
        route_replies_back(sa, netns, dst, hook);
        return Decided::pass(TraceVerdict::PassZtunnel);
    }
    if is_loopback(&dst.ip) || pod_owns(netns, &dst.ip) {
        return Decided::pass(TraceVerdict::PassLocal);
    }
    let is_dns = dst.port == DNS_PORT && pod.has(POD_DNS_CAPTURE);
    let target = if is_dns {
        // Where ztunnel's DNS proxy listens: the pod's loopback, as iptables REDIRECT would.
        Endpoint::new(loopback_like(&dst.ip), DNS_PROXY_PORT)
    } else if hook == Hook::Connect && sa.sock_type() == SOCK_STREAM {
        // The pod's own address (not 127.0.0.1): ztunnel must see the pod as the source.
        match pod_address_like(pod, &dst.ip) {
            Some(ip) => Endpoint::new(ip, OUTBOUND_PORT),
            // No CNI address of that family, so none ztunnel would take the connection from;
            // the pod may still have one (link-local, SLAAC, a secondary network), and the
            // connection must not leave around ztunnel: refused, as istio's ip6tables would.
            None => {
                diag!(
                    warn,
                    sa.ctx,
                    "netns {}: {:i}:{} refused: the pod has no CNI address of its family",
                    netns,
                    ip(&dst.ip),
                    dst.port
                );
                trace_outbound(
                    sa,
                    netns,
                    pod,
                    hook,
                    dst,
                    TraceVerdict::RefuseNoAddress,
                    NOWHERE,
                );
                return Decided::refused(TraceVerdict::RefuseNoAddress);
            }
        }
    } else {
        return Decided::pass(TraceVerdict::PassUncaptured);
    };
    let verdict = if is_dns {
        TraceVerdict::Dns
    } else {
        TraceVerdict::Outbound
    };
    Decided::send_to(target, verdict)
}

/// Sends a call to a proxy's listener (`target`), recording its original destination on the
/// socket, where `SO_ORIGINAL_DST`, getpeername and recvmsg find it. Returns the hook's verdict.
#[inline(always)]
fn send_to(
    sa: &SockAddr,
    netns: u64,
    pod: &PodConfig,
    hook: Hook,
    dst: &Endpoint,
    target: &Endpoint,
    verdict: TraceVerdict,
) -> i32 {
    if !SOCKET_ORIG_DST.set(sa.sk(), dst) {
        // Without the record the proxy could not learn the destination, and a direct
        // connection would bypass the mesh's policy: refuse the call (EPERM; the app retries).
        // Only happens when the kernel cannot allocate the socket's storage.
        diag!(
            warn,
            sa.ctx,
            "netns {}: {:i}:{} refused: no room to record its destination",
            netns,
            ip(&dst.ip),
            dst.port
        );
        trace_outbound(
            sa,
            netns,
            pod,
            hook,
            dst,
            TraceVerdict::RefuseNoRoom,
            NOWHERE,
        );
        return DENY;
    }
    sa.set_user_endpoint(target);
    // The listener's address is the pod's or loopback, as the trace records it: the log line
    // keeps to what its record can hold on kernels that count every frame against 512 bytes.
    diag!(
        by_ref debug,
        sa.ctx,
        "netns {}: redirect {:i}:{} to port {}",
        netns,
        ip(&dst.ip),
        dst.port,
        target.port
    );
    match verdict {
        TraceVerdict::Dns => count(netns, |c| &mut c.dns),
        TraceVerdict::Hairpin => count(netns, |c| &mut c.inbound),
        _ => count(netns, |c| &mut c.outbound),
    }
    trace_outbound(
        sa,
        netns,
        pod,
        hook,
        dst,
        verdict,
        (&target.ip, target.port),
    );
    ALLOW
}

/// Traces an in-pod decision. The source is the pod's address of the destination's family;
/// its port is not chosen yet at connect.
#[inline(always)]
fn trace_outbound(
    sa: &SockAddr,
    netns: u64,
    pod: &PodConfig,
    hook: Hook,
    dst: &Endpoint,
    verdict: TraceVerdict,
    target: impl Side,
) {
    trace!(
        hook.traced(),
        verdict,
        netns,
        if sa.sock_type() == SOCK_STREAM {
            TCP
        } else {
            UDP
        },
        PodAddress { pod, like: &dst.ip },
        (&dst.ip, dst.port),
        target
    );
}

/// Node side: TCP from the node's own netns to an enrolled pod (kubelet probes) is bound to the
/// probe source address, which the pod's inbound program lets through to the app; where the agent
/// names kubelet's cgroup, only TCP from kubelet's sockets. Traffic from other pods or forwarded
/// through the node keeps its source and is captured.
#[inline(always)]
fn give_probe_source(sa: &SockAddr, netns: u64, dst: &Endpoint) {
    if sa.sock_type() != SOCK_STREAM {
        return;
    }
    let Some(node) = node_config() else {
        return;
    };
    if node.host_netns_cookie == 0 || node.host_netns_cookie != netns {
        return;
    }
    // SAFETY: a helper without arguments, allowed in the socket address hooks.
    if node.probe_cgroup != 0 && unsafe { bpf_get_current_cgroup_id() } != node.probe_cgroup {
        return;
    }
    // Only toward an address the runtime gave the pod, which is what kubelet probes: one the
    // pod put on an interface itself may be anyone's (the API server's), and the node's
    // connections to it keep their source.
    let Some(target) = pod_with_ip(&dst.ip).and_then(pod) else {
        return;
    };
    // A sidecar pod's probes go through its proxy, which istio rewrites them for.
    if target.has(POD_SIDECAR) {
        return;
    }
    let given = (target.has(POD_HAS_IPV4) && same_ip(&dst.ip, &IpKey::from_v4(target.ipv4)))
        || (target.has(POD_HAS_IPV6) && same_ip(&dst.ip, &IpKey::from_v6(target.ipv6)));
    if !given {
        return;
    }
    let probe_source = if is_v4_mapped(&dst.ip) {
        IpKey::from_v4(node.probe_source_v4)
    } else {
        IpKey::from_v6(node.probe_source_v6)
    };
    // Counted as bypassed by the pod's inbound program when the SYN arrives.
    let bound = if !sa.v6 {
        bind(sa, &mut SockaddrIn::new(&probe_source, 0))
    } else {
        bind(sa, &mut SockaddrIn6::new(&probe_source, 0))
    };
    trace!(
        TraceHook::Connect,
        TraceVerdict::ProbeBypass,
        pod_with_ip(&dst.ip).unwrap_or(0),
        TCP,
        (&probe_source, 0),
        (&dst.ip, dst.port),
        NOWHERE
    );
    diag!(
        debug,
        sa.ctx,
        "node to {:i}:{}: probe source bind {}",
        ip(&dst.ip),
        dst.port,
        bound
    );
}

/// The agent's question on kernels before 5.14, which cannot tell a socket's netns cookie
/// (`SO_NETNS_COOKIE`): a UDP connect to the probe source address on `NETNS_COOKIE_PORT`.
#[inline(always)]
fn is_netns_cookie_question(sa: &SockAddr, dst: &Endpoint) -> bool {
    if sa.v6 || sa.sock_type() != SOCK_DGRAM {
        return false;
    }
    dst.port == NETNS_COOKIE_PORT && same_ip(&dst.ip, &IpKey::from_v4(PROBE_SOURCE_V4))
}

/// Stores the netns cookie on the socket, where the agent reads it (`NETNS_COOKIES`, keyed by
/// the socket's fd from userspace), and refuses the connect: nothing is ever sent.
#[inline(always)]
fn answer_netns_cookie(sa: &SockAddr, netns: u64) -> i32 {
    NETNS_COOKIES.set(sa.sk(), &netns);
    DENY
}

/// getpeername and recvmsg: show the app the address it asked for, not ztunnel's listener.
#[inline(always)]
fn show_original_peer(sa: SockAddr, shown_as: Shown) -> i32 {
    let shown = sa.user_endpoint();
    let redirected = match shown_as {
        Shown::Peer => {
            shown.port == OUTBOUND_PORT
                || shown.port == DNS_PROXY_PORT
                || shown.port == INBOUND_PORT
        }
        // Only the DNS proxy's own answers: anyone can send from port 15053, and the app
        // would take theirs for its resolver's.
        Shown::Datagram => shown.port == DNS_PROXY_PORT && is_loopback(&shown.ip),
    };
    if !redirected {
        return ALLOW;
    }
    if let Some(original) = SOCKET_ORIG_DST.of(sa.sk()) {
        sa.set_user_endpoint(&original);
    }
    ALLOW
}
