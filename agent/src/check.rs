//! What weir needs of the node and the cluster, checked one requirement at a time:
//! `weir-agent check` prints a line for each (`✓ <requirement>: <what was found>`, or
//! `✗ <requirement>: <what was found> — <what to do>`), and the agent runs the same checks at
//! start, so that a node without what weir needs is told so in its terms, not by a verifier log or
//! an errno from deep in the datapath.
//!
//! The node: the kernel release (the floor in `datapath::kernel`), every BPF program and map type
//! weir's object uses, probed by loading a trivial one (and whether bpf() is allowed at all), the
//! cgroup v2 hierarchy the socket programs attach to, bpffs at the pin root, the primary CNI
//! network config weir chains into, and the directory of ztunnel's socket. The cluster, when the
//! agent follows one: the API server answers, the Node is readable, and every access in
//! [`REQUIRED_ACCESS`] is granted, each asked with a SelfSubjectAccessReview.
//!
//! At start ([`before_start`]) an unmet requirement that only the operator can meet stops the
//! agent, with its line, before anything is loaded. Two can be met later with no change by the
//! operator, and the agent goes on with a warning: an API server it
//! cannot reach yet (its watches retry until it answers), and no primary CNI config yet (the
//! installer waits for the primary CNI to write one). A denied access refuses: it stays denied
//! until someone grants it, and an agent without it would half work.
use std::{
    fmt,
    future::Future,
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Result};
use k8s_openapi::api::{
    authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec},
    core::v1::Node,
};
use kube::{
    api::{Api, PostParams},
    Client,
};
use tracing::warn;

use crate::{
    cli::RunArgs,
    cluster::{self, ClusterConfig},
    config::{AgentConfig, SourceConfig},
    datapath::{
        cgroup2_root,
        kernel::{BpfType, Kernel, BPF_FEATURES, OLDEST, OLDEST_BECAUSE},
        mounts::{self, PinRootFs, DEFAULT_BPF_FS},
        DatapathConfig,
    },
    install::{self, NoNetworkConfig},
    policy::OwnPods,
};

/// How long one request to the API server may take before it counts as unanswered.
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// One requirement and what was found of it.
#[derive(Clone, Debug)]
pub struct Finding {
    pub requirement: String,
    pub found: String,
    /// What to do about it; `None` when the requirement is met.
    pub remedy: Option<String>,
    /// Unmet now, but met later with no change by the operator: the agent starts and waits.
    pub passes_later: bool,
}

impl Finding {
    fn met(requirement: impl Into<String>, found: impl Into<String>) -> Self {
        Self {
            requirement: requirement.into(),
            found: found.into(),
            remedy: None,
            passes_later: false,
        }
    }

    fn unmet(
        requirement: impl Into<String>,
        found: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Self {
        Self {
            remedy: Some(remedy.into()),
            ..Self::met(requirement, found)
        }
    }

    fn pending(
        requirement: impl Into<String>,
        found: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Self {
        Self {
            passes_later: true,
            ..Self::unmet(requirement, found, remedy)
        }
    }

    pub fn is_met(&self) -> bool {
        self.remedy.is_none()
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.remedy {
            None => write!(f, "✓ {}: {}", self.requirement, self.found),
            Some(remedy) => write!(f, "✗ {}: {} — {remedy}", self.requirement, self.found),
        }
    }
}

/// What is checked: the paths and the cluster the agent is given.
#[derive(Clone, Debug)]
pub struct CheckConfig {
    pub pin_root: PathBuf,
    /// `--cgroup`; `None`: the cgroup2 mount's root.
    pub cgroup: Option<PathBuf>,
    pub cni_net_dir: PathBuf,
    pub zds_socket: PathBuf,
    /// The cluster the agent follows, and its own DaemonSet there; `None`: a node without an API
    /// server (a policy file), whose checks are the node's alone.
    pub cluster: Option<(ClusterConfig, OwnPods)>,
}

impl CheckConfig {
    /// What `weir-agent run` with these flags needs; without --node-name or --policy-file (which
    /// `run` requires), the node's part alone.
    pub fn for_run(args: RunArgs, datapath: DatapathConfig) -> Result<Self> {
        if args.node_name.is_none() && args.policy_file.is_none() {
            return Ok(Self {
                pin_root: datapath.pin_root,
                cgroup: datapath.cgroup,
                cni_net_dir: args.cni_dirs.cni_net_dir,
                zds_socket: args.zds_socket,
                cluster: None,
            });
        }
        Ok(Self::of(&args.config(datapath)?))
    }

    /// What the agent configured by `config` needs.
    pub fn of(config: &AgentConfig) -> Self {
        Self {
            pin_root: config.datapath.pin_root.clone(),
            cgroup: config.datapath.cgroup.clone(),
            cni_net_dir: config.cni_net_dir.clone(),
            zds_socket: config.zds_socket.clone(),
            cluster: match &config.source {
                SourceConfig::Cluster(cluster) => {
                    Some((cluster.clone(), config.policy.own.clone()))
                }
                SourceConfig::File(_) => None,
            },
        }
    }
}

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

/// At start: stops with the lines of every unmet requirement the operator has to meet, and warns
/// about those that can be met later (see the module's comment).
pub async fn before_start(config: &CheckConfig) -> Result<()> {
    let mut refused = Vec::new();
    for finding in all(config).await.iter().filter(|finding| !finding.is_met()) {
        if finding.passes_later {
            warn!("{finding}");
        } else {
            refused.push(finding.to_string());
        }
    }
    if !refused.is_empty() {
        bail!(
            "this node lacks what weir needs (`weir-agent check` lists every requirement):\n{}",
            refused.join("\n")
        );
    }
    Ok(())
}

/// `weir-agent check`: prints every finding; fails when one is unmet.
pub async fn print(config: &CheckConfig) -> Result<()> {
    let findings = all(config).await;
    for finding in &findings {
        println!("{finding}");
    }
    let unmet = findings.iter().filter(|finding| !finding.is_met()).count();
    if unmet > 0 {
        bail!("{unmet} requirement(s) not met");
    }
    Ok(())
}

/// Every finding: the node's, then the cluster's.
pub async fn all(config: &CheckConfig) -> Vec<Finding> {
    let mut findings = node(config);
    if let Some((cluster, own)) = &config.cluster {
        findings.extend(cluster_findings(cluster, own).await);
    }
    findings
}

/// Everything the node itself must have.
fn node(config: &CheckConfig) -> Vec<Finding> {
    let mut findings = vec![kernel_release()];
    findings.extend(bpf_features());
    findings.push(cgroup(config.cgroup.as_deref()));
    findings.push(bpffs(&config.pin_root));
    findings.push(cni_config(&config.cni_net_dir));
    findings.push(zds_socket_dir(&config.zds_socket));
    findings
}

fn kernel_release() -> Finding {
    let requirement = format!("Linux {}.{} or later", OLDEST.0, OLDEST.1);
    let upgrade = format!("boot the node with {requirement}, for {OLDEST_BECAUSE}");
    match Kernel::read() {
        Ok(kernel) if kernel.is_supported() => Finding::met(requirement, kernel.release),
        Ok(kernel) => Finding::unmet(requirement, kernel.release, upgrade),
        Err(error) => Finding::unmet(requirement, format!("{error:#}"), upgrade),
    }
}

/// Whether bpf() may be used, then one line per program and map type (none when it may not:
/// every probe would only say the same).
fn bpf_features() -> Vec<Finding> {
    let requirement = "bpf() allowed";
    let probed: Vec<_> = BPF_FEATURES
        .iter()
        .map(|feature| (feature, feature.probe()))
        .collect();
    let refused = probed.iter().find_map(|(_, probe)| match probe {
        Err(error) if error.raw_os_error() == Some(libc::EPERM) => Some(error),
        _ => None,
    });
    if let Some(error) = refused {
        let found = format!("refused: {error}");
        let remedy = "run the agent as root, in a privileged container (or with CAP_BPF, \
                      CAP_NET_ADMIN and CAP_SYS_ADMIN)";
        return vec![Finding::unmet(requirement, found, remedy)];
    }
    let mut findings = vec![Finding::met(
        requirement,
        "test programs load and test maps are created",
    )];
    for (feature, probe) in probed {
        let kind = match feature.kind {
            BpfType::Program(_) => "program",
            BpfType::Map(_) => "map",
        };
        let requirement = format!("BPF {kind} type {} ({})", feature.name, feature.used_for);
        let remedy = format!("boot the node with a kernel built with {}", feature.kconfig);
        findings.push(match probe {
            Ok(true) => Finding::met(requirement, "supported"),
            Ok(false) => Finding::unmet(requirement, "not supported by this kernel", remedy),
            Err(error) => Finding::unmet(requirement, format!("probing failed: {error}"), remedy),
        });
    }
    findings
}

fn cgroup(configured: Option<&Path>) -> Finding {
    let requirement = "cgroup v2";
    let unified = "boot the node with the unified cgroup hierarchy \
                   (systemd.unified_cgroup_hierarchy=1), or mount cgroup2";
    let root = cgroup2_root();
    match (configured, root) {
        (None, Ok(root)) => Finding::met(requirement, format!("mounted at {}", root.display())),
        (None, Err(error)) => Finding::unmet(requirement, format!("{error:#}"), unified),
        (Some(path), _) if mounts::is_cgroup2(path) => Finding::met(
            requirement,
            format!("--cgroup {} is a cgroup2 directory", path.display()),
        ),
        (Some(path), root) => {
            let found = format!("--cgroup {} is not a cgroup2 directory", path.display());
            match root {
                Ok(root) => Finding::unmet(
                    requirement,
                    found,
                    format!(
                        "give --cgroup (WEIR_CGROUP) a directory under {}",
                        root.display()
                    ),
                ),
                Err(_) => Finding::unmet(requirement, found, unified),
            }
        }
    }
}

fn bpffs(pin_root: &Path) -> Finding {
    let requirement = format!("bpffs at the pin root {}", pin_root.display());
    match mounts::pin_root_fs(pin_root) {
        PinRootFs::Bpffs(existing) => {
            Finding::met(requirement, format!("{} is on a bpffs", existing.display()))
        }
        PinRootFs::Unmounted if Path::new(DEFAULT_BPF_FS).is_dir() => Finding::met(
            requirement,
            format!("{DEFAULT_BPF_FS} is no bpffs yet; the agent mounts one there"),
        ),
        PinRootFs::Unmounted => Finding::unmet(
            requirement,
            format!("{DEFAULT_BPF_FS} does not exist"),
            "boot the node with a kernel built with CONFIG_BPF_SYSCALL, and sysfs at /sys",
        ),
        PinRootFs::Other(existing) => Finding::unmet(
            requirement,
            format!("{} is not on a bpffs", existing.display()),
            format!(
                "give --pin-root (WEIR_PIN_ROOT) a directory under {DEFAULT_BPF_FS}, mounted \
                 from the host's in a pod"
            ),
        ),
    }
}

fn cni_config(net_dir: &Path) -> Finding {
    let requirement = "primary CNI network config";
    match install::active_config(net_dir) {
        Ok((file, _)) => Finding::met(requirement, file.display().to_string()),
        Err(error) if error.is::<NoNetworkConfig>() => Finding::pending(
            requirement,
            match net_dir.is_dir() {
                true => format!("none in {}", net_dir.display()),
                false => format!("{} does not exist", net_dir.display()),
            },
            "install the cluster's CNI (Calico, Cilium, flannel, ...): it writes one; or give \
             --cni-net-dir (WEIR_CNI_NET_DIR) the directory the runtime reads",
        ),
        Err(error) => Finding::unmet(
            requirement,
            format!("{error:#}"),
            "give --cni-net-dir (WEIR_CNI_NET_DIR) the directory the runtime reads",
        ),
    }
}

/// ztunnel connects to the socket the agent serves, which the agent binds (creating its
/// directory): the directory must be there or be creatable.
fn zds_socket_dir(socket: &Path) -> Finding {
    let requirement = format!("directory of the ZDS socket {}", socket.display());
    let dir = socket.parent().unwrap_or(Path::new("/"));
    let existing = dir.ancestors().find(|path| path.exists()).unwrap_or(dir);
    let writable = |path: &Path| nix::unistd::access(path, nix::unistd::AccessFlags::W_OK);
    let remedy = "give --zds-socket (WEIR_ZDS_SOCKET) the socket ztunnel connects to, in a \
                  writable directory (in a pod, ztunnel's directory mounted from the host)";
    if !existing.is_dir() {
        return Finding::unmet(
            requirement,
            format!("{} is not a directory", existing.display()),
            remedy,
        );
    }
    match writable(existing) {
        Ok(()) if existing == dir => Finding::met(requirement, format!("{} exists", dir.display())),
        Ok(()) => Finding::met(
            requirement,
            format!(
                "the agent creates {} (in {})",
                dir.display(),
                existing.display()
            ),
        ),
        Err(errno) => Finding::unmet(
            requirement,
            format!(
                "{} is not writable: {}",
                existing.display(),
                io::Error::from(errno)
            ),
            remedy,
        ),
    }
}

/// What the agent needs of the cluster `config` names, as the node `own` tells.
async fn cluster_findings(config: &ClusterConfig, own: &OwnPods) -> Vec<Finding> {
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
                findings.push(granted(&client, access, own).await);
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

/// Whether every verb of `access` is granted, each asked with a SelfSubjectAccessReview.
async fn granted(client: &Client, access: &Access, own: &OwnPods) -> Finding {
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
            Err(answer @ Unanswered::Refused(_)) => {
                return Finding::unmet(
                    requirement,
                    format!("the access review failed: {answer}"),
                    "let the agent's service account create selfsubjectaccessreviews \
                     (system:basic-user grants it by default)",
                )
            }
            Err(answer @ Unanswered::Unreachable(_)) => {
                return Finding::pending(
                    requirement,
                    answer.to_string(),
                    "make the API server reachable from the node; the agent keeps trying meanwhile",
                )
            }
        }
    }
    if denied.is_empty() {
        return Finding::met(requirement, "granted");
    }
    let role = match access.scope {
        AccessScope::Cluster => "ClusterRole".to_owned(),
        AccessScope::OwnDaemonSet => format!("Role in {}", own.namespace),
    };
    Finding::unmet(
        requirement,
        format!("{} denied", denied.join(", ")),
        format!(
            "grant it to the agent's service account: deploy/weir.yaml's {role} has every rule \
             weir needs"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_says_what_was_found_and_what_to_do() {
        assert_eq!(
            Finding::met("cgroup v2", "mounted at /sys/fs/cgroup").to_string(),
            "✓ cgroup v2: mounted at /sys/fs/cgroup"
        );
        assert_eq!(
            Finding::unmet("cgroup v2", "no cgroup2 mount", "boot with it").to_string(),
            "✗ cgroup v2: no cgroup2 mount — boot with it"
        );
    }
}
