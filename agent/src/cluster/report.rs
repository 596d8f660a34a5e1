//! What the agent tells the API server about pods: istio's status annotation
//! (`ambient.istio.io/redirection`, a JSON merge patch on `pods/status`), and Warning Events for
//! what a pod's owner should fix or know, deduplicated and rate-limited per pod so a pod that
//! the runtime retries every second does not flood its namespace with Events. Events about pod
//! repair come from istio's repair component ([`REPAIR_CONTROLLER`]), the others from weir's.
use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::Result;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::{
    api::{Api, Patch, PatchParams},
    runtime::events::{Event, EventType, Recorder, Reporter as EventReporter},
    Client,
};
use serde_json::json;

use crate::{
    enroll::Status,
    policy::{PodName, Warning, REDIRECTION_ANNOTATION},
};

/// The reporting controller on weir's Events.
pub const CONTROLLER: &str = "weir";
/// The reporting controller on Events about pod repair, as istio's repair controller names it.
pub const REPAIR_CONTROLLER: &str = "cni-repair";
/// The same warning for the same pod is published at most once per window.
pub const EVENT_WINDOW: Duration = Duration::from_secs(60);

pub struct Reporter {
    client: Client,
    recorder: Recorder,
    repair_recorder: Recorder,
    /// When each (pod, reason, note) was last published.
    published: Mutex<HashMap<(PodName, &'static str, String), Instant>>,
}

impl Reporter {
    /// `instance` is this agent's pod name, when it knows it.
    pub fn new(client: Client, instance: Option<String>) -> Self {
        let recorder = |controller: &str| {
            let reporter = EventReporter {
                controller: controller.into(),
                instance: instance.clone(),
            };
            Recorder::new(client.clone(), reporter)
        };
        Self {
            recorder: recorder(CONTROLLER),
            repair_recorder: recorder(REPAIR_CONTROLLER),
            client,
            published: Mutex::new(HashMap::new()),
        }
    }

    /// Sets the pod's `ambient.istio.io/redirection` to `enabled` or `pending`, or removes it.
    pub async fn set_redirection(&self, pod: &PodName, status: Option<Status>) -> Result<()> {
        let value = status.map(|status| match status {
            Status::Pending => "pending",
            Status::Enabled => "enabled",
        });
        let patch = json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: value}}});
        Api::<Pod>::namespaced(self.client.clone(), &pod.namespace)
            .patch_status(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Publishes `warning` as a Warning Event on the pod, unless the same one was published
    /// within [`EVENT_WINDOW`]. Returns whether it was published.
    pub async fn warn(
        &self,
        pod: &PodName,
        uid: Option<String>,
        warning: &Warning,
    ) -> Result<bool> {
        let key = (pod.clone(), warning.reason(), warning.note());
        if !self.first_in_window(key, Instant::now()) {
            return Ok(false);
        }
        let event = Event {
            type_: EventType::Warning,
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
        let recorder = if warning.is_repair() {
            &self.repair_recorder
        } else {
            &self.recorder
        };
        recorder.publish(&event, &regarding).await?;
        Ok(true)
    }

    /// Records `key` as published at `now` unless it was within the window; forgets entries
    /// older than the window so the map stays as small as the recent trouble.
    fn first_in_window(&self, key: (PodName, &'static str, String), now: Instant) -> bool {
        let mut published = self.published.lock().unwrap();
        published.retain(|_, at| now.duration_since(*at) < EVENT_WINDOW);
        if published.contains_key(&key) {
            return false;
        }
        published.insert(key, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_event_per_pod_and_reason_per_window() {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let reporter = Reporter::new(Client::try_from(config).unwrap(), None);
        let key = |pod: &str, note: &str| (PodName::new("ns", pod), "Reason", note.to_owned());
        let start = Instant::now();
        assert!(reporter.first_in_window(key("a", "x"), start));
        assert!(!reporter.first_in_window(key("a", "x"), start + Duration::from_secs(59)));
        assert!(
            reporter.first_in_window(key("a", "y"), start),
            "another note"
        );
        assert!(
            reporter.first_in_window(key("b", "x"), start),
            "another pod"
        );
        assert!(reporter.first_in_window(key("a", "x"), start + EVENT_WINDOW));
    }
}
