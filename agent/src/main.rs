//! weir-agent: the node agent binary.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use tokio::signal::unix::{signal, SignalKind};
use tracing::info;
use weir_agent::{
    app::PLUGIN_NAME,
    app::{self, AgentConfig, SourceConfig},
    cluster::{repair::BrokenPodAction, ClusterConfig},
    datapath::{Datapath, DatapathConfig},
    inspect,
    install::{InstallConfig, Installer, ServiceAccount},
    policy::{
        enablement::{default_selectors, parse_selectors, EnablementSelector},
        OwnPods, PolicyConfig,
    },
};
use weir_cni::protocol::{DEFAULT_AGENT_SOCKET, DEFAULT_VERDICT_CACHE};

#[derive(Parser)]
#[command(
    version,
    about = "weir: Istio ambient pod enrollment with eBPF instead of iptables"
)]
struct Cli {
    #[command(flatten)]
    datapath: DatapathArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct DatapathArgs {
    /// bpffs directory for weir's pinned maps and links.
    #[arg(
        long,
        env = "WEIR_PIN_ROOT",
        default_value = "/sys/fs/bpf/weir",
        global = true
    )]
    pin_root: PathBuf,
    /// cgroup v2 directory to attach the socket programs to (default: the cgroup2 mount root).
    #[arg(long, env = "WEIR_CGROUP", global = true)]
    cgroup: Option<PathBuf>,
    /// Do not give node-local TCP to enrolled pods (kubelet probes) the probe source address.
    #[arg(long, env = "WEIR_NO_PROBE_BYPASS", global = true)]
    no_probe_bypass: bool,
    /// Log the eBPF programs' decisions (redirects, inbound assignments and drops, original
    /// destinations, probe sources) at debug level, target `weir_ebpf`. Costs a record per
    /// decision: for debugging, not for production.
    #[arg(long, env = "WEIR_BPF_LOG", global = true)]
    bpf_log: bool,
}

impl DatapathArgs {
    fn config(&self) -> DatapathConfig {
        DatapathConfig {
            pin_root: self.pin_root.clone(),
            cgroup: self.cgroup.clone(),
            node_netns: None,
            probe_bypass: !self.no_probe_bypass,
            bpf_log: self.bpf_log,
        }
    }
}

#[derive(clap::Args)]
struct RunArgs {
    /// Ambient policy for a node without an API server: namespaces' and pods' labels and
    /// annotations (JSON, see the README). Re-read on every pod event. Without it the agent
    /// follows the cluster's API server.
    #[arg(long, env = "WEIR_POLICY_FILE")]
    policy_file: Option<PathBuf>,
    /// kubeconfig for the API server (default: the in-cluster service account).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// This node's name: the agent follows the pods with this `spec.nodeName`. Required without
    /// --policy-file.
    #[arg(long, env = "WEIR_NODE_NAME")]
    node_name: Option<String>,
    /// This agent's pod (never enrolled; the reporting instance of its Events).
    #[arg(long, env = "WEIR_POD_NAME")]
    pod_name: Option<String>,
    /// This agent's namespace, where weir's DaemonSet runs.
    #[arg(long, env = "WEIR_POD_NAMESPACE", default_value = "istio-system")]
    pod_namespace: String,
    /// weir's DaemonSet: its pods are never enrolled, and on SIGTERM weir stays on the node
    /// while it exists and still selects the node (an upgrade).
    #[arg(long, env = "WEIR_DAEMONSET_NAME", default_value = "weir")]
    daemonset_name: String,
    /// Seconds between full reconcile passes over the node's pods (changes are acted on as they
    /// come; the pass catches whatever was missed and retries failed pods).
    #[arg(long, env = "WEIR_RESYNC_INTERVAL", default_value_t = 60)]
    resync_interval: u64,
    /// What becomes of an ambient pod found running without weir's redirection (it started
    /// while weir-cni was missing from the chain) when it cannot be enrolled in place: left to
    /// the retries, deleted (its owner recreates it), or labelled cni.istio.io/uninitialized=true.
    /// As istio-cni's repair controller (repairPods, deletePods, labelPods); none is istio's default.
    #[arg(long, env = "WEIR_REPAIR_BROKEN_PODS", value_enum, default_value_t = BrokenPodAction::None)]
    repair_broken_pods: BrokenPodAction,
    /// Which pods are ambient: a list of {podSelector, namespaceSelector} label selectors, YAML
    /// or JSON, as istio's AMBIENT_ENABLEMENT_SELECTOR (default: istio's rule on the
    /// `istio.io/dataplane-mode` labels).
    #[arg(long, env = "WEIR_AMBIENT_ENABLEMENT_SELECTOR", value_parser = selectors)]
    ambient_enablement_selector: Option<Vec<EnablementSelector>>,
    /// Namespaces never enrolled.
    #[arg(
        long,
        env = "WEIR_EXCLUDE_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    exclude_namespaces: Vec<String>,
    /// The Istio system namespace (ztunnel's own pods are never enrolled).
    #[arg(long, env = "WEIR_SYSTEM_NAMESPACE", default_value = "istio-system")]
    system_namespace: String,
    /// Node default for DNS capture (`ambient.istio.io/dns-capture` overrides it per pod).
    #[arg(long, env = "WEIR_DNS_CAPTURE", default_value_t = true, action = clap::ArgAction::Set)]
    dns_capture: bool,
    /// Unix socket the CNI plugin talks to.
    #[arg(long, env = "WEIR_CNI_SOCKET", default_value = DEFAULT_AGENT_SOCKET)]
    cni_socket: PathBuf,
    /// Where the plugin finds the last known ambient verdicts while the agent and the API server
    /// are both away.
    #[arg(long, env = "WEIR_VERDICT_CACHE", default_value = DEFAULT_VERDICT_CACHE)]
    verdict_cache: PathBuf,
    #[command(flatten)]
    state: StateFileArg,
    /// ZDS socket ztunnel connects to.
    #[arg(
        long,
        env = "WEIR_ZDS_SOCKET",
        default_value = "/var/run/ztunnel/ztunnel.sock"
    )]
    zds_socket: PathBuf,
    #[command(flatten)]
    cni_dirs: CniDirs,
    /// The weir-cni binary to install (default: next to this executable).
    #[arg(long, env = "WEIR_CNI_PLUGIN")]
    cni_plugin: Option<PathBuf>,
    /// Log file for the plugin on the host (default: its stderr, which the runtime logs).
    #[arg(long, env = "WEIR_CNI_PLUGIN_LOG")]
    cni_plugin_log: Option<PathBuf>,
    /// Address for /healthz and /readyz.
    #[arg(long, env = "WEIR_HEALTH_ADDR", default_value = "0.0.0.0:8000")]
    health_addr: SocketAddr,
    /// Address for /metrics.
    #[arg(long, env = "WEIR_METRICS_ADDR", default_value = "0.0.0.0:15014")]
    metrics_addr: SocketAddr,
    /// On exit, remove weir from the node (plugin, config entry, datapath) instead of leaving it
    /// in place for the next agent (an upgrade or restart).
    #[arg(long, env = "WEIR_UNINSTALL_ON_EXIT")]
    uninstall_on_exit: bool,
    /// How often to look for enrolled pods whose DEL never came (no process and no mount holds
    /// their netns any more) and unenroll them, e.g. `60s`, `5m`.
    #[arg(long, env = "WEIR_ORPHAN_SWEEP_INTERVAL", default_value = "60s", value_parser = interval)]
    orphan_sweep_interval: Duration,
}

/// The agent's state file: `run` keeps it, `pods` reads it.
#[derive(clap::Args)]
struct StateFileArg {
    /// Where the agent remembers enrolled pods for its next start (tmpfs: gone at reboot, as the
    /// pods are).
    #[arg(
        long,
        env = "WEIR_STATE_FILE",
        default_value = "/var/run/weir/pods.json"
    )]
    state_file: PathBuf,
}

#[derive(clap::Args)]
struct PodsArgs {
    #[command(flatten)]
    state: StateFileArg,
    /// How the pods are printed.
    #[arg(long, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    /// A table, one line per pod.
    Text,
    /// One JSON array of objects (fields below).
    Json,
}

/// Where the node's CNI plugins and configuration live.
#[derive(clap::Args)]
struct CniDirs {
    /// Host CNI binary directory.
    #[arg(long, env = "WEIR_CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// Host CNI network configuration directory.
    #[arg(long, env = "WEIR_CNI_NET_DIR", default_value = "/etc/cni/net.d")]
    cni_net_dir: PathBuf,
}

#[derive(Subcommand)]
enum Command {
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
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // aya warns about the socket-storage map it has no type for, although it is allowed.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,aya::bpf=error"));
    if cli.datapath.bpf_log {
        // The programs' records arrive through the `log` crate at debug level.
        filter = filter.add_directive("weir_ebpf=debug".parse()?);
    }
    // `init` also installs tracing-log's LogTracer: `log` records (aya-log's) become events.
    // Colour only for a person at a terminal: `kubectl logs` and log files get plain text.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Run(args) => {
            let config = args.config(cli.datapath.config())?;
            tokio::runtime::Runtime::new()?.block_on(app::run(config, terminated()))
        }
        Command::Uninstall(dirs) => {
            Installer::new(InstallConfig {
                cni_bin_dir: dirs.cni_bin_dir,
                cni_net_dir: dirs.cni_net_dir,
                plugin_binary: PathBuf::new(),
                plugin_name: PLUGIN_NAME.into(),
                plugin_config: serde_json::Value::Null,
                service_account: None,
            })
            .uninstall()?;
            Datapath::start(cli.datapath.config())?.uninstall()
        }
        Command::Pods(args) => {
            let pods = inspect::pods(&cli.datapath.pin_root, &args.state.state_file)?;
            let shown = match args.output {
                Output::Text => inspect::table(&pods),
                Output::Json => inspect::json(&pods)?,
            };
            print!("{shown}");
            Ok(())
        }
    }
}

impl RunArgs {
    fn config(self, datapath: DatapathConfig) -> Result<AgentConfig> {
        // The plugin gets the agent's own credentials, as istio-cni's does: in a pod that
        // follows the cluster with its service account.
        let in_pod = self.policy_file.is_none() && self.kubeconfig.is_none();
        let service_account = in_pod.then(ServiceAccount::in_cluster).flatten();
        let source = match (self.policy_file, self.node_name) {
            (Some(file), _) => SourceConfig::File(file),
            (None, Some(node_name)) => SourceConfig::Cluster(ClusterConfig {
                kubeconfig: self.kubeconfig,
                node_name,
                resync_interval: std::time::Duration::from_secs(self.resync_interval),
                broken_pods: self.repair_broken_pods,
            }),
            (None, None) => anyhow::bail!(
                "--node-name (WEIR_NODE_NAME) is required without --policy-file: \
                 the agent follows this node's pods"
            ),
        };
        Ok(AgentConfig {
            datapath,
            policy: PolicyConfig {
                exclude_namespaces: self.exclude_namespaces,
                system_namespace: self.system_namespace,
                dns_capture: self.dns_capture,
                enablement: self
                    .ambient_enablement_selector
                    .unwrap_or_else(default_selectors),
                own: OwnPods {
                    namespace: self.pod_namespace,
                    daemonset: self.daemonset_name,
                    pod_name: self.pod_name,
                },
            },
            source,
            cni_socket: self.cni_socket,
            verdict_cache: self.verdict_cache,
            state_file: self.state.state_file,
            zds_socket: self.zds_socket,
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
            uninstall_on_exit: self.uninstall_on_exit,
            orphan_sweep_interval: self.orphan_sweep_interval,
        })
    }
}

fn selectors(text: &str) -> Result<Vec<EnablementSelector>, String> {
    parse_selectors(text).map_err(|error| format!("{error:#}"))
}

/// A period such as `60s`; zero is refused (it would be a busy loop).
fn interval(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(period) if period.is_zero() => Err("must be longer than zero".into()),
        Ok(period) => Ok(period),
        Err(error) => Err(error.to_string()),
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn terminated() {
    let mut terminate = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut interrupt = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = terminate.recv() => info!("SIGTERM"),
        _ = interrupt.recv() => info!("SIGINT"),
    }
}
