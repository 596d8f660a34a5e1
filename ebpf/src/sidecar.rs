//! Sidecar pods: every decision istio-cni's sidecar rules make (istio-iptables' `ISTIO_OUTPUT`
//! and `ISTIO_INBOUND`), for a pod whose traffic goes to its own istio-proxy instead of ztunnel.
//!
//! Outbound, in istio's rule order (first match wins):
//! 0. a destination the pod routes out of an excluded interface passes;
//! 1. a port in the pod's `excludeOutboundPorts` (TCP and UDP) passes;
//! 2. a socket bound to the inbound passthrough source (127.0.0.6, ::6) passes to the pod
//!    itself: Envoy's own connections to the app;
//! 3. the proxy's uid: TCP to a local address of the pod other than 127.0.0.1 (and not to 15008,
//!    nor to 53 with DNS capture) hairpins to the inbound listener 15006; anything else of the
//!    proxy passes;
//! 4. anyone else's traffic to a local address passes (unless an included range holds a loopback
//!    address; with DNS capture only TCP to a port other than 53);
//! 5. the proxy's gid: the same as 3, without the DNS exception;
//! 6. DNS capture: TCP and UDP to port 53, to any address, goes to the DNS proxy 15053;
//! 7. 127.0.0.1 (::1) passes; then the excluded ranges; then TCP to an included port or range
//!    goes to the outbound listener 15001. Anything else passes.
//!
//! In TPROXY mode, the proxy's own TCP to its pod (uid or gid, not one of its 0x539-marked
//! source-preserving dials) is captured inbound as any connection to the pod would be, before
//! these rules; its marked dials get the return mark, so the app's replies come back to it.
//!
//! IPv6 follows the same rules only when istio would install its ip6tables rules for the pod;
//! otherwise IPv6 passes untouched. Inbound, new TCP connections to the pod's captured ports are
//! handed to the proxy's 15006 listener by [`crate::inbound`], which asks [`captures_inbound`].
//!
//! Where iptables REDIRECT would rewrite the destination to 127.0.0.1, the outbound listener is
//! reached at the pod's own address instead (the proxy listens on every address): the connection
//! record `SO_ORIGINAL_DST` is answered from is then unique on the node. A hairpin goes to
//! 127.0.0.1:15006, where istio-validation listens, from the pod's own address for the same reason.
use aya_ebpf::helpers::bpf_get_current_uid_gid;
use weir_common::{
    list, Endpoint, IpKey, PodConfig, TraceVerdict, DNS_PORT, DNS_PROXY_PORT, HBONE_PORT,
    INBOUND_PORT, OUTBOUND_PORT, PASSTHROUGH_SOURCE_V4, PASSTHROUGH_SOURCE_V6, POD_DNS_CAPTURE,
    POD_EXCLUDED_INTERFACES, POD_HAS_IPV4, POD_INBOUND_ALL_PORTS, POD_LOOPBACK_INCLUDED,
    POD_OUTBOUND_ALL_RANGES, POD_SIDECAR_IPV6, POD_TPROXY, ZTUNNEL_MARK, ZTUNNEL_MARK_MASK,
};

use crate::{
    in_pod::{bind, pod_address_like, pod_owns, route_replies_back, Decided, Hook},
    maps::{pod, port_listed, range_listed, routed_out_of_excluded},
    net::{
        is_loopback, is_v4_mapped, loopback_like, same_ip, socket_addresses, SockAddr, SockaddrIn,
        SockaddrIn6, SOCK_STREAM,
    },
};

/// The outbound decision for a socket in a sidecar pod.
#[inline(always)]
pub fn outbound(sa: &SockAddr, netns: u64, hook: Hook, dst: &Endpoint) -> Decided {
    let Some(pod) = pod(netns) else {
        return Decided::pass(TraceVerdict::PassUncaptured);
    };
    if !family_captured(pod, !is_v4_mapped(&dst.ip)) {
        return Decided::pass(TraceVerdict::PassExcluded);
    }
    // An IPv6-only pod has no IPv4 route but loopback: the kernel fails the connect
    // (`ENETUNREACH`) before istio's rules, which act after routing, would see it. This hook acts
    // before routing, and must not give the app a connection its proxy could not forward.
    if is_v4_mapped(&dst.ip) && !pod.has(POD_HAS_IPV4) && !is_loopback(&dst.ip) {
        return Decided::pass(TraceVerdict::PassExcluded);
    }
    // istio's `-o <interface> -j RETURN`, ahead of every other rule: the route is looked up as
    // the kernel will take it, in the pod's routes as the agent last read them.
    if pod.has(POD_EXCLUDED_INTERFACES) && routed_out_of_excluded(netns, &dst.ip) {
        return Decided::pass(TraceVerdict::PassExcluded);
    }
    if port_listed(netns, list::OUTBOUND_EXCLUDE, dst.port) {
        return Decided::pass(TraceVerdict::PassExcluded);
    }
    // TPROXY: the proxy's source-preserving dials to the app (marked 0x539, as ztunnel's) keep
    // the way back, whichever rule lets them through (istio's mangle-table connmark).
    if pod.has(POD_TPROXY) && sa.mark() & ZTUNNEL_MARK_MASK == ZTUNNEL_MARK {
        route_replies_back(sa, netns, dst, hook);
    }
    // Routed over the pod's loopback: a loopback address, one of the pod's own, or `::6`, which
    // the agent puts on `lo` of a pod whose IPv6 is captured (istio-validation probes it).
    let local =
        is_loopback(&dst.ip) || is_v6_passthrough_source(&dst.ip) || pod_owns(netns, &dst.ip);
    // istio's `-o lo -s 127.0.0.6 -j RETURN` (`::6`): only to the pod itself. `::6` is no
    // loopback address, and an app that binds it must not reach other hosts around the proxy.
    if local && bound_to_passthrough_source(sa) {
        return Decided::pass(TraceVerdict::PassProxy);
    }
    let ids = bpf_get_current_uid_gid();
    let (uid, gid) = (ids as u32, (ids >> 32) as u32);
    let tcp = hook == Hook::Connect && sa.sock_type() == SOCK_STREAM;
    let dns_capture = pod.has(POD_DNS_CAPTURE);
    let hairpin = |dns_excluded: bool| {
        local
            && !is_local_host(&dst.ip)
            && tcp
            && dst.port != HBONE_PORT
            && !(dns_excluded && dns_capture && dst.port == DNS_PORT)
    };
    if pod.has(POD_TPROXY)
        && (uid == pod.proxy_uid || gid == pod.proxy_gid)
        && sa.mark() & ZTUNNEL_MARK_MASK != ZTUNNEL_MARK
        && local
        && !is_local_host(&dst.ip)
        && tcp
        && captures_inbound(netns, pod, dst.port, !is_v4_mapped(&dst.ip))
    {
        // TPROXY: the proxy's own connection to its pod is captured inbound as any other
        // (istio's mangle mark 1338), unless it is one of its source-preserving dials.
        return hairpin_to(sa, pod, dst);
    }
    if uid == pod.proxy_uid {
        if hairpin(true) {
            return hairpin_to(sa, pod, dst);
        }
        return Decided::pass(TraceVerdict::PassProxy);
    }
    let app_local_passes =
        local && !pod.has(POD_LOOPBACK_INCLUDED) && (!dns_capture || (tcp && dst.port != DNS_PORT));
    if app_local_passes {
        return Decided::pass(TraceVerdict::PassLocal);
    }
    if gid == pod.proxy_gid {
        if hairpin(false) {
            return hairpin_to(sa, pod, dst);
        }
        return Decided::pass(TraceVerdict::PassProxy);
    }
    if dns_capture && dst.port == DNS_PORT {
        let target = Endpoint::new(loopback_like(&dst.ip), DNS_PROXY_PORT);
        return Decided::send_to(target, TraceVerdict::Dns);
    }
    if is_local_host(&dst.ip) {
        return Decided::pass(TraceVerdict::PassLocal);
    }
    if !tcp {
        return Decided::pass(TraceVerdict::PassUncaptured);
    }
    if range_listed(netns, list::OUTBOUND_EXCLUDE, &dst.ip) {
        return Decided::pass(TraceVerdict::PassExcluded);
    }
    let included = port_listed(netns, list::OUTBOUND_INCLUDE, dst.port)
        || pod.has(POD_OUTBOUND_ALL_RANGES)
        || range_listed(netns, list::OUTBOUND_INCLUDE, &dst.ip);
    if !included {
        return Decided::pass(TraceVerdict::PassExcluded);
    }
    let listener = pod_address_like(pod, &dst.ip).unwrap_or_else(|| loopback_like(&dst.ip));
    Decided::send_to(
        Endpoint::new(listener, OUTBOUND_PORT),
        TraceVerdict::Outbound,
    )
}

/// Whether a new inbound TCP connection to `port` of a sidecar pod goes to its proxy: istio's
/// `ISTIO_INBOUND` (15008 first, then the included or the not excluded ports), in a family
/// istio captures.
#[inline(always)]
pub fn captures_inbound(netns: u64, pod: &PodConfig, port: u16, v6: bool) -> bool {
    if !family_captured(pod, v6) {
        return false;
    }
    if port == HBONE_PORT && !pod.has(POD_TPROXY) {
        return false;
    }
    if pod.has(POD_INBOUND_ALL_PORTS) {
        !port_listed(netns, list::INBOUND_EXCLUDE, port)
    } else {
        port_listed(netns, list::INBOUND_INCLUDE, port)
    }
}

/// Whether TCP to `destination` arriving on one of a sidecar pod's rerouted interfaces goes to
/// its outbound listener: istio's `-i <interface> [-d <included range>] -j ISTIO_REDIRECT`, above
/// every exclusion, for IPv6 only where its ip6tables rules are installed.
#[inline(always)]
pub fn reroutes(netns: u64, pod: &PodConfig, destination: &IpKey) -> bool {
    family_captured(pod, !is_v4_mapped(destination))
        && (pod.has(POD_OUTBOUND_ALL_RANGES)
            || range_listed(netns, list::OUTBOUND_INCLUDE, destination))
}

/// The proxy's connection to its own pod goes to its inbound listener, 127.0.0.1:15006 (::1),
/// as iptables REDIRECT sends it. An unbound socket is bound to the pod's address first, so the
/// connection's record is the pod's alone; one already bound keeps its source.
#[inline(always)]
fn hairpin_to(sa: &SockAddr, pod: &PodConfig, dst: &Endpoint) -> Decided {
    if let Some(source) = pod_address_like(pod, &dst.ip) {
        if !sa.v6 {
            bind(sa, &mut SockaddrIn::new(&source, 0));
        } else {
            bind(sa, &mut SockaddrIn6::new(&source, 0));
        }
    }
    Decided::send_to(
        Endpoint::new(loopback_like(&dst.ip), INBOUND_PORT),
        TraceVerdict::Hairpin,
    )
}

/// istio's loopback CIDR: 127.0.0.1/32 and ::1/128 (not all of 127.0.0.0/8).
#[inline(always)]
fn is_local_host(ip: &IpKey) -> bool {
    same_ip(ip, &loopback_like(ip))
}

/// Whether the socket is bound to 127.0.0.6 or ::6, where Envoy's inbound passthrough
/// connections to the app come from.
#[inline(always)]
fn bound_to_passthrough_source(sa: &SockAddr) -> bool {
    let sk = sa.sk();
    if sk.is_null() {
        return false;
    }
    // SAFETY: non-null socket pointer from the context.
    let Some((source, _)) =
        (unsafe { socket_addresses!(sk, (src_ip4, dst_ip4), (src_ip6, dst_ip6)) })
    else {
        return false;
    };
    same_ip(&source, &IpKey::from_v4(PASSTHROUGH_SOURCE_V4)) || is_v6_passthrough_source(&source)
}

/// Whether istio's rules capture a family in a sidecar pod: IPv4 always, IPv6 (`v6`) where it
/// writes ip6tables rules (the pod's IPv6 is captured), in every direction.
#[inline(always)]
fn family_captured(pod: &PodConfig, v6: bool) -> bool {
    !v6 || pod.has(POD_SIDECAR_IPV6)
}

/// Whether `ip` is `::6`, the IPv6 inbound passthrough source.
#[inline(always)]
fn is_v6_passthrough_source(ip: &IpKey) -> bool {
    same_ip(ip, &IpKey::from_v6(PASSTHROUGH_SOURCE_V6))
}
