//! Per-pod metrics on `/metrics`, read at each scrape from the counters the programs keep in
//! the pinned maps and named from the state file, as `weir-agent pods` shows them. A pod that
//! leaves the maps leaves the metrics with it; a pod weir cannot name has no series.
use std::{fmt, path::PathBuf};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, MetricType},
};
use tracing::warn;

use crate::inspect::{self, Counters};

#[derive(Debug)]
pub(super) struct PodMetrics {
    pub(super) pin_root: PathBuf,
    pub(super) state_file: PathBuf,
}

/// Each family: its name, help, and per pod the label set's last pair with its value.
type Family = (
    &'static str,
    &'static str,
    fn(&Counters) -> Vec<(Option<&'static str>, u64)>,
);

const FAMILIES: [Family; 3] = [
    (
        "weir_pod_redirected",
        "Connections (and DNS queries) the pod's traffic sent to ztunnel, by direction: \
         outbound (15001), inbound (15006), dns (15053).",
        |c| {
            vec![
                (Some("outbound"), c.outbound),
                (Some("inbound"), c.inbound),
                (Some("dns"), c.dns),
            ]
        },
    ),
    (
        "weir_pod_bypassed",
        "Inbound connections let through to the pod uncaptured: kubelet probes, inbound bypass.",
        |c| vec![(None, c.bypassed)],
    ),
    (
        "weir_pod_dropped",
        "Inbound packets dropped because they could not be steered to ztunnel.",
        |c| vec![(None, c.dropped)],
    ),
];

impl Collector for PodMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let rows = match inspect::pods(&self.pin_root, &self.state_file) {
            Ok(rows) => rows,
            Err(error) => {
                warn!(error = format!("{error:#}"), "reading per-pod counters");
                return Ok(());
            }
        };
        let named: Vec<_> = rows
            .iter()
            .filter_map(|row| {
                Some((
                    row.namespace.as_deref()?,
                    row.name.as_deref()?,
                    row.counters?,
                ))
            })
            .collect();
        for (name, help, values) in FAMILIES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (namespace, pod, counters) in &named {
                for (direction, value) in values(counters) {
                    let mut labels = vec![("namespace", *namespace), ("pod", *pod)];
                    labels.extend(direction.map(|direction| ("direction", direction)));
                    ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}
