//! The agent's end of the plugin protocol: a root-only unix socket, one JSON request line and one
//! JSON response line per connection. Requests are bounded in size and time; a malformed one gets
//! an error response, never a crash; many pods are served in parallel. Each request is decided
//! from policy and becomes an enrollment step; the step's outcome becomes the CNI response.
//!
//! The socket is served here; [`CniHandler`] decides and enrolls ([`handler`]), and
//! [`responses`] turns what went wrong into CNI error codes.
mod handler;
mod responses;

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{UnixListener, UnixStream},
};
use tracing::{debug, warn};
use weir_cni::{
    code::DECODE_FAILURE,
    protocol::{Request, Response, MAX_REQUEST_BYTES},
};

pub use handler::CniHandler;
use responses::error_response;

use crate::root_only;

/// How long a plugin may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

pub struct CniServer {
    listener: UnixListener,
    path: PathBuf,
}

impl CniServer {
    /// Binds the socket (replacing a stale one), readable and writable by root only.
    pub fn bind(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        match std::fs::remove_file(path) {
            Ok(()) => debug!(path = %path.display(), "removed a stale socket"),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error).context("removing the stale socket"),
        }
        let listener =
            UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(Self {
            listener,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub async fn serve(self, handler: Arc<CniHandler>) {
        loop {
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    let handler = handler.clone();
                    tokio::spawn(async move {
                        if let Err(error) = serve_connection(stream, &handler).await {
                            warn!(error = format!("{error:#}"), "plugin connection");
                        }
                    });
                }
                Err(error) => {
                    warn!(%error, "accepting a plugin connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

async fn serve_connection(stream: UnixStream, handler: &CniHandler) -> Result<()> {
    root_only::require_root_peer(&stream, "plugin")?;
    let (read, mut write) = stream.into_split();
    let response = match tokio::time::timeout(READ_TIMEOUT, read_request(read)).await {
        // The plugin's STATUS probe connects and closes without a request.
        Ok(Ok(None)) => return Ok(()),
        Ok(Ok(Some(request))) => handler.handle(&request).await,
        Ok(Err(error)) => error_response(DECODE_FAILURE, "malformed request", &error),
        Err(_) => Response::Error {
            code: DECODE_FAILURE,
            msg: "request timed out".into(),
            details: format!("no complete request within {READ_TIMEOUT:?}"),
        },
    };
    let mut line = serde_json::to_vec(&response)?;
    line.push(b'\n');
    write.write_all(&line).await?;
    write.shutdown().await?;
    Ok(())
}

/// One request line, at most [`MAX_REQUEST_BYTES`]; `None` when the peer closed without sending
/// anything.
pub async fn read_request(read: impl AsyncRead + Unpin) -> Result<Option<Request>> {
    let mut line = Vec::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST_BYTES as u64 + 1));
    reader.read_until(b'\n', &mut line).await?;
    if line.is_empty() {
        return Ok(None);
    }
    if line.len() > MAX_REQUEST_BYTES {
        anyhow::bail!("request larger than {MAX_REQUEST_BYTES} bytes");
    }
    Ok(Some(serde_json::from_slice(&line)?))
}
