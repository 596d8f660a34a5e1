//! kube-rs against the API server stand-in: the reflector, watch resumption and relisting,
//! bookmarks, status patches, events, deletes with preconditions and errors, withheld lists,
//! all through kube-rs's own requests. Nothing here needs privileges or touches the kernel.

use std::collections::BTreeMap;
use std::future::ready;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Event as CoreEvent, Namespace, Node, NodeCondition, NodeStatus, ObjectReference, Pod, PodSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions, WatchEvent,
    WatchParams,
};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::time::timeout;
use weir_tests::wait_until_async;
use weir_tests::ApiServer;

/// The longest any one step may take before the test fails instead of hanging.
const WAIT: Duration = Duration::from_secs(10);
const REDIRECTION: &str = "ambient.istio.io/redirection";

fn pod(name: &str, node: &str, labels: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn sorted_names<'a, K: ResourceExt + 'a>(objects: impl IntoIterator<Item = &'a K>) -> Vec<String> {
    let mut names: Vec<_> = objects.into_iter().map(ResourceExt::name_any).collect();
    names.sort();
    names
}

fn cached_names(cache: &reflector::Store<Pod>) -> Vec<String> {
    sorted_names(cache.state().iter().map(|pod| &**pod))
}

/// Every event of a watch until the stand-in ends it.
async fn watch_to_end(
    events: impl Stream<Item = kube::Result<WatchEvent<Pod>>>,
) -> Vec<WatchEvent<Pod>> {
    let collected = timeout(WAIT, events.try_collect()).await;
    collected
        .expect("the watch ends in time")
        .expect("the watch stream is well formed")
}

/// What a running reflector saw: the names of objects it was told about, and the HTTP codes of
/// the watch errors it got.
#[derive(Clone, Default)]
struct Seen {
    names: Arc<Mutex<Vec<String>>>,
    error_codes: Arc<Mutex<Vec<u16>>>,
}

/// Runs a reflector over `pods` with `config` until the returned task is aborted.
fn run_reflector(
    pods: Api<Pod>,
    config: watcher::Config,
) -> (reflector::Store<Pod>, Seen, tokio::task::JoinHandle<()>) {
    let (reader, writer) = reflector::store();
    let seen = Seen::default();
    let record = seen.clone();
    let events = reflector::reflector(writer, watcher(pods, config)).default_backoff();
    let task = tokio::spawn(events.for_each(move |event| {
        match event {
            Ok(
                watcher::Event::Apply(pod)
                | watcher::Event::InitApply(pod)
                | watcher::Event::Delete(pod),
            ) => record.names.lock().unwrap().push(pod.name_any()),
            Err(watcher::Error::WatchError(status)) => {
                record.error_codes.lock().unwrap().push(status.code)
            }
            _ => {}
        }
        ready(())
    }));
    (reader, seen, task)
}

#[tokio::test]
async fn reflector_follows_the_pods_of_its_node_only() {
    let server = ApiServer::start().await.unwrap();
    server.create(&pod("a1", "node-a", &[]));
    server.create(&pod("b1", "node-b", &[]));
    let config = watcher::Config::default().fields("spec.nodeName=node-a");
    let (cache, seen, reflector) = run_reflector(Api::all(server.client()), config);

    timeout(WAIT, cache.wait_until_ready())
        .await
        .expect("initial sync in time")
        .unwrap();
    assert_eq!(cached_names(&cache), ["a1"]);

    server.create(&pod("b2", "node-b", &[]));
    server.create(&pod("a2", "node-a", &[]));
    wait_until_async(WAIT, "a2 in the cache", || {
        cached_names(&cache) == ["a1", "a2"]
    })
    .await;

    let labels = json!({ "metadata": { "labels": { "istio.io/dataplane-mode": "ambient" } } });
    let pods: Api<Pod> = Api::default_namespaced(server.client());
    pods.patch("a1", &PatchParams::default(), &Patch::Merge(&labels))
        .await
        .unwrap();
    let a1 = ObjectRef::new("a1").within("default");
    wait_until_async(WAIT, "a1's new label in the cache", || {
        cache.get(&a1).is_some_and(|pod| {
            pod.labels()
                .get("istio.io/dataplane-mode")
                .is_some_and(|v| v == "ambient")
        })
    })
    .await;

    server.delete::<Pod>("default", "a1").expect("a1 existed");
    wait_until_async(WAIT, "a1 gone from the cache", || {
        cached_names(&cache) == ["a2"]
    })
    .await;
    // Initial a1, added a2, relabelled a1, deleted a1: never a pod of node-b.
    let expected = ["a1", "a2", "a1", "a1"];
    wait_until_async(WAIT, "every event reported", || {
        *seen.names.lock().unwrap() == expected
    })
    .await;
    reflector.abort();
    let requests = server.requests();
    let list = requests
        .iter()
        .find(|r| r.verb == "list")
        .expect("the watcher listed");
    assert_eq!(list.path, "/api/v1/pods");
    assert_eq!(
        list.param("fieldSelector").as_deref(),
        Some("spec.nodeName=node-a")
    );
    assert!(requests
        .iter()
        .filter(|r| r.verb == "watch")
        .all(|r| r.param("fieldSelector") == list.param("fieldSelector")));
}

#[tokio::test]
async fn expired_history_makes_the_watcher_relist_and_lose_nothing() {
    let server = ApiServer::start().await.unwrap();
    server.create(&pod("stays", "node-a", &[]));
    server.create(&pod("goes", "node-a", &[]));
    let (cache, seen, reflector) =
        run_reflector(Api::all(server.client()), watcher::Config::default());
    timeout(WAIT, cache.wait_until_ready())
        .await
        .expect("initial sync in time")
        .unwrap();
    wait_until_async(WAIT, "the watch after the initial list", || {
        server.open_watches() == 1
    })
    .await;

    // Changes while the stream is down and that a resumed watch could not replay: only a
    // relist can tell the watcher that "goes" went.
    server.expire_history();
    server.drop_watches();
    server
        .delete::<Pod>("default", "goes")
        .expect("goes existed");
    server.create(&pod("new", "node-a", &[]));

    wait_until_async(WAIT, "the relisted cache", || {
        cached_names(&cache) == ["new", "stays"]
    })
    .await;
    reflector.abort();
    assert_eq!(*seen.error_codes.lock().unwrap(), [410]);
    let lists = server
        .requests()
        .into_iter()
        .filter(|r| r.verb == "list")
        .count();
    assert_eq!(lists, 2, "the initial list and the relist after 410");
}

#[tokio::test]
async fn a_watch_resumes_from_history_and_gets_410_once_it_is_forgotten() {
    let server = ApiServer::start().await.unwrap();
    server.create(&pod("before", "node-a", &[]));
    let forgotten = server.resource_version();
    server.expire_history();
    let resumable = server.resource_version();
    server.create(&pod("after", "node-a", &[]));
    let pods: Api<Pod> = Api::default_namespaced(server.client());
    let params = WatchParams::default().timeout(1).disable_bookmarks();

    let resumed = watch_to_end(pods.watch(&params, &resumable.to_string()).await.unwrap()).await;
    match resumed.as_slice() {
        [WatchEvent::Added(pod)] => assert_eq!(pod.name_any(), "after"),
        other => panic!("expected only the change since {resumable}, got {other:?}"),
    }

    let expired = watch_to_end(pods.watch(&params, &forgotten.to_string()).await.unwrap()).await;
    match expired.as_slice() {
        [WatchEvent::Error(status)] => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("expected one 410 Expired error event, got {other:?}"),
    }
}

#[tokio::test]
async fn bookmarks_are_sent_when_asked_for() {
    let server = ApiServer::start().await.unwrap();
    server.create(&pod("p", "node-a", &[]));
    let pods: Api<Pod> = Api::default_namespaced(server.client());

    let with = watch_to_end(
        pods.watch(&WatchParams::default().timeout(1), "0")
            .await
            .unwrap(),
    )
    .await;
    match with.as_slice() {
        [WatchEvent::Added(pod), WatchEvent::Bookmark(bookmark)] => {
            assert_eq!(pod.name_any(), "p");
            assert_eq!(
                bookmark.metadata.resource_version,
                server.resource_version().to_string()
            );
            assert_eq!(
                (
                    bookmark.types.api_version.as_str(),
                    bookmark.types.kind.as_str()
                ),
                ("v1", "Pod")
            );
        }
        other => panic!("expected the pod and then a bookmark, got {other:?}"),
    }

    let params = WatchParams::default().timeout(1).disable_bookmarks();
    let without = watch_to_end(pods.watch(&params, "0").await.unwrap()).await;
    assert!(
        matches!(without.as_slice(), [WatchEvent::Added(_)]),
        "got {without:?}"
    );

    let asked: Vec<_> = server
        .requests()
        .iter()
        .map(|r| r.param("allowWatchBookmarks"))
        .collect();
    assert_eq!(asked, [Some("true".to_owned()), None]);
}

#[tokio::test]
async fn status_patch_sets_and_removes_the_redirection_annotation() {
    let server = ApiServer::start().await.unwrap();
    let mut unpatched = pod("p", "node-a", &[]);
    unpatched.metadata.annotations = Some(BTreeMap::from([("keep".to_owned(), "me".to_owned())]));
    let created = server.create(&unpatched);
    let pods: Api<Pod> = Api::default_namespaced(server.client());
    let params = PatchParams::default();

    let enable = json!({ "metadata": { "annotations": { REDIRECTION: "enabled" } } });
    let enabled = pods
        .patch_status("p", &params, &Patch::Merge(&enable))
        .await
        .unwrap();
    assert_eq!(
        enabled.annotations().get(REDIRECTION).map(String::as_str),
        Some("enabled")
    );
    assert_eq!(
        enabled.annotations().get("keep").map(String::as_str),
        Some("me")
    );
    let version = |pod: &Pod| pod.resource_version().unwrap().parse::<u64>().unwrap();
    assert!(version(&enabled) > version(&created));
    let stored = server.get::<Pod>("default", "p").unwrap();
    assert_eq!(
        stored.annotations().get(REDIRECTION).map(String::as_str),
        Some("enabled")
    );

    let remove = json!({ "metadata": { "annotations": { REDIRECTION: null } } });
    let removed = pods
        .patch_status("p", &params, &Patch::Merge(&remove))
        .await
        .unwrap();
    assert_eq!(
        removed.annotations(),
        &BTreeMap::from([("keep".to_owned(), "me".to_owned())])
    );

    // Labels change through it too (istio's repair controller labels pods this way).
    let label = json!({ "metadata": { "labels": { "cni.istio.io/uninitialized": "true" } } });
    let labelled = pods
        .patch_status("p", &params, &Patch::Merge(&label))
        .await
        .unwrap();
    assert_eq!(
        labelled
            .labels()
            .get("cni.istio.io/uninitialized")
            .map(String::as_str),
        Some("true")
    );

    // The status subresource leaves the spec alone.
    let move_it = json!({ "spec": { "nodeName": "node-b" } });
    let unmoved = pods
        .patch_status("p", &params, &Patch::Merge(&move_it))
        .await
        .unwrap();
    assert_eq!(unmoved.spec.unwrap().node_name.as_deref(), Some("node-a"));

    let patches: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .collect();
    assert_eq!(patches.len(), 4);
    for patch in patches {
        assert_eq!(patch.path, "/api/v1/namespaces/default/pods/p/status");
        assert_eq!(
            patch.content_type.as_deref(),
            Some("application/merge-patch+json")
        );
    }
}

/// A Node's conditions merge by `type` under a strategic merge patch, as the API server merges
/// them: a node agent's condition leaves the kubelet's alone. A merge patch replaces the list.
#[tokio::test]
async fn strategic_merge_patch_merges_node_conditions_by_type() {
    let server = ApiServer::start().await.unwrap();
    let condition = |type_: &str, status: &str| NodeCondition {
        type_: type_.into(),
        status: status.into(),
        ..NodeCondition::default()
    };
    let kubelets = vec![
        condition("Ready", "True"),
        condition("DiskPressure", "False"),
    ];
    server.create(&Node {
        metadata: ObjectMeta {
            name: Some("node-a".into()),
            ..ObjectMeta::default()
        },
        status: Some(NodeStatus {
            conditions: Some(kubelets.clone()),
            ..NodeStatus::default()
        }),
        ..Node::default()
    });
    let nodes: Api<Node> = Api::all(server.client());
    let params = PatchParams::default();
    let conditions = |node: Node| node.status.unwrap().conditions.unwrap();
    let set = |status: &str| {
        let mut ours = condition("example.com/AgentReady", status);
        ours.reason = Some(format!("Now{status}"));
        Patch::Strategic(json!({ "status": { "conditions": [ours] } }))
    };

    let added = nodes.patch_status("node-a", &params, &set("False")).await;
    let mut wanted = kubelets.clone();
    wanted.push(condition("example.com/AgentReady", "False"));
    wanted[2].reason = Some("NowFalse".into());
    assert_eq!(conditions(added.unwrap()), wanted, "added at the end");
    let changed = nodes.patch_status("node-a", &params, &set("True")).await;
    wanted[2].status = "True".into();
    wanted[2].reason = Some("NowTrue".into());
    assert_eq!(conditions(changed.unwrap()), wanted, "merged into its own");
    assert_eq!(
        conditions(server.get::<Node>("", "node-a").unwrap()),
        wanted
    );

    let replace = json!({ "status": { "conditions": [condition("Ready", "False")] } });
    let replaced = nodes
        .patch_status("node-a", &params, &Patch::Merge(&replace))
        .await;
    assert_eq!(
        conditions(replaced.unwrap()),
        [condition("Ready", "False")],
        "a merge patch replaces the list"
    );

    let directive =
        json!({ "status": { "conditions": [{ "type": "Ready", "$patch": "delete" }] } });
    let refused = nodes
        .patch_status("node-a", &params, &Patch::Strategic(directive))
        .await;
    assert!(
        matches!(refused, Err(kube::Error::Api(ref status)) if status.code == 400),
        "{refused:?}"
    );
}

#[tokio::test]
async fn recorder_publishes_an_event_about_the_pod() {
    let server = ApiServer::start().await.unwrap();
    let pod = server.create(&pod("p", "node-a", &[]));
    let reporter = Reporter {
        controller: "weir".into(),
        instance: Some("node-a".into()),
    };
    let recorder = Recorder::new(server.client(), reporter);
    let event = Event {
        type_: EventType::Warning,
        reason: "RedirectionFailed".into(),
        note: Some("no network namespace".into()),
        action: "Enroll".into(),
        secondary: None,
    };

    timeout(WAIT, recorder.publish(&event, &pod.object_ref(&())))
        .await
        .unwrap()
        .unwrap();
    let events = server.events();
    let [recorded] = events.as_slice() else {
        panic!("expected one event, got {events:?}")
    };
    assert_eq!(recorded["apiVersion"], "events.k8s.io/v1");
    assert_eq!(recorded["metadata"]["namespace"], "default");
    assert_eq!(recorded["reason"], "RedirectionFailed");
    assert_eq!(recorded["type"], "Warning");
    assert_eq!(recorded["note"], "no network namespace");
    assert_eq!(recorded["reportingController"], "weir");
    assert_eq!(recorded["regarding"]["kind"], "Pod");
    assert_eq!(recorded["regarding"]["name"], "p");
    assert_eq!(recorded["regarding"]["uid"].as_str(), pod.uid().as_deref());

    // kube-rs folds a repeat into a series on the same Event, with a merge patch.
    timeout(WAIT, recorder.publish(&event, &pod.object_ref(&())))
        .await
        .unwrap()
        .unwrap();
    let events = server.events();
    let [repeated] = events.as_slice() else {
        panic!("expected one event, got {events:?}")
    };
    assert_eq!(repeated["series"]["count"], 2);
    let writes: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .map(|r| (r.method, r.path))
        .collect();
    let path = "/apis/events.k8s.io/v1/namespaces/default/events".to_owned();
    let name = recorded["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        writes,
        [
            ("POST".to_owned(), path.clone()),
            ("PATCH".to_owned(), format!("{path}/{name}"))
        ]
    );
}

#[tokio::test]
async fn core_v1_events_are_recorded_too() {
    let server = ApiServer::start().await.unwrap();
    let events: Api<CoreEvent> = Api::default_namespaced(server.client());
    let event = CoreEvent {
        metadata: ObjectMeta {
            generate_name: Some("p.".into()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            kind: Some("Pod".into()),
            name: Some("p".into()),
            ..Default::default()
        },
        reason: Some("LabelBrokenPod".into()),
        type_: Some("Normal".into()),
        ..Default::default()
    };

    let created = events.create(&PostParams::default(), &event).await.unwrap();
    assert!(
        created.name_any().starts_with("p."),
        "named from generateName: {}",
        created.name_any()
    );
    let recorded = server.events();
    let [recorded] = recorded.as_slice() else {
        panic!("expected one event, got {recorded:?}")
    };
    assert_eq!(recorded["apiVersion"], "v1");
    assert_eq!(recorded["involvedObject"]["name"], "p");
    assert_eq!(recorded["reason"], "LabelBrokenPod");
}

#[tokio::test]
async fn a_pod_that_leaves_or_enters_a_watch_selector_is_deleted_or_added() {
    let server = ApiServer::start().await.unwrap();
    server.create(&pod(
        "p",
        "node-a",
        &[("istio.io/dataplane-mode", "ambient")],
    ));
    let pods: Api<Pod> = Api::default_namespaced(server.client());
    let params = WatchParams::default()
        .labels("istio.io/dataplane-mode=ambient")
        .disable_bookmarks();
    let mut events = pods.watch(&params, "0").await.unwrap().boxed();
    let mut next = async || {
        let event = timeout(WAIT, events.try_next())
            .await
            .expect("an event in time");
        match event.unwrap().expect("the watch goes on") {
            WatchEvent::Added(pod) => ("ADDED", pod.labels().clone()),
            WatchEvent::Modified(pod) => ("MODIFIED", pod.labels().clone()),
            WatchEvent::Deleted(pod) => ("DELETED", pod.labels().clone()),
            other => panic!("unexpected {other:?}"),
        }
    };
    let labelled =
        |mode: &str| BTreeMap::from([("istio.io/dataplane-mode".to_owned(), mode.to_owned())]);
    assert_eq!(next().await, ("ADDED", labelled("ambient")));

    for (mode, expected) in [
        ("none", ("DELETED", labelled("ambient"))),
        ("ambient", ("ADDED", labelled("ambient"))),
    ] {
        let relabel = json!({ "metadata": { "labels": { "istio.io/dataplane-mode": mode } } });
        pods.patch("p", &PatchParams::default(), &Patch::Merge(&relabel))
            .await
            .unwrap();
        assert_eq!(next().await, expected, "after relabelling to {mode}");
    }
    let annotate = json!({ "metadata": { "annotations": { "a": "b" } } });
    pods.patch("p", &PatchParams::default(), &Patch::Merge(&annotate))
        .await
        .unwrap();
    assert_eq!(next().await, ("MODIFIED", labelled("ambient")));
}

#[tokio::test]
async fn delete_honours_preconditions() {
    let server = ApiServer::start().await.unwrap();
    let created = server.create(&pod("p", "node-a", &[]));
    let pods: Api<Pod> = Api::default_namespaced(server.client());
    let mut events = pods
        .watch(
            &WatchParams::default().disable_bookmarks(),
            &server.resource_version().to_string(),
        )
        .await
        .unwrap()
        .boxed();
    let with_preconditions = |uid: Option<String>, resource_version: Option<String>| DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version,
        }),
        ..Default::default()
    };

    for refused in [
        with_preconditions(Some("11111111-2222-4333-8444-555555555555".into()), None),
        with_preconditions(created.uid(), Some("0".into())),
    ] {
        match pods.delete("p", &refused).await {
            Err(kube::Error::Api(status)) => {
                assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"))
            }
            other => panic!("expected 409 Conflict, got {other:?}"),
        }
    }
    assert!(server.get::<Pod>("default", "p").is_some());

    let deleted = pods
        .delete(
            "p",
            &with_preconditions(created.uid(), created.resource_version()),
        )
        .await
        .unwrap();
    assert!(
        deleted.is_left(),
        "the API server answers the deleted pod: {deleted:?}"
    );
    assert!(server.get::<Pod>("default", "p").is_none());
    let sent = server.requests().pop().unwrap();
    assert_eq!(sent.verb, "delete");
    assert_eq!(
        sent.body.unwrap()["preconditions"],
        json!({"uid": created.uid(), "resourceVersion": created.resource_version()}),
        "the request's body is recorded"
    );
    let event = timeout(WAIT, events.try_next())
        .await
        .expect("an event in time")
        .unwrap();
    match event {
        Some(WatchEvent::Deleted(pod)) => {
            assert_eq!(pod.name_any(), "p");
            assert_eq!(
                pod.resource_version(),
                Some(server.resource_version().to_string())
            );
        }
        other => panic!("expected p deleted, got {other:?}"),
    }
}

#[tokio::test]
async fn daemonset_get_works_and_a_missing_one_is_a_404() {
    let server = ApiServer::start().await.unwrap();
    let daemonset = DaemonSet {
        metadata: ObjectMeta {
            name: Some("weir".into()),
            namespace: Some("istio-system".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let created = server.create(&daemonset);
    let daemonsets: Api<DaemonSet> = Api::namespaced(server.client(), "istio-system");

    let got = daemonsets.get("weir").await.unwrap();
    assert_eq!(
        (got.name_any(), got.uid()),
        ("weir".to_owned(), created.uid())
    );
    assert_eq!(
        sorted_names(&daemonsets.list(&ListParams::default()).await.unwrap().items),
        ["weir"]
    );
    match daemonsets.get("missing").await {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (404, "NotFound"));
        }
        other => panic!("expected 404 NotFound, got {other:?}"),
    }
    assert!(daemonsets.get_opt("missing").await.unwrap().is_none());
    assert_eq!(
        server.requests()[0].path,
        "/apis/apps/v1/namespaces/istio-system/daemonsets/weir"
    );
}

#[tokio::test]
async fn selectors_filter_lists() {
    let server = ApiServer::start().await.unwrap();
    server.create(&pod("a", "node-a", &[("app", "x"), ("tier", "web")]));
    server.create(&pod("b", "node-a", &[("app", "x"), ("tier", "db")]));
    server.create(&pod("c", "node-b", &[("app", "y")]));
    server.create(&pod("d", "node-b", &[]));
    let pods: Api<Pod> = Api::default_namespaced(server.client());
    let names = |params: ListParams| {
        let pods = pods.clone();
        async move { sorted_names(&pods.list(&params).await.unwrap().items) }
    };

    assert_eq!(
        names(ListParams::default().labels("app=x,tier!=db")).await,
        ["a"]
    );
    assert_eq!(names(ListParams::default().labels("!app")).await, ["d"]);
    assert_eq!(
        names(ListParams::default().labels("app in (x,y),tier")).await,
        ["a", "b"]
    );
    assert_eq!(
        names(ListParams::default().labels("app notin (x)")).await,
        ["c", "d"]
    );
    assert_eq!(
        names(ListParams::default().fields("spec.nodeName=node-b,metadata.name!=c")).await,
        ["d"]
    );

    let ambient = Namespace {
        metadata: ObjectMeta {
            name: Some("mesh".into()),
            labels: Some(BTreeMap::from([(
                "istio.io/dataplane-mode".to_owned(),
                "ambient".to_owned(),
            )])),
            ..Default::default()
        },
        ..Default::default()
    };
    server.create(&ambient);
    server.create(&Namespace {
        metadata: ObjectMeta {
            name: Some("plain".into()),
            ..Default::default()
        },
        ..Default::default()
    });
    let namespaces: Api<Namespace> = Api::all(server.client());
    let selected = namespaces
        .list(&ListParams::default().labels("istio.io/dataplane-mode=ambient"))
        .await
        .unwrap();
    assert_eq!(sorted_names(&selected.items), ["mesh"]);
}

#[tokio::test]
async fn withheld_lists_are_answered_once_released() {
    let server = ApiServer::start().await.unwrap();
    server.create(&pod("p", "node-a", &[]));
    server.withhold_lists::<Namespace>();
    let namespaces: Api<Namespace> = Api::all(server.client());
    let pods: Api<Pod> = Api::default_namespaced(server.client());
    let listing = tokio::spawn(async move { namespaces.list(&ListParams::default()).await });

    // Other kinds are answered meanwhile.
    let listed = pods.list(&ListParams::default()).await.unwrap();
    assert_eq!(sorted_names(&listed), ["p"]);
    wait_until_async(WAIT, "the namespace list to arrive", || {
        server
            .requests()
            .iter()
            .any(|r| r.path == "/api/v1/namespaces")
    })
    .await;
    assert!(!listing.is_finished(), "the namespace list is withheld");

    server.answer_lists::<Namespace>();
    let answered = timeout(WAIT, listing).await.expect("answered").unwrap();
    assert!(answered.unwrap().items.is_empty());
}

#[tokio::test]
async fn lists_come_in_pages_of_one_snapshot() {
    let api = ApiServer::start().await.unwrap();
    for name in ["a", "b", "c"] {
        api.create(&pod(name, "node-a", &[]));
    }
    let pods: Api<Pod> = Api::namespaced(api.client(), "default");
    let first = pods.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(sorted_names(&first.items), ["a", "b"]);
    let token = first.metadata.continue_.clone().expect("a continue token");
    // The next page reads the list as it was at its first page: later writes are not in it.
    api.create(&pod("d", "node-a", &[]));
    let second = pods
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(sorted_names(&second.items), ["c"]);
    assert_eq!(second.metadata.continue_, None);
    assert_eq!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );

    // Smaller pages than asked for, as a loaded API server may give: a watcher still gets all.
    api.limit_pages(1, Duration::ZERO);
    let listed = pods.list(&ListParams::default().limit(500)).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    let (cache, _, task) = run_reflector(Api::all(api.client()), watcher::Config::default());
    wait_until_async(WAIT, "the paged list reaches the cache", || {
        cached_names(&cache) == ["a", "b", "c", "d"]
    })
    .await;
    task.abort();
}
