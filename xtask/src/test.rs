//! `cargo xtask test`: every test, in the order CI runs them.

use std::process::Command;

use anyhow::{bail, Result};

use crate::system::{self, cargo};
use crate::{bench, ebpf, step, sweep};

/// What the privileged tests run: the CNI plugins that wire test pods, `ip`, iptables and bpftool.
const TEST_PACKAGES: &[&str] = &[
    "containernetworking-plugins",
    "iproute2",
    "iptables",
    "bpftool",
];

pub fn run(test_args: &[String]) -> Result<()> {
    step("checking test system packages");
    ensure_test_packages()?;

    let object = ebpf::build(false)?;
    let with_object = |mut cmd: Command| {
        cmd.current_dir(crate::workspace_root())
            .env("WEIR_EBPF_OBJECT", &object);
        cmd
    };

    step("checking formatting");
    system::run(with_object(cargo()).args(["fmt", "--all", "--", "--check"]))?;
    system::run(ebpf_on_host().args(["fmt", "--", "--check"]))?;

    step("running clippy");
    system::run(with_object(cargo()).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // The kernel crate builds for the host too, so the host's clippy lints it and its pure
    // helpers have unit tests.
    system::run(ebpf_on_host().args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;

    step("testing the kernel crate's helpers on the host");
    system::run(ebpf_on_host().arg("test"))?;

    step("building the binaries the tests run (weir-cni, weir-agent, weir-bench)");
    system::run(with_object(cargo()).args(["build", "--workspace", "--bins"]))?;

    let mut test = with_object(cargo());
    test.args(["test", "--workspace"]);
    privileged_test_runner(&mut test)?;
    test.args(test_args);

    step("sweeping leftovers of earlier test runs");
    sweep::run_privileged()?;
    step("running tests");
    let result = system::run(&mut test).and_then(|()| {
        step("running the bench's quick configuration (it runs; no figures)");
        bench::run_built(true, &[])
    });
    step("sweeping leftovers of this test run");
    let swept = sweep::run_privileged();
    result.and(swept)
}

/// cargo in `ebpf/` (outside the workspace) with the workspace's toolchain, building for the
/// host into a target directory of its own.
fn ebpf_on_host() -> Command {
    let root = crate::workspace_root();
    let mut cmd = cargo();
    cmd.current_dir(root.join("ebpf"))
        .env("CARGO_TARGET_DIR", root.join("target").join("ebpf-host"));
    cmd
}

/// Install the test system packages when we can (root on Debian); otherwise say what is missing.
/// Also the bench's: it wires pods and reads map memory the same way.
pub fn ensure_test_packages() -> Result<()> {
    if !system::is_debian() {
        println!(
            "    not a Debian system: make sure these are installed: {}",
            TEST_PACKAGES.join(" ")
        );
        return Ok(());
    }
    if system::is_root() {
        return system::apt_install(TEST_PACKAGES);
    }
    let missing = system::missing_packages(TEST_PACKAGES);
    if !missing.is_empty() {
        eprintln!(
            "warning: missing test packages (privileged tests will fail or skip): \
             sudo apt-get install -y {}",
            missing.join(" ")
        );
    }
    Ok(())
}

/// The privileged tests need root: when we are not, run the test executables (only them; the
/// build stays ours) under `sudo -E`.
fn privileged_test_runner(test: &mut Command) -> Result<()> {
    if system::is_root() {
        return Ok(());
    }
    if system::find_on_path("sudo").is_some() {
        println!("    not root: the test executables run under `sudo -E`");
        test.args(["--config", r#"target."cfg(all())".runner = "sudo -E""#]);
        return Ok(());
    }
    if system::in_ci() {
        bail!("the privileged tests need root: run `cargo xtask test` as root, or install sudo");
    }
    eprintln!("warning: not root and no sudo: the privileged tests will skip");
    Ok(())
}
