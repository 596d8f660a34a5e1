//! The machine: privileges, commands on PATH, Debian packages, running child processes.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::step;

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

pub fn in_ci() -> bool {
    env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The first executable called `name` on PATH.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|file| is_executable(file))
}

pub fn is_executable(file: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    file.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Cargo's home: `$CARGO_HOME`, else `~/.cargo`.
pub fn cargo_home() -> Option<PathBuf> {
    env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
}

/// PATH with cargo's bin directory in front, for children that need `cargo install`ed tools.
pub fn path_with_cargo_bin() -> Result<OsString> {
    let mut dirs: Vec<PathBuf> = cargo_home()
        .map(|home| home.join("bin"))
        .into_iter()
        .collect();
    dirs.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
    env::join_paths(dirs).context("PATH has a directory that cannot be joined")
}

/// The cargo that runs this xtask (cargo sets `$CARGO` for `cargo run`), else `cargo` on PATH.
pub fn cargo() -> Command {
    Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Whether this is a Debian-like system whose packages we can manage.
pub fn is_debian() -> bool {
    find_on_path("apt-get").is_some() && find_on_path("dpkg").is_some()
}

/// The packages among `packages` that dpkg does not report as installed.
pub fn missing_packages<'a>(packages: &[&'a str]) -> Vec<&'a str> {
    packages
        .iter()
        .copied()
        .filter(|package| {
            let installed = Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", package])
                .output()
                .is_ok_and(|out| {
                    out.status.success() && out.stdout.ends_with(b"install ok installed")
                });
            !installed
        })
        .collect()
}

/// `apt-get install -y` the packages among `packages` that are missing (needs root on Debian).
/// When the install fails (e.g. no candidate because the package lists were never fetched),
/// runs `apt-get update` and tries once more.
pub fn apt_install(packages: &[&str]) -> Result<()> {
    let missing = missing_packages(packages);
    if missing.is_empty() {
        return Ok(());
    }
    step(&format!(
        "installing Debian packages: {}",
        missing.join(" ")
    ));
    let install = || {
        let mut cmd = Command::new("apt-get");
        cmd.args(["install", "-y"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive");
        run(&mut cmd)
    };
    if install().is_err() {
        step("apt-get install failed; running apt-get update and retrying");
        run(Command::new("apt-get").args(["update"]))?;
        install()?;
    }
    Ok(())
}

/// A command for `program` that runs as root: directly when we are root, else under `sudo -E`.
pub fn as_root(program: impl AsRef<std::ffi::OsStr>) -> Command {
    if is_root() {
        Command::new(program)
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("-E").arg(program);
        sudo
    }
}

/// Run a command to completion, failing unless it exits successfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed: {status}", describe(cmd));
    }
    Ok(())
}

fn describe(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    words.extend(cmd.get_args().map(|arg| arg.to_string_lossy().into_owned()));
    format!("`{}`", words.join(" "))
}
