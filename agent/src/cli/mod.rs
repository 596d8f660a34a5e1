//! `weir-agent`'s command line: its subcommands and flags (each with its environment variable),
//! turned into the agent's configuration. Defined here, in the library, so that the tests and
//! [`markdown`] (docs/configuration.md) read the same definition the binary parses.
use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::{bail, Result};
use clap::{ArgAction, Parser, Subcommand, ValueEnum};
use weir_cni::protocol::{DEFAULT_AGENT_SOCKET, DEFAULT_VERDICT_CACHE};
use weir_common::{PROBE_SOURCE_V4, PROBE_SOURCE_V6};

pub mod istio;
mod reference;

pub use reference::markdown;

use crate::{
    bug_report,
    check::CheckConfig,
    cluster::{
        repair::{BrokenPodAction, BrokenPods},
        ClusterConfig,
    },
    config::{AgentConfig, SourceConfig},
    datapath::{DatapathConfig, ProbeSource},
    explain::{self, ExplainArgs},
    inspect,
    install::{
        CniPlacement, InstallConfig, Placement, ServiceAccount, DEFAULT_OWNED_CONFIG_FILE,
        DEFAULT_STANDALONE_CONFIG_FILE, PLUGIN_NAME,
    },
    logging::LogFormat,
    policy::{
        enablement::{default_selectors, parse_selectors, EnablementSelector},
        OwnPods, PolicyConfig,
    },
    trace::{self, TraceArgs, TraceSocketArg},
};

#[derive(Parser)]
#[command(
    name = "weir-agent",
    version,
    about = "weir: Istio's node agent with eBPF instead of iptables: ambient pods to ztunnel, sidecar pods to their own proxy"
)]
pub struct Cli {
    #[command(flatten)]
    pub datapath: DatapathArgs,
    /// How log lines are written to stderr: `plain` text (coloured only on a terminal), or
    /// `json`, one object per line with the fields of the event and of the pod it concerns
    /// (`namespace`, `name`, `uid`). The level is set by RUST_LOG.
    #[arg(
        long,
        env = "LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Plain,
        global = true
    )]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Args)]
pub struct DatapathArgs {
    /// bpffs directory for weir's pinned maps and links.
    #[arg(
        long,
        env = "WEIR_PIN_ROOT",
        default_value = "/sys/fs/bpf/weir",
        global = true
    )]
    pub pin_root: PathBuf,
    /// cgroup v2 directory to attach the socket programs to (default: the cgroup2 mount root).
    #[arg(long, env = "WEIR_CGROUP", global = true)]
    pub cgroup: Option<PathBuf>,
    /// Do not give node-local TCP to enrolled pods (kubelet probes) the probe source address.
    #[arg(long, env = "WEIR_NO_PROBE_BYPASS", global = true)]
    pub no_probe_bypass: bool,
    /// The IPv4 source of the node's probes to enrolled pods, which the pods let through: an
    /// address the node does not otherwise use (weir makes it local). istio-cni's
    /// HOST_PROBE_SNAT_IP.
    #[arg(long, env = "HOST_PROBE_SNAT_IP", default_value_t = PROBE_SOURCE_V4.into(), global = true)]
    pub probe_source_ipv4: Ipv4Addr,
    /// The IPv6 source of the node's probes (istio-cni's HOST_PROBE_SNAT_IPV6).
    #[arg(long, env = "HOST_PROBE_SNAT_IPV6", default_value_t = PROBE_SOURCE_V6.into(), global = true)]
    pub probe_source_ipv6: Ipv6Addr,
    /// Give the probe source only to connections from this cgroup v2, as kubelet's process shows
    /// it in /proc/<pid>/cgroup (e.g. `/system.slice/kubelet.service`): other node processes'
    /// connections to pods are then captured like any other. The path is followed: a restarted
    /// kubelet's new cgroup there gets it within a second. Default: every TCP connection from
    /// the node's network namespace to a pod's address.
    #[arg(long, env = "WEIR_PROBE_SOURCE_CGROUP", global = true)]
    pub probe_source_cgroup: Option<String>,
    /// Log the eBPF programs' decisions (redirects, inbound assignments and drops, original
    /// destinations, probe sources) at debug level, target `weir_ebpf`. Costs a record per
    /// decision: for debugging, not for production.
    #[arg(long, env = "WEIR_BPF_LOG", global = true)]
    pub bpf_log: bool,
}

impl DatapathArgs {
    pub fn config(&self) -> DatapathConfig {
        DatapathConfig {
            pin_root: self.pin_root.clone(),
            cgroup: self.cgroup.clone(),
            node_netns: None,
            probe_bypass: !self.no_probe_bypass,
            probe_source: ProbeSource {
                v4: self.probe_source_ipv4,
                v6: self.probe_source_ipv6,
                cgroup: self.probe_source_cgroup.clone(),
            },
            bpf_log: self.bpf_log,
        }
    }
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// Ambient policy for a node without an API server: namespaces' and pods' labels and
    /// annotations (JSON, see the README). Re-read on every pod event. Without it the agent
    /// follows the cluster's API server.
    #[arg(long, env = "WEIR_POLICY_FILE")]
    pub policy_file: Option<PathBuf>,
    /// kubeconfig for the API server (default: the in-cluster service account).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name: the agent follows the pods with this `spec.nodeName`. Required without
    /// --policy-file.
    #[arg(long, env = "WEIR_NODE_NAME")]
    pub node_name: Option<String>,
    /// This agent's pod (never enrolled; the reporting instance of its Events).
    #[arg(long, env = "WEIR_POD_NAME")]
    pub pod_name: Option<String>,
    /// This agent's namespace, where weir's DaemonSet runs.
    #[arg(long, env = "WEIR_POD_NAMESPACE", default_value = "istio-system")]
    pub pod_namespace: String,
    /// weir's DaemonSet: its pods are never enrolled, and on SIGTERM weir stays on the node
    /// while it exists and still selects the node (an upgrade).
    #[arg(long, env = "WEIR_DAEMONSET_NAME", default_value = "weir")]
    pub daemonset_name: String,
    /// Time between full reconcile passes over the node's pods, e.g. `60s`, `5m` (a bare number
    /// is seconds). Changes are acted on as they come; the pass catches whatever was missed and
    /// retries failed pods.
    #[arg(long, env = "WEIR_RESYNC_INTERVAL", default_value = "60s", value_parser = interval)]
    pub resync_interval: Duration,
    /// What becomes of a pod found running without weir's redirection (it started while
    /// weir-cni was missing from the chain: an ambient pod, or a sidecar pod whose
    /// istio-validation init container exited with 126) when it is not enrolled in place: left
    /// to the retries, deleted (its owner recreates it), or labelled
    /// cni.istio.io/uninitialized=true. As istio-cni's repair controller (repairPods,
    /// deletePods, labelPods); none is istio's default.
    #[arg(long, env = "WEIR_REPAIR_BROKEN_PODS", value_enum, default_value_t = BrokenPodAction::None)]
    pub repair_broken_pods: BrokenPodAction,
    /// Enroll a broken sidecar pod in place, once: its istio-validation init container found no
    /// redirection (exit code 126) and passes on its next restart. As istio-cni's repairPods
    /// (REPAIR_REPAIR_PODS, on in istio's chart). When false, or when the repair fails,
    /// --repair-broken-pods applies to the pod. Ambient pods are always enrolled live.
    #[arg(long, env = "REPAIR_REPAIR_PODS", default_value_t = true, action = ArgAction::Set)]
    pub repair_pods: bool,
    /// Which pods are ambient: a list of {podSelector, namespaceSelector} label selectors, YAML
    /// or JSON, as istio's AMBIENT_ENABLEMENT_SELECTOR (default: istio's rule on the
    /// `istio.io/dataplane-mode` labels).
    // One value holding the whole list: the fully qualified Vec keeps clap from taking it for
    // a repeated flag.
    #[arg(long, env = "WEIR_AMBIENT_ENABLEMENT_SELECTOR", value_parser = selectors)]
    pub ambient_enablement_selector: Option<::std::vec::Vec<EnablementSelector>>,
    /// Namespaces never enrolled.
    #[arg(
        long,
        env = "WEIR_EXCLUDE_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub exclude_namespaces: Vec<String>,
    /// The Istio system namespace (ztunnel's own pods are never enrolled).
    #[arg(long, env = "WEIR_SYSTEM_NAMESPACE", default_value = "istio-system")]
    pub system_namespace: String,
    /// Node default for DNS capture (`ambient.istio.io/dns-capture` overrides it per pod).
    #[arg(long, env = "WEIR_DNS_CAPTURE", default_value_t = true, action = ArgAction::Set)]
    pub dns_capture: bool,
    /// Unix socket the CNI plugin talks to.
    #[arg(long, env = "WEIR_CNI_SOCKET", default_value = DEFAULT_AGENT_SOCKET)]
    pub cni_socket: PathBuf,
    /// Where the plugin finds the last known ambient verdicts while the agent and the API server
    /// are both away.
    #[arg(long, env = "WEIR_VERDICT_CACHE", default_value = DEFAULT_VERDICT_CACHE)]
    pub verdict_cache: PathBuf,
    #[command(flatten)]
    pub state: StateFileArg,
    #[command(flatten)]
    pub trace: TraceSocketArg,
    /// ZDS socket ztunnel connects to.
    #[arg(
        long,
        env = "WEIR_ZDS_SOCKET",
        default_value = "/var/run/ztunnel/ztunnel.sock"
    )]
    pub zds_socket: PathBuf,
    #[command(flatten)]
    pub cni_dirs: CniDirs,
    /// The weir-cni binary to install (default: next to this executable).
    #[arg(long, env = "WEIR_CNI_PLUGIN")]
    pub cni_plugin: Option<PathBuf>,
    /// Log file for the plugin on the host (default: its stderr, which the runtime logs).
    #[arg(long, env = "WEIR_CNI_PLUGIN_LOG")]
    pub cni_plugin_log: Option<PathBuf>,
    /// Address for /healthz and /readyz, and nothing else: every pod can reach it.
    #[arg(long, env = "WEIR_HEALTH_ADDR", default_value = "0.0.0.0:8000")]
    pub health_addr: SocketAddr,
    /// Address for /metrics (per-pod series included), and /healthz and /readyz.
    #[arg(long, env = "WEIR_METRICS_ADDR", default_value = "0.0.0.0:15014")]
    pub metrics_addr: SocketAddr,
    /// Address for /logging, which shows and changes the log filter: keep it on loopback, where
    /// only someone on the node reaches it.
    #[arg(long, env = "WEIR_ADMIN_ADDR", default_value = "127.0.0.1:15099")]
    pub admin_addr: SocketAddr,
    /// On exit, remove weir from the node (plugin, config entry, datapath) instead of leaving it
    /// in place for the next agent (an upgrade or restart).
    #[arg(long, env = "WEIR_UNINSTALL_ON_EXIT")]
    pub uninstall_on_exit: bool,
    /// When weir leaves the node (as with --uninstall-on-exit, or its DaemonSet no longer
    /// selecting the node), hand the ambient pods to istio-cni's node agent starting there
    /// instead of unenrolling them: wait up to this long (e.g. `90s`; below the pod's
    /// terminationGracePeriodSeconds) for istio-cni's plugin in the CNI config and istio's
    /// in-pod rules in each pod, then leave. See docs/install.md, "Handing a node back".
    #[arg(long, env = "WEIR_HAND_BACK_TO_ISTIO_CNI", value_parser = interval)]
    pub hand_back_to_istio_cni: Option<Duration>,
    /// How often to look for enrolled pods whose DEL never came (no process and no mount holds
    /// their netns any more) and unenroll them, e.g. `60s`, `5m` (a bare number is seconds).
    #[arg(long, env = "WEIR_ORPHAN_SWEEP_INTERVAL", default_value = "60s", value_parser = interval)]
    pub orphan_sweep_interval: Duration,
}

/// The agent's state file: `run` keeps it, `pods` reads it.
#[derive(clap::Args)]
pub struct StateFileArg {
    /// Where the agent remembers enrolled pods for its next start (tmpfs: gone at reboot, as the
    /// pods are).
    #[arg(
        long,
        env = "WEIR_STATE_FILE",
        default_value = "/var/run/weir/pods.json"
    )]
    pub state_file: PathBuf,
}

#[derive(clap::Args)]
pub struct PodsArgs {
    #[command(flatten)]
    pub state: StateFileArg,
    /// How the pods are printed.
    #[arg(long, short, value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Output {
    /// A table, one line per pod.
    Text,
    /// The table with the netns path and the rerouted interfaces besides.
    Wide,
    /// One JSON array of objects (fields below).
    Json,
    /// One YAML sequence of the same objects.
    Yaml,
}

/// Where the node's CNI plugins and configuration live.
#[derive(clap::Args)]
pub struct CniDirs {
    /// Host CNI binary directory.
    #[arg(long, env = "WEIR_CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// Host CNI network configuration directory.
    #[arg(long, env = "WEIR_CNI_NET_DIR", default_value = "/etc/cni/net.d")]
    pub cni_net_dir: PathBuf,
    /// Write the chain (the primary CNI's config with weir-cni appended) to a file of weir's own
    /// that the runtime loads first, instead of appending weir-cni to the primary's file: a
    /// primary CNI rewriting its file cannot then drop weir, even while no agent runs (as
    /// istio-cni's ISTIO_OWNED_CNI_CONFIG).
    #[arg(long, env = "WEIR_OWNED_CNI_CONFIG")]
    pub owned_cni_config: bool,
    /// The name of that file in the CNI net dir: a `.conflist` sorting before the primary's.
    #[arg(
        long,
        env = "WEIR_OWNED_CNI_CONFIG_FILENAME",
        default_value = DEFAULT_OWNED_CONFIG_FILE,
        value_parser = config_file(".conflist")
    )]
    pub owned_cni_config_filename: String,
    /// Chain weir-cni after the primary CNI (true), or write it as a network of its own, named
    /// istio-cni, that Multus runs as an extra attachment of the pods that name it in
    /// k8s.v1.cni.cncf.io/networks (false; as istio-cni's CHAINED_CNI_PLUGIN=false on
    /// OpenShift).
    #[arg(long, env = "WEIR_CHAINED_CNI_PLUGIN", default_value_t = true, action = ArgAction::Set)]
    pub chained_cni_plugin: bool,
    /// The name of the standalone network config in the CNI net dir: a `.conf` sorting after the
    /// files there.
    #[arg(
        long,
        env = "WEIR_STANDALONE_CNI_CONFIG_FILENAME",
        default_value = DEFAULT_STANDALONE_CONFIG_FILE,
        value_parser = config_file(".conf")
    )]
    pub standalone_cni_config_filename: String,
}

impl CniDirs {
    /// Where weir-cni goes, from the flags; an owned chain is a chain, so it is refused with a
    /// standalone plugin.
    pub fn placement(&self) -> Result<CniPlacement> {
        let placement = match (self.chained_cni_plugin, self.owned_cni_config) {
            (true, false) => Placement::Chained,
            (true, true) => Placement::Owned,
            (false, false) => Placement::Standalone,
            (false, true) => bail!(
                "--owned-cni-config (WEIR_OWNED_CNI_CONFIG) puts weir-cni in a chain of its own, \
                 and --chained-cni-plugin=false (WEIR_CHAINED_CNI_PLUGIN) in no chain: choose one"
            ),
        };
        Ok(CniPlacement {
            placement,
            owned_file: self.owned_cni_config_filename.clone(),
            standalone_file: self.standalone_cni_config_filename.clone(),
        })
    }

    /// What the installer needs to find, write and remove weir's files; `plugin_binary` and
    /// `plugin_config` are empty: enough to uninstall.
    pub fn install_config(&self) -> Result<InstallConfig> {
        Ok(InstallConfig {
            cni_bin_dir: self.cni_bin_dir.clone(),
            cni_net_dir: self.cni_net_dir.clone(),
            plugin_binary: PathBuf::new(),
            plugin_name: PLUGIN_NAME.into(),
            plugin_config: serde_json::Value::Null,
            placement: self.placement()?,
            service_account: None,
        })
    }
}

/// A file name in the CNI net dir that libcni loads, by its extension.
fn config_file(extension: &'static str) -> impl Fn(&str) -> Result<String, String> + Clone {
    move |name: &str| {
        if name.contains('/') || name.starts_with('.') || !name.ends_with(extension) {
            return Err(format!(
                "{name:?} must be a file name (no directory) ending in {extension}"
            ));
        }
        Ok(name.to_owned())
    }
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the node agent until SIGTERM/SIGINT.
    Run(Box<RunArgs>),
    /// Remove weir from this node: weir-cni from the CNI config and bin dir, then the datapath
    /// (every pod unenrolled, programs detached, pins removed).
    Uninstall(CniDirs),
    /// List the pods weir holds on this node, from the pinned maps (--pin-root) and the agent's
    /// state file, sorted by namespace/name. Read-only: a running agent is not disturbed. Pods in
    /// the maps without a record show with an unknown name; records with no map entry are
    /// orphans (enrolled as far as the agent knows, but not redirected).
    #[command(after_long_help = inspect::JSON_FIELDS)]
    Pods(PodsArgs),
    /// Check this node, and the cluster when given --node-name, for everything weir needs: one
    /// line per requirement, `✓` with what was found, or `✗` with what was found and what to do.
    /// Takes `run`'s flags: a `run` command line with `check` instead checks what that agent
    /// needs (the agent itself runs the same checks at start). Exits with 1 when a requirement
    /// is not met. Changes nothing.
    Check(Box<RunArgs>),
    /// Stream the programs' redirect decisions live from the agent on this node: each
    /// connection sent to ztunnel, let through, refused or dropped, with its pod, tuple and
    /// verdict. Safe next to a running agent; several readers may trace at once, and tracing
    /// costs the datapath nothing once the last one leaves. Stops on Ctrl-C.
    #[command(after_long_help = trace::verdicts_help())]
    Trace(TraceArgs),
    /// Explain a pod: whether it is captured and why (the state file, the pinned maps, and the
    /// labels and annotations that decide it, from --policy-file or the API server), its mode and options, and with
    /// --to or --from what one connection would meet, predicted from the map entries the
    /// programs read: the verdict `weir-agent trace` would record, and the rule that gives it.
    /// Read-only: a running agent is not disturbed. Takes `run`'s flags, as `check` does.
    #[command(after_long_help = explain::JSON_FIELDS)]
    Explain(Box<ExplainArgs>),
    /// Write one archive (.tar.gz) with what a bug report about this node needs: weir's version
    /// and the kernel, `check`'s and `pods`' output, the running agent's metrics and last log
    /// lines, weir's pinned maps (entries in hex), programs and pins, and the CNI configuration.
    /// Credentials never go in. Takes `run`'s flags, as `check` does, so that in weir's pod it reads what the agent
    /// was given. A part that cannot be collected is named, with why, in errors.txt.
    BugReport(Box<BugReportArgs>),
    /// Print a completion script for this command line, e.g.
    /// `weir-agent completion bash > /etc/bash_completion.d/weir-agent`.
    #[command(alias = "completions")]
    Completion {
        /// The shell the script is for.
        shell: clap_complete::Shell,
    },
}

#[derive(clap::Args)]
pub struct BugReportArgs {
    /// Where the archive is written; `-` writes it to stdout, e.g.
    /// `kubectl exec -n istio-system ds/weir -- weir-agent bug-report -o - > report.tar.gz`.
    #[arg(long, short, default_value = "weir-bug-report.tar.gz")]
    pub output: PathBuf,
    #[command(flatten)]
    pub run: RunArgs,
}

impl BugReportArgs {
    /// What the report is made from: the paths and addresses `run` would use.
    pub fn sources(self, datapath: DatapathConfig) -> Result<bug_report::Sources> {
        let run = self.run;
        Ok(bug_report::Sources {
            pin_root: datapath.pin_root.clone(),
            state_file: run.state.state_file.clone(),
            cni_net_dir: run.cni_dirs.cni_net_dir.clone(),
            metrics_addr: run.metrics_addr,
            admin_addr: run.admin_addr,
            check: run.check_config(datapath)?,
        })
    }
}

impl RunArgs {
    /// What `weir-agent run` with these flags needs; without --node-name or --policy-file (which
    /// `run` requires), the node's part alone.
    pub fn check_config(self, datapath: DatapathConfig) -> Result<CheckConfig> {
        if self.node_name.is_none() && self.policy_file.is_none() {
            return Ok(CheckConfig {
                pin_root: datapath.pin_root,
                cgroup: datapath.cgroup,
                cni_placement: self.cni_dirs.placement()?,
                cni_net_dir: self.cni_dirs.cni_net_dir,
                zds_socket: self.zds_socket,
                cluster: None,
            });
        }
        Ok(CheckConfig::of(&self.config(datapath)?))
    }

    /// The node-wide settings of the ambient and sidecar rules.
    pub fn policy(&self) -> PolicyConfig {
        PolicyConfig {
            exclude_namespaces: self.exclude_namespaces.clone(),
            system_namespace: self.system_namespace.clone(),
            dns_capture: self.dns_capture,
            enablement: self
                .ambient_enablement_selector
                .clone()
                .unwrap_or_else(default_selectors),
            own: OwnPods {
                namespace: self.pod_namespace.clone(),
                daemonset: self.daemonset_name.clone(),
                pod_name: self.pod_name.clone(),
            },
        }
    }

    /// The agent's configuration from these flags and the datapath's.
    pub fn config(self, datapath: DatapathConfig) -> Result<AgentConfig> {
        // The plugin gets the agent's own credentials, as istio-cni's does: in a pod that
        // follows the cluster with its service account.
        let in_pod = self.policy_file.is_none() && self.kubeconfig.is_none();
        let service_account = in_pod.then(ServiceAccount::in_cluster).flatten();
        let policy = self.policy();
        let source = match (self.policy_file, self.node_name) {
            (Some(file), _) => SourceConfig::File(file),
            (None, Some(node_name)) => SourceConfig::Cluster(ClusterConfig {
                kubeconfig: self.kubeconfig,
                node_name,
                resync_interval: self.resync_interval,
                broken_pods: BrokenPods {
                    repair_in_place: self.repair_pods,
                    action: self.repair_broken_pods,
                },
            }),
            (None, None) => anyhow::bail!(
                "--node-name (WEIR_NODE_NAME) is required without --policy-file: \
                 the agent follows this node's pods"
            ),
        };
        Ok(AgentConfig {
            datapath,
            policy,
            source,
            cni_socket: self.cni_socket,
            verdict_cache: self.verdict_cache,
            state_file: self.state.state_file,
            trace_socket: self.trace.trace_socket,
            zds_socket: self.zds_socket,
            cni_placement: self.cni_dirs.placement()?,
            cni_bin_dir: self.cni_dirs.cni_bin_dir,
            cni_net_dir: self.cni_dirs.cni_net_dir,
            cni_plugin: match self.cni_plugin {
                Some(path) => path,
                None => std::env::current_exe()?.with_file_name("weir-cni"),
            },
            cni_plugin_log: self.cni_plugin_log,
            service_account,
            health_addr: self.health_addr,
            metrics_addr: self.metrics_addr,
            admin_addr: self.admin_addr,
            uninstall_on_exit: self.uninstall_on_exit,
            hand_back_to_istio_cni: self.hand_back_to_istio_cni,
            orphan_sweep_interval: self.orphan_sweep_interval,
        })
    }
}

fn selectors(text: &str) -> Result<Vec<EnablementSelector>, String> {
    parse_selectors(text).map_err(|error| format!("{error:#}"))
}

/// The one syntax of every interval flag: a humantime period (`60s`, `1m`, `500ms`), or a bare
/// number of seconds. Zero is refused: it would be a busy loop.
pub fn interval(text: &str) -> Result<Duration, String> {
    let period = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => humantime::parse_duration(text).map_err(|error| error.to_string())?,
    };
    if period.is_zero() {
        return Err("must be longer than zero".into());
    }
    Ok(period)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_are_humantime_or_bare_seconds() {
        assert_eq!(interval("60"), Ok(Duration::from_secs(60)));
        assert_eq!(interval("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(interval("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(interval("500ms"), Ok(Duration::from_millis(500)));
        assert!(interval("0").is_err());
        assert!(interval("0s").is_err());
        assert!(interval("soon").is_err());
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
