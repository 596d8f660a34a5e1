//! What the caches keep of each object: only the fields the agent reads. A real pod carries
//! kilobytes weir never looks at (`managedFields`, container specs, probes, volumes, container
//! statuses); a node with hundreds of pods would hold all of it, and every namespace of the
//! cluster too. Each object is pruned as it arrives, before it reaches a store.
//!
//! Kept, for pods: name, namespace, uid, resourceVersion, labels, annotations, owner references,
//! deletionTimestamp, `spec.hostNetwork`, `spec.serviceAccountName`, `status.phase` and
//! `status.podIPs`; the name of every init container and container, and for those named
//! `istio-proxy` or `istio-init` also their `args`, `env` (name, value, valueFrom) and
//! `securityContext.runAsUser`/`runAsGroup`, which tell a sidecar pod and its redirection; and
//! from `status.initContainerStatuses` each one's name and the exit code, reason and message of
//! its current and last termination (`state`, `lastState`), which tell a pod whose sidecar
//! redirection failed. For namespaces: name, uid, resourceVersion and labels. For the DaemonSet:
//! its metadata (without `managedFields`) and its pod template's node selection.
use k8s_openapi::api::{
    apps::v1::{DaemonSet, DaemonSetSpec},
    core::v1::{
        Container, ContainerState, ContainerStateTerminated, ContainerStatus, Namespace, Pod,
        PodSpec, PodStatus, PodTemplateSpec, SecurityContext,
    },
};
use kube::api::ObjectMeta;

pub fn pod(pod: &mut Pod) {
    strip_managed_fields(&mut pod.metadata);
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        host_network: spec.host_network,
        service_account_name: spec.service_account_name,
        init_containers: spec
            .init_containers
            .map(|containers| containers.into_iter().map(container).collect()),
        containers: spec.containers.into_iter().map(container).collect(),
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|status| PodStatus {
        phase: status.phase,
        pod_ips: status.pod_ips,
        init_container_statuses: status
            .init_container_statuses
            .map(|statuses| statuses.into_iter().map(init_status).collect()),
        ..PodStatus::default()
    });
}

/// Every container's name (an `istio-init` anywhere, or no `istio-proxy`, decides alone); the
/// rest only of the two containers the sidecar decision reads.
fn container(container: Container) -> Container {
    if !matches!(container.name.as_str(), "istio-proxy" | "istio-init") {
        return Container {
            name: container.name,
            ..Container::default()
        };
    }
    Container {
        name: container.name,
        args: container.args,
        env: container.env,
        security_context: container.security_context.map(|context| SecurityContext {
            run_as_user: context.run_as_user,
            run_as_group: context.run_as_group,
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

fn init_status(status: ContainerStatus) -> ContainerStatus {
    let terminated = |state: Option<ContainerState>| {
        state.map(|state| ContainerState {
            terminated: state.terminated.map(|terminated| ContainerStateTerminated {
                exit_code: terminated.exit_code,
                reason: terminated.reason,
                message: terminated.message,
                ..ContainerStateTerminated::default()
            }),
            ..ContainerState::default()
        })
    };
    ContainerStatus {
        name: status.name,
        state: terminated(status.state),
        last_state: terminated(status.last_state),
        ..ContainerStatus::default()
    }
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
    use weir_cni::ambient::ContainerFacts;

    use super::*;
    use crate::cluster::{facts_of, shutdown::keep_node};
    use crate::policy::{sidecar, Labels, PodFacts};

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
            read_by_the_rules(facts_of(&pruned, labels.clone())),
            read_by_the_rules(facts_of(&whole, labels)),
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
        let containers = &pruned.spec.as_ref().unwrap().containers;
        assert_eq!(containers.len(), 1);
        assert_eq!(containers[0].name, "api");
        assert_eq!((&containers[0].image, &containers[0].env), (&None, &None));
    }

    /// The facts with what no rule reads dropped: the details of containers other than the two
    /// the sidecar decision looks at.
    fn read_by_the_rules(mut facts: PodFacts) -> PodFacts {
        for container in &mut facts.containers {
            if !matches!(container.name.as_str(), "istio-proxy" | "istio-init") {
                *container = ContainerFacts {
                    name: std::mem::take(&mut container.name),
                    ..ContainerFacts::default()
                };
            }
        }
        facts
    }

    /// A sidecar-injected pod (CNI enabled) whose `istio-validation` failed once, as the API
    /// server returns it.
    fn sidecar_pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "api-7d9c", "namespace": "shop", "uid": "u-2", "resourceVersion": "43",
                "labels": {"app": "api", "security.istio.io/tlsMode": "istio"},
                "annotations": {
                    "sidecar.istio.io/interceptionMode": "REDIRECT",
                    "traffic.sidecar.istio.io/includeInboundPorts": "*",
                    "traffic.sidecar.istio.io/excludeInboundPorts": "15020,3306",
                    "traffic.sidecar.istio.io/includeOutboundIPRanges": "*",
                    "sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"],\"containers\":[\"istio-proxy\"],\"revision\":\"default\"}",
                },
                "managedFields": [{"manager": "kubelet", "operation": "Update"}],
            },
            "spec": {
                "serviceAccountName": "api", "nodeName": "node-a",
                "initContainers": [{
                    "name": "istio-validation", "image": "istio/proxyv2:1.32",
                    "args": ["istio-iptables", "--run-validation", "--skip-rule-apply"],
                    "securityContext": {"runAsUser": 1337, "runAsGroup": 1337},
                }],
                "containers": [
                    {"name": "api", "image": "shop/api:1.2",
                     "env": [{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}],
                     "securityContext": {"runAsUser": 0}},
                    {"name": "istio-proxy", "image": "istio/proxyv2:1.32",
                     "args": ["proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local"],
                     "env": [
                         {"name": "ISTIO_META_DNS_CAPTURE", "value": "true"},
                         {"name": "ISTIO_DUAL_STACK",
                          "valueFrom": {"configMapKeyRef": {"name": "mesh", "key": "dual"}}},
                         {"name": "POD_NAME",
                          "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                     ],
                     "ports": [{"containerPort": 15090, "name": "http-envoy-prom"}],
                     "readinessProbe": {"httpGet": {"path": "/healthz/ready", "port": 15021}},
                     "securityContext": {"runAsUser": 0, "runAsGroup": 2000,
                                         "privileged": false, "readOnlyRootFilesystem": true,
                                         "capabilities": {"drop": ["ALL"]}}},
                ],
            },
            "status": {
                "phase": "Pending", "podIPs": [{"ip": "10.0.0.8"}],
                "initContainerStatuses": [{
                    "name": "istio-validation", "ready": false, "restartCount": 1,
                    "image": "istio/proxyv2:1.32", "imageID": "sha256:01",
                    "containerID": "containerd://abc",
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                    "lastState": {"terminated": {
                        "exitCode": 126, "reason": "Error", "message": "",
                        "containerID": "containerd://abc",
                        "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:01Z",
                    }},
                }],
                "containerStatuses": [{"name": "api", "ready": false, "restartCount": 0,
                                       "image": "shop/api:1.2", "imageID": "sha256:00"}],
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_pruned_sidecar_pod_decides_as_the_whole_pod_does() {
        let whole = sidecar_pod();
        let mut pruned = whole.clone();
        pod(&mut pruned);
        let decide = |pod: &Pod| sidecar::decide(&facts_of(pod, Labels::new()));
        let redirect = decide(&whole).unwrap().expect("a sidecar pod");
        assert_eq!(decide(&pruned), Ok(Some(redirect.clone())));
        assert_eq!(redirect.exclude_inbound_ports, [15020, 3306, 15021, 15090]);
        assert_eq!((redirect.proxy_uid, redirect.proxy_gid), (1337, 2000));
        assert!(redirect.dns_capture && !redirect.dual_stack);
        assert_eq!(
            read_by_the_rules(facts_of(&pruned, Labels::new())),
            read_by_the_rules(facts_of(&whole, Labels::new()))
        );

        // The same pod with istio-init (no CNI) is left alone, pruned or not.
        let mut self_redirecting = whole.clone();
        let spec = self_redirecting.spec.as_mut().unwrap();
        spec.init_containers.as_mut().unwrap()[0].name = "istio-init".into();
        let mut pruned = self_redirecting.clone();
        pod(&mut pruned);
        assert_eq!(decide(&self_redirecting), Ok(None));
        assert_eq!(decide(&pruned), Ok(None));
    }

    #[test]
    fn a_pruned_sidecar_pod_keeps_what_repair_reads_and_no_more() {
        let whole = sidecar_pod();
        let mut pruned = whole.clone();
        pod(&mut pruned);
        let spec = pruned.spec.as_ref().unwrap();
        let proxy = &spec.containers[1];
        assert_eq!(proxy.name, "istio-proxy");
        assert_eq!(
            (&proxy.image, &proxy.ports, &proxy.readiness_probe),
            (&None, &None, &None)
        );
        let env = proxy.env.as_ref().unwrap();
        assert!(env[1].value_from.is_some(), "valueFrom is kept as it is");
        let context = proxy.security_context.as_ref().unwrap();
        assert_eq!(
            (context.run_as_user, context.run_as_group),
            (Some(0), Some(2000))
        );
        assert_eq!((context.privileged, &context.capabilities), (None, &None));
        let api = &spec.containers[0];
        assert_eq!((&api.env, &api.security_context), (&None, &None));
        let validation = &spec.init_containers.as_ref().unwrap()[0];
        assert_eq!(validation.name, "istio-validation");
        assert_eq!((&validation.args, &validation.image), (&None, &None));

        let status = pruned.status.as_ref().unwrap();
        assert_eq!(status.container_statuses, None);
        let init = &status.init_container_statuses.as_ref().unwrap()[0];
        assert_eq!(init.name, "istio-validation");
        assert_eq!(
            init.state,
            Some(ContainerState::default()),
            "only a termination is kept"
        );
        let last = init
            .last_state
            .as_ref()
            .unwrap()
            .terminated
            .as_ref()
            .unwrap();
        assert_eq!(
            (
                last.exit_code,
                last.reason.as_deref(),
                last.message.as_deref()
            ),
            (126, Some("Error"), Some(""))
        );
        assert_eq!((&last.container_id, &last.started_at), (&None, &None));
        assert_eq!((&init.image, &init.container_id), (&String::new(), &None));
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
