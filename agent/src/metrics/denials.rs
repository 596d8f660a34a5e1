//! `weir_drops_total` and `weir_refusals_total`: what the programs dropped or refused on the
//! node, by reason (the verdict's name in `weir-agent trace`), whether or not the pod is known,
//! read from the pinned counters at each scrape. Every reason has a series from the start, so a
//! rate over one is never absent.
use std::{fmt, path::PathBuf};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, MetricType},
};
use tracing::warn;

use crate::{datapath, trace::verdict_name};

#[derive(Debug)]
pub(super) struct Denials {
    pub(super) pin_root: PathBuf,
}

impl Collector for Denials {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let counts = match datapath::denials(&self.pin_root) {
            Ok(Some(counts)) => counts,
            Ok(None) => return Ok(()),
            Err(error) => {
                warn!(
                    error = format!("{error:#}"),
                    "reading the node's drops and refusals"
                );
                return Ok(());
            }
        };
        let families = [
            (
                "weir_drops",
                "Packets the programs dropped on this node, any pod's, by reason",
                "drop-",
            ),
            (
                "weir_refusals",
                "Connects the programs refused on this node, any pod's, by reason",
                "refuse-",
            ),
        ];
        for (name, help, prefix) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (verdict, count) in &counts {
                let reason = verdict_name(*verdict);
                if reason.starts_with(prefix) {
                    ConstCounter::new(*count)
                        .encode(family.encode_family(&[("reason", reason)])?)?;
                }
            }
        }
        Ok(())
    }
}
