//! `kubectl weir`: weir-agent's node commands (`pods`, `trace`, `check`, `bug-report`,
//! `explain`) run in the weir pod on the node of a given pod, so that an operator names the pod
//! they care about instead of finding the node and weir's pod there by hand. The plugin finds
//! that pod through the API server (with the kubeconfig and context kubectl would use) and runs
//! the command with `kubectl exec`, whose output and exit status become the plugin's.
use std::{
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{bail, Result};
use clap::{Args, CommandFactory, Parser, Subcommand};

mod exec;
mod node;

use exec::Kubectl;
use node::Cluster;

#[derive(Parser)]
#[command(
    name = "kubectl-weir",
    version,
    about = "Runs weir-agent's node commands in the weir pod on a pod's node: `kubectl weir pods -n NAMESPACE POD`",
    after_help = "Arguments after `--` go to weir-agent's command as they are, e.g. \
                  `kubectl weir trace -n shop cart -- --verdict drop`."
)]
struct Cli {
    /// The kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, as for kubectl).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context (default: its current context).
    #[arg(long, global = true)]
    context: Option<String>,
    /// The namespace of weir's DaemonSet, where its pods are found by their labels
    /// (app.kubernetes.io/name=weir, app.kubernetes.io/component=node-agent).
    #[arg(
        long,
        env = "WEIR_NAMESPACE",
        default_value = "istio-system",
        global = true
    )]
    weir_namespace: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Node(NodeCommand),
    /// Print a completion script for this plugin, e.g. `kubectl-weir completion bash`.
    Completion {
        /// The shell the script is for.
        shell: clap_complete::Shell,
    },
}

/// weir-agent's commands, each run in the weir pod of one node.
#[derive(Subcommand)]
enum NodeCommand {
    /// The pods weir holds on the node: `weir-agent pods`.
    Pods {
        #[command(flatten)]
        target: NodeTarget,
        /// `weir-agent pods --output`: text, wide, json or yaml.
        #[arg(short, long)]
        output: Option<String>,
    },
    /// Stream the node's redirect decisions, for the pod alone when one is named:
    /// `weir-agent trace --pod NAMESPACE/POD`. Stops on Ctrl-C.
    Trace(NodeTarget),
    /// Check the node and the cluster for everything weir needs: `weir-agent check`.
    Check(NodeTarget),
    /// Save the node's bug report archive to a local file: `weir-agent bug-report`.
    BugReport {
        #[command(flatten)]
        target: NodeTarget,
        /// The local file (default: weir-bug-report-NODE.tar.gz); an existing file is never
        /// overwritten.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Why the pod is or is not redirected: `weir-agent explain NAMESPACE/POD`.
    Explain(PodTarget),
}

/// The node to ask about: a pod's, or one named.
#[derive(Args)]
struct NodeTarget {
    /// The pod whose node weir is asked about.
    #[arg(required_unless_present = "node", conflicts_with = "node")]
    pod: Option<String>,
    /// The pod's namespace (default: the context's namespace).
    #[arg(short, long)]
    namespace: Option<String>,
    /// The node whose weir pod is asked, instead of a pod's.
    #[arg(long)]
    node: Option<String>,
    /// More arguments for weir-agent's command.
    #[arg(last = true)]
    agent_args: Vec<String>,
}

#[derive(Args)]
struct PodTarget {
    /// The pod.
    pod: String,
    /// The pod's namespace (default: the context's namespace).
    #[arg(short, long)]
    namespace: Option<String>,
    /// More arguments for weir-agent's command.
    #[arg(last = true)]
    agent_args: Vec<String>,
}

/// A pod as the user named it, in the namespace it was resolved to.
struct PodName {
    namespace: String,
    name: String,
}

impl std::fmt::Display for PodName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => return failed(error.into()),
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(error) => failed(error),
    }
}

fn failed(error: anyhow::Error) -> ExitCode {
    eprintln!("error: {error:#}");
    ExitCode::FAILURE
}

async fn run(cli: Cli) -> Result<ExitCode> {
    let command = match cli.command {
        Command::Node(command) => command,
        Command::Completion { shell } => {
            let mut command = Cli::command();
            // Written whole, then printed: the generator panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut command, "kubectl-weir", &mut script);
            std::io::stdout().write_all(&script)?;
            return Ok(ExitCode::SUCCESS);
        }
    };
    let cluster = Cluster::connect(cli.kubeconfig.as_deref(), cli.context.as_deref()).await?;
    let kubectl = Kubectl {
        kubeconfig: cli.kubeconfig,
        context: cli.context,
    };
    let weir_namespace = cli.weir_namespace;
    let status = match command {
        NodeCommand::Pods { target, output } => {
            let mut args = vec!["pods".to_owned()];
            args.extend(output.map(|output| format!("--output={output}")));
            let (node, _) = target.resolve(&cluster).await?;
            let weir_pod = cluster.weir_pod(&weir_namespace, &node).await?;
            kubectl.exec(&weir_namespace, &weir_pod, &args, &target.agent_args)?
        }
        NodeCommand::Trace(target) => {
            let (node, pod) = target.resolve(&cluster).await?;
            let mut args = vec!["trace".to_owned()];
            args.extend(pod.map(|pod| format!("--pod={pod}")));
            let weir_pod = cluster.weir_pod(&weir_namespace, &node).await?;
            kubectl.exec(&weir_namespace, &weir_pod, &args, &target.agent_args)?
        }
        NodeCommand::Check(target) => {
            let (node, _) = target.resolve(&cluster).await?;
            let weir_pod = cluster.weir_pod(&weir_namespace, &node).await?;
            let args = ["check".to_owned()];
            kubectl.exec(&weir_namespace, &weir_pod, &args, &target.agent_args)?
        }
        NodeCommand::BugReport { target, output } => {
            let (node, _) = target.resolve(&cluster).await?;
            let output =
                output.unwrap_or_else(|| PathBuf::from(format!("weir-bug-report-{node}.tar.gz")));
            refuse_existing(&output)?;
            let weir_pod = cluster.weir_pod(&weir_namespace, &node).await?;
            let args = ["bug-report".to_owned(), "--output=-".to_owned()];
            let status = kubectl.exec_to_file(
                &weir_namespace,
                &weir_pod,
                &args,
                &target.agent_args,
                &output,
            )?;
            if status.success() {
                writeln!(
                    std::io::stderr(),
                    "{}: the bug report of node {node} (weir pod {weir_namespace}/{weir_pod})",
                    output.display()
                )?;
            }
            status
        }
        NodeCommand::Explain(target) => {
            let pod = cluster.pod_name(target.namespace, target.pod);
            let node = cluster.node_of(&pod).await?;
            let weir_pod = cluster.weir_pod(&weir_namespace, &node).await?;
            let args = ["explain".to_owned(), pod.to_string()];
            kubectl.exec(&weir_namespace, &weir_pod, &args, &target.agent_args)?
        }
    };
    Ok(exec::exit_code(status))
}

impl NodeTarget {
    /// The node to ask, and the pod it is the node of, if one was named.
    async fn resolve(&self, cluster: &Cluster) -> Result<(String, Option<PodName>)> {
        match (&self.node, &self.pod) {
            (Some(node), _) => Ok((node.clone(), None)),
            (None, Some(pod)) => {
                let pod = cluster.pod_name(self.namespace.clone(), pod.clone());
                Ok((cluster.node_of(&pod).await?, Some(pod)))
            }
            (None, None) => unreachable!("clap requires a pod without --node"),
        }
    }
}

/// A report is never written over an existing file: it may be an earlier report of the node.
fn refuse_existing(output: &Path) -> Result<()> {
    if output.exists() {
        bail!(
            "{} exists: move it away, or name another file with --output",
            output.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::WEIR_POD_SELECTOR;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn the_selector_in_the_help_is_the_one_used() {
        let help = Cli::command().render_long_help().to_string();
        for label in WEIR_POD_SELECTOR.split(',') {
            assert!(help.contains(label), "{label} in:\n{help}");
        }
    }
}
