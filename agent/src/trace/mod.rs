//! `weir-agent trace`: every redirect decision, live.
//!
//! The programs write one record per decision to a ring buffer while tracing is on
//! ([`weir_common::TraceRecord`]). The agent is the ring buffer's one consumer: it names each
//! record's pod and sends it to every reader connected to its trace socket, and turns tracing
//! on while at least one reader is connected. A reader that falls behind loses records, counted
//! and shown to it; the programs never wait.
mod client;
mod decision;
mod server;

use std::path::PathBuf;

pub use client::{run, verdicts_help, TraceArgs, TraceOutput};
pub(crate) use decision::{hook_name, verdict_name};
pub use decision::{Decision, Message};
pub use server::serve;

/// Where the agent serves trace readers.
pub const DEFAULT_TRACE_SOCKET: &str = "/var/run/weir/trace.sock";

#[derive(clap::Args, Clone, Debug)]
pub struct TraceSocketArg {
    /// Unix socket `weir-agent trace` reads decisions from (root only).
    #[arg(long, env = "WEIR_TRACE_SOCKET", default_value = DEFAULT_TRACE_SOCKET)]
    pub trace_socket: PathBuf,
}
