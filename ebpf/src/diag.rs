//! Kernel-side diagnostics through aya-log, off unless the agent asks for them (`--bpf-log`).
//!
//! Only the decisions an operator needs when debugging a pod are logged, never a no-op path.
//! Every call goes through [`diag!`], which tests `LOG_ENABLED` first: the loader sets it in
//! `.rodata`, which the kernel freezes, so with logging off the verifier knows the branch is never
//! taken and drops the logging code; what is left costs at most one load and one branch.
use core::ffi::c_void;

use aya_ebpf::EbpfContext;

use crate::net::SockAddr;

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
/// when logging is on; nothing else otherwise.
macro_rules! diag {
    ($level:ident, $ctx:expr, $($arg:tt)+) => {
        if $crate::diag::enabled() {
            ::aya_log_ebpf::$level!($ctx, $($arg)+);
        }
    };
}
pub(crate) use diag;

/// The sock_addr hooks log with their context.
impl EbpfContext for SockAddr {
    fn as_ptr(&self) -> *mut c_void {
        self.ctx as *mut c_void
    }
}
