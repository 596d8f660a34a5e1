//! The stand-in's state: its objects, the one resourceVersion counter they share, the history of
//! changes that watches resume from, the open watches, and the requests received.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::paging::Paging;
use super::selector::Selectors;
use super::ApiRequest;

/// A kind of object the stand-in serves.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Resource {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    pub namespaced: bool,
}

const RESOURCES: [Resource; 6] = [
    Resource {
        api_version: "v1",
        kind: "Pod",
        plural: "pods",
        namespaced: true,
    },
    Resource {
        api_version: "v1",
        kind: "Namespace",
        plural: "namespaces",
        namespaced: false,
    },
    // weir's SIGTERM rule reads its node's labels; the agent patches its condition on the node's
    // status.
    Resource {
        api_version: "v1",
        kind: "Node",
        plural: "nodes",
        namespaced: false,
    },
    Resource {
        api_version: "v1",
        kind: "Event",
        plural: "events",
        namespaced: true,
    },
    Resource {
        api_version: "apps/v1",
        kind: "DaemonSet",
        plural: "daemonsets",
        namespaced: true,
    },
    Resource {
        api_version: "events.k8s.io/v1",
        kind: "Event",
        plural: "events",
        namespaced: true,
    },
];

impl Resource {
    pub(super) fn of_kind(api_version: &str, kind: &str) -> Option<&'static Resource> {
        RESOURCES
            .iter()
            .find(|r| r.api_version == api_version && r.kind == kind)
    }

    pub(super) fn at(api_version: &str, plural: &str) -> Option<&'static Resource> {
        RESOURCES
            .iter()
            .find(|r| r.api_version == api_version && r.plural == plural)
    }

    pub(super) fn is_event(&self) -> bool {
        self.kind == "Event"
    }
}

/// Which objects a LIST or WATCH is about.
pub(super) struct Scope {
    pub resource: &'static Resource,
    /// `None`: every namespace (or a cluster-scoped resource).
    pub namespace: Option<String>,
    pub selectors: Selectors,
}

impl Scope {
    fn contains(&self, resource: &Resource, object: &Value) -> bool {
        resource == self.resource
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| namespace_of(object) == ns)
            && self.selectors.matches(object)
    }
}

/// A refusal, answered on the wire as a `Status` object.
#[derive(Debug)]
pub(super) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl ApiError {
    pub(super) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
        }
    }

    fn not_found(resource: &Resource, name: &str) -> Self {
        let message = format!("{} \"{name}\" not found", resource.plural);
        ApiError::new(404, "NotFound", message)
    }

    fn conflict(message: String) -> Self {
        ApiError::new(409, "Conflict", message)
    }

    pub(super) fn status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

/// What a WATCH gets from the store.
pub(super) enum Watch {
    /// Events owed before the live ones (current objects, or changes since the version asked
    /// for), and the live ones as they happen; the channel closes on [`Store::drop_watches`].
    Open {
        backlog: Vec<String>,
        live: mpsc::UnboundedReceiver<String>,
    },
    /// The changes since the version asked for are forgotten: the watch must end with 410.
    Expired(ApiError),
}

#[derive(Default)]
pub(super) struct Store {
    resource_version: u64,
    objects: BTreeMap<ObjectKey, Value>,
    /// Every change after `history_start`; a watch from an older version cannot be resumed.
    history: Vec<Change>,
    history_start: u64,
    watchers: Vec<Watcher>,
    requests: Vec<ApiRequest>,
    pub paging: Paging,
    /// (verb, API group, resource as RBAC names it) that access reviews answer as not allowed.
    pub denied: BTreeSet<(String, String, String)>,
    /// Access reviews are answered 404, as by an API server that does not serve them.
    pub access_reviews_unserved: bool,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct ObjectKey {
    resource: &'static Resource,
    namespace: String,
    name: String,
}

/// One write, as each watch sees it depending on whether the object was and is in its scope.
struct Change {
    resource: &'static Resource,
    resource_version: u64,
    previous: Option<Value>,
    current: Option<Value>,
}

struct Watcher {
    scope: Scope,
    events: mpsc::UnboundedSender<String>,
}

impl Store {
    pub(super) fn resource_version(&self) -> u64 {
        self.resource_version
    }

    pub(super) fn record(&mut self, request: ApiRequest) {
        self.requests.push(request);
    }

    pub(super) fn requests(&self) -> Vec<ApiRequest> {
        self.requests.clone()
    }

    pub(super) fn get(
        &self,
        resource: &'static Resource,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let key = ObjectKey {
            resource,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        };
        self.objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(resource, name))
    }

    /// The objects in scope, in the API server's (etcd key) order, and the list's version.
    pub(super) fn list(&self, scope: &Scope) -> (Vec<Value>, u64) {
        let objects = self
            .objects
            .iter()
            .filter(|(key, object)| scope.contains(key.resource, object));
        (
            objects.map(|(_, object)| object.clone()).collect(),
            self.resource_version,
        )
    }

    /// Every Event received, of either API, in the order they were created.
    pub(super) fn events(&self) -> Vec<Value> {
        let mut events: Vec<_> = self
            .objects
            .iter()
            .filter(|(key, _)| key.resource.is_event())
            .collect();
        events.sort_by_key(|(_, event)| version_of(event));
        events.into_iter().map(|(_, event)| event.clone()).collect()
    }

    /// Stores a new object in `namespace` (ignored for cluster-scoped resources), giving it a
    /// name from `generateName` if it has none, a uid, a resourceVersion and a creationTimestamp.
    pub(super) fn create(
        &mut self,
        resource: &'static Resource,
        namespace: &str,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        let resource_version = self.resource_version + 1;
        let metadata = metadata_mut(&mut object)?;
        if resource.namespaced {
            match metadata.get("namespace").and_then(Value::as_str) {
                Some(theirs) if theirs != namespace => {
                    let message = format!("the namespace of the object ({theirs}) does not match the namespace on the request ({namespace})");
                    return Err(ApiError::new(400, "BadRequest", message));
                }
                _ => metadata.insert("namespace".into(), namespace.into()),
            };
        } else {
            metadata.remove("namespace");
        }
        if !metadata.contains_key("name") {
            let prefix = metadata
                .get("generateName")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::new(
                        422,
                        "Invalid",
                        "metadata.name: Required value: name or generateName is required",
                    )
                })?;
            metadata.insert(
                "name".into(),
                format!("{prefix}{resource_version:05x}").into(),
            );
        }
        metadata.insert(
            "uid".into(),
            format!("00000000-0000-4000-8000-{resource_version:012x}").into(),
        );
        metadata.insert(
            "creationTimestamp".into(),
            serde_json::to_value(Time(Timestamp::now())).expect("a timestamp is JSON"),
        );
        let key = key_of(resource, &object);
        if self.objects.contains_key(&key) {
            let message = format!("{} \"{}\" already exists", resource.plural, key.name);
            return Err(ApiError::new(409, "AlreadyExists", message));
        }
        Ok(self.write(key, None, Some(object)))
    }

    /// Replaces an object whole, keeping what the API server keeps (name, namespace, uid,
    /// creationTimestamp); the test side's update, so it checks no resourceVersion.
    pub(super) fn replace(
        &mut self,
        resource: &'static Resource,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        let key = key_of(resource, &object);
        let previous = self.get(resource, &key.namespace, &key.name)?;
        keep_identity(&previous, &mut object)?;
        Ok(self.write(key, Some(previous), Some(object)))
    }

    /// Applies a patch. Through the `status` subresource only metadata and status change;
    /// through the object itself, everything but status.
    pub(super) fn patch(
        &mut self,
        resource: &'static Resource,
        namespace: &str,
        name: &str,
        status_subresource: bool,
        patch_type: PatchType,
        patch: &Value,
    ) -> Result<Value, ApiError> {
        let previous = self.get(resource, namespace, name)?;
        let merged_lists;
        let patch = match patch_type {
            PatchType::Merge => patch,
            PatchType::StrategicMerge => {
                merged_lists = lists_merged_by_key(resource, &previous, patch)?;
                &merged_lists
            }
        };
        if let Some(wanted) = patch["metadata"]["resourceVersion"].as_str() {
            check_precondition(
                "ResourceVersion",
                wanted,
                &previous["metadata"]["resourceVersion"],
            )?;
        }
        let mut object = previous.clone();
        merge(&mut object, patch);
        keep_identity(&previous, &mut object)?;
        let object_map = object
            .as_object_mut()
            .expect("keep_identity made sure it is an object");
        for (field, value) in previous.as_object().into_iter().flatten() {
            let patchable = if status_subresource {
                field == "metadata" || field == "status"
            } else {
                field != "status"
            };
            if !patchable {
                object_map.insert(field.clone(), value.clone());
            }
        }
        if object == previous {
            return Ok(previous);
        }
        let key = key_of(resource, &previous);
        Ok(self.write(key, Some(previous), Some(object)))
    }

    /// Deletes an object at once, if it still has the uid and resourceVersion the caller expects.
    pub(super) fn delete(
        &mut self,
        resource: &'static Resource,
        namespace: &str,
        name: &str,
        preconditions: &Value,
    ) -> Result<Value, ApiError> {
        let previous = self.get(resource, namespace, name)?;
        if let Some(uid) = preconditions["uid"].as_str() {
            check_precondition("UID", uid, &previous["metadata"]["uid"])?;
        }
        if let Some(version) = preconditions["resourceVersion"].as_str() {
            check_precondition(
                "ResourceVersion",
                version,
                &previous["metadata"]["resourceVersion"],
            )?;
        }
        let key = key_of(resource, &previous);
        Ok(self.write(key, Some(previous), None))
    }

    /// Opens a watch from `from` (`None`: the current objects as `ADDED`, then what changes).
    pub(super) fn watch(&mut self, scope: Scope, from: Option<u64>) -> Watch {
        let backlog = match from {
            None => self
                .list(&scope)
                .0
                .iter()
                .map(|object| event_line("ADDED", object))
                .collect(),
            Some(from) if from < self.history_start => {
                let message = format!("too old resource version: {from} ({})", self.history_start);
                return Watch::Expired(ApiError::new(410, "Expired", message));
            }
            Some(from) => self
                .history
                .iter()
                .filter(|change| change.resource_version > from)
                .filter_map(|change| change.seen_by(&scope))
                .collect(),
        };
        let (events, live) = mpsc::unbounded_channel();
        self.watchers.push(Watcher { scope, events });
        Watch::Open { backlog, live }
    }

    pub(super) fn open_watches(&mut self) -> usize {
        self.watchers.retain(|watcher| !watcher.events.is_closed());
        self.watchers.len()
    }

    /// Forgets every change so far, so that a watch resuming from any version handed out until
    /// now gets 410 Expired. The counter moves on so that a relist gets a version it can resume from.
    pub(super) fn expire_history(&mut self) {
        self.resource_version += 1;
        self.history_start = self.resource_version;
        self.history.clear();
    }

    /// Ends every open watch stream, as a restarting API server or a broken connection does.
    pub(super) fn drop_watches(&mut self) {
        self.watchers.clear();
    }

    /// Stores (or removes, `current` `None`) an object under a new resourceVersion, keeps the
    /// change for watches to resume from and tells the open watches; returns the object as
    /// written (a removed object as it was, with the version of its removal). Every write has
    /// an object before it, after it, or both.
    fn write(&mut self, key: ObjectKey, previous: Option<Value>, current: Option<Value>) -> Value {
        self.resource_version += 1;
        let version = self.resource_version;
        let resource = key.resource;
        let current = current.map(|object| with_version(object, version));
        match &current {
            Some(object) => self.objects.insert(key, object.clone()),
            None => self.objects.remove(&key),
        };
        let change = Change {
            resource,
            resource_version: version,
            previous,
            current,
        };
        self.watchers
            .retain(|watcher| match change.seen_by(&watcher.scope) {
                Some(line) => watcher.events.send(line).is_ok(),
                None => !watcher.events.is_closed(),
            });
        let written = match (&change.current, &change.previous) {
            (Some(object), _) => object.clone(),
            (None, Some(object)) => with_version(object.clone(), version),
            (None, None) => unreachable!("a write without an object"),
        };
        self.history.push(change);
        written
    }
}

impl Change {
    /// The event line a watch over `scope` gets for this change, if any: an object that enters
    /// the scope is `ADDED` and one that leaves it `DELETED`, as from the API server's watch cache.
    fn seen_by(&self, scope: &Scope) -> Option<String> {
        let in_scope = |object: &Option<Value>| {
            object
                .as_ref()
                .is_some_and(|o| scope.contains(self.resource, o))
        };
        match (in_scope(&self.previous), in_scope(&self.current)) {
            (false, true) => Some(event_line("ADDED", self.current.as_ref()?)),
            (true, true) => Some(event_line("MODIFIED", self.current.as_ref()?)),
            (true, false) => {
                let last_state = with_version(self.previous.clone()?, self.resource_version);
                Some(event_line("DELETED", &last_state))
            }
            (false, false) => None,
        }
    }
}

/// One line of a watch stream.
pub(super) fn event_line(kind: &str, object: &Value) -> String {
    format!("{}\n", json!({ "type": kind, "object": object }))
}

/// How a PATCH's body applies, by its content type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PatchType {
    /// `application/merge-patch+json`, RFC 7386.
    Merge,
    /// `application/strategic-merge-patch+json`: a merge patch, but the lists in [`MERGE_KEYS`]
    /// merge item by item.
    StrategicMerge,
}

impl PatchType {
    pub(super) fn of(content_type: &str) -> Option<Self> {
        match content_type {
            "application/merge-patch+json" => Some(Self::Merge),
            "application/strategic-merge-patch+json" => Some(Self::StrategicMerge),
            _ => None,
        }
    }
}

/// The lists a strategic merge patch merges by a key (the Kubernetes types' `patchStrategy:
/// merge` with their `patchMergeKey`): (kind, JSON pointer, key). Every other list is replaced,
/// as by a merge patch.
const MERGE_KEYS: [(&str, &str, &str); 2] = [
    ("Node", "/status/conditions", "type"),
    ("Pod", "/status/conditions", "type"),
];

/// `patch` with each list of [`MERGE_KEYS`] it holds made whole: the object's list, each item
/// of the patch's merged into the item with its key or added at the end. The result applies as
/// a merge patch. Strategic merge directives (`$patch`, `$setElementOrder`, ...) are refused.
fn lists_merged_by_key(
    resource: &Resource,
    object: &Value,
    patch: &Value,
) -> Result<Value, ApiError> {
    if let Some(directive) = directive_in(patch) {
        let message = format!("the stand-in applies no strategic merge directive ({directive})");
        return Err(ApiError::new(400, "BadRequest", message));
    }
    let mut patch = patch.clone();
    for (_, pointer, key) in MERGE_KEYS
        .iter()
        .filter(|(kind, ..)| *kind == resource.kind)
    {
        let Some(items) = patch.pointer_mut(pointer).and_then(Value::as_array_mut) else {
            continue;
        };
        let mut merged = (object.pointer(pointer).and_then(Value::as_array))
            .cloned()
            .unwrap_or_default();
        for item in items.drain(..) {
            if item.get(key).is_none_or(Value::is_null) {
                let message = format!("{pointer}: an item without its merge key {key:?}");
                return Err(ApiError::new(422, "Invalid", message));
            }
            match merged
                .iter_mut()
                .find(|existing| existing[key] == item[key])
            {
                Some(existing) => merge(existing, &item),
                None => merged.push(item),
            }
        }
        *items = merged;
    }
    Ok(patch)
}

/// The first key of `patch` (at any depth) that is a strategic merge directive.
fn directive_in(patch: &Value) -> Option<String> {
    match patch {
        Value::Object(map) => map.iter().find_map(|(key, value)| {
            key.starts_with('$')
                .then(|| key.clone())
                .or_else(|| directive_in(value))
        }),
        Value::Array(items) => items.iter().find_map(directive_in),
        _ => None,
    }
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` removes a key, anything else
/// replaces what was there.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target = target.as_object_mut().expect("made an object above");
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

fn check_precondition(what: &str, wanted: &str, actual: &Value) -> Result<(), ApiError> {
    let actual = actual.as_str().unwrap_or("");
    if wanted == actual {
        return Ok(());
    }
    let message = format!(
        "Precondition failed: {what} in precondition: {wanted}, {what} in object meta: {actual}"
    );
    Err(ApiError::conflict(message))
}

/// Carries over the fields a write cannot change.
fn keep_identity(previous: &Value, object: &mut Value) -> Result<(), ApiError> {
    let metadata = metadata_mut(object)?;
    for field in ["name", "namespace", "uid", "creationTimestamp"] {
        match previous["metadata"].get(field) {
            Some(value) => metadata.insert(field.into(), value.clone()),
            None => metadata.remove(field),
        };
    }
    Ok(())
}

fn metadata_mut(object: &mut Value) -> Result<&mut Map<String, Value>, ApiError> {
    let invalid = || {
        ApiError::new(
            400,
            "BadRequest",
            "the object is not a JSON object with metadata",
        )
    };
    let object = object.as_object_mut().ok_or_else(invalid)?;
    let metadata = object
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    metadata.as_object_mut().ok_or_else(invalid)
}

fn with_version(mut object: Value, version: u64) -> Value {
    object["metadata"]["resourceVersion"] = version.to_string().into();
    object
}

fn version_of(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn namespace_of(object: &Value) -> &str {
    object["metadata"]["namespace"].as_str().unwrap_or("")
}

fn key_of(resource: &'static Resource, object: &Value) -> ObjectKey {
    ObjectKey {
        resource,
        namespace: namespace_of(object).to_owned(),
        name: object["metadata"]["name"].as_str().unwrap_or("").to_owned(),
    }
}
