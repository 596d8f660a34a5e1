//! Plugin requests decided from policy and turned into enrollment steps.
use std::{future::Future, net::IpAddr, path::PathBuf, sync::Arc};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tracing::{debug, error, info, warn, Instrument};
use weir_cni::{
    code::{DECODE_FAILURE, INVALID_CONFIG, PLUGIN_SPECIFIC, TRY_AGAIN_LATER},
    protocol::{Attachment, Command, LogLevel, LogRecord, PluginLog, Request, Response},
};

use super::responses::{
    decision_error, enrollment_failure, error_response, incomplete_add, pod_ip,
};
use crate::{
    datapath::netns,
    enroll::Enroller,
    logging::pod_span,
    policy::{Decision, Labels, Policy, PolicyError},
    report::{report_problems, Reporter, Warning},
    workload::{Mode, PodName, Status, Workload},
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
    result: &'static str,
}

/// istio-cni's label for the outcome of a plugin's ADD: the HTTP status its agent answers with.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResponseCodeLabel {
    response_code: &'static str,
}

/// Plugin requests decided from policy and turned into enrollment steps, and the steps' outcomes
/// into CNI responses and error codes.
pub struct CniHandler {
    enroller: Arc<Enroller>,
    policy: Arc<dyn Policy>,
    reporter: Arc<dyn Reporter>,
    events: Family<EventLabels, Counter>,
    adds: Family<ResponseCodeLabel, Counter>,
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
            adds: Family::default(),
        })
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "weir_cni_requests",
            "Plugin requests handled by the node agent, by event and result",
            self.events.clone(),
        );
        registry.register(
            "istio_cni_plugin_requests",
            "CNI plugin ADD requests handled by the node agent, by response code",
            self.adds.clone(),
        );
    }

    /// Serves one plugin request, in turn with every other step for the same pod.
    pub async fn handle(&self, request: &Request) -> Response {
        match request.command {
            Command::Add => self.serve("add", request, self.add(request)).await,
            Command::Del => self.serve("del", request, self.del(request)).await,
            Command::Check => self.serve("check", request, self.check(request)).await,
            Command::Gc => {
                let gc = self.gc(&request.valid_attachments);
                self.serve("gc", request, gc).await
            }
            Command::Log => log_plugin_lines(request),
        }
    }

    /// Runs `step`, the pod's `event`, in the pod's turn and span, and counts its result.
    async fn serve(
        &self,
        event: &'static str,
        request: &Request,
        step: impl Future<Output = Response>,
    ) -> Response {
        let key = if request.pod.uid.is_empty() {
            &request.container_id
        } else {
            &request.pod.uid
        };
        // GC names no pod: it takes each stale pod's turn on its own.
        let result = if request.command == Command::Gc {
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
        if request.command == Command::Add {
            let response_code = response_code(&result);
            self.adds
                .get_or_create(&ResponseCodeLabel { response_code })
                .inc();
        }
        result
    }

    /// Decides from policy; returns the pod to enroll (ambient, or a sidecar pod), or `None`
    /// when it is neither. `Err` is the response: the decision failed, or the request cannot
    /// name a pod to enroll.
    async fn workload(&self, request: &Request) -> Result<Option<Workload>, Response> {
        let name = PodName::new(&request.pod.namespace, &request.pod.name);
        let annotations: Labels = request.annotations.clone().into_iter().collect();
        let decision = match self
            .policy
            .decide(&name, &request.pod.uid, &annotations)
            .await
        {
            Ok(decision) => decision,
            Err(PolicyError::InvalidAnnotation(_, invalid)) => {
                let msg = format!("sidecar pod {name} cannot be redirected: {invalid}");
                let warning = Warning::SidecarRedirectionFailed(msg.clone());
                self.reporter.warn(&name, warning).await;
                self.enroller.count_failed(&request.pod.uid, Mode::Sidecar);
                return Err(Response::Error {
                    code: INVALID_CONFIG,
                    msg,
                    details: "istio-cni refuses the same annotation: fix it on the pod".into(),
                });
            }
            Err(error) => return Err(decision_error(&name, error)),
        };
        let (options, service_account, sidecar) = match decision {
            Decision::Neither => return Ok(None),
            Decision::Ambient(ambient) => {
                report_problems(&*self.reporter, &name, &ambient.problems).await;
                (ambient.options, Some(ambient.service_account), None)
            }
            Decision::Sidecar(sidecar) => (sidecar.options(), None, Some(sidecar)),
        };
        let mut ips = request
            .ips
            .iter()
            .map(|ip| pod_ip(&name, ip))
            .collect::<Result<Vec<IpAddr>, Response>>()?;
        if ips.is_empty() && !request.netns.is_empty() {
            // weir-cni as a network of its own (a Multus attachment) has no prevResult.
            let path = PathBuf::from(&request.netns);
            ips = tokio::task::spawn_blocking(move || netns::pod_ips(&path))
                .await
                .map_err(anyhow::Error::from)
                .and_then(|found| found)
                .map_err(|error| enrollment_failure(&name, &error))?;
        }
        Ok(Some(Workload {
            uid: request.pod.uid.clone(),
            pod: PodName::new(&request.pod.namespace, &request.pod.name),
            netns: PathBuf::from(&request.netns),
            ips,
            options,
            service_account,
            attachment: Some(Attachment {
                container_id: request.container_id.clone(),
                ifname: request.ifname.clone(),
            }),
            sidecar,
        }))
    }

    async fn add(&self, request: &Request) -> Response {
        let pod = match self.workload(request).await {
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
                    "ztunnel has not acknowledged pod {}: redirection is in place and pending",
                    pod.pod
                ),
                details: "the runtime retries; the pod completes when ztunnel connects".into(),
            },
            Err(error) => {
                let name = pod.pod.clone();
                let error_text = format!("{error:#}");
                let warning = match pod.sidecar {
                    Some(_) => Warning::SidecarRedirectionFailed(error_text),
                    None => Warning::EnrollmentFailed(error_text),
                };
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
        match self.workload(request).await {
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

/// The target of the plugin's lines, `weir_cni=debug` in a filter; their scope is `cni`.
const PLUGIN_TARGET: &str = "weir_cni";

/// The plugin's lines about a request it sent before, logged as the agent's own lines about the
/// pod are: in the pod's span, at the plugin's level, filtered by the agent's filter.
fn log_plugin_lines(request: &Request) -> Response {
    if let Some(PluginLog { command, records }) = &request.plugin_log {
        let pod = &request.pod;
        let _pod = pod_span(&pod.namespace, &pod.name, &pod.uid).entered();
        let (command, container) = (command.name(), &request.container_id);
        for LogRecord { level, msg } in records {
            match level {
                LogLevel::Error => error!(target: PLUGIN_TARGET, command, container, "{msg}"),
                LogLevel::Warn => warn!(target: PLUGIN_TARGET, command, container, "{msg}"),
                LogLevel::Info => info!(target: PLUGIN_TARGET, command, container, "{msg}"),
                LogLevel::Debug => debug!(target: PLUGIN_TARGET, command, container, "{msg}"),
            }
        }
    }
    Response::Ok { enrolled: false }
}

/// The status istio-cni's agent would answer an ADD with: 400 for a request it cannot take as
/// given (undecodable, or invalid for the pod), 500 for one it took and failed, 200 otherwise.
fn response_code(response: &Response) -> &'static str {
    match response {
        Response::Error { code, .. } if matches!(*code, DECODE_FAILURE | INVALID_CONFIG) => "400",
        Response::Error { .. } => "500",
        _ => "200",
    }
}
