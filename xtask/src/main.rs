//! weir's developer tasks, run as `cargo xtask <command>` (an alias in .cargo/config.toml).

mod bench;
mod demo;
mod ebpf;
mod run;
mod sweep;
mod system;
mod test;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "weir's developer tasks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build the eBPF programs (ebpf/) for bpfel-unknown-none and print the object's path.
    BuildEbpf {
        /// Build with the dev profile instead of release.
        #[arg(long)]
        debug: bool,
    },
    /// Run every test: eBPF build, fmt, clippy and `cargo test --workspace` (needs root).
    Test {
        /// Extra arguments for `cargo test`, after `--` (e.g. a test name filter).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run weir's main job on a throwaway demo node.
    Demo,
    /// Run weir-agent on this machine as a local node agent (needs root).
    Run {
        /// Directory for the node's CNI config (net.d/), plugins (bin/), sockets (run/) and
        /// the ambient policy (policy.json).
        #[arg(long, default_value = "target/weir-run")]
        dir: PathBuf,
        /// Extra arguments for `weir-agent run`, after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Measure weir's datapath against istio's iptables rules, side by side; writes
    /// target/bench/{bench.md,bench.json,scale.svg}.
    Bench {
        /// Tiny sizes in a dev build: shows that the bench runs (the test run does this), no
        /// figures to read.
        #[arg(long)]
        quick: bool,
        /// Extra arguments for weir-bench, after `--` (e.g. `--sizes 10,100,1000`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Remove leftovers of killed test runs: `weir-t-*` network namespaces and bpffs pins (needs root).
    Sweep,
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::BuildEbpf { debug } => {
            ebpf::build(debug).map(|object| println!("{}", object.display()))
        }
        Command::Test { args } => test::run(&args),
        Command::Demo => demo::run(),
        Command::Run { dir, args } => run::run(&dir, &args),
        Command::Bench { quick, args } => bench::run(quick, &args),
        Command::Sweep => sweep::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: the parent of this crate's directory.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

/// Announce a step.
pub fn step(message: &str) {
    println!("==> {message}");
}
