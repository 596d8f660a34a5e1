//! What the node itself must have: the kernel release and the BPF features weir's object uses,
//! cgroup v2 and cgroups of their own for containers, bpffs at the pin root, the primary CNI
//! config, and the directory of ztunnel's socket.
use std::{io, path::Path};

use super::{CheckConfig, Finding};
use crate::{
    datapath::{
        cgroup2_root, cgroup_identity_of, istio_rules,
        kernel::{
            mounts::{self, PinRootFs, DEFAULT_BPF_FS},
            support::{BpfType, Kernel, BPF_FEATURES, OLDEST, OLDEST_BECAUSE},
        },
    },
    install::{self, NoNetworkConfig, Placement},
};

/// Everything the node itself must have.
pub(super) fn findings(config: &CheckConfig) -> Vec<Finding> {
    let mut findings = vec![kernel_release()];
    findings.extend(bpf_features());
    findings.push(cgroup(config.cgroup.as_deref()));
    findings.push(cgroups_of_their_own());
    findings.push(bpffs(&config.pin_root));
    // A standalone network needs none: Multus's directory holds only extra networks.
    if config.cni_placement.placement != Placement::Standalone {
        findings.push(cni_config(
            &config.cni_net_dir,
            &config.cni_placement.owned_file,
        ));
    }
    findings.push(zds_socket_dir(&config.zds_socket));
    findings.push(istio_cni_leftovers(&config.cni_net_dir));
    findings
}

/// What istio-cni's node agent leaves on a node weir took over: its plugin in a CNI config, its
/// plugin's kubeconfig, its probe SNAT in the node's netns (nf_tables or legacy chains, its
/// nftables table, ipsets).
/// Harmless to weir, which starts anyway, and removes the probe SNAT itself once the node is its
/// own; the operator removes the rest once istio-cni's agent is gone.
fn istio_cni_leftovers(net_dir: &Path) -> Finding {
    let requirement = "no istio-cni node agent leftovers";
    let mut found = Vec::new();
    for file in install::files::istio_cni_configs(net_dir) {
        found.push(format!("istio-cni's plugin in {}", file.display()));
    }
    let kubeconfig = net_dir.join(ISTIO_CNI_KUBECONFIG);
    if kubeconfig.exists() {
        found.push(kubeconfig.display().to_string());
    }
    match istio_rules::netfilter_leftovers() {
        Ok(objects) => found.extend(objects),
        Err(error) => found.push(format!(
            "(the node's netfilter rules cannot be read: {error})"
        )),
    }
    if found.is_empty() {
        return Finding::met(requirement, "none");
    }
    Finding::partly_unmet(
        requirement,
        found.join(", "),
        "once istio-cni's node agent is off this node (docs/install.md, Taking over from \
         istio-cni), delete its plugin's entry and kubeconfig file; weir's agent removes the \
         probe SNAT chains, table and ipsets itself once ztunnel is connected to it and every \
         ambient pod is its own (not with --hand-back-to-istio-cni)",
    )
}

/// The kubeconfig istio-cni's installer writes for its plugin, in the CNI net dir.
const ISTIO_CNI_KUBECONFIG: &str = "ZZZ-istio-cni-kubeconfig";

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

/// ztunnel's sockets are told from pods' by its cgroup, which must be its container's own. The
/// agent's own process stands for every container here: a runtime (or a hybrid hierarchy) that
/// left it in the hierarchy's root does the same to ztunnel, which is then refused.
fn cgroups_of_their_own() -> Finding {
    let requirement = "containers have cgroups (v2) of their own";
    let pid = std::process::id();
    let identity = cgroup2_root().and_then(|hierarchy| cgroup_identity_of(pid, &hierarchy));
    match identity {
        Ok(id) => Finding::met(
            requirement,
            format!("weir-agent (pid {pid}) is in a cgroup of its own (id {id})"),
        ),
        Err(error) => Finding::partly_unmet(
            requirement,
            format!("weir-agent: {error:#}; ztunnel will be refused, and ambient pods wait"),
            "boot the node with the unified cgroup hierarchy (systemd.unified_cgroup_hierarchy=1) \
             and a runtime that gives each container a cgroup v2 directory",
        ),
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

fn cni_config(net_dir: &Path, owned_file: &str) -> Finding {
    let requirement = "primary CNI network config";
    match install::primary_config(net_dir, owned_file) {
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
