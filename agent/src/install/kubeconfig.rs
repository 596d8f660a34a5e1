//! The plugin's kubeconfig: the agent's own service account, written beside the CNI config for
//! the plugin to read pods and namespaces with when the agent cannot be reached, as istio-cni's
//! installer writes `ZZZ-istio-cni-kubeconfig`.
//!
//! The plugin runs on the host, where the agent container's service-account mount does not
//! exist, so the token and the CA are written into the file itself (mode 0600: the token is the
//! agent's credential). The kubelet rotates the token; every install check reads it again and
//! rewrites the file when it changed. It is JSON, which is YAML: kubectl reads it as well.
use std::{
    fs,
    io::{self, Read},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use base64::Engine;
use serde_json::json;

use super::files::{self, FileAttrs};

/// Its name in the CNI net dir: no CNI extension, so libcni never loads it.
pub const KUBECONFIG_FILE: &str = "weir-kubeconfig";

/// Where a pod's service account is mounted.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The credentials the plugin gets: the API server and the agent's service account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccount {
    /// The API server's URL, `https://HOST:PORT` in a pod.
    pub server: String,
    /// The service account's token (the kubelet rotates it).
    pub token_file: PathBuf,
    /// The cluster's CA bundle; `None` for a plain-http server.
    pub ca_file: Option<PathBuf>,
}

impl ServiceAccount {
    /// The agent's own, as its pod sees it: `KUBERNETES_SERVICE_HOST`/`_PORT` and the mounted
    /// token and CA. `None` outside a pod.
    pub fn in_cluster() -> Option<Self> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").ok()?;
        Some(Self::for_service(
            &host,
            &port,
            Path::new(SERVICE_ACCOUNT_DIR),
        ))
    }

    /// The API server's service address and the service-account files under `dir`.
    pub fn for_service(host: &str, port: &str, dir: &Path) -> Self {
        // An IPv6 address is bracketed in a URL.
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        Self {
            server: format!("https://{host}:{port}"),
            token_file: dir.join("token"),
            ca_file: Some(dir.join("ca.crt")),
        }
    }

    /// The kubeconfig text: the token and CA as they are now.
    pub fn kubeconfig(&self) -> Result<Vec<u8>> {
        let token = fs::read_to_string(&self.token_file)
            .with_context(|| format!("reading {}", self.token_file.display()))?;
        let mut cluster = json!({"server": self.server});
        if let Some(ca_file) = &self.ca_file {
            let ca = fs::read(ca_file).with_context(|| format!("reading {}", ca_file.display()))?;
            cluster["certificate-authority-data"] =
                base64::engine::general_purpose::STANDARD.encode(ca).into();
        }
        let kubeconfig = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": cluster}],
            "users": [{"name": "weir-cni", "user": {"token": token.trim()}}],
            "contexts": [{"name": "weir-cni", "context": {"cluster": "local", "user": "weir-cni"}}],
            "current-context": "weir-cni",
        });
        let mut text = serde_json::to_vec_pretty(&kubeconfig)?;
        text.push(b'\n');
        Ok(text)
    }
}

/// Makes `path` hold `contents` with mode 0600; returns whether it was written. An identical
/// file is left alone, so the checks do not rewrite it every time.
pub fn write(path: &Path, contents: &[u8]) -> io::Result<bool> {
    if let Ok(mut file) = fs::File::open(path) {
        let metadata = file.metadata()?;
        let mut current = Vec::new();
        file.read_to_end(&mut current)?;
        if current == contents && metadata.permissions().mode() & 0o7777 == 0o600 {
            return Ok(false);
        }
    }
    files::write_atomically(path, contents, &FileAttrs::secret())?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_address_becomes_a_url() {
        let dir = Path::new("/sa");
        let v4 = ServiceAccount::for_service("10.96.0.1", "443", dir);
        assert_eq!(v4.server, "https://10.96.0.1:443");
        assert_eq!(v4.token_file, Path::new("/sa/token"));
        assert_eq!(v4.ca_file.as_deref(), Some(Path::new("/sa/ca.crt")));
        let v6 = ServiceAccount::for_service("fd00:10:96::1", "443", dir);
        assert_eq!(v6.server, "https://[fd00:10:96::1]:443");
    }
}
