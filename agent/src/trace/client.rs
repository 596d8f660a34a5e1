//! `weir-agent trace`: a reader of the agent's trace socket.
use std::io::Write;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    net::UnixStream,
    signal::unix::{signal, SignalKind},
};

use super::{
    decision::{Decision, Message, VERDICTS},
    TraceSocketArg,
};

#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    #[command(flatten)]
    pub socket: TraceSocketArg,
    /// Only this pod: `namespace/name`, or a name in any namespace.
    #[arg(long)]
    pub pod: Option<String>,
    /// Only pods in this namespace.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Only these verdicts (comma-separated; `drop`, `pass` and `refuse` stand for every
    /// verdict of that kind). See the list below.
    #[arg(long, value_delimiter = ',')]
    pub verdict: Vec<String>,
    /// Only decisions with this port as source, destination or target.
    #[arg(long)]
    pub port: Option<u16>,
    #[arg(long, value_enum, default_value_t = TraceOutput::Text)]
    pub output: TraceOutput,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TraceOutput {
    /// One line per decision; losses on stderr.
    Text,
    /// One JSON object per line: each decision, and `{"lost": N}` for records not received.
    Json,
}

/// The `--verdict` list for `--help`.
pub fn verdicts_help() -> String {
    let mut help = String::from("Verdicts:\n");
    for (_, name, meaning) in VERDICTS {
        help.push_str(&format!("  {name:<24} {meaning}\n"));
    }
    help
}

/// Streams decisions until Ctrl-C (or the agent stops). The agent turns tracing off when its
/// last reader leaves.
pub async fn run(args: TraceArgs) -> Result<()> {
    for verdict in &args.verdict {
        let known = ["drop", "pass", "refuse"].contains(&verdict.as_str())
            || VERDICTS.iter().any(|(_, name, _)| name == verdict);
        if !known {
            bail!("unknown verdict {verdict:?} (see `weir-agent trace --help`)");
        }
    }
    // Listened for from the start, not per line: a Ctrl-C that comes while a line is being
    // printed (or while connecting) is kept for the next wait instead of lost.
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for Ctrl-C")?;
    let path = &args.socket.trace_socket;
    let stream = UnixStream::connect(path).await.with_context(|| {
        format!(
            "connecting to {} (is weir-agent running on this node?)",
            path.display()
        )
    })?;
    let mut lines = BufReader::new(stream).lines();
    let mut lost = 0;
    let mut stdout = std::io::stdout().lock();
    loop {
        let line = tokio::select! {
            _ = interrupt.recv() => break,
            line = lines.next_line() => match line.context("reading from the agent")? {
                Some(line) => line,
                None => {
                    eprintln!("the agent closed the trace");
                    break;
                }
            },
        };
        match serde_json::from_str::<Message>(&line)
            .with_context(|| format!("unexpected line from the agent: {line}"))?
        {
            Message::Decision(decision) if !args.shows(&decision) => {}
            Message::Decision(decision) => match args.output {
                TraceOutput::Text => writeln!(stdout, "{decision}")?,
                TraceOutput::Json => writeln!(stdout, "{line}")?,
            },
            Message::Lost { lost: more } => {
                lost += more;
                match args.output {
                    TraceOutput::Text => eprintln!("{more} records lost"),
                    TraceOutput::Json => writeln!(stdout, "{line}")?,
                }
            }
        }
        stdout.flush()?;
    }
    if lost > 0 {
        eprintln!("{lost} records lost in all");
    }
    Ok(())
}

impl TraceArgs {
    fn shows(&self, decision: &Decision) -> bool {
        let pod_matches = self
            .pod
            .as_deref()
            .is_none_or(|wanted| match wanted.split_once('/') {
                Some((namespace, name)) => {
                    decision.namespace.as_deref() == Some(namespace)
                        && decision.pod.as_deref() == Some(name)
                }
                None => decision.pod.as_deref() == Some(wanted),
            });
        let namespace_matches = self
            .namespace
            .as_deref()
            .is_none_or(|wanted| decision.namespace.as_deref() == Some(wanted));
        let verdict_matches = self.verdict.is_empty()
            || self.verdict.iter().any(|wanted| {
                decision.verdict == *wanted || decision.verdict.starts_with(&format!("{wanted}-"))
            });
        let port_matches = self.port.is_none_or(|port| {
            decision.source.port() == port
                || decision.destination.port() == port
                || decision.target.is_some_and(|target| target.port() == port)
        });
        pod_matches && namespace_matches && verdict_matches && port_matches
    }
}
