//! Enrollment as the cluster's monitoring sees it: how long each enrollment took and how it
//! ended, by mode, and how many pods are in each state, counted at each scrape from the agent's
//! record of its pods (so the count cannot drift from what the agent holds).
use std::{collections::BTreeMap, fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        family::Family,
        gauge::ConstGauge,
        histogram::{exponential_buckets, Histogram},
        MetricType,
    },
};

use super::Enroller;
use crate::workload::{Mode, Status};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct EnrollLabels {
    mode: &'static str,
    result: &'static str,
}

/// `weir_enroll_seconds`: a whole enrollment, redirection and (for an ambient pod) ztunnel's
/// answer, by mode and result (`ok`, `error`).
pub(super) type EnrollSeconds = Family<EnrollLabels, Histogram>;

pub(super) fn enroll_seconds() -> EnrollSeconds {
    // 100 µs .. ~3.3 s: a sidecar pod's enrollment is sub-millisecond; an ambient pod's waits
    // for ztunnel's Ack, which has seconds to come.
    Family::new_with_constructor(|| Histogram::new(exponential_buckets(100e-6, 2.0, 16)))
}

pub(super) fn observe(family: &EnrollSeconds, mode: Mode, ok: bool, seconds: f64) {
    let labels = EnrollLabels {
        mode: mode.as_str(),
        result: if ok { "ok" } else { "error" },
    };
    family.get_or_create(&labels).observe(seconds);
}

/// `weir_pods{mode, state}`: `enrolled` and `pending` (an ambient pod ztunnel has not acked)
/// from the agent's record, `failed` for pods whose enrollment failed and that are not enrolled.
pub(super) struct PodsByState(pub(super) Arc<Enroller>);

impl fmt::Debug for PodsByState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PodsByState")
    }
}

const STATES: [&str; 3] = ["enrolled", "pending", "failed"];

impl Collector for PodsByState {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let mut counts: BTreeMap<(&str, &str), i64> = [Mode::Ambient, Mode::Sidecar]
            .into_iter()
            .flat_map(|mode| STATES.map(|state| ((mode.as_str(), state), 0)))
            .collect();
        let recorded = self.0.state.count_by(|record| {
            let state = match record.status {
                Some(Status::Pending) => "pending",
                _ => "enrolled",
            };
            (record.workload.mode().as_str(), state)
        });
        for (key, count) in recorded {
            *counts.entry(key).or_default() += count as i64;
        }
        for mode in self.0.failed.lock().unwrap().values() {
            *counts.entry((mode.as_str(), "failed")).or_default() += 1;
        }
        let mut family = encoder.encode_descriptor(
            "weir_pods",
            "Pods by mode (ambient, sidecar) and state: enrolled, pending (redirected, not yet \
             acked by ztunnel), failed (enrollment failed, not enrolled)",
            None,
            MetricType::Gauge,
        )?;
        for ((mode, state), count) in counts {
            ConstGauge::new(count)
                .encode(family.encode_family(&[("mode", mode), ("state", state)])?)?;
        }
        Ok(())
    }
}
