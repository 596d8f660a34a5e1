//! What the agent tells the API server about pods ([`ApiReporter`], the cluster's
//! [`Reporter`]): istio's status annotation (`ambient.istio.io/redirection`, a JSON merge patch on
//! `pods/status`), and Warning Events for what a pod's owner should fix or know, deduplicated and
//! rate-limited per pod and warning so a pod that the runtime retries every second does not flood
//! its namespace with Events. Events about pod repair come from istio's repair component
//! ([`REPAIR_CONTROLLER`]), the others from weir's.
use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::Result;
use futures::{future::BoxFuture, FutureExt};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::{
    api::{Api, Patch, PatchParams},
    runtime::events::{Event, EventType, Recorder, Reporter as EventReporter},
    Client, ResourceExt,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use serde_json::json;
use tracing::{debug, warn};

use super::Reflectors;
use crate::{
    policy::REDIRECTION_ANNOTATION,
    report::{Reporter, Warning},
    workload::{PodName, Status},
};

/// The reporting controller on weir's Events.
pub const CONTROLLER: &str = "weir";
/// The reporting controller on Events about pod repair, as istio's repair controller names it.
pub const REPAIR_CONTROLLER: &str = "cni-repair";
/// The same warning for the same pod (its reason and [`Warning::problem`]) is published at most
/// once per window, whatever its note says (a failed enrollment's names the netns, which changes
/// with every sandbox the runtime tries).
pub const EVENT_WINDOW: Duration = Duration::from_secs(60);
/// A status patch or Event must not hold a pod's CNI ADD for long.
const API_TIMEOUT: Duration = Duration::from_secs(2);

pub struct ApiReporter {
    client: Client,
    /// Where the uid of the pod an Event regards is looked up.
    reflectors: Reflectors,
    /// This agent's pod name, when it knows it: the reporting instance of its Events.
    instance: Option<String>,
    recorder: Recorder,
    repair_recorder: Recorder,
    /// When each warning was last published.
    published: Mutex<HashMap<WindowKey, Instant>>,
    /// `weir_events_suppressed_total{reason}`: warnings not published within the window.
    suppressed: Family<Reason, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

/// What makes two warnings the same for [`EVENT_WINDOW`].
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct WindowKey {
    pod: PodName,
    reason: &'static str,
    problem: Option<String>,
}

impl WindowKey {
    fn of(pod: &PodName, warning: &Warning) -> Self {
        Self {
            pod: pod.clone(),
            reason: warning.reason(),
            problem: warning.problem(),
        }
    }
}

impl ApiReporter {
    /// `instance` is this agent's pod name, when it knows it.
    pub fn new(client: Client, instance: Option<String>, reflectors: Reflectors) -> Self {
        let recorder = |controller: &'static str| {
            Recorder::new(client.clone(), event_reporter(controller, &instance))
        };
        Self {
            recorder: recorder(CONTROLLER),
            repair_recorder: recorder(REPAIR_CONTROLLER),
            client,
            reflectors,
            instance,
            published: Mutex::new(HashMap::new()),
            suppressed: Family::default(),
        }
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "weir_events_suppressed",
            "Warning Events not published because the same warning was published for the same \
             pod within the last minute",
            self.suppressed.clone(),
        );
    }

    /// Sets the pod's `ambient.istio.io/redirection` to `enabled` or `pending`, or removes it.
    async fn set_redirection(&self, pod: &PodName, status: Option<Status>) -> Result<()> {
        let value = status.map(Status::as_str);
        let patch = json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: value}}});
        Api::<Pod>::namespaced(self.client.clone(), &pod.namespace)
            .patch_status(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Publishes `warning` as a Warning Event on the pod, unless the same one was published
    /// within [`EVENT_WINDOW`]. Returns whether it was published.
    async fn publish_warning(
        &self,
        pod: &PodName,
        uid: Option<String>,
        warning: &Warning,
    ) -> Result<bool> {
        if !self.first_in_window(WindowKey::of(pod, warning), Instant::now()) {
            self.suppressed
                .get_or_create(&Reason {
                    reason: warning.reason(),
                })
                .inc();
            return Ok(false);
        }
        let event = Event {
            type_: if warning.is_normal() {
                EventType::Normal
            } else {
                EventType::Warning
            },
            reason: warning.reason().into(),
            note: Some(warning.note()),
            action: warning.action().into(),
            secondary: None,
        };
        let regarding = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.name.clone()),
            uid,
            ..ObjectReference::default()
        };
        let (controller, shared) = if warning.is_repair() {
            (REPAIR_CONTROLLER, &self.repair_recorder)
        } else {
            (CONTROLLER, &self.recorder)
        };
        // kube-rs's Recorder patches a warning into the series of the Event it published on the
        // same pod with the same reason in the last minutes, keeping that Event's note whatever
        // the new one says: another problem would read as the first one again. A Recorder with
        // no past creates a new Event.
        let recorder = match warning.problem() {
            Some(_) => &Recorder::new(
                self.client.clone(),
                event_reporter(controller, &self.instance),
            ),
            None => shared,
        };
        recorder.publish(&event, &regarding).await?;
        Ok(true)
    }

    /// Records `key` as published at `now` unless it was within the window; forgets entries
    /// older than the window so the map stays as small as the recent trouble.
    fn first_in_window(&self, key: WindowKey, now: Instant) -> bool {
        let mut published = self.published.lock().unwrap();
        published.retain(|_, at| now.duration_since(*at) < EVENT_WINDOW);
        if published.contains_key(&key) {
            return false;
        }
        published.insert(key, now);
        true
    }
}

fn event_reporter(controller: &'static str, instance: &Option<String>) -> EventReporter {
    EventReporter {
        controller: controller.into(),
        instance: instance.clone(),
    }
}

impl Reporter for ApiReporter {
    fn report_status<'a>(&'a self, pod: &'a PodName, status: Option<Status>) -> BoxFuture<'a, ()> {
        async move {
            match tokio::time::timeout(API_TIMEOUT, self.set_redirection(pod, status)).await {
                Ok(Ok(())) => debug!(%pod, ?status, "redirection annotation set"),
                Ok(Err(error)) => {
                    warn!(%pod, ?status, "setting the redirection annotation: {error:#}")
                }
                Err(_) => warn!(%pod, ?status, "setting the redirection annotation timed out"),
            }
        }
        .boxed()
    }

    fn warn<'a>(&'a self, pod: &'a PodName, warning: Warning) -> BoxFuture<'a, ()> {
        async move {
            let uid = self.reflectors.pod(pod).and_then(|p| p.uid());
            let publish = self.publish_warning(pod, uid, &warning);
            match tokio::time::timeout(API_TIMEOUT, publish).await {
                Ok(Ok(published)) => debug!(%pod, reason = warning.reason(), published, "event"),
                Ok(Err(error)) => warn!(%pod, "publishing an event: {error:#}"),
                Err(_) => warn!(%pod, "publishing an event timed out"),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{AnnotationProblem, BYPASS_INBOUND_ANNOTATION, DNS_CAPTURE_ANNOTATION};

    /// A failed enrollment's note names the sandbox's netns, new with each retry: still one
    /// Event a minute for the pod, and the rest counted.
    #[tokio::test]
    async fn one_event_per_pod_and_reason_per_window_whatever_the_note() {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let mut watches = tokio::task::JoinSet::new();
        let reflectors = Reflectors::start(&client, "node", "ns", "weir", &mut watches);
        let reporter = ApiReporter::new(client, None, reflectors);
        let failed = |netns: &str| Warning::EnrollmentFailed(format!("opening pod netns {netns}"));
        let pod = PodName::new("ns", "a");
        // Published (the API server is unreachable here, so publishing fails: still counted
        // as the window's one Event).
        assert!(reporter
            .publish_warning(&pod, None, &failed("cni-1"))
            .await
            .is_err());
        for netns in ["cni-2", "cni-3"] {
            assert!(!reporter
                .publish_warning(&pod, None, &failed(netns))
                .await
                .unwrap());
        }
        let other_pod = PodName::new("ns", "b");
        assert!(reporter
            .publish_warning(&other_pod, None, &failed("cni-4"))
            .await
            .is_err());
        let mut registry = Registry::default();
        reporter.register_metrics(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"weir_events_suppressed_total{reason="AmbientEnrollmentFailed"} 2"#),
            "{text}"
        );
        let key = WindowKey::of(&pod, &failed("x"));
        let start = Instant::now();
        assert!(!reporter.first_in_window(key.clone(), start + Duration::from_secs(59)));
        assert!(reporter.first_in_window(key, start + EVENT_WINDOW));
    }

    /// Each invalid annotation is news to the pod's owner; the same one met again is not.
    #[tokio::test]
    async fn one_event_per_invalid_annotation_per_window() {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let mut watches = tokio::task::JoinSet::new();
        let reflectors = Reflectors::start(&client, "node", "ns", "weir", &mut watches);
        let reporter = ApiReporter::new(client, None, reflectors);
        let invalid = |annotation, value: &str| {
            Warning::InvalidAnnotation(AnnotationProblem {
                annotation,
                value: value.into(),
                used: "false",
            })
        };
        let pod = PodName::new("ns", "a");
        let now = Instant::now();
        let first = |warning: &Warning| reporter.first_in_window(WindowKey::of(&pod, warning), now);
        assert!(first(&invalid(DNS_CAPTURE_ANNOTATION, "maybe")));
        assert!(first(&invalid(BYPASS_INBOUND_ANNOTATION, "perhaps")));
        assert!(first(&invalid(DNS_CAPTURE_ANNOTATION, "perhaps")));
        assert!(!first(&invalid(BYPASS_INBOUND_ANNOTATION, "perhaps")));
    }
}
