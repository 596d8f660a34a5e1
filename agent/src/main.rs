//! weir-agent: the node agent binary.
use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use nix::sys::signal::{SigSet, Signal};
use tracing::info;
use weir_agent::datapath::{Datapath, DatapathConfig};

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
}

impl DatapathArgs {
    fn config(&self) -> DatapathConfig {
        DatapathConfig {
            pin_root: self.pin_root.clone(),
            cgroup: self.cgroup.clone(),
            node_netns: None,
            probe_bypass: !self.no_probe_bypass,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Load (or take over) the datapath and serve until SIGTERM/SIGINT; pods stay redirected
    /// after exit, and the next start takes over without a gap.
    Run,
    /// Remove weir's datapath from this node: unenroll every pod, detach, unpin.
    Uninstall,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // Blocked before any thread starts, so every thread inherits the mask and the signal waits
    // for `sigwait` instead of killing the process mid-operation.
    let termination = termination_signals();
    termination.thread_block()?;
    let datapath = Datapath::start(cli.datapath.config())?;
    match cli.command {
        Command::Run => {
            let signal = termination.wait()?;
            info!(%signal, "signal received");
            info!("stopping; the datapath stays in place");
            datapath.shutdown()
        }
        Command::Uninstall => datapath.uninstall(),
    }
}

fn termination_signals() -> SigSet {
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals
}
