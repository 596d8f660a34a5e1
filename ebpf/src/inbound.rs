//! Inbound: tc ingress on an enrolled pod's interfaces. A new TCP connection for the pod is
//! handed to ztunnel's 15006 listener with `bpf_sk_assign`, keeping the packet's destination, so
//! ztunnel's accepted socket has the original destination as its local address (TPROXY
//! semantics; no NAT, no conntrack). Established connections, HBONE (15008) and the node's probes
//! pass untouched. The pod is the one whose interface the program runs on, told by the slot the
//! agent gave weir's filter there as its classid, not by the packet's destination: a pod with
//! more addresses than the index holds, or an address another pod holds too, is decided as
//! itself.
//!
//! Nothing addressed to the pod may reach it around ztunnel, and this program sees packets before
//! the kernel reassembles them, where an `sk_assign` would not survive reassembly. So for a pod:
//! - a first TCP fragment passes only when a connection already owns its ports (the reassembled
//!   segment goes to that socket); otherwise it is dropped, and its later fragments, which carry
//!   no ports, can never be reassembled;
//! - IPv6 extension headers are walked (a bounded number) to find TCP behind them;
//! - a TCP packet whose headers cannot be read or walked is dropped;
//! - a SYN for a tuple in TIME_WAIT is steered too: the kernel would hand it to the app's
//!   listener.
//!
//! Every drop is counted in the pod's `dropped` counter.
//!
//! [`weir_inbound_l3`] is the same program for interfaces whose packets have no Ethernet header.
//!
//! [`weir_reroute`] takes the inbound program's place on an interface named in the pod's
//! `istio.io/reroute-virtual-interfaces` (a VM behind a tap or bridge in the pod): not an
//! entrance to the pod but to its outbound. Every new TCP connection arriving there goes to
//! the outbound listener 15001, ztunnel's or a sidecar pod's proxy's, as if the pod had opened it
//! (istio's `-i <interface> -p tcp -j REDIRECT --to-ports 15001`; for a sidecar pod only to its
//! included ranges, and IPv6 only where istio captures it). The packet keeps its destination
//! (the accepted socket's local address is the original destination), and the connection is
//! recorded for `SO_ORIGINAL_DST` exactly as the pod's own outbound is. The routing rules the
//! agent adds per such interface (`iif <interface> [to <range>] ipproto tcp lookup 100`) deliver
//! that TCP locally instead of forwarding it; the program passes what they do not deliver. The
//! pod is told by the filter's slot, as for inbound.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{
        bpf_sock, bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT,
    },
    helpers::generated::{bpf_sk_assign, bpf_sk_fullsock, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
};
use weir_common::{
    ConnectionKey, Endpoint, IpKey, PodCounters, TraceHook, TraceVerdict, HBONE_PORT, INBOUND_PORT,
    OUTBOUND_PORT, POD_INBOUND_BYPASS, POD_SIDECAR, POD_SOCKET_LOOKUP_HANDOFF,
};

use crate::{
    diag::{diag, ip, ip_fixed},
    handoff,
    maps::{count, is_probe_source, original_destination, pod, pod_in_slot, CONN_ORIG_DST},
    net::{ctx_read, ip_from_v4_word, v6_words},
    sidecar,
    trace::{trace, NOWHERE, TCP},
    ztunnel,
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_HLEN: usize = 4;
/// VLAN tags walked past the one the kernel strips: a double-tagged frame (802.1ad outer, 802.1Q
/// inner) has one left, and one more is a margin; a deeper stack is dropped, not guessed.
const MAX_VLAN_TAGS: usize = 2;
const IPV4_HLEN_MIN: usize = 20;
const IPV6_HLEN: usize = 40;
const IPV4_FRAGMENT_OFFSET: u16 = 0x1fff;
const IPV4_MORE_FRAGMENTS: u16 = 0x2000;
const IPV6_FRAGMENT_OFFSET: u16 = 0xfff8;
/// IPv6 next-header values of the extension headers walked to reach TCP.
const IPPROTO_HOPOPTS: u8 = 0;
pub(crate) const IPPROTO_TCP: u8 = 6;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;
/// More extension headers than any real packet carries: a longer chain is dropped, not guessed.
const MAX_EXTENSION_HEADERS: usize = 8;
pub(crate) const TCP_FLAGS_OFFSET: usize = 13;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;
/// `bpf_sock.state` values (the kernel's `TCP_*` states).
const TCP_TIME_WAIT: u32 = 6;
const TCP_LISTEN: u32 = 10;
const TCP_NEW_SYN_RECV: u32 = 12;
/// Sizes of the IPv4 and IPv6 parts of `bpf_sock_tuple`.
const IPV4_TUPLE_LEN: u32 = 12;
const IPV6_TUPLE_LEN: u32 = 36;
/// Look sockets up in the netns the packet is in (the pod's).
const BPF_F_CURRENT_NETNS: u64 = u64::MAX;

// The bindings' integer type for these differs between the BPF target and the host.
#[allow(clippy::unnecessary_cast)]
pub(crate) const PASS: i32 = TC_ACT_OK as i32;
#[allow(clippy::unnecessary_cast)]
pub(crate) const DROP: i32 = TC_ACT_SHOT as i32;

#[classifier]
pub fn weir_inbound(ctx: TcContext) -> i32 {
    inbound::<true>(&ctx)
}

/// [`weir_inbound`] for interfaces without a link-layer header (tun, wireguard, ipip, gre, sit,
/// netkit in L3 mode): the packet starts with its IP header, whose version the kernel's protocol
/// field gives. Read as an Ethernet frame, such a packet would be taken for one that is not IP,
/// and pass around ztunnel.
#[classifier]
pub fn weir_inbound_l3(ctx: TcContext) -> i32 {
    inbound::<false>(&ctx)
}

/// The packet's IP header found behind an Ethernet header (and VLAN tags), or at the start.
#[inline(always)]
fn inbound<const ETHERNET: bool>(ctx: &TcContext) -> i32 {
    let payload = if ETHERNET {
        network_header(ctx)
    } else {
        ip_header(ctx, u16::from_be(ctx.skb.protocol() as u16), 0)
    };
    let packet = match payload {
        Payload::Ip(packet) => packet,
        // Not IP, or an IP header too short to hold the addresses: the kernel drops the latter.
        Payload::Other => return PASS,
        Payload::TooManyTags => return drop_vlan(TraceHook::TcIngress),
    };
    // The pod whose interface this is, told by the filter's classid: a packet for an address
    // the pod added beyond those indexed, or one another pod holds too, is still the pod's.
    // SAFETY: a field of the context the kernel hands tc programs.
    let slot = unsafe { (*ctx.skb.skb).tc_classid };
    let Some(netns) = pod_in_slot(slot) else {
        return PASS;
    };
    match decide::<ETHERNET>(ctx, &packet, netns) {
        Ok(verdict) => verdict,
        Err(()) => {
            diag!(
                by_ref warn,
                ctx.skb.skb,
                "netns {}: drop {:i} to {:i}: headers not readable",
                netns,
                ip(&packet.source),
                ip(&packet.destination)
            );
            trace!(
                TraceHook::TcIngress,
                TraceVerdict::DropUnparsable,
                netns,
                0,
                (&packet.source, 0),
                (&packet.destination, 0),
                NOWHERE
            );
            drop_counted(netns)
        }
    }
}

/// Drops a frame behind more VLAN tags than walked; its pod is unknown.
#[inline(always)]
fn drop_vlan(hook: TraceHook) -> i32 {
    trace!(
        hook,
        TraceVerdict::DropVlan,
        0,
        0,
        NOWHERE,
        NOWHERE,
        NOWHERE
    );
    DROP
}

/// Whether a packet is a fragment, as far as this program can act on it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// A whole packet.
    No,
    /// The fragment at offset 0: it carries the transport header.
    First,
    /// A fragment past offset 0: payload only, useless without its first fragment.
    Later,
}

/// The network header of a packet: where it starts, and its addresses.
pub(crate) struct NetworkHeader {
    pub(crate) offset: usize,
    pub(crate) v6: bool,
    pub(crate) source: IpKey,
    pub(crate) destination: IpKey,
}

/// What a frame carries.
pub(crate) enum Payload {
    Ip(NetworkHeader),
    /// Anything else, or an IP header too short to hold the addresses (the kernel drops it).
    Other,
    /// More VLAN tags than walked: what is inside is unknown, and must not reach a pod.
    TooManyTags,
}

/// The IP packet a frame carries, behind any VLAN tags left on it. The kernel takes the outer
/// tag off before tc runs, and after it an inner tag with VLAN id 0 (priority tagging) too, then
/// hands the packet to IP without running tc again: a SYN behind two such tags would reach the
/// pod undecided if this program stopped at the first ethertype.
#[inline(always)]
pub(crate) fn network_header(ctx: &TcContext) -> Payload {
    let Ok(mut ethertype) = ctx.load::<u16>(12).map(u16::from_be) else {
        return Payload::Other;
    };
    let mut offset = ETH_HLEN;
    for _ in 0..MAX_VLAN_TAGS {
        if ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD {
            break;
        }
        let Ok(inner) = ctx.load::<u16>(offset + 2).map(u16::from_be) else {
            return Payload::TooManyTags;
        };
        ethertype = inner;
        offset += VLAN_HLEN;
    }
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        return Payload::TooManyTags;
    }
    ip_header(ctx, ethertype, offset)
}

/// The IP header at `offset`, of the version `ethertype` names.
#[inline(always)]
fn ip_header(ctx: &TcContext, ethertype: u16, offset: usize) -> Payload {
    let header = match ethertype {
        ETH_P_IP => (|| {
            let saddr: u32 = ctx.load(offset + 12).ok()?;
            let daddr: u32 = ctx.load(offset + 16).ok()?;
            Some(NetworkHeader {
                offset,
                v6: false,
                source: ip_from_v4_word(saddr),
                destination: ip_from_v4_word(daddr),
            })
        })(),
        ETH_P_IPV6 => (|| {
            Some(NetworkHeader {
                offset,
                v6: true,
                source: IpKey::from_v6(ctx.load(offset + 8).ok()?),
                destination: IpKey::from_v6(ctx.load(offset + 24).ok()?),
            })
        })(),
        _ => None,
    };
    header.map_or(Payload::Other, Payload::Ip)
}

/// Where the transport header is, which protocol it is, and whether the packet is a fragment.
pub(crate) struct Transport {
    pub(crate) protocol: u8,
    pub(crate) offset: usize,
    pub(crate) fragment: Fragment,
}

#[inline(always)]
pub(crate) fn transport(ctx: &TcContext, packet: &NetworkHeader) -> Result<Transport, ()> {
    let base = packet.offset;
    if !packet.v6 {
        let version_ihl: u8 = ctx.load(base).map_err(|_| ())?;
        let header_len = ((version_ihl & 0x0f) as usize) * 4;
        if header_len < IPV4_HLEN_MIN {
            return Err(());
        }
        let flags_offset = u16::from_be(ctx.load::<u16>(base + 6).map_err(|_| ())?);
        let fragment = if flags_offset & IPV4_FRAGMENT_OFFSET != 0 {
            Fragment::Later
        } else if flags_offset & IPV4_MORE_FRAGMENTS != 0 {
            Fragment::First
        } else {
            Fragment::No
        };
        return Ok(Transport {
            protocol: ctx.load(base + 9).map_err(|_| ())?,
            offset: base + header_len,
            fragment,
        });
    }
    let mut next: u8 = ctx.load(base + 6).map_err(|_| ())?;
    let mut offset = base + IPV6_HLEN;
    let mut fragment = Fragment::No;
    for _ in 0..MAX_EXTENSION_HEADERS {
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                let [next_header, length]: [u8; 2] = ctx.load(offset).map_err(|_| ())?;
                next = next_header;
                offset += (length as usize + 1) * 8;
            }
            IPPROTO_AH => {
                let [next_header, length]: [u8; 2] = ctx.load(offset).map_err(|_| ())?;
                next = next_header;
                offset += (length as usize + 2) * 4;
            }
            IPPROTO_FRAGMENT => {
                next = ctx.load(offset).map_err(|_| ())?;
                let offset_flags = u16::from_be(ctx.load::<u16>(offset + 2).map_err(|_| ())?);
                if offset_flags & IPV6_FRAGMENT_OFFSET != 0 {
                    fragment = Fragment::Later;
                    break;
                }
                // Offset 0, with or without more to come (an atomic fragment is reassembled
                // alone): the first fragment, where the rest of the chain and TCP must be.
                fragment = Fragment::First;
                offset += 8;
            }
            protocol => {
                return Ok(Transport {
                    protocol,
                    offset,
                    fragment,
                })
            }
        }
    }
    if fragment == Fragment::Later {
        return Ok(Transport {
            protocol: next,
            offset,
            fragment,
        });
    }
    // A chain longer than any real packet's: what it carries is unknown.
    Err(())
}

/// The verdict on a packet for the pod whose netns cookie is `netns`; `Err` when its headers
/// cannot be read, which drops it.
///
/// One copy per program (`ETHERNET` is the caller's): shared by both, the log records' closures
/// would be subprograms of their own, whose frames the verifier adds to the program's, past
/// the 512 bytes it allows when logging is on.
#[inline(always)]
fn decide<const ETHERNET: bool>(
    ctx: &TcContext,
    packet: &NetworkHeader,
    netns: u64,
) -> Result<i32, ()> {
    let transport = transport(ctx, packet)?;
    // Payload-only fragments need their first fragment, which is judged below; other protocols
    // are not captured inbound (istio redirects TCP only).
    if transport.fragment == Fragment::Later || transport.protocol != IPPROTO_TCP {
        return Ok(PASS);
    }
    let Some(pod) = pod(netns) else {
        return Ok(PASS);
    };
    let (sport, dport): (u16, u16) = (
        ctx.load(transport.offset).map_err(|_| ())?,
        ctx.load(transport.offset + 2).map_err(|_| ())?,
    );
    let sidecar = pod.has(POD_SIDECAR);
    if sidecar && !sidecar::captures_inbound(netns, pod, u16::from_be(dport), packet.v6) {
        return Ok(PASS);
    }
    if !sidecar && u16::from_be(dport) == HBONE_PORT {
        let (mut tuple, tuple_len) = sock_tuple(packet, sport, dport);
        if hbone_reaches_ztunnel(ctx, &mut tuple, tuple_len) {
            return Ok(PASS);
        }
        diag!(
            by_ref warn,
            ctx.skb.skb,
            "netns {}: drop TCP {:i} to {:i}:15008: the listener is not ztunnel's",
            netns,
            ip(&packet.source),
            ip(&packet.destination)
        );
        trace!(
            TraceHook::TcIngress,
            TraceVerdict::DropHboneNotZtunnel,
            netns,
            TCP,
            (&packet.source, u16::from_be(sport)),
            (&packet.destination, HBONE_PORT),
            NOWHERE
        );
        return Ok(drop_counted(netns));
    }
    // The node's probes and bypassing pods: whole packets and fragments alike, as istio's ACCEPT.
    let from_node_probe = is_probe_source(&packet.source);
    let bypass = from_node_probe || pod.has(POD_INBOUND_BYPASS);

    let (mut tuple, tuple_len) = sock_tuple(packet, sport, dport);
    // Who owns this tuple now: a connection (established, half-open, or ztunnel's own), a
    // listener, a TIME_WAIT remnant, or nothing.
    let owner = socket_state(ctx, &mut tuple, tuple_len);
    let connected = matches!(owner, Some(state) if state != TCP_LISTEN && state != TCP_TIME_WAIT);

    let (verdict, refused) = if transport.fragment == Fragment::First {
        // Reassembly happens after this program; only a connection's own socket can be trusted
        // to receive the whole segment (the kernel drops overlapping fragments).
        if bypass || (connected && owner != Some(TCP_NEW_SYN_RECV)) {
            return Ok(PASS);
        }
        (
            TraceVerdict::DropFragment,
            "a first fragment no connection owns",
        )
    } else {
        let flags: u8 = ctx
            .load(transport.offset + TCP_FLAGS_OFFSET)
            .map_err(|_| ())?;
        // A SYN opens a connection; so does the ACK of a SYN cookie, which meets no connection
        // and is taken by the listener (one sent while ztunnel's listener was flooded names the
        // original destination, and the app's listener would accept it).
        let opens = flags & (TCP_SYN | TCP_ACK) == TCP_SYN
            || (flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_ACK
                && owner == Some(TCP_LISTEN)
                && !redirected_by_netfilter(ctx, packet, sport));
        if bypass {
            if opens {
                count(netns, |c: &mut PodCounters| &mut c.bypassed);
                trace!(
                    TraceHook::TcIngress,
                    if from_node_probe {
                        TraceVerdict::ProbeBypass
                    } else {
                        TraceVerdict::PassInboundBypass
                    },
                    netns,
                    TCP,
                    (&packet.source, u16::from_be(sport)),
                    (&packet.destination, u16::from_be(dport)),
                    NOWHERE
                );
            }
            return Ok(PASS);
        }
        if connected || !opens {
            return Ok(PASS);
        }
        let connection = ConnectionKey {
            client: Endpoint::new(packet.source, u16::from_be(sport)),
            listener: Endpoint::new(packet.destination, u16::from_be(dport)),
        };
        let handoff = pod.has(POD_SOCKET_LOOKUP_HANDOFF);
        let proxy = if sidecar {
            Proxy::Sidecar
        } else {
            Proxy::Ztunnel
        };
        if assign_to_proxy(
            ctx,
            &mut tuple,
            tuple_len,
            INBOUND_PORT,
            proxy,
            &connection,
            handoff,
        ) {
            diag!(
                by_ref debug,
                ctx.skb.skb,
                "netns {}: inbound {:i} to {:i}:{} assigned to 15006",
                netns,
                ip(&packet.source),
                ip(&packet.destination),
                u16::from_be(dport)
            );
            count(netns, |c: &mut PodCounters| &mut c.inbound);
            trace!(
                TraceHook::TcIngress,
                TraceVerdict::Inbound,
                netns,
                TCP,
                (&packet.source, u16::from_be(sport)),
                (&packet.destination, u16::from_be(dport)),
                (&packet.destination, INBOUND_PORT)
            );
            return Ok(PASS);
        }
        // The proxy is not listening in this pod (yet): refuse to deliver around it.
        (proxy.absent(), "the proxy's 15006 listener not found")
    };
    diag!(
        by_ref warn,
        ctx.skb.skb,
        "netns {}: drop TCP {:i} to {:i}:{}: {}",
        netns,
        ip(&packet.source),
        ip(&packet.destination),
        u16::from_be(dport),
        refused
    );
    trace!(
        TraceHook::TcIngress,
        verdict,
        netns,
        TCP,
        (&packet.source, u16::from_be(sport)),
        (&packet.destination, u16::from_be(dport)),
        NOWHERE
    );
    Ok(drop_counted(netns))
}

#[classifier]
pub fn weir_reroute(ctx: TcContext) -> i32 {
    on_rerouted_packet(&ctx, reroute)
}

/// The entry of a rerouted interface's tc ingress program: `verdict` on each IP packet, and a
/// packet whose headers it cannot read dropped, as for [`decide`].
#[inline(always)]
pub(crate) fn on_rerouted_packet(
    ctx: &TcContext,
    verdict: impl FnOnce(&TcContext, &NetworkHeader) -> Result<i32, ()>,
) -> i32 {
    let packet = match network_header(ctx) {
        Payload::Ip(packet) => packet,
        Payload::Other => return PASS,
        Payload::TooManyTags => return drop_vlan(TraceHook::Reroute),
    };
    verdict(ctx, &packet).unwrap_or_else(|()| {
        diag!(
            by_ref warn,
            ctx.skb.skb,
            "rerouted interface: drop {:i} to {:i}: headers not readable",
            ip_fixed(&packet.source),
            ip_fixed(&packet.destination)
        );
        trace!(
            TraceHook::Reroute,
            TraceVerdict::DropUnparsable,
            0,
            0,
            (&packet.source, 0),
            (&packet.destination, 0),
            NOWHERE
        );
        DROP
    })
}

/// The verdict on a packet that arrived on a rerouted interface: new TCP goes to ztunnel's
/// outbound listener with its destination recorded; `Err` as for [`decide`].
#[inline(always)]
fn reroute(ctx: &TcContext, packet: &NetworkHeader) -> Result<i32, ()> {
    let transport = transport(ctx, packet)?;
    if transport.fragment == Fragment::Later || transport.protocol != IPPROTO_TCP {
        return Ok(PASS);
    }
    // SAFETY: a field of the context the kernel hands tc programs.
    let netns = pod_in_slot(unsafe { (*ctx.skb.skb).tc_classid }).unwrap_or(0);
    let proxy = match pod(netns) {
        Some(pod) if pod.has(POD_SIDECAR) => {
            // Not rerouted: forwarded, as the agent's rules leave it.
            if !sidecar::reroutes(netns, pod, &packet.destination) {
                return Ok(PASS);
            }
            Proxy::Sidecar
        }
        _ => Proxy::Ztunnel,
    };
    let (sport, dport): (u16, u16) = (
        ctx.load(transport.offset).map_err(|_| ())?,
        ctx.load(transport.offset + 2).map_err(|_| ())?,
    );
    let (mut tuple, tuple_len) = sock_tuple(packet, sport, dport);
    let owner = socket_state(ctx, &mut tuple, tuple_len);
    // ztunnel's accepted socket for an earlier SYN, which the routing rule delivers to.
    let connected = matches!(owner, Some(state) if state != TCP_LISTEN && state != TCP_TIME_WAIT);
    if transport.fragment == Fragment::First {
        if connected && owner != Some(TCP_NEW_SYN_RECV) {
            return Ok(PASS);
        }
        trace!(
            TraceHook::Reroute,
            TraceVerdict::DropFragment,
            netns,
            TCP,
            (&packet.source, u16::from_be(sport)),
            (&packet.destination, u16::from_be(dport)),
            NOWHERE
        );
        return Ok(DROP);
    }
    let flags: u8 = ctx
        .load(transport.offset + TCP_FLAGS_OFFSET)
        .map_err(|_| ())?;
    if connected || flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
        return Ok(PASS);
    }
    let original = Endpoint::new(packet.destination, u16::from_be(dport));
    let connection = ConnectionKey {
        client: Endpoint::new(packet.source, u16::from_be(sport)),
        // TPROXY semantics: ztunnel's accepted socket has the original destination as its
        // local address.
        listener: original,
    };
    // Recorded before the SYN can reach ztunnel, which asks as soon as it accepts. The VM
    // chooses the source, so the key may be another pod's connection: an entry is never
    // overwritten or removed here, only written where there is none (or the same, for a
    // retransmitted SYN).
    let (verdict, refused) = match CONN_ORIG_DST.insert(connection, original, BPF_NOEXIST.into()) {
        Err(_) if original_destination(&connection) != Some(original) => {
            (TraceVerdict::DropTupleTaken, "the connection is another's")
        }
        inserted => {
            // The agent attaches the hand-off program to every pod's netns where the kernel
            // needs it.
            if assign_to_proxy(
                ctx,
                &mut tuple,
                tuple_len,
                OUTBOUND_PORT,
                proxy,
                &connection,
                true,
            ) {
                diag!(
                    by_ref debug,
                    ctx.skb.skb,
                    "rerouted {:i} to {:i}:{} assigned to 15001",
                    ip_fixed(&packet.source),
                    ip_fixed(&packet.destination),
                    u16::from_be(dport)
                );
                trace!(
                    TraceHook::Reroute,
                    TraceVerdict::Outbound,
                    netns,
                    TCP,
                    (&packet.source, u16::from_be(sport)),
                    (&packet.destination, u16::from_be(dport)),
                    (&packet.destination, OUTBOUND_PORT)
                );
                count(netns, |c: &mut PodCounters| &mut c.outbound);
                return Ok(PASS);
            }
            if inserted.is_ok() {
                let _ = CONN_ORIG_DST.remove(connection);
            }
            (proxy.absent(), "the proxy's 15001 listener not found")
        }
    };
    diag!(
        by_ref warn,
        ctx.skb.skb,
        "drop rerouted {:i} to {:i}:{}: {}",
        ip_fixed(&packet.source),
        ip_fixed(&packet.destination),
        u16::from_be(dport),
        refused
    );
    trace!(
        TraceHook::Reroute,
        verdict,
        netns,
        TCP,
        (&packet.source, u16::from_be(sport)),
        (&packet.destination, u16::from_be(dport)),
        NOWHERE
    );
    Ok(DROP)
}

/// The verdict that drops a packet for the pod, counted in its `dropped` counter.
#[inline(always)]
pub(crate) fn drop_counted(netns: u64) -> i32 {
    count(netns, |c: &mut PodCounters| &mut c.dropped);
    DROP
}

/// The socket lookup tuple for a segment (ports in network order) and the length of its
/// family's part.
#[inline(always)]
fn sock_tuple(packet: &NetworkHeader, sport: u16, dport: u16) -> (bpf_sock_tuple, u32) {
    // SAFETY: an all-zero tuple is a valid value of this plain C union.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    // Network order; an IPv4 address is the last word of its v4-mapped key.
    let (saddr, daddr) = (v6_words(&packet.source), v6_words(&packet.destination));
    if packet.v6 {
        tuple.__bindgen_anon_1.ipv6 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
            saddr,
            daddr,
            sport,
            dport,
        };
        (tuple, IPV6_TUPLE_LEN)
    } else {
        tuple.__bindgen_anon_1.ipv4 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
            saddr: saddr[3],
            daddr: daddr[3],
            sport,
            dport,
        };
        (tuple, IPV4_TUPLE_LEN)
    }
}

/// Whether the segment belongs to a connection that netfilter's `REDIRECT` to 15006 made before
/// weir took the pod over from iptables rules (istio-cni's, istio-init's): the proxy has it, or
/// its handshake, at the pod's address and 15006, and conntrack maps the segment there after
/// this program, so it is no SYN cookie's ACK for the proxy's listener (assigned to the
/// listener, the handshake's last ACK would miss its request and the connection would stall).
/// Only netfilter makes that tuple: weir's own hand-off keeps the original destination as the
/// local address.
#[inline(always)]
fn redirected_by_netfilter(ctx: &TcContext, packet: &NetworkHeader, sport: u16) -> bool {
    let (mut tuple, len) = sock_tuple(packet, sport, INBOUND_PORT.to_be());
    matches!(
        socket_state(ctx, &mut tuple, len),
        Some(state) if state != TCP_LISTEN && state != TCP_TIME_WAIT
    )
}

/// The TCP state of the socket the kernel would deliver `tuple` to, if any.
#[inline(always)]
fn socket_state(ctx: &TcContext, tuple: &mut bpf_sock_tuple, len: u32) -> Option<u32> {
    let socket = lookup(ctx, tuple, len);
    if socket.is_null() {
        return None;
    }
    // SAFETY: non-null socket from a lookup; released right after reading its state.
    unsafe {
        let state = ctx_read!(socket, state);
        bpf_sk_release(socket as *mut c_void);
        Some(state)
    }
}

/// Whether HBONE to this tuple goes where istio sends it, ztunnel's 15008 listener: a packet of
/// a connection goes to its socket, and one that would open a connection (the tuple's owner is a
/// listener, or a TIME_WAIT remnant that passes a SYN on to it) only to a listener ztunnel made
/// ([`ztunnel::listens_for_ztunnel`]). An app holding 15008 while ztunnel is away gets nothing.
#[inline(always)]
fn hbone_reaches_ztunnel(ctx: &TcContext, tuple: &mut bpf_sock_tuple, len: u32) -> bool {
    let socket = lookup(ctx, tuple, len);
    if socket.is_null() {
        // Nothing listens: the kernel refuses the connection itself.
        return true;
    }
    // SAFETY: non-null socket from a lookup, released before returning.
    unsafe {
        let state = ctx_read!(socket, state);
        let reaches = if state == TCP_LISTEN || state == TCP_TIME_WAIT {
            let full = bpf_sk_fullsock(socket);
            !full.is_null() && ztunnel::listens_for_ztunnel(full)
        } else {
            true
        };
        bpf_sk_release(socket as *mut c_void);
        reaches
    }
}

/// Whose listener a new connection is handed to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Proxy {
    /// ztunnel's, and only a socket that is ztunnel's ([`ztunnel::listens_for_ztunnel`]).
    Ztunnel,
    /// A sidecar pod's istio-proxy: any listener on the port, as istio's `REDIRECT`.
    Sidecar,
}

impl Proxy {
    /// The verdict on a new connection this proxy was not listening for.
    #[inline(always)]
    fn absent(self) -> TraceVerdict {
        match self {
            Self::Ztunnel => TraceVerdict::DropNoZtunnel,
            Self::Sidecar => TraceVerdict::DropNoProxy,
        }
    }
}

/// Hands the packet of `connection` to the proxy's listener on `port` in this netns; false when
/// there is none. Before 6.5 the kernel refuses to assign a reuseport listener here: then the
/// listener is handed off through the socket lookup, where `handoff` says the pod's netns has
/// the program for it ([`crate::handoff`]).
#[inline(always)]
fn assign_to_proxy(
    ctx: &TcContext,
    tuple: &mut bpf_sock_tuple,
    len: u32,
    port: u16,
    proxy: Proxy,
    connection: &ConnectionKey,
    handoff: bool,
) -> bool {
    // The member written is the one `len` says is in use.
    if len == IPV4_TUPLE_LEN {
        tuple.__bindgen_anon_1.ipv4.dport = port.to_be();
    } else {
        tuple.__bindgen_anon_1.ipv6.dport = port.to_be();
    }
    let listener = lookup(ctx, tuple, len);
    if listener.is_null() {
        return false;
    }
    // SAFETY: non-null socket from a lookup, released before returning.
    unsafe {
        let mut assigned = false;
        let full = bpf_sk_fullsock(listener);
        if ctx_read!(listener, state) == TCP_LISTEN
            && !full.is_null()
            && (proxy == Proxy::Sidecar || ztunnel::listens_for_ztunnel(full))
        {
            let result = bpf_sk_assign(ctx.skb.skb as *mut c_void, listener as *mut c_void, 0);
            assigned = result == 0
                || (result == -handoff::ESOCKTNOSUPPORT
                    && handoff
                    && handoff::hand_off(connection, listener));
        }
        bpf_sk_release(listener as *mut c_void);
        assigned
    }
}

#[inline(always)]
fn lookup(ctx: &TcContext, tuple: &mut bpf_sock_tuple, len: u32) -> *mut bpf_sock {
    // SAFETY: the tuple lives on the stack and `len` matches its family's part.
    unsafe {
        bpf_skc_lookup_tcp(
            ctx.skb.skb as *mut c_void,
            tuple as *mut bpf_sock_tuple,
            len,
            BPF_F_CURRENT_NETNS,
            0,
        )
    }
}
