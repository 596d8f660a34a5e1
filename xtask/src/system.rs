//! The machine: privileges, commands on PATH, Debian packages, running child processes.

use std::env;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag};
use nix::unistd::{getpid, getppid, Pid};

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

/// Installs the packages among `packages` that are missing when we can (root on Debian);
/// otherwise says what is missing and that `without` happens.
pub fn ensure_packages(packages: &[&str], without: &str) -> Result<()> {
    if !is_debian() {
        println!(
            "    not a Debian system: make sure these are installed: {}",
            packages.join(" ")
        );
        return Ok(());
    }
    if is_root() {
        return apt_install(packages);
    }
    let missing = missing_packages(packages);
    if !missing.is_empty() {
        eprintln!(
            "warning: missing packages ({without}): sudo apt-get install -y {}",
            missing.join(" ")
        );
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

/// Runs `cmd` (the agent, the demo, the bench: a child that changes the machine until it exits)
/// to completion, and never leaves it behind. A SIGINT, SIGTERM or SIGHUP to xtask (Ctrl-C, a
/// supervisor, a closed terminal) reaches it as SIGTERM, its cue to clean up and exit, and xtask
/// waits until it has. Should xtask die without a chance to pass it on (SIGKILL), the kernel sends
/// the child SIGTERM (parent-death signal).
///
/// Under sudo (not root) the kernel drops the parent-death signal when it executes the set-user-ID
/// sudo, so only the passed-on signals remain there: sudo relays SIGINT, SIGTERM and SIGHUP to the
/// command it runs. A SIGKILL of xtask then leaves the command running.
pub fn run_supervised(cmd: &mut Command) -> Result<()> {
    let mut stop_signals = SigSet::empty();
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        stop_signals.add(signal);
    }
    // Blocked before the forwarding thread exists, so that it inherits the mask and takes them
    // with sigwait, and no other thread dies of them. The child unblocks them (below): a mask
    // outlives exec, and one that blocks SIGTERM makes an agent deaf to it.
    let previous_mask = stop_signals
        .thread_swap_mask(SigmaskHow::SIG_BLOCK)
        .context("blocking the stop signals")?;
    let result = supervise(cmd, stop_signals);
    previous_mask
        .thread_set_mask()
        .context("unblocking the stop signals")?;
    result
}

fn supervise(cmd: &mut Command, stop_signals: SigSet) -> Result<()> {
    let xtask = getpid();
    // SAFETY: pthread_sigmask, prctl and getppid are async-signal-safe and touch no memory of the
    // parent. The parent-death signal follows the thread that forks: this one, the main thread,
    // which lives as long as xtask.
    unsafe {
        cmd.pre_exec(move || {
            stop_signals.thread_unblock()?;
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // xtask died before the prctl: no signal would come.
            if getppid() != xtask {
                return Err(std::io::Error::other("xtask exited"));
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot run {}", describe(cmd)))?;
    let pid = Pid::from_raw(child.id() as i32);
    // Set once the child is reaped: its pid may then belong to another process.
    let reaped = Arc::new(Mutex::new(false));
    let forwarder_reaped = reaped.clone();
    let name = Path::new(cmd.get_program())
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    std::thread::spawn(move || {
        while let Ok(signal) = stop_signals.wait() {
            let reaped = forwarder_reaped.lock().unwrap_or_else(|e| e.into_inner());
            if *reaped {
                return;
            }
            eprintln!("xtask: {signal}: stopping {name} (SIGTERM), waiting for it to exit");
            let _ = kill(pid, Signal::SIGTERM);
        }
    });
    // Waits without reaping: until `reaped` is set, the pid stays the child's (a zombie), so a
    // signal passed on in the meantime cannot reach another process.
    waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT)
        .with_context(|| format!("waiting for {}", describe(cmd)))?;
    let status = {
        let mut reaped = reaped.lock().unwrap_or_else(|e| e.into_inner());
        *reaped = true;
        child.wait()?
    };
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
