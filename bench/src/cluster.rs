//! The agent following a cluster, against the API stand-in: its memory with a node's worth of
//! pod objects and a cluster's namespaces in its caches, and the API requests it makes at start,
//! per pod enrolled and per restart.
//!
//! Memory is measured twice in one run, with the same objects as a real API server returns them
//! (`managedFields`, container specs, statuses: a few KB a pod) and stripped to what weir reads:
//! the difference is what the caches keep of what weir never looks at.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod as PodObject};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use weir_agent::datapath::Datapath;
use weir_agent::policy::{DATAPLANE_MODE_LABEL, REDIRECTION_ANNOTATION};
use weir_tests::agent::{AgentBinary, AgentProcess, NodeFiles};
use weir_tests::{ApiRequest, ApiServer, PodSpec, TestNode, ZdsZtunnel};

use crate::report::{self, Report, Table};
use crate::Plan;

const NODE_NAME: &str = "bench-node";
const MESH: &str = "mesh";
/// How long the agent is left after it is ready before its memory or requests are read: its
/// first full pass and status writes come right after.
const SETTLE: Duration = Duration::from_secs(3);
const ENROLL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Objects {
    /// As a real API server returns them.
    Realistic,
    /// Only what weir reads.
    Minimal,
}

pub fn measure(plan: &Plan, report: &mut Report) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let mut memory = Table::new(
        &format!(
            "Agent memory following a cluster: {} pods on its node, {} namespaces",
            plan.cluster_pods, plan.cluster_namespaces
        ),
        &["objects", "pod object", "agent RSS", "peak RSS"],
    );
    let mut rows = Vec::new();
    for objects in [Objects::Realistic, Objects::Minimal] {
        let (rss, peak, requests) = on_node(&runtime, plan, objects)?;
        let pod_bytes =
            serde_json::to_vec(&pod_object("team-0", "app-0", Some("10.0.0.1"), objects))?.len();
        let name = match objects {
            Objects::Realistic => "as the API server returns them",
            Objects::Minimal => "stripped to what weir reads",
        };
        memory.row(&[
            name.into(),
            format!("{:.1} KB", pod_bytes as f64 / 1000.0),
            report::mebibytes(rss),
            report::mebibytes(peak),
        ]);
        rows.push(json!({
            "objects": name, "pod_object_bytes": pod_bytes, "rss_bytes": rss, "peak_rss_bytes": peak,
        }));
        if let Some(requests) = requests {
            report.push(requests);
        }
    }
    memory.note(
        "RSS: VmRSS of the agent's process once ready and settled; peak: its VmHWM, which \
         includes the lists in flight at start. Both runs hold the same names, labels and \
         annotations; the first also everything else a real API server sends (managedFields, \
         containers, volumes, conditions, container statuses)."
            .into(),
    );
    memory.json = json!(rows);
    report.push(memory);
    Ok(())
}

/// Runs an agent on a node of its own following a cluster of `objects`; its memory, and for
/// realistic objects the table of the requests it made.
fn on_node(
    runtime: &tokio::runtime::Runtime,
    plan: &Plan,
    objects: Objects,
) -> Result<(u64, u64, Option<Table>)> {
    let files = NodeFiles::new()?;
    let node = TestNode::with_options(files.node_options())?;
    // Listening in the node's network namespace, where the agent runs (host network).
    let api = node.run(|| runtime.block_on(ApiServer::start()))?;
    populate(&api, plan, objects);
    let count_requests = objects == Objects::Realistic;
    let api = &api;
    let kubeconfig = files.kubeconfig(api)?;
    let binary = AgentBinary::RunInCluster {
        kubeconfig: &kubeconfig,
        node_name: NODE_NAME,
    };
    let measured = (|| -> Result<_> {
        let agent = AgentProcess::start(&files, node.netns(), binary)?;
        std::thread::sleep(SETTLE);
        let memory = (agent.rss_bytes()?, agent.peak_rss_bytes()?);
        let at_start = api.requests();
        if !count_requests {
            return Ok((memory.0, memory.1, None));
        }
        let table = requests(api, plan, &files, &node, binary, agent, at_start)?;
        Ok((memory.0, memory.1, Some(table)))
    })();
    // The agent stops as an upgrade does (its DaemonSet exists), leaving its datapath pinned.
    let removed = Datapath::start(node.datapath_config()).and_then(|d| d.uninstall().wait());
    let measured = measured?;
    removed.context("removing the agent's datapath")?;
    Ok(measured)
}

/// Enrolls `plan.cluster_enrolled` pods, then restarts the agent, counting the requests of each
/// phase.
fn requests(
    api: &ApiServer,
    plan: &Plan,
    files: &NodeFiles,
    node: &TestNode,
    binary: AgentBinary,
    agent: AgentProcess,
    at_start: Vec<ApiRequest>,
) -> Result<Table> {
    let mut table = Table::new(
        "API requests the agent makes",
        &["phase", "requests", "by verb"],
    );
    let mut phases = serde_json::Map::new();
    let mut phase = |name: &str, requests: &[ApiRequest], per: usize| {
        let by_verb = by_verb(requests);
        let total = requests.len() as f64 / per as f64;
        let shown: Vec<String> = by_verb
            .iter()
            .map(|(verb, count)| format!("{verb} {}", *count as f64 / per as f64))
            .collect();
        table.row(&[name.into(), format!("{total}"), shown.join(", ")]);
        phases.insert(name.into(), json!({ "total": total, "by_verb": by_verb }));
    };
    phase("start, until ready and settled", &at_start, 1);

    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket)?;
    ztunnel.ack_without_proxies();
    let before = api.requests().len();
    let mut pods = Vec::new();
    for index in 0..plan.cluster_enrolled {
        let name = format!("enrolled-{index}");
        let object = api.create(&pod_object(MESH, &name, None, Objects::Minimal));
        let pod = node.add_pod_with(PodSpec {
            namespace: MESH.into(),
            uid: object.metadata.uid.clone(),
            ..PodSpec::new(&name)
        })?;
        // Kubelet reports the pod running once its sandbox is up, through the status
        // subresource: the agent's annotation, written meanwhile, stays.
        let ip = pod.ipv4().to_string();
        let running = pod_object(MESH, &name, Some(&ip), Objects::Minimal).status;
        api.patch_status::<PodObject>(MESH, &name, &running);
        pods.push(pod);
    }
    let deadline = Instant::now() + ENROLL_TIMEOUT;
    for index in 0..plan.cluster_enrolled {
        let name = format!("enrolled-{index}");
        while redirection(api, &name).as_deref() != Some("enabled") {
            if Instant::now() > deadline {
                bail!(
                    "{name} was not reported enabled within {ENROLL_TIMEOUT:?} (its {}: {:?})",
                    REDIRECTION_ANNOTATION,
                    redirection(api, &name)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    std::thread::sleep(SETTLE);
    phase(
        "per pod enrolled",
        &api.requests()[before..],
        plan.cluster_enrolled.max(1),
    );

    // A restart, as an upgrade does it: the pods stay redirected meanwhile.
    drop(ztunnel);
    drop(agent);
    let before = api.requests().len();
    let agent = AgentProcess::start(files, node.netns(), binary)?;
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket)?;
    ztunnel.ack_without_proxies();
    std::thread::sleep(SETTLE);
    let restart = api.requests()[before..].to_vec();
    phase("restart, until ready and settled", &restart, 1);
    let patches = restart.iter().filter(|r| r.verb == "patch").count();
    table.note(format!(
        "Counted at the API stand-in. Lists come in pages of 500 objects; a restart with {} \
         enrolled pods wrote {patches} pod patches.",
        plan.cluster_enrolled
    ));
    table.json = serde_json::Value::Object(phases);
    // The pods' DELs reach the agent before it stops.
    drop(pods);
    drop(ztunnel);
    drop(agent);
    Ok(table)
}

fn by_verb(requests: &[ApiRequest]) -> BTreeMap<String, usize> {
    let mut by_verb = BTreeMap::new();
    for request in requests {
        *by_verb.entry(request.verb.clone()).or_default() += 1;
    }
    by_verb
}

fn redirection(api: &ApiServer, name: &str) -> Option<String> {
    let pod: PodObject = api.get(MESH, name)?;
    pod.metadata
        .annotations?
        .get(REDIRECTION_ANNOTATION)
        .cloned()
}

/// The cluster: `plan.cluster_namespaces` namespaces with `plan.cluster_pods` running pods on
/// this node spread over them (none ambient, so the agent only caches them), the ambient
/// namespace for the pods it enrolls, weir's DaemonSet and the node.
fn populate(api: &ApiServer, plan: &Plan, objects: Objects) {
    api.create(&typed::<Namespace>(json!({
        "metadata": { "name": MESH, "labels": { DATAPLANE_MODE_LABEL: "ambient" } },
    })));
    api.create(&typed::<Namespace>(
        json!({ "metadata": { "name": "istio-system" } }),
    ));
    api.create(&typed::<Node>(json!({ "metadata": { "name": NODE_NAME } })));
    api.create(&typed::<k8s_openapi::api::apps::v1::DaemonSet>(json!({
        "metadata": { "name": "weir", "namespace": "istio-system" },
        "spec": { "selector": {}, "template": { "spec": { "containers": [] } } },
    })));
    let namespaces = plan.cluster_namespaces.max(1);
    for index in 0..namespaces {
        api.create(&namespace_object(&format!("team-{index}"), objects));
    }
    for index in 0..plan.cluster_pods {
        let namespace = format!("team-{}", index % namespaces);
        // Distinct addresses, as the pods of a node have; none is ever reached.
        let ip = format!("10.200.{}.{}", index / 250, index % 250 + 1);
        api.create(&pod_object(
            &namespace,
            &format!("app-{index}"),
            Some(&ip),
            objects,
        ));
    }
}

fn typed<K: DeserializeOwned>(value: Value) -> K {
    serde_json::from_value(value).expect("a valid object")
}

fn namespace_object(name: &str, objects: Objects) -> Namespace {
    let mut namespace = json!({
        "metadata": {
            "name": name,
            "labels": { "kubernetes.io/metadata.name": name, "team": name },
        },
    });
    if objects == Objects::Realistic {
        let applied = json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": { "name": name, "labels": { "team": name },
                          "annotations": { "owner": "platform-team@example.com" } },
        });
        namespace["metadata"]["annotations"] = json!({
            "kubectl.kubernetes.io/last-applied-configuration": applied.to_string(),
            "owner": "platform-team@example.com",
        });
        namespace["metadata"]["managedFields"] = json!([{
            "manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "v1",
            "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
            "fieldsV1": { "f:metadata": { "f:annotations": { ".": {},
                "f:kubectl.kubernetes.io/last-applied-configuration": {}, "f:owner": {} },
                "f:labels": { ".": {}, "f:kubernetes.io/metadata.name": {}, "f:team": {} } } },
        }]);
        namespace["spec"] = json!({ "finalizers": ["kubernetes"] });
        namespace["status"] = json!({ "phase": "Active" });
    }
    typed(namespace)
}

/// A pod bound to this node, running at `ip` when given.
fn pod_object(namespace: &str, name: &str, ip: Option<&str>, objects: Objects) -> PodObject {
    let mut pod = json!({
        "metadata": {
            "name": name, "namespace": namespace,
            "labels": { "app": name, "pod-template-hash": "7d9c8b6f4" },
            "annotations": { "kubectl.kubernetes.io/default-container": "app" },
        },
        "spec": { "nodeName": NODE_NAME, "serviceAccountName": "default", "containers": [] },
    });
    if let Some(ip) = ip {
        pod["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
    }
    if objects == Objects::Realistic {
        realistic_bulk(&mut pod);
    }
    typed(pod)
}

/// What a Deployment's pod carries besides: owner, containers with probes, env and volume mounts,
/// volumes, tolerations, conditions, container statuses and the managers' managedFields.
fn realistic_bulk(pod: &mut Value) {
    let container = |name: &str| {
        json!({
            "name": name, "image": format!("registry.example.com/shop/{name}:1.24.3"),
            "imagePullPolicy": "IfNotPresent",
            "ports": [{ "name": "http", "containerPort": 8080, "protocol": "TCP" }],
            "env": (0..8).map(|i| json!({ "name": format!("SETTING_{i}"), "value": format!("value-{i}") }))
                .collect::<Vec<_>>(),
            "resources": { "requests": { "cpu": "100m", "memory": "128Mi" },
                           "limits": { "memory": "256Mi" } },
            "readinessProbe": { "httpGet": { "path": "/ready", "port": 8080, "scheme": "HTTP" },
                                "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1,
                                "failureThreshold": 3 },
            "livenessProbe": { "httpGet": { "path": "/health", "port": 8080, "scheme": "HTTP" },
                               "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1,
                               "failureThreshold": 3 },
            "volumeMounts": [
                { "name": "config", "mountPath": "/etc/app" },
                { "name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                  "readOnly": true },
            ],
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File",
        })
    };
    let container_status = |name: &str| {
        json!({
            "name": name, "ready": true, "started": true, "restartCount": 0,
            "image": format!("registry.example.com/shop/{name}:1.24.3"),
            "imageID": format!("registry.example.com/shop/{name}@sha256:{}", "0".repeat(64)),
            "containerID": format!("containerd://{}", "1".repeat(64)),
            "state": { "running": { "startedAt": "2026-01-01T00:00:00Z" } },
            "lastState": {},
        })
    };
    let fields = |keys: &[&str]| -> Value {
        keys.iter()
            .map(|key| {
                (
                    format!("f:{key}"),
                    json!({ ".": {}, "f:name": {}, "f:value": {} }),
                )
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let metadata = &mut pod["metadata"];
    metadata["generateName"] = json!("app-7d9c8b6f4-");
    metadata["ownerReferences"] = json!([{ "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "name": "app-7d9c8b6f4", "uid": "7d9c8b6f-0000-4000-8000-000000000000",
        "controller": true, "blockOwnerDeletion": true }]);
    metadata["managedFields"] = json!([
        { "manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
          "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
          "fieldsV1": { "f:metadata": { "f:generateName": {}, "f:labels": { ".": {}, "f:app": {},
              "f:pod-template-hash": {} }, "f:ownerReferences": { ".": {} } },
              "f:spec": { "f:containers": { "k:{\"name\":\"app\"}": {
                  "f:env": fields(&["SETTING_0", "SETTING_1", "SETTING_2", "SETTING_3",
                                    "SETTING_4", "SETTING_5", "SETTING_6", "SETTING_7"]),
                  "f:image": {}, "f:livenessProbe": {}, "f:ports": {}, "f:readinessProbe": {},
                  "f:resources": {}, "f:volumeMounts": {} },
                "k:{\"name\":\"sidecar\"}": {
                  "f:env": fields(&["SETTING_0", "SETTING_1", "SETTING_2", "SETTING_3"]),
                  "f:image": {}, "f:resources": {} } },
                "f:volumes": {} } } },
        { "manager": "kubelet", "operation": "Update", "apiVersion": "v1", "subresource": "status",
          "time": "2026-01-01T00:00:05Z", "fieldsType": "FieldsV1",
          "fieldsV1": { "f:status": { "f:conditions": {}, "f:containerStatuses": {},
              "f:hostIP": {}, "f:hostIPs": {}, "f:phase": {}, "f:podIP": {}, "f:podIPs": {},
              "f:startTime": {} } } },
    ]);
    let spec = &mut pod["spec"];
    spec["containers"] = json!([container("app"), container("sidecar")]);
    spec["volumes"] = json!([
        { "name": "config", "configMap": { "name": "app-config", "defaultMode": 420 } },
        { "name": "kube-api-access", "projected": { "defaultMode": 420, "sources": [
            { "serviceAccountToken": { "expirationSeconds": 3607, "path": "token" } },
            { "configMap": { "name": "kube-root-ca.crt", "items": [{ "key": "ca.crt", "path": "ca.crt" }] } },
            { "downwardAPI": { "items": [{ "path": "namespace",
                "fieldRef": { "apiVersion": "v1", "fieldPath": "metadata.namespace" } }] } } ] } },
    ]);
    spec["tolerations"] = json!([
        { "key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
          "tolerationSeconds": 300 },
        { "key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
          "tolerationSeconds": 300 },
    ]);
    spec["restartPolicy"] = json!("Always");
    spec["dnsPolicy"] = json!("ClusterFirst");
    spec["schedulerName"] = json!("default-scheduler");
    spec["terminationGracePeriodSeconds"] = json!(30);
    if pod["status"].is_object() {
        let status = &mut pod["status"];
        status["hostIP"] = json!("192.168.10.4");
        status["startTime"] = json!("2026-01-01T00:00:01Z");
        status["qosClass"] = json!("Burstable");
        status["conditions"] = json!([
            "PodReadyToStartContainers",
            "Initialized",
            "Ready",
            "ContainersReady",
            "PodScheduled"
        ]
        .map(|kind| json!({ "type": kind, "status": "True",
                "lastTransitionTime": "2026-01-01T00:00:03Z" })));
        status["containerStatuses"] = json!([container_status("app"), container_status("sidecar")]);
    }
}
