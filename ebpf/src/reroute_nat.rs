//! Rerouted interfaces of a sidecar pod in REDIRECT mode. [`crate::inbound::weir_reroute`] hands
//! a rerouted connection to the outbound listener with its original destination as the local
//! address, which only a transparent listener can answer from, and the proxy's listeners are
//! transparent only in TPROXY mode. Here, as istio's `REDIRECT` does, the connection is
//! translated instead: [`weir_nat_in`] (tc ingress on the interface) sends it to the proxy's
//! 15001 at the pod's own address, and [`weir_nat_out`] (tc egress there) gives the proxy's
//! replies the original destination back as their source. The original destination is recorded
//! for `SO_ORIGINAL_DST` under the tuple the proxy's accepted socket sees, as for the pod's own
//! outbound.
//!
//! The translation of each connection is kept in `REROUTE_NAT` in both directions, the SYN
//! making it: `(client, original)` to the proxy's endpoint, and `(client, proxy)` to the
//! original. The map is LRU, as `CONN_ORIG_DST` is: there is no end-of-connection hook here, so
//! entries of finished connections are recycled as new ones need room. Only the included
//! destinations are translated ([`crate::sidecar::reroutes`]); everything else is routed as the
//! pod routes it. The agent's routing rules for the interface are those of `weir_reroute`: a
//! translated connection is for a local address anyway, and until this program is attached
//! (an interface that has just appeared) they deliver rerouted TCP locally, where nothing
//! listens for it, instead of forwarding it around the proxy.
use aya_ebpf::{
    bindings::BPF_F_PSEUDO_HDR, helpers::generated::bpf_csum_diff, macros::classifier,
    programs::TcContext,
};
use weir_common::{
    ConnectionKey, Endpoint, IpKey, PodCounters, TraceHook, TraceVerdict, OUTBOUND_PORT,
    POD_SIDECAR,
};

use crate::{
    inbound::{
        network_header, on_rerouted_packet, transport, Fragment, NetworkHeader, Payload, DROP,
        IPPROTO_TCP, PASS, TCP_ACK, TCP_FLAGS_OFFSET, TCP_SYN,
    },
    maps::{count, pod, pod_in_slot, Translation, CONN_ORIG_DST, NAT_SCRATCH, REROUTE_NAT},
    outbound::pod_address_like,
    sidecar,
    trace::{trace, NOWHERE, TCP},
};

const IPV4_CHECKSUM_OFFSET: usize = 10;
const IPV4_SOURCE_OFFSET: usize = 12;
const IPV4_DESTINATION_OFFSET: usize = 16;
const IPV6_SOURCE_OFFSET: usize = 8;
const IPV6_DESTINATION_OFFSET: usize = 24;
const TCP_CHECKSUM_OFFSET: usize = 16;

/// Which end of a packet [`rewrite`] changes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    Source,
    Destination,
}

#[classifier]
pub fn weir_nat_in(ctx: TcContext) -> i32 {
    on_rerouted_packet(&ctx, translate_in)
}

/// A packet arriving on the interface: TCP to an included destination goes to the proxy's
/// outbound listener at the pod's address. `Err` when its headers cannot be read or rewritten.
#[inline(always)]
fn translate_in(ctx: &TcContext, packet: &NetworkHeader) -> Result<i32, ()> {
    let transport = transport(ctx, packet)?;
    if transport.fragment == Fragment::Later || transport.protocol != IPPROTO_TCP {
        return Ok(PASS);
    }
    // SAFETY: a field of the context the kernel hands tc programs.
    let netns = pod_in_slot(unsafe { (*ctx.skb.skb).tc_classid }).unwrap_or(0);
    let Some(pod) = pod(netns).filter(|pod| pod.has(POD_SIDECAR)) else {
        return Ok(PASS);
    };
    if !sidecar::reroutes(netns, pod, &packet.destination) {
        return Ok(PASS);
    }
    // Its later fragments keep the original destination: they could never be reassembled.
    if transport.fragment == Fragment::First {
        trace!(
            TraceHook::Reroute,
            TraceVerdict::DropFragment,
            netns,
            TCP,
            (&packet.source, 0),
            (&packet.destination, 0),
            NOWHERE
        );
        return Ok(DROP);
    }
    let Some(translation) = NAT_SCRATCH.get_ptr_mut(0) else {
        return Ok(PASS);
    };
    // SAFETY: this CPU's scratch value, used by this program run alone.
    let translation = unsafe { &mut *translation };
    translation.forward.client = Endpoint::new(
        packet.source,
        u16::from_be(ctx.load(transport.offset).map_err(|_| ())?),
    );
    translation.forward.listener = Endpoint::new(
        packet.destination,
        u16::from_be(ctx.load(transport.offset + 2).map_err(|_| ())?),
    );
    translation.reverse.client = translation.forward.client;
    let forward = &translation.forward;
    // SAFETY: a lookup in a map of plain values, copied out.
    match unsafe { REROUTE_NAT.get(forward) } {
        Some(proxy) => translation.reverse.listener = *proxy,
        None => {
            let flags: u8 = ctx
                .load(transport.offset + TCP_FLAGS_OFFSET)
                .map_err(|_| ())?;
            // Only a SYN opens a translation; anything else of a connection not known here
            // is routed as it would be without weir.
            if flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
                return Ok(PASS);
            }
            let Some(address) = pod_address_like(pod, &packet.destination) else {
                return Ok(PASS);
            };
            translation.reverse.listener = Endpoint::new(address, OUTBOUND_PORT);
            if !record(translation) {
                trace_in(netns, translation, TraceVerdict::DropTupleTaken, NOWHERE);
                return Ok(DROP);
            }
            count(netns, |c: &mut PodCounters| &mut c.outbound);
            let proxy = &translation.reverse.listener;
            trace_in(
                netns,
                translation,
                TraceVerdict::Outbound,
                (&proxy.ip, proxy.port),
            );
        }
    }
    rewrite(
        ctx,
        packet,
        transport.offset,
        End::Destination,
        &translation.forward.listener,
        &translation.reverse.listener,
    )?;
    Ok(PASS)
}

#[inline(always)]
fn trace_in(netns: u64, translation: &Translation, verdict: TraceVerdict, to: (&IpKey, u16)) {
    let (client, original) = (&translation.forward.client, &translation.forward.listener);
    trace!(
        TraceHook::Reroute,
        verdict,
        netns,
        TCP,
        (&client.ip, client.port),
        (&original.ip, original.port),
        to
    );
}

/// Records a new connection's translation and its original destination; false when the tuple
/// the proxy would see is another connection's (the VM chooses its source: it may claim the
/// pod's own address and port), which is never overwritten. A retransmitted SYN finds its own.
#[inline(always)]
fn record(translation: &Translation) -> bool {
    let (forward, reverse) = (&translation.forward, &translation.reverse);
    let (original, proxy) = (&forward.listener, &reverse.listener);
    // SAFETY: lookups in maps of plain values.
    let taken = |value: Option<&Endpoint>| value.is_some_and(|taken| taken != original);
    if taken(unsafe { REROUTE_NAT.get(reverse) }) || taken(unsafe { CONN_ORIG_DST.get(reverse) }) {
        return false;
    }
    REROUTE_NAT.insert(reverse, original, 0).is_ok()
        && REROUTE_NAT.insert(forward, proxy, 0).is_ok()
        && CONN_ORIG_DST.insert(reverse, original, 0).is_ok()
}

#[classifier]
pub fn weir_nat_out(ctx: TcContext) -> i32 {
    let Payload::Ip(packet) = network_header(&ctx) else {
        return PASS;
    };
    // Nothing else leaves by this program's hand: a packet it cannot read passes as it is.
    translate_out(&ctx, &packet).unwrap_or(PASS)
}

/// A packet leaving by the interface: the proxy's side of a translated connection gets the
/// original destination back as its source.
#[inline(always)]
fn translate_out(ctx: &TcContext, packet: &NetworkHeader) -> Result<i32, ()> {
    let transport = transport(ctx, packet)?;
    if transport.fragment == Fragment::Later || transport.protocol != IPPROTO_TCP {
        return Ok(PASS);
    }
    let sport = u16::from_be(ctx.load(transport.offset).map_err(|_| ())?);
    if sport != OUTBOUND_PORT {
        return Ok(PASS);
    }
    let dport = u16::from_be(ctx.load(transport.offset + 2).map_err(|_| ())?);
    let proxy = Endpoint::new(packet.source, sport);
    let reverse = &ConnectionKey {
        client: Endpoint::new(packet.destination, dport),
        listener: proxy,
    };
    // SAFETY: a lookup in a map of plain values, copied out.
    let Some(original) = (unsafe { REROUTE_NAT.get(reverse) }).copied() else {
        return Ok(PASS);
    };
    rewrite(
        ctx,
        packet,
        transport.offset,
        End::Source,
        &proxy,
        &original,
    )?;
    Ok(PASS)
}

/// Rewrites one end of a TCP packet from `from` to `to`, address and port, with the checksums
/// (the TCP one covers the addresses through its pseudo-header).
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    packet: &NetworkHeader,
    tcp: usize,
    end: End,
    from: &Endpoint,
    to: &Endpoint,
) -> Result<(), ()> {
    let tcp_checksum = tcp + TCP_CHECKSUM_OFFSET;
    if let (false, Some(old), Some(new)) = (packet.v6, from.ip.v4(), to.ip.v4()) {
        let at = packet.offset
            + match end {
                End::Source => IPV4_SOURCE_OFFSET,
                End::Destination => IPV4_DESTINATION_OFFSET,
            };
        let (old, new) = (u32::from_ne_bytes(old), u32::from_ne_bytes(new));
        ctx.store(at, &new, 0).map_err(|_| ())?;
        ctx.l3_csum_replace(
            packet.offset + IPV4_CHECKSUM_OFFSET,
            old.into(),
            new.into(),
            4,
        )
        .map_err(|_| ())?;
        ctx.l4_csum_replace(
            tcp_checksum,
            old.into(),
            new.into(),
            u64::from(BPF_F_PSEUDO_HDR) | 4,
        )
        .map_err(|_| ())?;
    } else if packet.v6 {
        let at = packet.offset
            + match end {
                End::Source => IPV6_SOURCE_OFFSET,
                End::Destination => IPV6_DESTINATION_OFFSET,
            };
        // SAFETY: both buffers are 16 bytes, as the sizes say; the helper only reads them.
        let diff = unsafe {
            bpf_csum_diff(
                from.ip.octets.as_ptr() as *mut u32,
                16,
                to.ip.octets.as_ptr() as *mut u32,
                16,
                0,
            )
        };
        if diff < 0 {
            return Err(());
        }
        ctx.store(at, &to.ip.octets, 0).map_err(|_| ())?;
        ctx.l4_csum_replace(tcp_checksum, 0, diff as u64, u64::from(BPF_F_PSEUDO_HDR))
            .map_err(|_| ())?;
    } else {
        return Err(());
    }
    let port_at = tcp
        + match end {
            End::Source => 0,
            End::Destination => 2,
        };
    let (old_port, new_port) = (from.port.to_be(), to.port.to_be());
    ctx.store(port_at, &new_port, 0).map_err(|_| ())?;
    ctx.l4_csum_replace(tcp_checksum, old_port.into(), new_port.into(), 2)
        .map_err(|_| ())
}
