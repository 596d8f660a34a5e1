//! weir's developer tasks, run as `cargo xtask <command>` (an alias in .cargo/config.toml).

mod bench;
mod demo;
mod deny;
mod ebpf;
mod helm;
mod image;
mod packages;
mod run;
mod sweep;
mod system;
mod test;
mod vm;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::LazyLock;
use std::time::Instant;

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
    /// Run every test: eBPF build, fmt, clippy, the image and `cargo test --workspace` (needs
    /// root), then the kernel-facing tests on Debian's 5.10, 6.1 and 6.12 kernels
    /// (`test-kernels`).
    Test {
        /// Only this machine's kernel: skip the other kernels' VMs (a quick local run).
        #[arg(long)]
        host_only: bool,
        /// Extra arguments for `cargo test`, after `--` (e.g. a test name filter). They do not
        /// reach the other kernels' runs.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run the kernel-facing tests (datapath, interfaces, fuzz, faults, kernel_compat) in one VM
    /// per kernel, each booted with one of Debian's kernels (fetched into target/kernels/).
    TestKernels {
        /// The kernel series to boot, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "5.10,6.1,6.12")]
        kernels: Vec<vm::Series>,
        /// Every test executable of the workspace, not only the kernel-facing ones.
        #[arg(long)]
        all: bool,
        /// Arguments for each test executable, after `--` (e.g. a test name filter).
        #[arg(last = true)]
        filter: Vec<String>,
    },
    /// Run a command as root in a VM booted with one of Debian's kernels, from the workspace
    /// root; exits with the command's status.
    Vm {
        /// The kernel series to boot.
        #[arg(long)]
        kernel: vm::Series,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
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
    /// Build weir's container image from the release binaries, with no base image and no
    /// container engine, into target/image/weir-agent.tar: one archive for `docker load`,
    /// `podman load` and `ctr images import`.
    Image,
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
    /// Check the dependencies' licenses, bans and sources against deny.toml (cargo-deny, built
    /// on first use); `cargo xtask test` runs it too.
    Deny,
    /// Remove leftovers of killed test runs: `weir-t-*` network namespaces and bpffs pins (needs root).
    Sweep,
}

fn main() -> ExitCode {
    LazyLock::force(&STARTED);
    let result = match Cli::parse().command {
        Command::BuildEbpf { debug } => {
            ebpf::build(debug).map(|object| println!("{}", object.display()))
        }
        Command::Test { host_only, args } => test::run(host_only, &args),
        Command::TestKernels {
            kernels,
            all,
            filter,
        } => test::run_kernels(&kernels, all, &filter),
        // Exits with the command's own status, whatever it is.
        Command::Vm { kernel, command } => {
            return vm::run_command(kernel, &command).map_or_else(failure, ExitCode::from);
        }
        Command::Demo => demo::run(),
        Command::Run { dir, args } => run::run(&dir, &args),
        Command::Image => image::run(),
        Command::Bench { quick, args } => bench::run(quick, &args),
        Command::Deny => deny::check(),
        Command::Sweep => sweep::run(),
    };
    result.map_or_else(failure, |()| ExitCode::SUCCESS)
}

fn failure(err: anyhow::Error) -> ExitCode {
    eprintln!("error: {err:#}");
    ExitCode::FAILURE
}

/// The workspace root: the parent of this crate's directory.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

/// Where cargo puts what it builds (`CARGO_TARGET_DIR`, a `build.target-dir` setting, or the
/// workspace's `target/`), as `cargo metadata` reports it.
pub fn target_dir() -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    let out = system::cargo()
        .current_dir(workspace_root())
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cannot run cargo metadata")?;
    if !out.status.success() {
        anyhow::bail!("cargo metadata failed: {}", out.status);
    }
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    metadata["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("cargo metadata names no target directory")
}

/// When this xtask started: each step says how far in it is, so a CI log shows where its time went.
static STARTED: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Announce a step.
pub fn step(message: &str) {
    let elapsed = STARTED.elapsed().as_secs();
    println!("==> [{:02}:{:02}] {message}", elapsed / 60, elapsed % 60);
}
