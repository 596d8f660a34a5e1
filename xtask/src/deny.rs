//! cargo-deny over every crate weir builds from, with the policy in `deny.toml`: licenses, banned
//! crates and sources. A known cargo-deny version is built from crates.io into the target dir on
//! first use; a cargo-deny on PATH is not used.
use std::path::PathBuf;
use std::process::Command;

use anyhow::Result;

use crate::{step, system};

const VERSION: &str = "0.20.2";

/// Checks the workspace's and the kernel crate's dependency graphs.
pub fn check() -> Result<()> {
    let deny = ensure()?;
    let root = crate::workspace_root();
    let policy = root.join("deny.toml");
    step("checking dependencies' licenses, bans and sources (cargo-deny)");
    // The kernel crate has a handful of dependencies: the policy's other licenses are the
    // workspace's, which its check must not call unused.
    for (manifest, allowed) in [
        (root.join("Cargo.toml"), None),
        (
            root.join("ebpf").join("Cargo.toml"),
            Some("license-not-encountered"),
        ),
    ] {
        let mut check = Command::new(&deny);
        check
            .arg("--manifest-path")
            .arg(&manifest)
            .arg("--config")
            .arg(&policy)
            .args(["check", "--hide-inclusion-graph"]);
        if let Some(allowed) = allowed {
            check.args(["--allow", allowed]);
        }
        system::run(check.args(["licenses", "bans", "sources"]))?;
    }
    Ok(())
}

/// The path of cargo-deny, built on first use.
fn ensure() -> Result<PathBuf> {
    let root = crate::target_dir()?
        .join("tools")
        .join(format!("cargo-deny-{VERSION}"));
    let deny = root.join("bin").join("cargo-deny");
    if system::is_executable(&deny) {
        return Ok(deny);
    }
    step(&format!("building cargo-deny {VERSION} (crates.io)"));
    system::run(
        system::cargo()
            .args(["install", "--locked", "--root"])
            .arg(&root)
            .arg(format!("cargo-deny@{VERSION}")),
    )?;
    Ok(deny)
}
