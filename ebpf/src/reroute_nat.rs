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
//! The translation of each connection is kept in its pod's own map
//! ([`crate::maps::translations`], the pod told by the filters' classid) in both directions,
//! the SYN making it: `(client, original)` to the proxy's endpoint, and `(client, proxy)` to the
//! original. Every KubeVirt VM has the same address, so only the pod tells two VMs' connections
//! apart. A connection's entries go when tc sees it end: a RST either way, or once each side
//! has acknowledged the other's FIN (the packet doing so is translated first). What tc cannot
//! see end (a peer that vanished, a SYN never answered) stays until the pod's map, LRU and
//! bounded, recycles it: a pod's VM can push out its own pod's translations, never another
//! pod's. Only the included destinations are translated ([`crate::sidecar::reroutes`]);
//! everything else is routed as the pod routes it. The agent's routing rules for the interface
//! are those of `weir_reroute`: a translated connection is for a local address anyway, and a
//! packet of an included destination that finds no translation (the program not attached yet,
//! a connection's entries gone) is delivered locally, where nothing listens for it, instead of
//! being forwarded around the proxy.
use aya_ebpf::{
    bindings::BPF_F_PSEUDO_HDR, helpers::generated::bpf_csum_diff, macros::classifier,
    programs::TcContext,
};
use weir_common::{
    ConnectionKey, Endpoint, IpKey, NatEntry, PodCounters, TraceHook, TraceVerdict, OUTBOUND_PORT,
    POD_SIDECAR,
};

use crate::{
    in_pod::pod_address_like,
    inbound::{
        drop_counted, network_header, on_rerouted_packet, transport, Fragment, NetworkHeader,
        Payload, DROP, IPPROTO_TCP, PASS, TCP_ACK, TCP_FLAGS_OFFSET, TCP_RST, TCP_SYN,
    },
    maps::{
        count, pod, pod_in_slot, translations, PodTranslations, Translation, CONN_ORIG_DST,
        NAT_SCRATCH,
    },
    sidecar,
    trace::{trace, NOWHERE, TCP},
};

const IPV4_TOTAL_LENGTH_OFFSET: usize = 2;
const IPV4_CHECKSUM_OFFSET: usize = 10;
const IPV4_SOURCE_OFFSET: usize = 12;
const IPV4_DESTINATION_OFFSET: usize = 16;
const IPV6_PAYLOAD_LENGTH_OFFSET: usize = 4;
const IPV6_HEADER_LEN: usize = 40;
const IPV6_SOURCE_OFFSET: usize = 8;
const IPV6_DESTINATION_OFFSET: usize = 24;
const TCP_SEQUENCE_OFFSET: usize = 4;
const TCP_ACK_NUMBER_OFFSET: usize = 8;
const TCP_DATA_OFFSET_OFFSET: usize = 12;
const TCP_CHECKSUM_OFFSET: usize = 16;
const TCP_FIN: u8 = 0x01;

/// Which end of a packet [`rewrite`] changes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    Source,
    Destination,
}

/// What following a connection's end takes from one of its packets.
struct Segment {
    flags: u8,
    ack: u32,
    /// The acknowledgment number that acknowledges this segment, were it a FIN: its sequence
    /// number, its payload's length and the FIN's one. `None` when the IP header's length does
    /// not hold the TCP header (a GSO packet past 64 KiB): such a FIN ends nothing.
    fin_ack: Option<u32>,
}

impl Segment {
    #[inline(always)]
    fn read(ctx: &TcContext, packet: &NetworkHeader, tcp: usize) -> Result<Self, ()> {
        let load_u32 = |at: usize| ctx.load::<u32>(at).map(u32::from_be).map_err(|_| ());
        let flags: u8 = ctx.load(tcp + TCP_FLAGS_OFFSET).map_err(|_| ())?;
        let data_offset: u8 = ctx.load(tcp + TCP_DATA_OFFSET_OFFSET).map_err(|_| ())?;
        let ip_length = |at: usize| ctx.load::<u16>(at).map(u16::from_be).map_err(|_| ());
        let ip_end = match packet.v6 {
            false => {
                packet.offset + usize::from(ip_length(packet.offset + IPV4_TOTAL_LENGTH_OFFSET)?)
            }
            true => {
                packet.offset
                    + IPV6_HEADER_LEN
                    + usize::from(ip_length(packet.offset + IPV6_PAYLOAD_LENGTH_OFFSET)?)
            }
        };
        let payload = ip_end.checked_sub(tcp + usize::from(data_offset >> 4) * 4);
        let sequence = load_u32(tcp + TCP_SEQUENCE_OFFSET)?;
        Ok(Self {
            flags,
            ack: load_u32(tcp + TCP_ACK_NUMBER_OFFSET)?,
            fin_ack: payload.map(|payload| sequence.wrapping_add(payload as u32).wrapping_add(1)),
        })
    }

    #[inline(always)]
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
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
    // SAFETY: this CPU's scratch value, used by this program run alone (tc runs with bottom
    // halves disabled: no other program run on this CPU starts before this one ends).
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
    let segment = Segment::read(ctx, packet, transport.offset)?;
    let connections = translations(netns);
    // A SYN records its connection afresh, also over the entries a connection that ended
    // unseen left on its tuple, whose end state is not this connection's.
    let syn = segment.flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let forward = &translation.forward;
    let entry = connections
        .filter(|_| !syn)
        .and_then(|connections| connections.get_ptr_mut(forward));
    match entry {
        // SAFETY: an entry of the pod's map, read in place.
        Some(entry) => translation.reverse.listener = unsafe { (*entry).to },
        None => {
            // Only a SYN opens a translation; anything else of a connection not known here
            // is routed as it would be without weir.
            if !syn {
                return Ok(PASS);
            }
            let Some(address) = pod_address_like(pod, &packet.destination) else {
                return Ok(PASS);
            };
            translation.reverse.listener = Endpoint::new(address, OUTBOUND_PORT);
            if !connections.is_some_and(|connections| record(connections, translation)) {
                trace_in(netns, translation, TraceVerdict::DropTupleTaken, NOWHERE);
                return Ok(drop_counted(netns));
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
    if let (Some(connections), Some(entry)) = (connections, entry) {
        follow_end(
            connections,
            translation,
            entry,
            &translation.reverse,
            &segment,
        );
    }
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

/// Records a new connection's translation in its pod's map, and its original destination;
/// false when the tuple the proxy would see is another connection's (the VM chooses its source:
/// it may claim the pod's own address and port), which is never overwritten, or when an entry
/// cannot be made. A retransmitted SYN finds its own, and records it again.
#[inline(always)]
fn record(connections: &PodTranslations, translation: &Translation) -> bool {
    let (forward, reverse) = (&translation.forward, &translation.reverse);
    let (original, proxy) = (&forward.listener, &reverse.listener);
    // SAFETY: lookups in maps of plain values.
    let taken = unsafe {
        connections
            .get(reverse)
            .is_some_and(|taken| taken.to != *original)
            || CONN_ORIG_DST
                .get(reverse)
                .is_some_and(|taken| taken != original)
    };
    !taken
        && connections
            .insert(reverse, NatEntry::new(*original), 0)
            .is_ok()
        && connections
            .insert(forward, NatEntry::new(*proxy), 0)
            .is_ok()
        && CONN_ORIG_DST.insert(reverse, original, 0).is_ok()
}

/// Follows a translated connection's end from one of its packets (`segment`), whose direction's
/// entry is `entry` and the other direction's is keyed `other`: a RST ends the connection; a
/// FIN tells the other direction which acknowledgment takes it; and the connection ends when
/// this packet acknowledges the other side's FIN after the other side acknowledged this one's.
/// What comes after (a lost last ACK's retransmitted FIN) finds no translation: it is
/// delivered locally or to the VM untranslated, and answered with a reset.
#[inline(always)]
fn follow_end(
    connections: &PodTranslations,
    translation: &Translation,
    entry: *mut NatEntry,
    other: &ConnectionKey,
    segment: &Segment,
) {
    if segment.has(TCP_RST) {
        forget(connections, translation);
        return;
    }
    if let (true, Some(fin_ack)) = (segment.has(TCP_FIN), segment.fin_ack) {
        if let Some(other) = connections.get_ptr_mut(other) {
            // SAFETY: an entry of the pod's map, written in place; only this direction writes
            // these fields, the acknowledgment first.
            unsafe {
                (*other).peer_fin_ack = fin_ack;
                (*other).peer_fin = 1;
            }
        }
    }
    // SAFETY: as above; `peer_fin*` are the other direction's to write, `peer_fin_acked` this
    // one's.
    let entry = unsafe { &mut *entry };
    let acknowledges_peer_fin = entry.peer_fin != 0
        && segment.has(TCP_ACK)
        && segment.ack.wrapping_sub(entry.peer_fin_ack) as i32 >= 0;
    if !acknowledges_peer_fin {
        return;
    }
    entry.peer_fin_acked = 1;
    // SAFETY: a lookup in a map of plain values.
    if unsafe { connections.get(other) }.is_some_and(|other| other.peer_fin_acked != 0) {
        forget(connections, translation);
    }
}

/// Removes an ended connection's translation, and its original destination unless another
/// connection has the tuple since.
#[inline(always)]
fn forget(connections: &PodTranslations, translation: &Translation) {
    let (forward, reverse) = (&translation.forward, &translation.reverse);
    let _ = connections.remove(forward);
    let _ = connections.remove(reverse);
    // SAFETY: a lookup in a map of plain values.
    if unsafe { CONN_ORIG_DST.get(reverse) } == Some(&forward.listener) {
        let _ = CONN_ORIG_DST.remove(reverse);
    }
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
    // SAFETY: as in `translate_in`.
    let Some(netns) = pod_in_slot(unsafe { (*ctx.skb.skb).tc_classid }) else {
        return Ok(PASS);
    };
    let (Some(connections), Some(translation)) = (translations(netns), NAT_SCRATCH.get_ptr_mut(0))
    else {
        return Ok(PASS);
    };
    // SAFETY: as in `translate_in`.
    let translation = unsafe { &mut *translation };
    let dport = u16::from_be(ctx.load(transport.offset + 2).map_err(|_| ())?);
    translation.reverse.client = Endpoint::new(packet.destination, dport);
    translation.reverse.listener = Endpoint::new(packet.source, sport);
    let reverse = &translation.reverse;
    let Some(entry) = connections.get_ptr_mut(reverse) else {
        return Ok(PASS);
    };
    translation.forward.client = translation.reverse.client;
    // SAFETY: an entry of the pod's map, read in place.
    translation.forward.listener = unsafe { (*entry).to };
    let segment = Segment::read(ctx, packet, transport.offset)?;
    rewrite(
        ctx,
        packet,
        transport.offset,
        End::Source,
        &translation.reverse.listener,
        &translation.forward.listener,
    )?;
    follow_end(
        connections,
        translation,
        entry,
        &translation.forward,
        &segment,
    );
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
