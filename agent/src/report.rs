//! What the agent tells about pods: their enrollment status and the [`Warning`]s their owners
//! should hear. [`Reporter`] is where the enrollment path, the CNI server and the reconcile loop
//! send them; in a cluster it is `cluster::report::ApiReporter` (istio's status annotation and
//! Kubernetes Events), on a node without an API server [`NoReporter`] (the log lines at the
//! call sites are all there is).
use futures::{future::BoxFuture, FutureExt};
use tracing::warn;

use crate::{
    policy::AnnotationProblem,
    workload::{PodName, Status},
};

/// Where pods' statuses and warnings are published. Held as an `Arc<dyn Reporter>`: the callers
/// never know whether there is an API server.
pub trait Reporter: Send + Sync {
    /// Publishes a pod's redirection status (`None`: no longer enrolled).
    fn report_status<'a>(&'a self, pod: &'a PodName, status: Option<Status>) -> BoxFuture<'a, ()>;

    /// Tells the pod's owner something went wrong with it.
    fn warn<'a>(&'a self, pod: &'a PodName, warning: Warning) -> BoxFuture<'a, ()>;
}

/// A node without an API server: nobody to publish to.
pub struct NoReporter;

impl Reporter for NoReporter {
    fn report_status<'a>(&'a self, _: &'a PodName, _: Option<Status>) -> BoxFuture<'a, ()> {
        futures::future::ready(()).boxed()
    }

    fn warn<'a>(&'a self, _: &'a PodName, _: Warning) -> BoxFuture<'a, ()> {
        futures::future::ready(()).boxed()
    }
}

/// Logs a pod's annotation problems; the reporter turns them into Events where it can.
pub async fn report_problems(
    reporter: &dyn Reporter,
    pod: &PodName,
    problems: &[AnnotationProblem],
) {
    for problem in problems {
        warn!(
            %pod,
            annotation = problem.annotation,
            value = problem.value,
            used = problem.used,
            "invalid annotation value, using the default"
        );
        reporter
            .warn(pod, Warning::InvalidAnnotation(problem.clone()))
            .await;
    }
}

/// Something about a pod its owner should hear (a Warning Event on the pod in a cluster).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Warning {
    EnrollmentFailed(String),
    /// A sidecar pod could not be redirected: an invalid annotation at its ADD, or a failed
    /// enrollment (at its ADD, or by an in-place repair).
    SidecarRedirectionFailed(String),
    InvalidAnnotation(AnnotationProblem),
    /// An ambient pod ran without weir's redirection and was enrolled live.
    RepairedPod,
    /// A pod running without redirection that could not be repaired in place (`why`) was
    /// deleted, or deleting it failed (`failed`).
    DeleteBrokenPod {
        why: String,
        failed: Option<String>,
    },
    /// The same, labelled [`UNINITIALIZED_LABEL`]`=true` instead.
    LabelBrokenPod {
        why: String,
        failed: Option<String>,
    },
    /// Another component rewrote the node's CNI config (on the agent's own pod).
    CniConfigRewritten {
        file: String,
    },
    /// A running pod another node agent (istio-cni's) redirected was taken over in place: not
    /// a warning, a Normal Event.
    TakenOver,
}

/// What istio's repair controller labels a broken pod with, for its owner to act on.
pub const UNINITIALIZED_LABEL: &str = "cni.istio.io/uninitialized";

impl Warning {
    pub fn reason(&self) -> &'static str {
        match self {
            Warning::EnrollmentFailed(_) => "AmbientEnrollmentFailed",
            Warning::SidecarRedirectionFailed(_) => "SidecarRedirectionFailed",
            Warning::InvalidAnnotation(_) => "InvalidAmbientAnnotation",
            Warning::RepairedPod => "RepairedPod",
            Warning::DeleteBrokenPod { .. } => "DeleteBrokenPod",
            Warning::LabelBrokenPod { .. } => "LabelBrokenPod",
            Warning::CniConfigRewritten { .. } => "CniConfigRewritten",
            Warning::TakenOver => "TakenOver",
        }
    }

    /// Whether it is news rather than trouble: a Normal Event, not a Warning.
    pub fn is_normal(&self) -> bool {
        matches!(self, Warning::TakenOver)
    }

    /// What tells this warning apart from others with the same reason on the same pod, where
    /// that stays the same while the trouble does: each invalid annotation value is news to the
    /// pod's owner, while a failure's error text changes with every retry of the same failure.
    pub fn problem(&self) -> Option<String> {
        match self {
            Warning::InvalidAnnotation(problem) => {
                Some(format!("{}={}", problem.annotation, problem.value))
            }
            Warning::CniConfigRewritten { file } => Some(file.clone()),
            Warning::EnrollmentFailed(_)
            | Warning::SidecarRedirectionFailed(_)
            | Warning::RepairedPod
            | Warning::DeleteBrokenPod { .. }
            | Warning::LabelBrokenPod { .. }
            | Warning::TakenOver => None,
        }
    }

    /// Whether it reports an act of pod repair: istio's repair controller (`cni-repair`)
    /// reports those, so tools that follow its Events find weir's.
    pub fn is_repair(&self) -> bool {
        matches!(
            self,
            Warning::RepairedPod | Warning::DeleteBrokenPod { .. } | Warning::LabelBrokenPod { .. }
        )
    }

    /// The Event's action: what the agent was doing.
    pub fn action(&self) -> &'static str {
        match self {
            Warning::EnrollmentFailed(_)
            | Warning::SidecarRedirectionFailed(_)
            | Warning::InvalidAnnotation(_) => "Enroll",
            Warning::RepairedPod
            | Warning::DeleteBrokenPod { .. }
            | Warning::LabelBrokenPod { .. } => "Repair",
            Warning::CniConfigRewritten { .. } => "Install",
            Warning::TakenOver => "TakeOver",
        }
    }

    pub fn note(&self) -> String {
        let broken = |why: &str, outcome: String| {
            format!(
                "pod detected as broken: it runs without weir's redirection and cannot be \
                 repaired in place ({why}); {outcome}"
            )
        };
        let act = |done: &str, doing: &str, failed: &Option<String>| match failed {
            None => done.to_owned(),
            Some(error) => format!("{doing} failed: {error}"),
        };
        match self {
            Warning::EnrollmentFailed(error) => format!("ambient enrollment failed: {error}"),
            Warning::SidecarRedirectionFailed(error) => {
                format!("sidecar redirection failed: {error}")
            }
            Warning::InvalidAnnotation(problem) => format!(
                "annotation {}={:?} is not true or false; using {}",
                problem.annotation, problem.value, problem.used
            ),
            Warning::RepairedPod => "the pod started without weir's redirection (weir-cni was \
                 missing from the node's CNI chain when its sandbox was created) and was \
                 enrolled live"
                .into(),
            Warning::DeleteBrokenPod { why, failed } => {
                broken(why, act("deleted", "deleting it", failed))
            }
            Warning::LabelBrokenPod { why, failed } => {
                let label = format!("{UNINITIALIZED_LABEL}=true");
                let (done, doing) = (format!("labelled {label}"), format!("labelling it {label}"));
                broken(why, act(&done, &doing, failed))
            }
            Warning::TakenOver => "the pod was redirected by istio-cni's in-pod rules; weir's \
                 eBPF programs redirect it now, taken over in place: its connections go on, and \
                 istio's rules leave the pod once none needs them"
                .into(),
            Warning::CniConfigRewritten { file } => format!(
                "another component rewrote the CNI config {file} without weir-cni; weir put it \
                 back at the end of the chain. Pods that started meanwhile ran without \
                 redirection until weir enrolled them live"
            ),
        }
    }
}
