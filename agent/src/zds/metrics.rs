//! The ZDS server's metrics: ztunnel connections, Adds awaiting an answer, and requests, acks
//! and failures by message.
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::{Metric, Registry},
};

use super::proto::workload_request::Payload;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MessageLabels {
    message: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    message: &'static str,
    reason: &'static str,
}

pub(super) struct Metrics {
    pub(super) connected: Gauge,
    /// ztunnel connections that said hello, over the agent's life: reconnects show as increases.
    pub(super) connections: Counter,
    /// Adds sent (or queued) to ztunnel that have no answer yet.
    pending_adds: Gauge,
    /// Connections that said hello and wait for their snapshot until the agent knows its pods.
    held_snapshots: Gauge,
    requests: Family<MessageLabels, Counter>,
    acks: Family<MessageLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
}

impl Metrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        Self {
            connected: registered(
                registry,
                "ztunnel_connected",
                "Number of connections to ztunnel",
            ),
            connections: registered(
                registry,
                "weir_zds_connections",
                "ztunnel connections that said hello (reconnects count each)",
            ),
            pending_adds: registered(
                registry,
                "weir_zds_pending_adds",
                "Adds sent or queued to ztunnel and not yet answered",
            ),
            held_snapshots: registered(
                registry,
                "weir_zds_held_snapshots",
                "ztunnel connections that said hello and whose snapshot waits until the agent \
                 knows its pods (its first reconcile pass)",
            ),
            requests: registered(
                registry,
                "weir_zds_requests",
                "ZDS requests sent to ztunnel, by message",
            ),
            acks: registered(
                registry,
                "weir_zds_acks",
                "ZDS requests ztunnel acked without error, by message",
            ),
            errors: registered(
                registry,
                "weir_zds_errors",
                "ZDS failures, by message (or hello, unsolicited) and reason",
            ),
        }
    }

    /// Counts an Add as pending for as long as the guard lives, also when its caller gives up.
    pub(super) fn pending_add(&self) -> CountedWhileAlive {
        CountedWhileAlive::new(&self.pending_adds)
    }

    /// Counts a connection's snapshot as held for as long as the guard lives.
    pub(super) fn held_snapshot(&self) -> CountedWhileAlive {
        CountedWhileAlive::new(&self.held_snapshots)
    }

    pub(super) fn request(&self, message: &'static str) {
        self.requests
            .get_or_create(&MessageLabels { message })
            .inc();
    }

    pub(super) fn ack(&self, message: &'static str) {
        self.acks.get_or_create(&MessageLabels { message }).inc();
    }

    pub(super) fn error(&self, message: &'static str, reason: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels { message, reason })
            .inc();
    }
}

/// One in a gauge's count until dropped.
pub(super) struct CountedWhileAlive(Gauge);

impl CountedWhileAlive {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for CountedWhileAlive {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A new metric, registered as `name`.
fn registered<M: Metric + Clone + Default>(registry: &mut Registry, name: &str, help: &str) -> M {
    let metric = M::default();
    registry.register(name, help, metric.clone());
    metric
}

/// The `message` label of a request.
pub(super) fn message_name(payload: &Payload) -> &'static str {
    match payload {
        Payload::Add(_) => "add",
        Payload::Keep(_) => "keep",
        Payload::Del(_) => "del",
        Payload::SnapshotSent(_) => "snapshot_sent",
    }
}
