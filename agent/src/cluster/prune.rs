//! What the caches keep of each object: only the fields the agent reads. A real pod carries
//! kilobytes weir never looks at (`managedFields`, container specs, probes, volumes, container
//! statuses); a node with hundreds of pods would hold all of it, and every namespace of the
//! cluster too. Each object is pruned as it arrives, before it reaches a store.
//!
//! Kept, for pods: name, namespace, uid, resourceVersion, labels, annotations, owner references,
//! deletionTimestamp, `spec.hostNetwork`, `spec.serviceAccountName`, `status.phase` and
//! `status.podIPs`. For namespaces: name, uid, resourceVersion and labels. For the DaemonSet:
//! its metadata (without `managedFields`) and its pod template's node selection.
use k8s_openapi::api::{
    apps::v1::{DaemonSet, DaemonSetSpec},
    core::v1::{Namespace, Pod, PodSpec, PodStatus, PodTemplateSpec},
};
use kube::api::ObjectMeta;

pub fn pod(pod: &mut Pod) {
    strip_managed_fields(&mut pod.metadata);
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        host_network: spec.host_network,
        service_account_name: spec.service_account_name,
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|status| PodStatus {
        phase: status.phase,
        pod_ips: status.pod_ips,
        ..PodStatus::default()
    });
}

pub fn namespace(namespace: &mut Namespace) {
    let metadata = std::mem::take(&mut namespace.metadata);
    *namespace = Namespace {
        metadata: ObjectMeta {
            name: metadata.name,
            uid: metadata.uid,
            resource_version: metadata.resource_version,
            labels: metadata.labels,
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
}

pub fn daemonset(daemonset: &mut DaemonSet) {
    strip_managed_fields(&mut daemonset.metadata);
    daemonset.status = None;
    let template = std::mem::take(&mut daemonset.spec.template);
    daemonset.spec = DaemonSetSpec {
        template: PodTemplateSpec {
            metadata: None,
            spec: template.spec.map(|pod| PodSpec {
                node_selector: pod.node_selector,
                affinity: pod.affinity,
                ..PodSpec::default()
            }),
        },
        ..DaemonSetSpec::default()
    };
}

fn strip_managed_fields(metadata: &mut ObjectMeta) {
    metadata.managed_fields = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{facts_of, shutdown::keep_node};
    use crate::policy::Labels;

    /// A pod as the API server returns it, with what kubelet and the controllers add.
    fn realistic_pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "api-7d9c", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
                "labels": {"app": "api", "istio.io/dataplane-mode": "ambient"},
                "annotations": {"ambient.istio.io/redirection": "enabled"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                                     "name": "agent", "uid": "d-1"}],
                "deletionTimestamp": "2026-01-01T00:00:00Z",
                "managedFields": [{"manager": "kubelet", "operation": "Update",
                                   "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}],
            },
            "spec": {
                "hostNetwork": true, "serviceAccountName": "api", "nodeName": "node-a",
                "containers": [{"name": "api", "image": "shop/api:1.2",
                                "env": [{"name": "MODE", "value": "prod"}]}],
            },
            "status": {
                "phase": "Running", "podIP": "10.0.0.7", "podIPs": [{"ip": "10.0.0.7"}],
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "api", "ready": true, "restartCount": 0,
                                       "image": "shop/api:1.2", "imageID": "sha256:00"}],
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_pruned_pod_decides_as_the_whole_pod_does() {
        let whole = realistic_pod();
        let mut pruned = whole.clone();
        pod(&mut pruned);
        let labels = Labels::from([("istio.io/dataplane-mode".into(), "ambient".into())]);
        assert_eq!(
            facts_of(&pruned, labels.clone()),
            facts_of(&whole, labels),
            "the rule's inputs survive"
        );
        assert_eq!(
            pruned.metadata.deletion_timestamp,
            whole.metadata.deletion_timestamp
        );
        assert_eq!(
            pruned.metadata.resource_version,
            whole.metadata.resource_version
        );
        let status = pruned.status.as_ref().unwrap();
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert_eq!(status.pod_ips, whole.status.as_ref().unwrap().pod_ips);
        assert_eq!(status.container_statuses, None);
        assert_eq!(pruned.metadata.managed_fields, None);
        assert!(pruned.spec.as_ref().unwrap().containers.is_empty());
    }

    #[test]
    fn a_pruned_namespace_keeps_its_labels_only() {
        let mut ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "shop", "uid": "n-1", "labels": {"istio.io/dataplane-mode": "ambient"},
                         "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }))
        .unwrap();
        let labels = ns.metadata.labels.clone();
        namespace(&mut ns);
        assert_eq!(ns.metadata.labels, labels);
        assert_eq!(ns.metadata.name.as_deref(), Some("shop"));
        assert_eq!(ns.metadata.annotations, None);
        assert_eq!((ns.spec, ns.status), (None, None));
    }

    #[test]
    fn a_pruned_daemonset_still_decides_where_weir_stays() {
        let whole: DaemonSet = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "weir", "namespace": "istio-system",
                         "managedFields": [{"manager": "helm"}]},
            "spec": {
                "selector": {"matchLabels": {"app": "weir"}},
                "template": {
                    "metadata": {"labels": {"app": "weir"}},
                    "spec": {"nodeSelector": {"mesh": "yes"},
                             "containers": [{"name": "agent", "image": "weir-agent"}]},
                },
            },
        }))
        .unwrap();
        let mut pruned = whole.clone();
        daemonset(&mut pruned);
        for labels in [Labels::new(), Labels::from([("mesh".into(), "yes".into())])] {
            assert_eq!(
                keep_node(Some(&pruned), &labels),
                keep_node(Some(&whole), &labels)
            );
        }
        assert_eq!(pruned.metadata.managed_fields, None);
    }
}
