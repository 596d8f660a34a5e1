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

use anyhow::{Context, Result};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{UnixListener, UnixStream},
};
use tracing::{debug, warn, Instrument};
use weir_cni::{
    code::{DECODE_FAILURE, INVALID_CONFIG, INVALID_ENVIRONMENT, PLUGIN_SPECIFIC, TRY_AGAIN_LATER},
    protocol::{Attachment, Command, PodIp, Request, Response, MAX_REQUEST_BYTES},
};

use crate::{
    datapath::Unenrollable,
    enroll::Enroller,
    logging::pod_span,
    policy::{Labels, Policy, PolicyError},
    report::{report_problems, Reporter, Warning},
    workload::{PodName, Status, Workload},
};

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
    result: &'static str,
}

/// Plugin requests decided from policy and turned into enrollment steps, and the steps' outcomes
/// into CNI responses and error codes.
pub struct CniHandler {
    enroller: Arc<Enroller>,
    policy: Arc<dyn Policy>,
    reporter: Arc<dyn Reporter>,
    events: Family<EventLabels, Counter>,
}

impl CniHandler {
    pub fn new(
        enroller: Arc<Enroller>,
        policy: Arc<dyn Policy>,
        reporter: Arc<dyn Reporter>,
    ) -> Arc<Self> {
        Arc::new(Self {
            enroller,
            policy,
            reporter,
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
            let pod = &request.pod;
            self.enroller
                .in_turn(key, step)
                .instrument(pod_span(&pod.namespace, &pod.name, &pod.uid))
                .await
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

    /// Decides from policy; returns the pod to enroll, or `None` when it is not ambient. `Err`
    /// is the response: the decision failed, or the request cannot name an ambient pod.
    async fn ambient_workload(&self, request: &Request) -> Result<Option<Workload>, Response> {
        let name = PodName::new(&request.pod.namespace, &request.pod.name);
        let annotations: Labels = request.annotations.clone().into_iter().collect();
        let Some(ambient) = self
            .policy
            .decide(&name, &request.pod.uid, &annotations)
            .await
            .map_err(|error| decision_error(&name, error))?
        else {
            return Ok(None);
        };
        report_problems(&*self.reporter, &name, &ambient.problems).await;
        let ips = request
            .ips
            .iter()
            .map(|ip| pod_ip(&name, ip))
            .collect::<Result<Vec<IpAddr>, Response>>()?;
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
            Err(response) => return response,
        };
        if let Some(incomplete) = incomplete_add(&pod) {
            return incomplete;
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
                self.reporter.warn(&name, warning).await;
                enrollment_failure(&name, &error)
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
            Err(error) => error_response(PLUGIN_SPECIFIC, "unenroll failed", &error),
        }
    }

    async fn gc(&self, valid: &[Attachment]) -> Response {
        match self.enroller.collect_garbage(valid).await {
            Ok(_) => Response::Ok { enrolled: false },
            Err(error) => error_response(PLUGIN_SPECIFIC, "GC left stale pods", &error),
        }
    }

    async fn check(&self, request: &Request) -> Response {
        match self.ambient_workload(request).await {
            Ok(None) => Response::Ok { enrolled: false },
            Ok(Some(pod)) => match self.enroller.is_redirected(&pod.uid).await {
                Ok(true) => Response::Ok { enrolled: true },
                Ok(false) => Response::Error {
                    code: PLUGIN_SPECIFIC,
                    msg: format!(
                        "ambient pod {}/{} has no redirection",
                        request.pod.namespace, request.pod.name
                    ),
                    details: String::new(),
                },
                Err(error) => error_response(PLUGIN_SPECIFIC, "check failed", &error),
            },
            Err(response) => response,
        }
    }
}

/// The policy could not decide: the agent does not know the pod yet, or cannot read its
/// policy now. Both clear up without a new request, so the runtime retries.
fn decision_error(pod: &PodName, error: PolicyError) -> Response {
    let msg = match &error {
        PolicyError::NotYetKnown(_) => error.to_string(),
        PolicyError::Failed(cause) => format!(
            "cannot decide whether pod {pod} is ambient: {}",
            cause.root_cause()
        ),
    };
    Response::Error {
        code: TRY_AGAIN_LATER,
        msg,
        details: format!("{:#}", anyhow::Error::from(error)),
    }
}

/// An address from the previous plugin's result, without its prefix length.
fn pod_ip(pod: &PodName, ip: &PodIp) -> Result<IpAddr, Response> {
    let address = ip.address.split('/').next().unwrap_or_default();
    address.parse().map_err(|error| Response::Error {
        code: INVALID_CONFIG,
        msg: format!(
            "prevResult address {:?} is not an IP address: ambient pod {pod} cannot be enrolled",
            ip.address
        ),
        details: format!("{error}"),
    })
}

/// What an ambient pod's ADD lacks, as the spec's code for where it should have been: the
/// runtime sends the same request again, so it can never succeed.
fn incomplete_add(pod: &Workload) -> Option<Response> {
    let (code, missing, details) = if pod.netns.as_os_str().is_empty() {
        (INVALID_ENVIRONMENT, "CNI_NETNS is empty", "")
    } else if pod.uid.is_empty() {
        (
            INVALID_ENVIRONMENT,
            "CNI_ARGS has no K8S_POD_UID",
            "ztunnel and the agent know pods by uid; kubelet's runtimes pass it",
        )
    } else if pod.ips.is_empty() {
        (
            INVALID_CONFIG,
            "prevResult has no IP address",
            "weir-cni comes after the plugin that gives the pod its addresses",
        )
    } else {
        return None;
    };
    Some(Response::Error {
        code,
        msg: format!(
            "{missing}: ambient pod {}/{} cannot be enrolled",
            pod.namespace, pod.name
        ),
        details: details.into(),
    })
}

/// A failed enrollment as the runtime sees it. One that can never succeed as asked fails for
/// good, with the spec's code where one names the culprit (4: the runtime's `CNI_NETNS` or
/// `K8S_POD_UID`; 7: `prevResult`) and 999 otherwise; any other failure may pass (the kernel
/// busy or short of memory, the agent's own trouble), and the runtime tries again (11).
fn enrollment_failure(pod: &PodName, error: &anyhow::Error) -> Response {
    let details = format!("{error:#}");
    if let Some(cause) = error.downcast_ref::<Unenrollable>() {
        let (code, culprit) = match cause {
            Unenrollable::NetnsMissing(_) | Unenrollable::NotANetns(_) => {
                (INVALID_ENVIRONMENT, "CNI_NETNS")
            }
            Unenrollable::NodeNetns { .. } => (PLUGIN_SPECIFIC, "CNI_NETNS"),
            Unenrollable::InvalidUid(_) => (INVALID_ENVIRONMENT, "K8S_POD_UID in CNI_ARGS"),
            Unenrollable::NoIp { .. } => (INVALID_CONFIG, "prevResult"),
        };
        let msg = format!("{culprit}: {cause}: ambient pod {pod} cannot be enrolled");
        return Response::Error { code, msg, details };
    }
    let (code, msg) = match unsupported_by_kernel(error) {
        Some(refused) => (
            PLUGIN_SPECIFIC,
            format!(
                "the kernel lacks a feature weir needs ({refused}): ambient pod {pod} cannot \
                 be enrolled on this node"
            ),
        ),
        None => (
            TRY_AGAIN_LATER,
            format!(
                "ambient pod {pod} is not enrolled yet: {}",
                error.root_cause()
            ),
        ),
    };
    Response::Error { code, msg, details }
}

/// The kernel's answer that it has no such operation (`EOPNOTSUPP`, `ENOSYS`), anywhere in the
/// error's chain: a kernel built without what weir needs does not gain it on a retry.
fn unsupported_by_kernel(error: &anyhow::Error) -> Option<&std::io::Error> {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<std::io::Error>())
        .find(|cause| cause.kind() == std::io::ErrorKind::Unsupported)
}

fn error_response(code: u32, msg: &str, error: &anyhow::Error) -> Response {
    Response::Error {
        code,
        msg: msg.to_owned(),
        details: format!("{error:#}"),
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    fn pod() -> PodName {
        PodName::new("mesh", "app")
    }

    fn code_and_msg(response: Response) -> (u32, String) {
        match response {
            Response::Error { code, msg, .. } => (code, msg),
            Response::Ok { .. } => panic!("not an error"),
        }
    }

    /// Each cause keeps its code under the context an enrollment adds on its way up (the
    /// netns causes are shown end to end in `tests/cni.rs`).
    #[test]
    fn enrollments_that_can_never_succeed_name_the_culprit() {
        for (cause, code, msg) in [
            (
                Unenrollable::NodeNetns { uid: "u".into() },
                PLUGIN_SPECIFIC,
                "CNI_NETNS: refusing to redirect the node's own network namespace as pod u: \
                 ambient pod mesh/app cannot be enrolled",
            ),
            (
                Unenrollable::InvalidUid("u".repeat(99)),
                INVALID_ENVIRONMENT,
                "K8S_POD_UID in CNI_ARGS",
            ),
            (
                Unenrollable::NoIp { uid: "u".into() },
                INVALID_CONFIG,
                "prevResult: pod u has no IP",
            ),
        ] {
            let error = anyhow::Error::new(cause).context("enrolling");
            let (got_code, got_msg) = code_and_msg(enrollment_failure(&pod(), &error));
            assert_eq!(got_code, code, "{got_msg}");
            assert!(got_msg.starts_with(msg), "{got_msg}");
        }
    }

    #[test]
    fn a_kernel_without_the_operation_fails_for_good_and_a_busy_one_is_retried() {
        let failed = |errno| {
            anyhow::Error::new(io::Error::from_raw_os_error(errno))
                .context("tc programs and rerouting rules")
                .context("enrolling pod u")
        };
        for errno in [libc::EOPNOTSUPP, libc::ENOSYS] {
            let (code, msg) = code_and_msg(enrollment_failure(&pod(), &failed(errno)));
            assert_eq!(code, PLUGIN_SPECIFIC, "{msg}");
            assert!(
                msg.starts_with("the kernel lacks a feature weir needs"),
                "{msg}"
            );
        }
        for errno in [libc::EBUSY, libc::EAGAIN, libc::ENOMEM, libc::ENOBUFS] {
            let (code, msg) = code_and_msg(enrollment_failure(&pod(), &failed(errno)));
            assert_eq!(code, TRY_AGAIN_LATER, "{msg}");
            let cause = io::Error::from_raw_os_error(errno).to_string();
            assert_eq!(
                msg,
                format!("ambient pod mesh/app is not enrolled yet: {cause}")
            );
        }
    }

    #[test]
    fn undecided_pods_are_retried() {
        for error in [
            PolicyError::NotYetKnown(pod()),
            PolicyError::Failed(anyhow::anyhow!("policy.json: EOF while parsing")),
        ] {
            let (code, msg) = code_and_msg(decision_error(&pod(), error));
            assert_eq!(code, TRY_AGAIN_LATER, "{msg}");
            assert!(msg.contains("mesh/app"), "{msg}");
        }
    }

    /// Only a client other than weir-cni (which insists on `CNI_NETNS`) sends an ADD without
    /// a netns.
    #[test]
    fn an_ambient_add_without_a_netns_names_the_variable() {
        let mut pod = Workload {
            uid: "u".into(),
            name: "app".into(),
            namespace: "mesh".into(),
            service_account: None,
            netns: "/var/run/netns/x".into(),
            ips: vec![IpAddr::from([10, 0, 0, 2])],
            options: Default::default(),
            attachment: None,
        };
        assert!(incomplete_add(&pod).is_none());
        pod.netns = PathBuf::new();
        let (code, msg) = code_and_msg(incomplete_add(&pod).unwrap());
        assert_eq!(code, INVALID_ENVIRONMENT);
        assert_eq!(
            msg,
            "CNI_NETNS is empty: ambient pod mesh/app cannot be enrolled"
        );
    }
}
