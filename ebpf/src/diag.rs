//! Kernel-side diagnostics through aya-log, off unless the agent asks for them (`--bpf-log`).
//!
//! Only the decisions an operator needs when debugging a pod are logged, never a no-op path.
//! Every call goes through [`diag!`], which tests `LOG_ENABLED` first: the loader sets it in
//! `.rodata`, which the kernel freezes, so with logging off the verifier knows the branch is never
//! taken and removes the logging code; what is left is the flag's load and a jump. Paths that
//! decide nothing are the same instructions as without diagnostics.
use core::{
    ffi::c_void,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya_ebpf::EbpfContext;
use weir_common::IpKey;

use crate::net::is_v4_mapped;

/// Set to 1 by the loader (`EbpfLoader::set_global`) to turn logging on.
#[unsafe(no_mangle)]
static LOG_ENABLED: u8 = 0;

/// Read volatile so the compiler cannot fold the zero it was compiled with.
#[inline(always)]
pub fn enabled() -> bool {
    // SAFETY: a plain static, only ever written by the loader before the program runs.
    unsafe { core::ptr::read_volatile(&LOG_ENABLED) != 0 }
}

/// `diag!(level, ctx, "format", args...)`: an aya-log record at `level` (`debug`, `warn`, ...)
/// when logging is on; nothing else otherwise. `ctx` is the program's raw context pointer.
///
/// The context and every argument are evaluated into locals inside the branch, before aya-log's
/// macro: its closure captures what it names by reference, and a variable of the program it
/// captured (the context struct, an address computed for the kernel) would be kept on the stack
/// on every path, logging or not.
///
/// `diag!(by_ref level, ...)` leaves the arguments to aya-log's closure instead: for a program
/// short of stack, when what they name is on the stack anyway (inbound's parsed segment).
macro_rules! diag {
    (by_ref $level:ident, $ctx:expr, $($arg:tt)+) => {
        if $crate::diag::enabled() {
            let ctx = $crate::diag::Ctx($ctx as *mut ::core::ffi::c_void);
            ::aya_log_ebpf::$level!(&ctx, $($arg)+);
        }
    };
    ($level:ident, $ctx:expr, $format:literal $(, $arg:expr)* $(,)?) => {
        if $crate::diag::enabled() {
            $crate::diag::diag!(@bind $level, $ctx, $format, [$($arg),*], []);
        }
    };
    // One argument into a local; hygiene keeps each expansion's `value` distinct.
    (@bind $level:ident, $ctx:expr, $format:literal, [$head:expr $(, $rest:expr)*],
     [$($bound:ident),*]) => {
        match $head {
            value => $crate::diag::diag!(
                @bind $level, $ctx, $format, [$($rest),*], [$($bound,)* value]
            ),
        }
    };
    (@bind $level:ident, $ctx:expr, $format:literal, [], [$($bound:ident),*]) => {{
        let ctx = $crate::diag::Ctx($ctx as *mut ::core::ffi::c_void);
        ::aya_log_ebpf::$level!(&ctx, $format, $($bound),*);
    }};
}
pub(crate) use diag;

/// The context aya-log wants, made from the raw pointer only once a record is written: a
/// reference to the program's own context struct would make the compiler keep that struct on the
/// stack on every path, logging or not.
pub struct Ctx(pub *mut c_void);

impl EbpfContext for Ctx {
    fn as_ptr(&self) -> *mut c_void {
        self.0
    }
}

/// An address as a log argument (`{:i}`): IPv4 shown as IPv4, not IPv4-mapped.
#[inline(always)]
pub fn ip(key: &IpKey) -> IpAddr {
    let o = &key.octets;
    if is_v4_mapped(key) {
        IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*o))
    }
}

/// An address as a log argument of one size whatever its family (IPv4 shown IPv4-mapped), for a
/// program short of stack: writing `IpAddr`'s 4 or 16 bytes makes LLVM call `memcpy`, a
/// subprogram the verifiers before 6.x count with a frame of its own (32 bytes), even on paths
/// that never log.
#[inline(always)]
pub fn ip_fixed(key: &IpKey) -> Ipv6Addr {
    Ipv6Addr::from(key.octets)
}
