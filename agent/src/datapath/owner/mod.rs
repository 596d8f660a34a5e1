//! The owner thread, and the handle the rest of the agent drives it through. The thread holds
//! every BPF object; it starts by loading or taking over the datapath and rebuilding its pods
//! from the pinned maps, then serves commands, audits what it enrolled, and retires the map
//! layouts of earlier builds.
//!
//! - `thread.rs`: the owner's state ([`Owner`], [`Enrolled`]), its start, command loop and
//!   uninstall.
//! - `handle.rs`: [`crate::datapath::Datapath`] and the commands it sends.
//! - `tasks.rs`, `bpf_log.rs`: the waits on sockets, run as tasks that wake the owner.
//! - `audit.rs`: the periodic comparison of the maps and pods' netns with what was enrolled.
//! - `recovery.rs`: the pods rebuilt after a restart, and the orphan check.
//! - `layouts.rs`: other map layouts retired once their pods moved.
mod audit;
mod bpf_log;
pub(in crate::datapath) mod handle;
mod layouts;
pub(in crate::datapath) mod recovery;
pub(in crate::datapath) mod tasks;
mod thread;

pub(in crate::datapath) use handle::{Command, Reply, Traced};
pub(in crate::datapath) use thread::{Enrolled, Owner};
