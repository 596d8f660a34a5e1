//! weir-agent: the node agent binary. Its command line is [`weir_agent::cli`].
use std::{io::Write, process::ExitCode};

use anyhow::Result;
use clap::{CommandFactory, Parser};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info};
use weir_agent::{
    app, bug_report, check,
    cli::{istio, Cli, Command, Output},
    datapath::Datapath,
    explain::{self, ExplainOutput},
    inspect,
    install::Installer,
    logging, trace,
};

fn main() -> ExitCode {
    // Before clap reads the environment, and reported once the logger is there.
    let istio_settings = istio::carry_over();
    let cli = Cli::parse();
    if let Err(error) = logging::init(cli.log_format, cli.datapath.bpf_log) {
        eprintln!("weir-agent: logging: {error:#}");
        return ExitCode::FAILURE;
    }
    match istio_settings {
        Ok(resolved) => resolved.log(),
        Err(error) => {
            error!("{error:#}");
            return ExitCode::FAILURE;
        }
    }
    // Through the logger, so that a failure is a line of the chosen format, with its causes.
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            error!("{error:#}");
            ExitCode::FAILURE
        }
    }
}

/// glibc gives each thread that allocates an arena of its own (up to eight per core), and a
/// pod's enrollment allocates on several threads (tokio's workers, the datapath's): with 5,000
/// pods the arenas' free fragments were a fifth of the agent's RSS (75 to 78 MiB, 59 MiB with
/// one arena, no slower). Set before the runtime's threads exist.
fn one_malloc_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a malloc parameter, under malloc's own lock.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run(args) => {
            let config = args.config(cli.datapath.config())?;
            one_malloc_arena();
            tokio::runtime::Runtime::new()?.block_on(app::run(config, terminated()))
        }
        Command::Uninstall(dirs) => {
            Installer::new(dirs.install_config()?).uninstall()?;
            Datapath::start(cli.datapath.config())?.uninstall().wait()
        }
        Command::Pods(args) => {
            let pods = inspect::pods(&cli.datapath.pin_root, &args.state.state_file)?;
            let shown = match args.output {
                Output::Text => inspect::table(&pods),
                Output::Wide => inspect::wide_table(&pods),
                Output::Json => inspect::json(&pods)?,
                Output::Yaml => inspect::yaml(&pods)?,
            };
            print!("{shown}");
            Ok(())
        }
        Command::Check(args) => {
            let config = args.check_config(cli.datapath.config())?;
            tokio::runtime::Runtime::new()?.block_on(check::print(&config))
        }
        Command::Explain(args) => {
            let explanation = tokio::runtime::Runtime::new()?
                .block_on(explain::explain(&args, &cli.datapath.pin_root))?;
            let shown = match args.output {
                ExplainOutput::Text => explain::text(&explanation),
                ExplainOutput::Json => explain::json(&explanation)?,
            };
            print!("{shown}");
            Ok(())
        }
        Command::Trace(args) => tokio::runtime::Runtime::new()?.block_on(trace::run(args)),
        Command::BugReport(args) => {
            let output = args.output.clone();
            let sources = args.sources(cli.datapath.config())?;
            tokio::runtime::Runtime::new()?.block_on(bug_report::write(&sources, &output))
        }
        Command::Completion { shell } => {
            let mut command = Cli::command();
            // Written whole, then printed: the generator panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut command, "weir-agent", &mut script);
            std::io::stdout().write_all(&script)?;
            Ok(())
        }
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
