//! Asking the Kubernetes API server about one pod, as istio-cni's plugin does, with the node
//! agent's credentials from the kubeconfig its installer writes beside the CNI config. Only when
//! the agent cannot be reached: it is the one source that knows a pod labelled after the agent's
//! verdict cache was written.
//!
//! Two GETs, `/api/v1/namespaces/{ns}/pods/{name}` and `/api/v1/namespaces/{ns}`, within one
//! deadline, over HTTPS verified against the kubeconfig's CA (or plain http, when the server's
//! URL says so). The kubeconfig is read as JSON (which is YAML, so kubectl reads the same file):
//! `current-context` (or the first entries), the cluster's `server` and
//! `certificate-authority-data` or `certificate-authority` (or `insecure-skip-tls-verify`), and
//! the user's `token` or `tokenFile`. Proxies from the environment are not used: the API server
//! is reached as the agent reaches it, directly.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use serde::Deserialize;
use ureq::tls::{Certificate, RootCerts, TlsConfig, TlsProvider};

use crate::ambient::{Labels, PodFacts};
use crate::protocol::PodRef;

/// Bounds both requests together: a pod start should not wait long on a second opinion.
pub const DEADLINE: Duration = Duration::from_secs(2);
/// A pod object is a few KiB; annotations may make it a few hundred.
const MAX_BODY_BYTES: u64 = 4 * 1024 * 1024;

/// What the API server says about the runtime's pod.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The pod and its namespace, as the API server has them now.
    Found(PodFacts),
    /// The API server has no such pod, or one of that name with another uid (a static pod's
    /// mirror, a pod deleted and created again): why, for the log.
    NotThisPod(String),
}

/// Reads the pod the runtime names, and its namespace, from the API server the kubeconfig at
/// `kubeconfig` names. An error says why the API server could not tell.
pub fn lookup(kubeconfig: &Path, pod: &PodRef, deadline: Duration) -> Result<Lookup, String> {
    let deadline = Instant::now() + deadline;
    for name in [&pod.namespace, &pod.name] {
        if !is_object_name(name) {
            return Err(format!("{name:?} is not a Kubernetes object name"));
        }
    }
    let access = Access::from_kubeconfig(kubeconfig)?;
    let client = access.client()?;
    let pod_path = format!("/api/v1/namespaces/{}/pods/{}", pod.namespace, pod.name);
    let Some(object) = client.get(&pod_path, deadline)? else {
        return Ok(Lookup::NotThisPod(format!(
            "the API server has no pod {}/{}",
            pod.namespace, pod.name
        )));
    };
    let object: PodObject =
        serde_json::from_slice(&object).map_err(|e| format!("GET {pod_path}: not a pod: {e}"))?;
    if !pod.uid.is_empty() && object.metadata.uid != pod.uid {
        return Ok(Lookup::NotThisPod(format!(
            "the API server's pod {}/{} has uid {}, the runtime's has uid {}",
            pod.namespace, pod.name, object.metadata.uid, pod.uid
        )));
    }
    let namespace_path = format!("/api/v1/namespaces/{}", pod.namespace);
    let namespace = client
        .get(&namespace_path, deadline)?
        .ok_or_else(|| format!("GET {namespace_path}: not found"))?;
    let namespace: NamespaceObject = serde_json::from_slice(&namespace)
        .map_err(|e| format!("GET {namespace_path}: not a namespace: {e}"))?;
    Ok(Lookup::Found(object.facts(pod, namespace)))
}

/// DNS labels and subdomains, which every namespace and pod name is: nothing that could change
/// the path it is put in.
fn is_object_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !name.starts_with('.')
}

/// Where the API server is and how to talk to it.
#[derive(Debug, PartialEq, Eq)]
struct Access {
    server: String,
    /// PEM or DER certificates to verify the server with.
    ca: Option<Vec<u8>>,
    insecure: bool,
    token: Option<String>,
}

#[derive(Deserialize)]
struct Kubeconfig {
    #[serde(rename = "current-context", default)]
    current_context: Option<String>,
    #[serde(default)]
    clusters: Option<Vec<NamedCluster>>,
    #[serde(default)]
    users: Option<Vec<NamedUser>>,
    #[serde(default)]
    contexts: Option<Vec<NamedContext>>,
}

#[derive(Deserialize)]
struct NamedCluster {
    name: String,
    cluster: Cluster,
}

#[derive(Deserialize)]
struct Cluster {
    server: String,
    #[serde(rename = "certificate-authority-data", default)]
    ca_data: Option<String>,
    #[serde(rename = "certificate-authority", default)]
    ca_file: Option<PathBuf>,
    #[serde(rename = "insecure-skip-tls-verify", default)]
    insecure: Option<bool>,
}

#[derive(Deserialize)]
struct NamedUser {
    name: String,
    #[serde(default)]
    user: Option<User>,
}

#[derive(Default, Deserialize)]
struct User {
    #[serde(default)]
    token: Option<String>,
    #[serde(rename = "tokenFile", default)]
    token_file: Option<PathBuf>,
}

#[derive(Deserialize)]
struct NamedContext {
    name: String,
    context: Context,
}

#[derive(Deserialize)]
struct Context {
    cluster: String,
    #[serde(default)]
    user: Option<String>,
}

impl Access {
    fn from_kubeconfig(path: &Path) -> Result<Self, String> {
        let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let config: Kubeconfig = serde_json::from_slice(&text)
            .map_err(|e| format!("{}: not a JSON kubeconfig: {e}", path.display()))?;
        // Relative file names in a kubeconfig are relative to the kubeconfig itself.
        let base = path.parent().unwrap_or(Path::new("."));
        Self::resolve(config, base).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn resolve(config: Kubeconfig, base: &Path) -> Result<Self, String> {
        let clusters = config.clusters.unwrap_or_default();
        let users = config.users.unwrap_or_default();
        let context = match &config.current_context {
            Some(name) if !name.is_empty() => Some(
                config
                    .contexts
                    .unwrap_or_default()
                    .into_iter()
                    .find(|c| &c.name == name)
                    .ok_or_else(|| format!("no context {name:?}"))?
                    .context,
            ),
            _ => None,
        };
        let cluster = match &context {
            Some(context) => clusters.into_iter().find(|c| c.name == context.cluster),
            None => clusters.into_iter().next(),
        }
        .ok_or("no cluster")?
        .cluster;
        let user = match &context {
            Some(Context {
                user: Some(name), ..
            }) => users.into_iter().find(|u| &u.name == name),
            Some(_) => None,
            None => users.into_iter().next(),
        }
        .and_then(|u| u.user)
        .unwrap_or_default();
        let ca = match (cluster.ca_data, cluster.ca_file) {
            (Some(data), _) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(data.trim())
                    .map_err(|e| format!("certificate-authority-data: {e}"))?,
            ),
            (None, Some(file)) => {
                let file = base.join(file);
                Some(std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?)
            }
            (None, None) => None,
        };
        let token = match (user.token, user.token_file) {
            (Some(token), _) => Some(token),
            (None, Some(file)) => {
                let file = base.join(file);
                let token = std::fs::read_to_string(&file)
                    .map_err(|e| format!("{}: {e}", file.display()))?;
                Some(token.trim().to_owned())
            }
            (None, None) => None,
        };
        Ok(Self {
            server: cluster.server.trim_end_matches('/').to_owned(),
            ca,
            insecure: cluster.insecure.unwrap_or(false),
            token,
        })
    }

    fn client(&self) -> Result<Client<'_>, String> {
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(None)
            .user_agent("weir-cni");
        if self.server.starts_with("https://") {
            config = config.tls_config(self.tls()?);
        } else if !self.server.starts_with("http://") {
            return Err(format!("server {:?} is not an http(s) URL", self.server));
        }
        Ok(Client {
            access: self,
            agent: ureq::Agent::new_with_config(config.build()),
        })
    }

    fn tls(&self) -> Result<TlsConfig, String> {
        // The process has one crypto provider; set it for rustls before the first connection.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let builder = TlsConfig::builder().provider(TlsProvider::Rustls);
        if self.insecure {
            return Ok(builder.disable_verification(true).build());
        }
        let ca = self.ca.as_deref().ok_or(
            "the kubeconfig names no certificate authority for an https server, and weir-cni \
             trusts no other",
        )?;
        let certificates = if ca.starts_with(b"-----") {
            ureq::tls::parse_pem(ca)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(cert)) => Some(Ok(cert)),
                    Ok(_) => None,
                    Err(e) => Some(Err(e)),
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("certificate authority: {e}"))?
        } else {
            vec![Certificate::from_der(ca).to_owned()]
        };
        if certificates.is_empty() {
            return Err("certificate authority: no certificate in it".into());
        }
        Ok(builder
            .root_certs(RootCerts::Specific(Arc::new(certificates)))
            .build())
    }
}

struct Client<'a> {
    access: &'a Access,
    agent: ureq::Agent,
}

impl Client<'_> {
    /// The body of a 200, `None` for a 404; any other answer, or none by `deadline`, is an error.
    fn get(&self, path: &str, deadline: Instant) -> Result<Option<Vec<u8>>, String> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("GET {path}: no time left"));
        }
        let mut request = self
            .agent
            .get(format!("{}{path}", self.access.server))
            .config()
            .timeout_global(Some(left))
            .build()
            .header("Accept", "application/json");
        if let Some(token) = &self.access.token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        let mut response = request
            .call()
            .map_err(|e| format!("GET {}{path}: {e}", self.access.server))?;
        let status = response.status().as_u16();
        let body = response
            .body_mut()
            .with_config()
            .limit(MAX_BODY_BYTES)
            .read_to_vec()
            .map_err(|e| format!("GET {path}: reading the answer: {e}"))?;
        match status {
            200 => Ok(Some(body)),
            404 => Ok(None),
            _ => Err(format!(
                "GET {path}: HTTP {status}: {}",
                status_message(&body)
            )),
        }
    }
}

/// The `message` of a Kubernetes `Status` answer, or the start of whatever came.
fn status_message(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Status {
        message: String,
    }
    match serde_json::from_slice::<Status>(body) {
        Ok(status) => status.message,
        Err(_) => String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
    }
}

/// The few fields of a pod the rule reads. Kubernetes omits empty maps, and `null` is read as
/// empty too.
#[derive(Deserialize)]
struct PodObject {
    metadata: PodMeta,
    #[serde(default)]
    spec: Option<PodSpec>,
}

#[derive(Deserialize)]
struct PodMeta {
    #[serde(default)]
    uid: String,
    #[serde(default)]
    labels: Option<Labels>,
    #[serde(default)]
    annotations: Option<Labels>,
    #[serde(rename = "ownerReferences", default)]
    owner_references: Option<Vec<OwnerReference>>,
}

#[derive(Deserialize)]
struct OwnerReference {
    kind: String,
    name: String,
}

#[derive(Default, Deserialize)]
struct PodSpec {
    #[serde(rename = "hostNetwork", default)]
    host_network: Option<bool>,
    #[serde(rename = "serviceAccountName", default)]
    service_account_name: Option<String>,
}

#[derive(Deserialize)]
struct NamespaceObject {
    #[serde(default)]
    metadata: Option<NamespaceMeta>,
}

#[derive(Deserialize)]
struct NamespaceMeta {
    #[serde(default)]
    labels: Option<Labels>,
}

impl PodObject {
    fn facts(self, pod: &PodRef, namespace: NamespaceObject) -> PodFacts {
        let spec = self.spec.unwrap_or_default();
        PodFacts {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            labels: self.metadata.labels.unwrap_or_default(),
            annotations: self.metadata.annotations.unwrap_or_default(),
            namespace_labels: namespace
                .metadata
                .and_then(|meta| meta.labels)
                .unwrap_or_default(),
            host_network: spec.host_network.unwrap_or(false),
            daemonset_owner: self
                .metadata
                .owner_references
                .unwrap_or_default()
                .into_iter()
                .find(|owner| owner.kind == "DaemonSet")
                .map(|owner| owner.name),
            service_account: spec.service_account_name,
            containers: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(config: serde_json::Value) -> Result<Access, String> {
        Access::resolve(serde_json::from_value(config).unwrap(), Path::new("/k"))
    }

    #[test]
    fn the_current_context_picks_cluster_and_user() {
        let access = resolve(serde_json::json!({
            "current-context": "b",
            "clusters": [{"name": "one", "cluster": {"server": "https://10.0.0.1:443/"}},
                         {"name": "two", "cluster": {"server": "https://10.0.0.2:6443",
                                                     "certificate-authority-data": "AAEC"}}],
            "users": [{"name": "u1", "user": {"token": "t1"}}, {"name": "u2", "user": {"token": "t2"}}],
            "contexts": [{"name": "a", "context": {"cluster": "one", "user": "u1"}},
                         {"name": "b", "context": {"cluster": "two", "user": "u2"}}]
        }))
        .unwrap();
        assert_eq!(
            access,
            Access {
                server: "https://10.0.0.2:6443".into(),
                ca: Some(vec![0, 1, 2]),
                insecure: false,
                token: Some("t2".into()),
            }
        );
    }

    #[test]
    fn without_a_context_the_first_entries_and_files_relative_to_the_kubeconfig() {
        let err = resolve(serde_json::json!({
            "clusters": [{"name": "c", "cluster": {"server": "https://h",
                                                   "certificate-authority": "ca.crt"}}],
        }))
        .unwrap_err();
        assert!(err.contains("/k/ca.crt"), "{err}");
        let access = resolve(serde_json::json!({
            "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:8080"}}],
        }))
        .unwrap();
        assert_eq!(access.token, None);
        assert!(resolve(serde_json::json!({"current-context": "x"})).is_err());
        assert!(resolve(serde_json::json!({})).is_err());
    }

    #[test]
    fn https_needs_a_certificate_authority() {
        let access = Access {
            server: "https://10.0.0.1".into(),
            ca: None,
            insecure: false,
            token: None,
        };
        assert!(access.client().is_err());
        let garbage = Access {
            ca: Some(b"-----BEGIN NOTHING-----\n".to_vec()),
            ..access
        };
        assert!(garbage.client().is_err());
    }

    #[test]
    fn object_names_cannot_change_the_path() {
        for good in ["default", "pod-2", "a.b-c"] {
            assert!(is_object_name(good), "{good}");
        }
        for bad in ["", "a/b", "..", "A", "a?b", "a b", "%2e"] {
            assert!(!is_object_name(bad), "{bad}");
        }
    }

    #[test]
    fn facts_from_the_api_objects() {
        let pod: PodObject = serde_json::from_value(serde_json::json!({
            "metadata": {"uid": "u", "labels": {"app": "x"}, "annotations": null,
                         "ownerReferences": [{"kind": "ReplicaSet", "name": "r"},
                                             {"kind": "DaemonSet", "name": "weir"}]},
            "spec": {"hostNetwork": true, "serviceAccountName": "sa"}
        }))
        .unwrap();
        let namespace: NamespaceObject = serde_json::from_value(serde_json::json!({
            "metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}
        }))
        .unwrap();
        let runtime = PodRef {
            namespace: "ns".into(),
            name: "p".into(),
            uid: "u".into(),
        };
        let facts = pod.facts(&runtime, namespace);
        assert_eq!(facts.labels.get("app").map(String::as_str), Some("x"));
        assert!(facts.annotations.is_empty());
        assert!(facts.host_network);
        assert_eq!(facts.daemonset_owner.as_deref(), Some("weir"));
        assert_eq!(facts.service_account.as_deref(), Some("sa"));
        assert_eq!(facts.namespace_labels.len(), 1);
    }
}
