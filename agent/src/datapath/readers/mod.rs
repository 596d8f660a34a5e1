//! What reads the pinned maps without an owner, so it runs beside the agent that owns them:
//! the pods and the maps' fill (`snapshot.rs`, for `weir-agent pods`, metrics and bug reports),
//! the programs' trace maps (`trace_maps.rs`, for the trace server).
pub(in crate::datapath) mod snapshot;
pub(in crate::datapath) mod trace_maps;
