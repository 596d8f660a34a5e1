//! `cargo xtask bench`: weir-bench (the `bench/` crate), weir's datapath side by side with istio-cni's iptables rules, in one run
//! on a throwaway node (release build; medians and pair-by-pair ratios), written to
//! `target/bench/`. `--quick` (into `target/bench/quick/`) runs tiny sizes from the dev build the
//! tests use, so the bench cannot rot; its figures mean nothing. The agent sections run the
//! `weir-agent` and `weir-cni` binaries built next to the bench (weir-cni through
//! `weir-plugin-runner`), so those are built too.

use anyhow::Result;

use crate::{ebpf, packages, step, system};

pub fn run(quick: bool, args: &[String]) -> Result<()> {
    step("checking the system packages the bench uses");
    packages::ensure_test_packages()?;
    let object = ebpf::build(false)?;
    let profile = if quick { "dev" } else { "release" };
    step(&format!("building the benchmark and the agent ({profile})"));
    let build = |packages: &[&str]| {
        system::run(
            system::cargo()
                .current_dir(crate::workspace_root())
                .args(["build", "--profile", profile])
                .args(packages)
                .env("WEIR_EBPF_OBJECT", &object),
        )
    };
    build(&["-p", "weir-bench"])?;
    // A build of its own: built with the bench, weir-agent would get the fault-injection points
    // its harness, weir-tests, enables (cargo unifies features), and the bench measures the
    // agent as shipped.
    build(&["-p", "weir-agent", "-p", "weir-cni", "--bins"])?;
    // What runs weir-cni for the agent sections, from a process with few descriptors.
    build(&["-p", "weir-tests", "--bin", "weir-plugin-runner"])?;
    step("running it: a throwaway node, weir and iptables side by side");
    run_built(quick, args)
}

/// Runs the weir-bench binary the build left (dev for `--quick`, else release).
pub fn run_built(quick: bool, args: &[String]) -> Result<()> {
    let root = crate::workspace_root();
    let profile_dir = if quick { "debug" } else { "release" };
    let mut bench = system::as_root(crate::target_dir()?.join(profile_dir).join("weir-bench"));
    // The quick run's figures mean nothing: they never replace a real run's.
    let out = if quick {
        "target/bench/quick"
    } else {
        "target/bench"
    };
    bench.arg("--out").arg(root.join(out));
    if quick {
        bench.arg("--quick");
    }
    system::run_supervised(bench.args(args))
}
