//! Decision records for `weir-agent trace`: one per verdict, into a ring buffer the agent
//! reads, only while a reader is attached; and the node-wide count of drops and refusals by
//! verdict, kept whether anyone traces or not.
//!
//! With tracing off a decision costs one array lookup (which the verifier inlines) and a
//! branch. A record is written in place in the ring buffer, never built on the stack: the tc
//! programs have little stack to spare. A full ring buffer loses the record and counts it; the
//! datapath never waits for a reader.
use aya_ebpf::{
    btf_maps::{Array, PerCpuArray, RingBuf},
    macros::btf_map,
};
use weir_common::{
    Endpoint, IpKey, PodConfig, TraceHook, TraceRecord, TraceVerdict, DENIAL_SLOTS, POD_HAS_IPV4,
    POD_HAS_IPV6,
};

use crate::net::is_v4_mapped;

/// A few thousand records: room for a burst while the agent is scheduled out.
const RING_BYTES: usize = 256 * 1024;

#[btf_map]
static TRACE_ON: Array<u32, 1> = Array::new();

#[btf_map]
static TRACE_EVENTS: RingBuf<TraceRecord, RING_BYTES> = RingBuf::new();

#[btf_map]
static TRACE_LOST: PerCpuArray<u64, 1> = PerCpuArray::new();

#[btf_map]
static DENIALS: PerCpuArray<u64, { DENIAL_SLOTS as usize }> = PerCpuArray::new();

/// Counts a drop or refusal node-wide; other verdicts cost nothing where the verdict is a
/// constant, a comparison where it is not.
#[inline(always)]
pub fn count_denial(verdict: TraceVerdict) {
    if verdict.denies() {
        if let Some(count) = DENIALS.get_ptr_mut(verdict as u32) {
            // SAFETY: per-CPU value, only this CPU writes it while this program runs.
            unsafe { *count += 1 };
        }
    }
}

/// Whether a reader is tracing.
#[inline(always)]
pub fn on() -> bool {
    TRACE_ON.get(0).is_some_and(|flag| *flag != 0)
}

/// `TraceRecord::protocol` values.
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

/// One side of a traced tuple, written straight into the record.
pub trait Side {
    /// # Safety
    /// `slot` points into a reserved record.
    unsafe fn write(self, slot: *mut Endpoint);
}

/// An address and a port (host order).
impl Side for (&IpKey, u16) {
    #[inline(always)]
    unsafe fn write(self, slot: *mut Endpoint) {
        (*slot).ip = *self.0;
        (*slot).port = self.1;
        (*slot)._pad = 0;
    }
}

/// The pod's own address of `like`'s family, with no port (not chosen yet at connect). Built
/// in the record, not on the stack: the sock_addr programs have little of it to spare on 5.10.
pub struct PodAddress<'a> {
    pub pod: &'a PodConfig,
    pub like: &'a IpKey,
}

impl Side for PodAddress<'_> {
    #[inline(always)]
    unsafe fn write(self, slot: *mut Endpoint) {
        let octets = &mut (*slot).ip.octets;
        if is_v4_mapped(self.like) {
            let has = self.pod.has(POD_HAS_IPV4);
            for (i, octet) in octets.iter_mut().enumerate() {
                *octet = match i {
                    10 | 11 if has => 0xff,
                    12..=15 if has => self.pod.ipv4[i - 12],
                    _ => 0,
                };
            }
        } else {
            let has = self.pod.has(POD_HAS_IPV6);
            for (i, octet) in octets.iter_mut().enumerate() {
                *octet = if has { self.pod.ipv6[i] } else { 0 };
            }
        }
        (*slot).port = 0;
        (*slot)._pad = 0;
    }
}

/// The address a verdict sends nothing to.
pub const NOWHERE: (&IpKey, u16) = (&IpKey { octets: [0; 16] }, 0);

/// Records a decision; `netns` is the pod's netns cookie (0: unknown). Called through
/// [`trace!`], which tests [`on`] first.
#[inline(always)]
pub fn record(
    hook: TraceHook,
    verdict: TraceVerdict,
    netns: u64,
    protocol: u8,
    source: impl Side,
    destination: impl Side,
    target: impl Side,
) {
    let Some(mut entry) = TRACE_EVENTS.reserve(0) else {
        if let Some(lost) = TRACE_LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU value, only this CPU writes it while this program runs.
            unsafe { *lost += 1 };
        }
        return;
    };
    let slot = entry.as_mut_ptr();
    // SAFETY: `slot` is the reserved record, written field by field before it is submitted.
    unsafe {
        (*slot).netns_cookie = netns;
        source.write(&raw mut (*slot).source);
        destination.write(&raw mut (*slot).destination);
        target.write(&raw mut (*slot).target);
        (*slot).protocol = protocol;
        (*slot).hook = hook as u8;
        (*slot).verdict = verdict as u8;
        (*slot)._pad = 0;
    }
    entry.submit(0);
}

/// `trace!(hook, verdict, netns, protocol, source, destination, target)`: a drop or refusal
/// counted, and a record when tracing is on. The arguments but the verdict are evaluated only
/// then, so a path that traces costs nothing more with tracing off.
macro_rules! trace {
    ($hook:expr, $verdict:expr, $($arg:expr),+ $(,)?) => {{
        let verdict = $verdict;
        $crate::trace::count_denial(verdict);
        if $crate::trace::on() {
            $crate::trace::record($hook, verdict, $($arg),+);
        }
    }};
}
pub(crate) use trace;
