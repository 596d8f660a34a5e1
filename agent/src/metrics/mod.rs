//! The agent-wide series read at each scrape rather than counted as things happen: the
//! enrolled pods' counters, the node's drops and refusals and the maps' fill from the pins, the
//! process's own resources, and what this agent is. The counters of each part of the agent are registered by that part.
mod denials;
mod maps;
mod pods;
mod process;

use std::path::Path;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::datapath;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    map_layout: String,
    inbound_handoff: &'static str,
}

/// Registers the scrape-time collectors for the datapath pinned under `pin_root` and the pods
/// named in `state_file`, and `weir_build_info`.
pub fn register(registry: &mut Registry, pin_root: &Path, state_file: &Path) {
    registry.register_collector(Box::new(pods::PodMetrics {
        pin_root: pin_root.to_owned(),
        state_file: state_file.to_owned(),
    }));
    registry.register_collector(Box::new(maps::MapFill {
        pin_root: pin_root.to_owned(),
    }));
    registry.register_collector(Box::new(denials::Denials {
        pin_root: pin_root.to_owned(),
    }));
    registry.register_collector(Box::new(process::ProcessMetrics));
    let build = Family::<BuildLabels, Gauge>::default();
    // The datapath started on this kernel, so reading its release again cannot fail but by a
    // vanished /proc; then the path is unknown rather than the metric missing.
    let inbound_handoff = datapath::running_inbound_path();
    build
        .get_or_create(&BuildLabels {
            version: env!("CARGO_PKG_VERSION"),
            map_layout: weir_common::ABI_VERSION.to_string(),
            inbound_handoff,
        })
        .set(1);
    registry.register(
        "weir_build_info",
        "This agent: its version, the BPF map layout it pins, and how new inbound connections \
         reach ztunnel on this kernel (tc, or sk_lookup before Linux 6.5)",
        build,
    );
}
