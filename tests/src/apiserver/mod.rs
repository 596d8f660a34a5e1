//! A stand-in for the Kubernetes API server on a loopback port, plain http, so that weir's kube
//! side is tested through kube-rs itself against the real list/watch/patch wire format rather
//! than through mocks of weir's own traits.
//!
//! It serves core/v1 Pods, Namespaces, Nodes and Events, apps/v1 DaemonSets and events.k8s.io/v1
//! Events (the API kube-rs's `Recorder` writes to; the two Event APIs are kept apart), stored as
//! JSON with `uid`, `creationTimestamp` and a `resourceVersion` from one counter, and speaks:
//! - GET of one object; a missing one is a 404 `Status` with reason `NotFound`, which kube-rs
//!   turns into `kube::Error::Api`.
//! - LIST, honouring `labelSelector` (`k=v`, `k!=v`, `k`, `!k`, `k in (..)`, `k notin (..)`) and
//!   `fieldSelector` (`path=v`, `path!=v` on dotted paths such as `spec.nodeName`), with the
//!   list's `resourceVersion`, in pages of `limit` items followed with `continue`, each page of
//!   a list read from the list as it was at its first page. [`ApiServer::limit_pages`] makes
//!   pages smaller and slower to come, as from a loaded API server.
//! - WATCH (`watch=true` or `1`): newline-delimited JSON events, one chunk each. Without a
//!   `resourceVersion` (or `0`) the current objects come first as `ADDED`; from a version, the
//!   changes since, or, when those are forgotten ([`ApiServer::expire_history`]), an `ERROR` event
//!   with a 410 `Expired` Status that makes kube-rs's watcher relist. An object that starts or
//!   stops matching a watch's selectors arrives as `ADDED` or `DELETED`, as from the real watch
//!   cache. `allowWatchBookmarks` adds a `BOOKMARK` every few seconds and when `timeoutSeconds`
//!   ends the stream.
//! - POST creating an object (`generateName` included); 409 `AlreadyExists` if it exists.
//! - PATCH with `application/merge-patch+json` (RFC 7386: `null` removes a key) on an object or
//!   its `status` subresource, which changes only metadata and status, the object itself
//!   everything but status, as for pods and nodes. `application/strategic-merge-patch+json` is
//!   applied as a merge patch, except that the conditions of a Pod's or Node's status merge item
//!   by item by their `type`, as the API server merges them; other lists are replaced rather than
//!   merged by key, and directives (`$patch`, ...) are refused (400). A
//!   `metadata.resourceVersion` in the patch is a precondition (409 `Conflict`); a patch that
//!   changes nothing keeps the version and notifies no watch.
//! - DELETE, honouring `preconditions` (uid, resourceVersion) in the DeleteOptions body (409
//!   `Conflict`). The object goes at once, as with a grace period of 0.
//! - On demand, no answer to the LISTs of a kind ([`ApiServer::withhold_lists`]), so a test can
//!   hold a client before its caches sync.
//! - `GET /version`, as a Kubernetes 1.34 API server answers it.
//! - POST of a SelfSubjectAccessReview, answered (never stored) with `status.allowed`: true,
//!   unless a test took that access away with [`ApiServer::deny`]. Only the reviews are
//!   authorized so: every request is served whatever they answer. On demand, 404 instead
//!   ([`ApiServer::serve_no_access_reviews`]), as from an API server that does not serve them.
//!
//! Deliberately not: TLS, authentication and authorization, discovery (`/api`, `/apis`), PUT,
//! JSON patch and server-side apply (415), `resourceVersionMatch` and
//! `sendInitialEvents`, defaulting, validation, admission, finalizers, garbage collection, other
//! kinds (404), and a bounded history: changes are kept until [`ApiServer::expire_history`].

mod http;
mod paging;
mod selector;
mod store;
mod watch;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch as signal;
use tokio::task::JoinHandle;

use store::{Resource, Store};

/// One request the stand-in received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiRequest {
    /// `get`, `list`, `watch`, `create`, `patch`, `delete` (what the stand-in serves), or another
    /// Kubernetes verb or HTTP method, which it refuses.
    pub verb: String,
    pub method: String,
    pub path: String,
    /// As sent, percent-encoded; [`ApiRequest::param`] decodes one parameter.
    pub query: String,
    /// Without parameters such as `; charset=utf-8`.
    pub content_type: Option<String>,
    /// The body, when it is JSON (a created object, a patch, DeleteOptions).
    pub body: Option<Value>,
}

impl ApiRequest {
    pub fn param(&self, name: &str) -> Option<String> {
        form_urlencoded::parse(self.query.as_bytes())
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.into_owned())
    }
}

#[derive(Clone, Default)]
struct Shared {
    store: Arc<Mutex<Store>>,
    /// The kinds whose lists are not answered for now ([`ApiServer::withhold_lists`]).
    withheld: Arc<signal::Sender<Vec<&'static Resource>>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock leaves a store no test can trust anyway.
        self.store
            .lock()
            .expect("the API stand-in's store lock is poisoned")
    }

    /// Resolves once lists of `resource` are answered again.
    async fn lists_answered(&self, resource: &'static Resource) {
        let mut withheld = self.withheld.subscribe();
        // The sender lives as long as `self`.
        let _ = withheld
            .wait_for(|withheld| !withheld.contains(&resource))
            .await;
    }
}

/// The running stand-in. It serves on the tokio runtime it was started on, and stops when dropped.
///
/// The test-side methods take and return k8s-openapi types; for cluster-scoped kinds such as
/// `Namespace` the namespace argument is `""`. They change objects the way a write through the
/// API would: a new resourceVersion, and an event to every watch that sees the object.
pub struct ApiServer {
    address: SocketAddr,
    store: Shared,
    serving: JoinHandle<()>,
}

impl ApiServer {
    pub async fn start() -> io::Result<ApiServer> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let address = listener.local_addr()?;
        let store = Shared::default();
        let app = http::router(store.clone());
        let serving = tokio::spawn(async move {
            axum::serve(listener, app)
                .await
                .expect("axum's accept loop retries its errors");
        });
        Ok(ApiServer {
            address,
            store,
            serving,
        })
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// A kubeconfig naming the stand-in, with no credentials: what a process that reads its
    /// configuration from a file (weir-agent's `--kubeconfig`) is given.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: stand-in\n\
             clusters: [{{name: stand-in, cluster: {{server: \"{}\"}}}}]\n\
             contexts: [{{name: stand-in, context: {{cluster: stand-in, user: nobody}}}}]\n\
             users: [{{name: nobody, user: {{}}}}]\n",
            self.url()
        )
    }

    /// A kube-rs client for the stand-in: no credentials, default namespace `default`. Needs a
    /// tokio runtime, as every kube client does.
    pub fn client(&self) -> kube::Client {
        let url = self
            .url()
            .parse()
            .expect("the stand-in's URL is a valid URI");
        kube::Client::try_from(kube::Config::new(url)).expect("a plain-http kube client builds")
    }

    /// Creates `object` (in namespace `default` if a namespaced object names none). Panics if
    /// the stand-in refuses it, for example because it exists.
    pub fn create<K>(&self, object: &K) -> K
    where
        K: k8s_openapi::Resource + Serialize + DeserializeOwned,
    {
        let (resource, object) = (resource_of::<K>(), to_json(object));
        let namespace = match object["metadata"]["namespace"].as_str() {
            Some(namespace) => namespace.to_owned(),
            None if resource.namespaced => "default".to_owned(),
            None => String::new(),
        };
        let created = self.store.lock().create(resource, &namespace, object);
        from_json(created.unwrap_or_else(|e| panic!("creating a {}: {e}", K::KIND)))
    }

    /// Creates a pod with one container and nothing else, as a bare `kubectl run` would; returns
    /// its uid, which the runtime's sandbox of it must carry.
    pub fn create_pod(&self, namespace: &str, name: &str) -> String {
        use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
        let pod = Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "app".into(),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        self.create(&pod)
            .metadata
            .uid
            .expect("the stand-in gives every object a uid")
    }

    /// Replaces an object whole, whatever resourceVersion `object` carries. Panics if it does not exist.
    pub fn update<K>(&self, object: &K) -> K
    where
        K: k8s_openapi::Resource + Serialize + DeserializeOwned,
    {
        let updated = self
            .store
            .lock()
            .replace(resource_of::<K>(), to_json(object));
        from_json(updated.unwrap_or_else(|e| panic!("updating a {}: {e}", K::KIND)))
    }

    /// Writes an object's status as kubelet does, through the status subresource (a merge
    /// patch): what others changed in the object since the caller read it stays. Panics if it
    /// does not exist.
    pub fn patch_status<K>(&self, namespace: &str, name: &str, status: &impl Serialize) -> K
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        let patch = serde_json::json!({ "status": to_json(status) });
        let patched = self.store.lock().patch(
            resource_of::<K>(),
            namespace,
            name,
            true,
            store::PatchType::Merge,
            &patch,
        );
        from_json(patched.unwrap_or_else(|e| panic!("patching a {}'s status: {e}", K::KIND)))
    }

    pub fn get<K>(&self, namespace: &str, name: &str) -> Option<K>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        self.store
            .lock()
            .get(resource_of::<K>(), namespace, name)
            .ok()
            .map(from_json)
    }

    /// Deletes an object; `None` if there was none.
    pub fn delete<K>(&self, namespace: &str, name: &str) -> Option<K>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        let deleted = self
            .store
            .lock()
            .delete(resource_of::<K>(), namespace, name, &Value::Null);
        deleted.ok().map(from_json)
    }

    /// Every Event received, core/v1 and events.k8s.io/v1 alike, as stored (JSON, with their
    /// `apiVersion`), oldest first.
    pub fn events(&self) -> Vec<Value> {
        self.store.lock().events()
    }

    /// Every request received, in order.
    pub fn requests(&self) -> Vec<ApiRequest> {
        self.store.lock().requests()
    }

    /// The newest resourceVersion handed out.
    pub fn resource_version(&self) -> u64 {
        self.store.lock().resource_version()
    }

    /// How many watch streams are open.
    pub fn open_watches(&self) -> usize {
        self.store.lock().open_watches()
    }

    /// Forgets the history of changes: a watch resuming from any resourceVersion handed out so
    /// far is answered with 410 Expired, and must relist. Open watch streams go on.
    pub fn expire_history(&self) {
        self.store.lock().expire_history();
    }

    /// Ends every open watch stream, as a restart of the API server would.
    pub fn drop_watches(&self) {
        self.store.lock().drop_watches();
    }

    /// Answers lists at most `max_items` a page, and each continued page only after
    /// `continue_delay`, as a loaded API server may: a relist then reaches a client in parts.
    pub fn limit_pages(&self, max_items: usize, continue_delay: Duration) {
        self.store
            .lock()
            .paging
            .limit_pages(max_items, continue_delay);
    }

    /// Leaves every LIST of `K` unanswered until [`ApiServer::answer_lists`], as an API server
    /// too loaded to answer: a reflector over `K` cannot sync meanwhile.
    pub fn withhold_lists<K: k8s_openapi::Resource>(&self) {
        let resource = resource_of::<K>();
        self.store
            .withheld
            .send_modify(|withheld| withheld.push(resource));
    }

    /// Makes access reviews (SelfSubjectAccessReview) answer that `verb` on `resource` of API
    /// `group` (`""` for the core group) is not allowed, as RBAC without that rule would;
    /// `resource` as RBAC names it, `pods/status` for a subresource. Everything else is allowed.
    pub fn deny(&self, verb: &str, group: &str, resource: &str) {
        self.store
            .lock()
            .denied
            .insert((verb.to_owned(), group.to_owned(), resource.to_owned()));
    }

    /// Answers every access review with 404 NotFound from now on, as an API server (or a proxy
    /// in front of it) that does not serve authorization.k8s.io/v1 does.
    pub fn serve_no_access_reviews(&self) {
        self.store.lock().access_reviews_unserved = true;
    }

    /// Answers the withheld LISTs of `K`, and every later one.
    pub fn answer_lists<K: k8s_openapi::Resource>(&self) {
        let resource = resource_of::<K>();
        self.store
            .withheld
            .send_modify(|withheld| withheld.retain(|kind| *kind != resource));
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.serving.abort();
        // Connections already accepted live on in their own tasks; ending the watches ends
        // the streams that would otherwise outlast the stand-in.
        self.drop_watches();
    }
}

fn resource_of<K: k8s_openapi::Resource>() -> &'static Resource {
    Resource::of_kind(K::API_VERSION, K::KIND).unwrap_or_else(|| {
        panic!(
            "the API stand-in does not serve {} {}",
            K::API_VERSION,
            K::KIND
        )
    })
}

fn to_json<K: Serialize>(object: &K) -> Value {
    serde_json::to_value(object).expect("a k8s-openapi object serializes")
}

fn from_json<K: DeserializeOwned>(object: Value) -> K {
    serde_json::from_value(object)
        .expect("the stand-in stores objects of the kind they are read as")
}
