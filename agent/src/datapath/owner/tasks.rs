//! Where the datapath's waits on its sockets run: the pods' interface changes
//! ([`crate::datapath::pod::interface_watch`]) and the programs' log records
//! ([`super::bpf_log`]). Each is a task that sleeps until its socket is readable, then wakes the
//! owner thread through its command channel (or hands the records to the logger), so neither
//! needs a thread of its own: they run on the tokio runtime of whoever starts the datapath (the
//! agent's). A caller without one (`weir-agent uninstall`, the tests and the bench, which drive
//! the datapath from plain threads) gets a one-worker runtime of the datapath's own for them.
use std::future::Future;

use anyhow::{Context, Result};
use tokio::{
    runtime::{Handle, Runtime},
    task::JoinHandle,
};

pub(in crate::datapath) enum Tasks {
    /// The runtime `Datapath::start` was called on.
    Caller(Handle),
    /// One of the datapath's own, dropped with the owner.
    Own(Runtime),
}

impl Tasks {
    /// The calling thread's runtime, or a runtime of the datapath's own where it has none.
    pub(super) fn of_caller() -> Result<Self> {
        match Handle::try_current() {
            Ok(handle) => Ok(Self::Caller(handle)),
            Err(_) => tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("weir-datapath-io")
                .enable_io()
                .enable_time()
                .build()
                .map(Self::Own)
                .context("starting the datapath's runtime"),
        }
    }

    pub(super) fn handle(&self) -> &Handle {
        match self {
            Self::Caller(handle) => handle,
            Self::Own(runtime) => runtime.handle(),
        }
    }

    /// Runs `task` until it ends or the returned [`Task`] is dropped.
    pub(in crate::datapath) fn spawn(
        &self,
        task: impl Future<Output = ()> + Send + 'static,
    ) -> Task {
        Task(self.handle().spawn(task))
    }
}

/// A running task, stopped when this is dropped: with the owner, whose sockets it waits on.
pub(in crate::datapath) struct Task(JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}
