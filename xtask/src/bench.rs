//! `cargo xtask bench`: weir's datapath side by side with istio-cni's iptables rules, in one run
//! on a throwaway node (release build; medians and ratios).

use anyhow::Result;

use crate::{ebpf, step, system};

pub fn run() -> Result<()> {
    let object = ebpf::build(false)?;
    step("building the benchmark (release)");
    system::run(
        system::cargo()
            .current_dir(crate::workspace_root())
            .args([
                "build",
                "--release",
                "-p",
                "weir-tests",
                "--bin",
                "weir-bench",
            ])
            .env("WEIR_EBPF_OBJECT", &object),
    )?;
    step("running it: a throwaway node, weir and iptables side by side");
    let bench = crate::workspace_root().join("target/release/weir-bench");
    system::run(&mut system::as_root(bench))
}
