//! The agent's end of the plugin protocol: a root-only unix socket, one JSON request line and one
//! JSON response line per connection. Requests are bounded in size and time; a malformed one gets
//! an error response, never a crash; many pods are served in parallel. Each request is decided
//! from policy and becomes an enrollment step; the step's outcome becomes the CNI response.
use std::{
    net::IpAddr,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{anyhow, Context, Result};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{UnixListener, UnixStream},
};
use tracing::{debug, warn};
use weir_cni::protocol::{Attachment, Command, Request, Response, MAX_REQUEST_BYTES};

use crate::{
    enroll::{Enroller, Status},
    policy::{report_problems, Labels, PodName, PolicyError, PolicySource, Warning},
    workload::Workload,
};

/// How long a plugin may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// CNI error code for content that cannot be decoded.
const DECODING_FAILURE: u32 = 6;
/// CNI error code for "try again later": the runtime retries the ADD.
const TRY_AGAIN_LATER: u32 = 11;
/// CNI error code for failures specific to this plugin.
const PLUGIN_ERROR: u32 = 999;

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
                            warn!(%error, "plugin connection");
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
    // The socket file is root-only already; the peer check also refuses a descriptor passed
    // to an unprivileged process.
    let peer = stream.peer_cred().context("peer credentials")?;
    if peer.uid() != 0 {
        anyhow::bail!("refusing a plugin connection from uid {}", peer.uid());
    }
    let (read, mut write) = stream.into_split();
    let response = match tokio::time::timeout(READ_TIMEOUT, read_request(read)).await {
        // The plugin's STATUS probe connects and closes without a request.
        Ok(Ok(None)) => return Ok(()),
        Ok(Ok(Some(request))) => handler.handle(&request).await,
        Ok(Err(error)) => error_response(DECODING_FAILURE, "malformed request", &error),
        Err(_) => Response::Error {
            code: DECODING_FAILURE,
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
    result: &'static str,
}

/// Plugin requests decided from policy and turned into enrollment steps, and the steps' outcomes
/// into CNI responses and error codes.
pub struct CniHandler {
    enroller: Arc<Enroller>,
    policy: Arc<dyn PolicySource>,
    events: Family<EventLabels, Counter>,
}

impl CniHandler {
    pub fn new(enroller: Arc<Enroller>, policy: Arc<dyn PolicySource>) -> Arc<Self> {
        Arc::new(Self {
            enroller,
            policy,
            events: Family::default(),
        })
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "nodeagent_reconcile_events",
            "Pod events handled by the node agent, by event and result",
            self.events.clone(),
        );
    }

    /// Serves one plugin request, in turn with every other step for the same pod.
    pub async fn handle(&self, request: &Request) -> Response {
        let key = if request.pod.uid.is_empty() {
            &request.container_id
        } else {
            &request.pod.uid
        };
        let step = async {
            match request.command {
                Command::Add => ("add", self.add(request).await),
                Command::Del => ("del", self.del(request).await),
                Command::Check => ("check", self.check(request).await),
                Command::Gc => ("gc", self.gc(&request.valid_attachments).await),
            }
        };
        // GC names no pod: it takes each stale pod's turn on its own.
        let (event, result) = if request.command == Command::Gc {
            step.await
        } else {
            self.enroller.in_turn(key, step).await
        };
        let outcome = if matches!(result, Response::Ok { .. }) {
            "ok"
        } else {
            "error"
        };
        self.events
            .get_or_create(&EventLabels {
                event,
                result: outcome,
            })
            .inc();
        result
    }

    /// Decides from policy; returns the pod to enroll, or `None` when it is not ambient.
    async fn ambient_workload(&self, request: &Request) -> Result<Option<Workload>, PolicyError> {
        let name = PodName::new(&request.pod.namespace, &request.pod.name);
        let annotations: Labels = request.annotations.clone().into_iter().collect();
        let Some(ambient) = self
            .policy
            .decide(&name, &request.pod.uid, &annotations)
            .await?
        else {
            return Ok(None);
        };
        report_problems(&*self.policy, &name, &ambient.problems).await;
        let ips = request
            .ips
            .iter()
            .map(|ip| {
                let address = ip.address.split('/').next().unwrap_or_default();
                address
                    .parse()
                    .with_context(|| format!("pod IP {:?}", ip.address))
            })
            .collect::<Result<Vec<IpAddr>>>()?;
        Ok(Some(Workload {
            uid: request.pod.uid.clone(),
            name: request.pod.name.clone(),
            namespace: request.pod.namespace.clone(),
            netns: PathBuf::from(&request.netns),
            ips,
            options: ambient.options,
            service_account: Some(ambient.service_account),
            attachment: Some(Attachment {
                container_id: request.container_id.clone(),
                ifname: request.ifname.clone(),
            }),
        }))
    }

    async fn add(&self, request: &Request) -> Response {
        let pod = match self.ambient_workload(request).await {
            Ok(Some(pod)) => pod,
            Ok(None) => return Response::Ok { enrolled: false },
            Err(error) => return decision_error(error),
        };
        if pod.uid.is_empty() || pod.ips.is_empty() || request.netns.is_empty() {
            return error_response(
                PLUGIN_ERROR,
                "incomplete ADD",
                &anyhow!("an ambient pod needs K8S_POD_UID, a netns and IPs from prevResult"),
            );
        }
        match self.enroller.enroll(&pod).await {
            Ok(Status::Enabled) => Response::Ok { enrolled: true },
            Ok(Status::Pending) => Response::Error {
                code: TRY_AGAIN_LATER,
                msg: format!(
                    "ztunnel has not acknowledged pod {}/{}: redirection is in place and pending",
                    pod.namespace, pod.name
                ),
                details: "the runtime retries; the pod completes when ztunnel connects".into(),
            },
            Err(error) => {
                let name = PodName::new(&pod.namespace, &pod.name);
                let warning = Warning::EnrollmentFailed(format!("{error:#}"));
                self.policy.warn(&name, warning).await;
                error_response(TRY_AGAIN_LATER, "enrollment failed", &error)
            }
        }
    }

    async fn del(&self, request: &Request) -> Response {
        if request.pod.uid.is_empty() {
            // Nothing names the pod: its maps entries go when its netns does.
            return Response::Ok { enrolled: false };
        }
        let unenrolled = self
            .enroller
            .unenroll_sandbox(&request.pod.uid, &request.container_id)
            .await;
        match unenrolled {
            Ok(was) => Response::Ok { enrolled: was },
            Err(error) => error_response(PLUGIN_ERROR, "unenroll failed", &error),
        }
    }

    async fn gc(&self, valid: &[Attachment]) -> Response {
        match self.enroller.collect_garbage(valid).await {
            Ok(_) => Response::Ok { enrolled: false },
            Err(error) => error_response(PLUGIN_ERROR, "GC left stale pods", &error),
        }
    }

    async fn check(&self, request: &Request) -> Response {
        match self.ambient_workload(request).await {
            Ok(None) => Response::Ok { enrolled: false },
            Ok(Some(pod)) => match self.enroller.is_redirected(&pod.uid).await {
                Ok(true) => Response::Ok { enrolled: true },
                Ok(false) => Response::Error {
                    code: PLUGIN_ERROR,
                    msg: format!(
                        "ambient pod {}/{} has no redirection",
                        request.pod.namespace, request.pod.name
                    ),
                    details: String::new(),
                },
                Err(error) => error_response(PLUGIN_ERROR, "check failed", &error),
            },
            Err(error) => decision_error(error),
        }
    }
}

/// A pod the agent does not know yet is worth a retry (the runtime's); anything else is not.
fn decision_error(error: PolicyError) -> Response {
    let code = match error {
        PolicyError::NotYetKnown(_) => TRY_AGAIN_LATER,
        PolicyError::Failed(_) => PLUGIN_ERROR,
    };
    error_response(code, "cannot decide", &error.into())
}

fn error_response(code: u32, msg: &str, error: &anyhow::Error) -> Response {
    Response::Error {
        code,
        msg: msg.to_owned(),
        details: format!("{error:#}"),
    }
}
