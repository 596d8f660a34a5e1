//! Inbound: tc ingress on an enrolled pod's interfaces. A new TCP connection for the pod is
//! handed to ztunnel's 15006 listener with `bpf_sk_assign`, keeping the packet's destination, so
//! ztunnel's accepted socket has the original destination as its local address (TPROXY
//! semantics; no NAT, no conntrack). Established connections, HBONE (15008) and the node's probes
//! pass untouched.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{
        bpf_sock, bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2, TC_ACT_OK, TC_ACT_SHOT,
    },
    helpers::gen::{bpf_sk_assign, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
};
use weir_common::{
    IpKey, PodCounters, HBONE_PORT, INBOUND_PORT, POD_INBOUND_BYPASS, PROBE_SOURCE_V4,
    PROBE_SOURCE_V6,
};

use crate::{
    diag::{diag, ip},
    maps::{count, PODS, POD_IPS},
    net::{ctx_read, ip_from_v4_word, same_ip, v6_words},
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPV6_HLEN: usize = 40;
const IPV4_FRAGMENT_OFFSET: u16 = 0x1fff;
const TCP_FLAGS_OFFSET: usize = 13;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
const TCP_LISTEN: u32 = 10;
/// Sizes of the IPv4 and IPv6 parts of `bpf_sock_tuple`.
const IPV4_TUPLE_LEN: u32 = 12;
const IPV6_TUPLE_LEN: u32 = 36;
/// Look sockets up in the netns the packet is in (the pod's).
const BPF_F_CURRENT_NETNS: u64 = u64::MAX;

#[classifier]
pub fn weir_inbound(ctx: TcContext) -> i32 {
    match steer(&ctx) {
        Ok(verdict) => verdict,
        Err(()) => TC_ACT_OK as i32,
    }
}

/// A parsed inbound TCP segment: the lookup tuple in network order, and what the decision needs.
struct Segment {
    tuple: bpf_sock_tuple,
    tuple_len: u32,
    source: IpKey,
    destination: IpKey,
    dport: u16,
    flags: u8,
}

#[inline(always)]
fn steer(ctx: &TcContext) -> Result<i32, ()> {
    let Some(segment) = parse(ctx)? else {
        return Ok(TC_ACT_OK as i32);
    };
    if segment.dport == HBONE_PORT {
        return Ok(TC_ACT_OK as i32);
    }
    let Some(netns) = POD_IPS.get(&segment.destination).copied() else {
        return Ok(TC_ACT_OK as i32);
    };
    let Some(pod) = PODS.get(&netns) else {
        return Ok(TC_ACT_OK as i32);
    };
    let opens = segment.flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let from_node_probe = same_ip(&segment.source, &IpKey::from_v4(PROBE_SOURCE_V4))
        || same_ip(&segment.source, &IpKey::from_v6(PROBE_SOURCE_V6));
    if from_node_probe || pod.has(POD_INBOUND_BYPASS) {
        if opens {
            count(netns, |c: &mut PodCounters| &mut c.bypassed);
        }
        return Ok(TC_ACT_OK as i32);
    }
    let mut tuple = segment.tuple;
    // A socket already owns this tuple (an established or half-open connection, or ztunnel's
    // own): the kernel delivers it. Only a listener, or nothing, means a new connection.
    let existing = lookup(ctx, &mut tuple, segment.tuple_len);
    if !existing.is_null() {
        // SAFETY: non-null socket from a lookup; released right after reading its state.
        let state = unsafe { ctx_read!(existing, state) };
        unsafe { bpf_sk_release(existing as *mut c_void) };
        if state != TCP_LISTEN {
            return Ok(TC_ACT_OK as i32);
        }
    }
    if !opens {
        return Ok(TC_ACT_OK as i32);
    }
    set_dport(&mut tuple, segment.tuple_len, INBOUND_PORT.to_be());
    let listener = lookup(ctx, &mut tuple, segment.tuple_len);
    if listener.is_null() {
        // ztunnel is not listening in this pod (yet): refuse to deliver around it.
        diag!(
            by_ref warn,
            ctx.skb.skb,
            "netns {}: drop {:i} to {:i}:{}: ztunnel not listening on 15006",
            netns,
            ip(&segment.source),
            ip(&segment.destination),
            segment.dport
        );
        return Ok(TC_ACT_SHOT as i32);
    }
    // SAFETY: non-null socket from a lookup, released on every path below.
    let assigned = unsafe {
        let assigned = if ctx_read!(listener, state) == TCP_LISTEN {
            bpf_sk_assign(ctx.skb.skb as *mut c_void, listener as *mut c_void, 0) == 0
        } else {
            false
        };
        bpf_sk_release(listener as *mut c_void);
        assigned
    };
    if !assigned {
        diag!(
            by_ref warn,
            ctx.skb.skb,
            "netns {}: drop {:i} to {:i}:{}: ztunnel's 15006 socket not assignable",
            netns,
            ip(&segment.source),
            ip(&segment.destination),
            segment.dport
        );
        return Ok(TC_ACT_SHOT as i32);
    }
    diag!(
        by_ref debug,
        ctx.skb.skb,
        "netns {}: inbound {:i} to {:i}:{} assigned to 15006",
        netns,
        ip(&segment.source),
        ip(&segment.destination),
        segment.dport
    );
    count(netns, |c: &mut PodCounters| &mut c.inbound);
    Ok(TC_ACT_OK as i32)
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

#[inline(always)]
fn set_dport(tuple: &mut bpf_sock_tuple, len: u32, dport_be: u16) {
    // The member written is the one `len` says is in use.
    if len == IPV4_TUPLE_LEN {
        tuple.__bindgen_anon_1.ipv4.dport = dport_be;
    } else {
        tuple.__bindgen_anon_1.ipv6.dport = dport_be;
    }
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Result<Option<Segment>, ()> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).map_err(|_| ())?);
    // SAFETY: an all-zero tuple is a valid value of this plain C union.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let (tuple_len, source, destination, dport_be, l4) = match ethertype {
        ETH_P_IP => {
            let version_ihl: u8 = ctx.load(ETH_HLEN).map_err(|_| ())?;
            if ctx.load::<u8>(ETH_HLEN + 9).map_err(|_| ())? != IPPROTO_TCP {
                return Ok(None);
            }
            // A later fragment carries no TCP header: what would be read as ports is payload.
            let fragment = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).map_err(|_| ())?);
            if fragment & IPV4_FRAGMENT_OFFSET != 0 {
                return Ok(None);
            }
            let saddr: u32 = ctx.load(ETH_HLEN + 12).map_err(|_| ())?;
            let daddr: u32 = ctx.load(ETH_HLEN + 16).map_err(|_| ())?;
            let l4 = ETH_HLEN + ((version_ihl & 0x0f) as usize) * 4;
            let (sport, dport): (u16, u16) = (
                ctx.load(l4).map_err(|_| ())?,
                ctx.load(l4 + 2).map_err(|_| ())?,
            );
            tuple.__bindgen_anon_1.ipv4 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
                saddr,
                daddr,
                sport,
                dport,
            };
            (
                IPV4_TUPLE_LEN,
                ip_from_v4_word(saddr),
                ip_from_v4_word(daddr),
                dport,
                l4,
            )
        }
        ETH_P_IPV6 => {
            // Extension headers before TCP are left to the kernel.
            if ctx.load::<u8>(ETH_HLEN + 6).map_err(|_| ())? != IPPROTO_TCP {
                return Ok(None);
            }
            let saddr: [u8; 16] = ctx.load(ETH_HLEN + 8).map_err(|_| ())?;
            let daddr: [u8; 16] = ctx.load(ETH_HLEN + 24).map_err(|_| ())?;
            let l4 = ETH_HLEN + IPV6_HLEN;
            let (sport, dport): (u16, u16) = (
                ctx.load(l4).map_err(|_| ())?,
                ctx.load(l4 + 2).map_err(|_| ())?,
            );
            let (source, destination) = (IpKey::from_v6(saddr), IpKey::from_v6(daddr));
            tuple.__bindgen_anon_1.ipv6 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
                saddr: v6_words(&source),
                daddr: v6_words(&destination),
                sport,
                dport,
            };
            (IPV6_TUPLE_LEN, source, destination, dport, l4)
        }
        _ => return Ok(None),
    };
    let flags: u8 = ctx.load(l4 + TCP_FLAGS_OFFSET).map_err(|_| ())?;
    Ok(Some(Segment {
        tuple,
        tuple_len,
        source,
        destination,
        dport: u16::from_be(dport_be),
        flags,
    }))
}
