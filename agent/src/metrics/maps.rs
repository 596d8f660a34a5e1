//! `weir_map_entries` and `weir_map_capacity`: how full each of weir's pinned maps is, read from
//! the pins at each scrape. A full hash map refuses new pods; a full LRU map (the original
//! destinations, the rerouted connections' translations) evicts its oldest entries, which the
//! kernel does not count: its fill at capacity is the sign.
use std::{fmt, path::PathBuf};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{gauge::ConstGauge, MetricType},
};
use tracing::warn;

use crate::datapath;

#[derive(Debug)]
pub(super) struct MapFill {
    pub(super) pin_root: PathBuf,
}

/// Which number of a map's fill a family reports.
type Value = fn(&datapath::MapFill) -> u32;

impl Collector for MapFill {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let fills = match datapath::map_fill(&self.pin_root) {
            Ok(fills) => fills,
            Err(error) => {
                warn!(error = format!("{error:#}"), "reading the maps' fill");
                return Ok(());
            }
        };
        let families: [(&str, &str, Value); 2] = [
            (
                "weir_map_entries",
                "Entries in each of weir's BPF maps whose entries come and go",
                |fill| fill.entries,
            ),
            (
                "weir_map_capacity",
                "The most entries each of those maps holds (max_entries)",
                |fill| fill.capacity,
            ),
        ];
        for (name, help, value) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for fill in &fills {
                ConstGauge::new(i64::from(value(fill)))
                    .encode(family.encode_family(&[("map", fill.name)])?)?;
            }
        }
        Ok(())
    }
}
