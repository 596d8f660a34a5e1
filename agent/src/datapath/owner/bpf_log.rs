//! The programs' diagnostics (aya-log, on with `--bpf-log`): their records, read from the log
//! ring buffer, go to the `log` crate at target `weir_ebpf::<module>`.
use anyhow::{anyhow, Context, Result};
use aya::Ebpf;
use tokio::io::{unix::AsyncFd, Interest};
use tracing::info;

use super::tasks::{Task, Tasks};

/// Forwards the programs' log records to the `log` crate: a task waits for the log ring buffer
/// to be readable and drains it, until the returned [`Task`] is dropped.
pub(super) fn read_bpf_log(ebpf: &mut Ebpf, tasks: &Tasks) -> Result<Task> {
    let logger = aya_log::EbpfLogger::init(ebpf).context("reading the eBPF programs' logs")?;
    let mut logger = {
        let _entered = tasks.handle().enter();
        // SAFETY: the logger owns its ring buffer's fd, open and the same until it is dropped
        // with the AsyncFd.
        unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) }
            .map_err(|error| anyhow!("polling the eBPF logs: {error}"))?
    };
    let task = tasks.spawn(async move {
        while let Ok(mut ready) = logger.readable_mut().await {
            ready.get_inner_mut().flush();
            ready.clear_ready();
        }
    });
    info!("eBPF diagnostics on (log target weir_ebpf)");
    Ok(task)
}
