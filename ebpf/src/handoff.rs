//! Hand-off through the socket lookup, for kernels before 6.5: there `bpf_sk_assign` in tc
//! refuses a listener in a reuseport group (ESOCKTNOSUPPORT), and ztunnel's listeners are. The
//! tc program decides as always; for a new connection it then stores ztunnel's listener and the
//! connection's tuple in a free slot of its CPU ([`hand_off`]) and lets the SYN on, and
//! [`weir_handoff`], an sk_lookup program attached to the pod's netns, hands it that listener
//! when the stack looks for a socket for that tuple on the same CPU. The socket lookup picks
//! among the reuseport group itself, and the local address stays the original destination, as
//! with `bpf_sk_assign` in tc.
//!
//! A receive batch (GRO, a driver's packet list, a NAPI poll) runs tc for each of its packets
//! before the socket lookup of any, so one CPU may hold several SYNs' hand-offs at once: each
//! gets a slot of its own, and a slot is only taken again once its SYN's lookup took it, or
//! once it is stale (its SYN was dropped between tc and the lookup). When every slot of the CPU
//! is held by a SYN still on its way, the new SYN is dropped, to be sent again, never let
//! through: a lookup that found its slot overwritten would give the connection to the app.
//!
//! The sk_lookup program decides nothing: it acts only on tuples tc stored, so traffic that never
//! crossed the pod's interfaces (ztunnel's own dials to the app over `lo`) is left alone. This
//! relies on nothing deferring a SYN between tc and its socket lookup in the pod's netns (an
//! NFQUEUE rule there would): a SYN looked up on another CPU than tc's finds no slot.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{bpf_sock, sk_action::SK_PASS},
    helpers::generated::{
        bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_sk_assign, bpf_sk_release,
    },
    macros::sk_lookup,
    programs::SkLookupContext,
};
use weir_common::{ConnectionKey, Endpoint, HandoffSlot, HANDOFF_SLOTS, HANDOFF_STALE_NS};

use crate::{
    maps::{HANDOFF, HANDOFF_CONNS},
    net::{ctx_read, socket_addresses, IPPROTO_TCP},
};

/// `bpf_sk_assign`'s answer in tc, before 6.5, for a listener in a reuseport group.
pub const ESOCKTNOSUPPORT: i64 = 94;

/// Stores `listener` for the connection's socket lookup; false when it cannot (no free slot, or
/// no room in the map), and the connection must then be dropped.
#[inline(always)]
pub fn hand_off(connection: &ConnectionKey, listener: *mut bpf_sock) -> bool {
    // SAFETY: helpers without arguments.
    let (cpu, now) = unsafe { (bpf_get_smp_processor_id(), bpf_ktime_get_ns()) };
    // An empty slot before a stale one: a slot is only presumed stale, its SYN may still be on
    // its way on a CPU that stalled, and taking it would give that connection to the app. Two
    // passes, each ending at its first match, keep the verifier's work linear in the slots.
    for index in 0..HANDOFF_SLOTS {
        let Some(slot) = HANDOFF_CONNS.get_ptr_mut(index) else {
            return false;
        };
        // SAFETY: this CPU's element of a per-CPU array; no other program runs on it meanwhile.
        unsafe {
            // A retransmitted SYN in the same batch: one slot serves both lookups' first.
            if (*slot).stored_ns == 0 || (*slot).connection == *connection {
                return store(
                    slot,
                    HandoffSlot::key(cpu, index),
                    connection,
                    listener,
                    now,
                );
            }
        }
    }
    for index in 0..HANDOFF_SLOTS {
        let Some(slot) = HANDOFF_CONNS.get_ptr_mut(index) else {
            return false;
        };
        // SAFETY: as above.
        unsafe {
            if now.wrapping_sub((*slot).stored_ns) > HANDOFF_STALE_NS {
                return store(
                    slot,
                    HandoffSlot::key(cpu, index),
                    connection,
                    listener,
                    now,
                );
            }
        }
    }
    false
}

/// Takes `slot` (this CPU's, at `key`) for the connection.
///
/// # Safety
/// `slot` points to this CPU's element of `HANDOFF_CONNS`.
#[inline(always)]
unsafe fn store(
    slot: *mut HandoffSlot,
    key: u32,
    connection: &ConnectionKey,
    listener: *mut bpf_sock,
    now: u64,
) -> bool {
    (*slot).connection = *connection;
    (*slot).stored_ns = now;
    HANDOFF.insert(&key, listener)
}

#[sk_lookup]
pub fn weir_handoff(ctx: SkLookupContext) -> u32 {
    // SAFETY: the context pointer is valid for the program's run.
    unsafe { take_handed_off(&ctx) };
    SK_PASS
}

/// Gives the lookup the listener tc stored for its tuple on this CPU, once.
#[inline(always)]
unsafe fn take_handed_off(ctx: &SkLookupContext) {
    let lookup = ctx.lookup;
    if ctx_read!(lookup, protocol) != IPPROTO_TCP {
        return;
    }
    let Some((remote_ip, local_ip)) =
        socket_addresses!(lookup, (remote_ip4, local_ip4), (remote_ip6, local_ip6))
    else {
        return;
    };
    // remote_port is in network order, local_port in host order.
    let key = ConnectionKey {
        client: Endpoint::new(remote_ip, u16::from_be(ctx_read!(lookup, remote_port))),
        listener: Endpoint::new(local_ip, ctx_read!(lookup, local_port) as u16),
    };
    let cpu = bpf_get_smp_processor_id();
    for index in 0..HANDOFF_SLOTS {
        let Some(slot) = HANDOFF_CONNS.get_ptr_mut(index) else {
            return;
        };
        if (*slot).stored_ns == 0 || (*slot).connection != key {
            continue;
        }
        *slot = HandoffSlot::default();
        let handed = HandoffSlot::key(cpu, index);
        let listener = HANDOFF.get(&handed);
        if listener.is_null() {
            return;
        }
        HANDOFF.remove(&handed);
        bpf_sk_assign(lookup as *mut c_void, listener as *mut c_void, 0);
        bpf_sk_release(listener as *mut c_void);
        return;
    }
}
