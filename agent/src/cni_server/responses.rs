//! What went wrong, as a CNI error code the runtime acts on: retry later, or fail for good with
//! the culprit named.
use std::net::IpAddr;

use weir_cni::{
    code::{INVALID_CONFIG, INVALID_ENVIRONMENT, PLUGIN_SPECIFIC, TRY_AGAIN_LATER},
    protocol::{PodIp, Response},
};

use crate::{
    datapath::Unenrollable,
    policy::PolicyError,
    workload::{PodName, Workload},
};

/// The policy could not decide: the agent does not know the pod yet, or cannot read its
/// policy now. Both clear up without a new request, so the runtime retries.
pub(super) fn decision_error(pod: &PodName, error: PolicyError) -> Response {
    let msg = match &error {
        PolicyError::NotYetKnown(_) | PolicyError::InvalidAnnotation(..) => error.to_string(),
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
pub(super) fn pod_ip(pod: &PodName, ip: &PodIp) -> Result<IpAddr, Response> {
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
pub(super) fn incomplete_add(pod: &Workload) -> Option<Response> {
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
            "neither prevResult nor the pod's eth0 has an IP address",
            "chained, weir-cni comes after the plugin that gives the pod its addresses; on its \
             own, after the pod's default network on eth0",
        )
    } else {
        return None;
    };
    Some(Response::Error {
        code,
        msg: format!("{missing}: ambient pod {} cannot be enrolled", pod.pod),
        details: details.into(),
    })
}

/// A failed enrollment as the runtime sees it. One that can never succeed as asked fails for
/// good, with the spec's code where one names the culprit (4: the runtime's `CNI_NETNS` or
/// `K8S_POD_UID`; 7: `prevResult`) and 999 otherwise; any other failure may pass (the kernel
/// busy or short of memory, the agent's own trouble), and the runtime tries again (11).
pub(super) fn enrollment_failure(pod: &PodName, error: &anyhow::Error) -> Response {
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

pub(super) fn error_response(code: u32, msg: &str, error: &anyhow::Error) -> Response {
    Response::Error {
        code,
        msg: msg.to_owned(),
        details: format!("{error:#}"),
    }
}

#[cfg(test)]
mod tests {
    use std::{io, path::PathBuf};

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
    /// netns causes are shown end to end in `tests/tests/cni/`).
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
            pod: PodName::new("mesh", "app"),
            service_account: None,
            netns: "/var/run/netns/x".into(),
            ips: vec![IpAddr::from([10, 0, 0, 2])],
            options: Default::default(),
            attachment: None,
            sidecar: None,
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
