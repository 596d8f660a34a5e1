//! Where a pod's enrollment time goes, step by step: a histogram per step, and the stopwatch
//! `Owner::enroll` times its steps with.
use std::time::Instant;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        family::Family,
        histogram::{exponential_buckets, Histogram},
    },
    registry::{Registry, Unit},
};

/// Where a pod's enrollment time goes, step by step (`weir_enroll_step_seconds{step}`): what an
/// operator looks at when enrollment is slow on a node, and what the bench reports.
#[derive(Clone)]
pub(in crate::datapath) struct EnrollSteps(Family<Step, Histogram>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct Step {
    step: &'static str,
}

impl Default for EnrollSteps {
    fn default() -> Self {
        Self(Family::new_with_constructor(|| {
            Histogram::new(exponential_buckets(2e-6, 2.0, 14))
        }))
    }
}

impl EnrollSteps {
    pub(in crate::datapath) fn register(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "weir_enroll_step",
            "Time of each step of a pod's enrollment in the datapath: netns (entering it, its \
             rtnetlink socket and cookie), interfaces (link and address dumps), sysctls, maps, \
             routing (the return path's rules and routes), tc (qdiscs, filters and rerouting \
             rules), finish",
            Unit::Seconds,
            self.0.clone(),
        );
    }

    pub(super) fn stopwatch(&self) -> Stopwatch<'_> {
        Stopwatch {
            steps: self,
            since: Instant::now(),
        }
    }
}

/// Times consecutive steps.
pub(super) struct Stopwatch<'a> {
    steps: &'a EnrollSteps,
    since: Instant,
}

impl Stopwatch<'_> {
    /// Ends `step` (begun when the previous one ended) now.
    pub(super) fn lap(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps
            .0
            .get_or_create(&Step { step })
            .observe((now - self.since).as_secs_f64());
        self.since = now;
    }
}
