//! `cargo xtask demo`: weir-demo (the `demo/` crate), weir's main job on a throwaway demo node.

use anyhow::Result;

use crate::{ebpf, packages, step, sweep, system};

/// Builds the eBPF object and every binary of the workspace (weir-agent, weir-cni, the demo).
pub fn build_binaries() -> Result<()> {
    let object = ebpf::build(false)?;
    step("building weir-agent, weir-cni and the demo");
    system::run(
        system::cargo()
            .current_dir(crate::workspace_root())
            .args(["build", "--workspace", "--bins"])
            .env("WEIR_EBPF_OBJECT", &object),
    )
}

pub fn run() -> Result<()> {
    step("checking the system packages the demo node uses");
    packages::ensure_node_packages()?;
    build_binaries()?;
    let demo = crate::target_dir()?.join("debug/weir-demo");
    let result = system::run_supervised(&mut system::as_root(demo));
    // The demo cleans up after itself; this catches what a killed run left.
    let swept = sweep::run_privileged();
    result.and(swept)
}
