//! `cargo xtask demo`: weir's main job on a throwaway demo node.

use std::process::Command;

use anyhow::Result;

use crate::{ebpf, step, sweep, system};

pub fn run() -> Result<()> {
    let object = ebpf::build(false)?;
    step("building weir-agent, weir-cni and the demo");
    system::run(
        system::cargo()
            .current_dir(crate::workspace_root())
            .args(["build", "--workspace", "--bins"])
            .env("WEIR_EBPF_OBJECT", &object),
    )?;
    let demo = crate::workspace_root().join("target/debug/weir-demo");
    let mut command = if system::is_root() {
        Command::new(demo)
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("-E").arg(demo);
        sudo
    };
    let result = system::run(&mut command);
    // The demo cleans up after itself; this catches what a killed run left.
    let swept = sweep::run_privileged();
    result.and(swept)
}
