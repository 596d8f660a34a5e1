//! What the agent needs of the cluster: the API server answers, the Node is readable, and every
//! access in [`REQUIRED_ACCESS`] is granted, each asked with a SelfSubjectAccessReview.
//!
//! One review per verb, not one SelfSubjectRulesReview: a rules review lists the rules that
//! apply in one namespace, so a RoleBinding there is indistinguishable from the ClusterRoleBinding
//! a cluster-wide access needs, and authorizers other than RBAC (webhooks) may answer it
//! incomplete.
use std::{fmt, future::Future, time::Duration};

use k8s_openapi::api::{
    authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec},
    core::v1::Node,
};
use kube::{
    api::{Api, PostParams},
    Client,
};

use super::Finding;
use crate::{
    cluster::{self, ClusterConfig},
    policy::OwnPods,
};

/// How long one request to the API server may take before it counts as unanswered.
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// Where an access is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessScope {
    /// Every namespace (or a cluster-scoped resource).
    Cluster,
    /// The agent's namespace, on weir's DaemonSet alone (by name).
    OwnDaemonSet,
}

/// Verbs on one resource the agent's account must be granted.
#[derive(Debug)]
pub struct Access {
    pub verbs: &'static [&'static str],
    /// The API group, `""` for the core group.
    pub group: &'static str,
    /// As RBAC names it: `pods`, or a subresource as `pods/status`.
    pub resource: &'static str,
    pub scope: AccessScope,
    /// What the agent does with it.
    pub used_for: &'static str,
}

/// Everything the agent does with the API server, as RBAC grants it.
pub const REQUIRED_ACCESS: &[Access] = &[
    Access {
        verbs: &["get", "list", "watch"],
        group: "",
        resource: "pods",
        scope: AccessScope::Cluster,
        used_for: "this node's pods; weir-cni reads a starting pod with these credentials",
    },
    Access {
        verbs: &["patch"],
        group: "",
        resource: "pods/status",
        scope: AccessScope::Cluster,
        used_for: "the ambient.istio.io/redirection status annotation",
    },
    Access {
        verbs: &["get", "list", "watch"],
        group: "",
        resource: "namespaces",
        scope: AccessScope::Cluster,
        used_for: "namespace labels; weir-cni reads a starting pod's namespace",
    },
    Access {
        verbs: &["get"],
        group: "",
        resource: "nodes",
        scope: AccessScope::Cluster,
        used_for: "on SIGTERM, whether weir's DaemonSet still selects this node",
    },
    Access {
        verbs: &["patch"],
        group: "",
        resource: "nodes/status",
        scope: AccessScope::Cluster,
        used_for: "the node condition telling whether the agent serves the node",
    },
    Access {
        verbs: &["get", "list", "watch"],
        group: "apps",
        resource: "daemonsets",
        scope: AccessScope::OwnDaemonSet,
        used_for: "on SIGTERM, whether weir's DaemonSet still exists",
    },
    Access {
        verbs: &["create", "patch"],
        group: "events.k8s.io",
        resource: "events",
        scope: AccessScope::Cluster,
        used_for: "Events on the pods it enrolls",
    },
];

/// What the agent needs of the cluster `config` names, as the node `own` tells.
pub(super) async fn findings(config: &ClusterConfig, own: &OwnPods) -> Vec<Finding> {
    let requirement = "API server reachable";
    let client = match cluster::connect(config).await {
        Ok(client) => client,
        Err(error) => {
            return vec![Finding::unmet(
                requirement,
                format!("{error:#}"),
                "give --kubeconfig (KUBECONFIG), or run the agent in a pod with a service account",
            )]
        }
    };
    match ask(client.apiserver_version()).await {
        Ok(version) => {
            let found = format!("Kubernetes {}", version.git_version);
            let mut findings = vec![Finding::met(requirement, found)];
            findings.push(node_object(&client, &config.node_name).await);
            for access in REQUIRED_ACCESS {
                match granted(&client, access, own).await {
                    Ok(finding) => findings.push(finding),
                    Err(unserved) => {
                        // Every other review would be answered the same.
                        findings.push(Finding::unverified(
                            "RBAC of the agent's service account",
                            format!(
                                "not verified, the API server does not serve access reviews \
                                 ({unserved})"
                            ),
                            "make sure it has every rule of deploy/weir.yaml's ClusterRole and \
                             Role; the agent starts without verifying them",
                        ));
                        break;
                    }
                }
            }
            findings
        }
        Err(answer) => vec![Finding::pending(
            requirement,
            answer.to_string(),
            "make the API server reachable from the node (the kubeconfig's server, the network \
             between them); the agent keeps trying meanwhile",
        )],
    }
}

/// A request's outcome other than success.
enum Unanswered {
    /// The API server answered with an error status.
    Refused(Box<kube::core::Status>),
    /// It did not answer (connection, timeout).
    Unreachable(String),
}

impl fmt::Display for Unanswered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(status) => {
                write!(f, "{} {}: {}", status.code, status.reason, status.message)
            }
            Self::Unreachable(error) => f.write_str(error),
        }
    }
}

impl Unanswered {
    /// Whether the API server does not serve the request's API at all, as opposed to refusing
    /// this request to it.
    fn is_unserved(&self) -> bool {
        matches!(self, Self::Refused(status) if matches!(status.code, 404 | 405 | 501))
    }
}

async fn ask<T>(request: impl Future<Output = kube::Result<T>>) -> Result<T, Unanswered> {
    match tokio::time::timeout(API_TIMEOUT, request).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(kube::Error::Api(status))) => Err(Unanswered::Refused(status)),
        Ok(Err(error)) => Err(Unanswered::Unreachable(error.to_string())),
        Err(_) => Err(Unanswered::Unreachable(format!(
            "no answer within {API_TIMEOUT:?}"
        ))),
    }
}

async fn node_object(client: &Client, node_name: &str) -> Finding {
    let requirement = "this node's Node object";
    match ask(Api::<Node>::all(client.clone()).get(node_name)).await {
        Ok(_) => Finding::met(requirement, format!("{node_name} is readable")),
        Err(Unanswered::Refused(status)) if status.code == 404 => Finding::unmet(
            requirement,
            format!("no Node named {node_name}"),
            "give --node-name (WEIR_NODE_NAME) this node's name (spec.nodeName, from the \
             Downward API in a pod)",
        ),
        Err(answer @ Unanswered::Refused(_)) => Finding::unmet(
            requirement,
            answer.to_string(),
            "grant get on nodes to the agent's service account (deploy/weir.yaml's ClusterRole)",
        ),
        Err(answer @ Unanswered::Unreachable(_)) => Finding::pending(
            requirement,
            answer.to_string(),
            "make the API server reachable from the node; the agent keeps trying meanwhile",
        ),
    }
}

/// Whether every verb of `access` is granted, each asked with a SelfSubjectAccessReview; the
/// answer of an API server that does not serve those reviews, as the error.
async fn granted(client: &Client, access: &Access, own: &OwnPods) -> Result<Finding, Unanswered> {
    let (resource, subresource) = match access.resource.split_once('/') {
        Some((resource, subresource)) => (resource, Some(subresource)),
        None => (access.resource, None),
    };
    let (namespace, name, place) = match access.scope {
        AccessScope::Cluster => (None, None, "cluster-wide".to_owned()),
        AccessScope::OwnDaemonSet => (
            Some(own.namespace.clone()),
            Some(own.daemonset.clone()),
            format!("{} in {}", own.daemonset, own.namespace),
        ),
    };
    let group = match access.group {
        "" => String::new(),
        group => format!(".{group}"),
    };
    let requirement = format!(
        "RBAC {} {}{group} {place} ({})",
        access.verbs.join(", "),
        access.resource,
        access.used_for
    );
    let reviews = Api::<SelfSubjectAccessReview>::all(client.clone());
    let mut denied = Vec::new();
    for verb in access.verbs {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(verb.to_string()),
                    group: Some(access.group.to_owned()),
                    resource: Some(resource.to_owned()),
                    subresource: subresource.map(str::to_owned),
                    namespace: namespace.clone(),
                    name: name.clone(),
                    ..ResourceAttributes::default()
                }),
                ..SelfSubjectAccessReviewSpec::default()
            },
            ..SelfSubjectAccessReview::default()
        };
        match ask(reviews.create(&PostParams::default(), &review)).await {
            Ok(review) if review.status.as_ref().is_some_and(|status| status.allowed) => {}
            Ok(_) => denied.push(*verb),
            Err(answer) if answer.is_unserved() => return Err(answer),
            Err(answer @ Unanswered::Refused(_)) => {
                return Ok(Finding::unmet(
                    requirement,
                    format!("the access review failed: {answer}"),
                    "let the agent's service account create selfsubjectaccessreviews \
                     (system:basic-user grants it by default)",
                ))
            }
            Err(answer @ Unanswered::Unreachable(_)) => {
                return Ok(Finding::pending(
                    requirement,
                    answer.to_string(),
                    "make the API server reachable from the node; the agent keeps trying meanwhile",
                ))
            }
        }
    }
    if denied.is_empty() {
        return Ok(Finding::met(requirement, "granted"));
    }
    let role = match access.scope {
        AccessScope::Cluster => "ClusterRole".to_owned(),
        AccessScope::OwnDaemonSet => format!("Role in {}", own.namespace),
    };
    Ok(Finding::unmet(
        requirement,
        format!("{} denied", denied.join(", ")),
        format!(
            "grant it to the agent's service account: deploy/weir.yaml's {role} has every rule \
             weir needs"
        ),
    ))
}
