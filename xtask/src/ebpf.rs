//! Building the kernel crate `ebpf/` for `bpfel-unknown-none`: toolchain discovery and the build.
//!
//! The crate needs a `core` for the BPF target and `bpf-linker`. Two routes give a `core`:
//!
//! - **nightly**: rustup's nightly with `rust-src`, building `core` with `-Z build-std=core`;
//! - **debian**: Debian's rustc (`rustc-web`) with its prebuilt BPF `core`
//!   (`libstd-rust-web-dev-bpf`), driven by any cargo through `RUSTC` and `RUSTC_BOOTSTRAP=1`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::system::{self, apt_install, cargo, find_on_path, run};
use crate::{step, workspace_root};

const TARGET: &str = "bpfel-unknown-none";
const RUSTFLAGS: &str = "-C debuginfo=2 -C link-arg=--btf";

const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_BPF_CORE: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
/// What the Debian route needs: the compiler with its BPF `core`, and what bpf-linker links against.
const DEBIAN_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
];
const BPF_LINKER_VERSION: &str = "0.13.0";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Nightly,
    Debian,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Route::Nightly => "rustup nightly with rust-src (-Z build-std=core)",
            Route::Debian => "Debian rustc-web with its prebuilt BPF core",
        })
    }
}

/// Build `ebpf/` and return the absolute path of the object.
pub fn build(debug: bool) -> Result<PathBuf> {
    step("building eBPF programs");
    let route = choose_route()?;
    println!("    toolchain route: {route}");
    let linker_dir = ensure_bpf_linker(route)?;

    let root = workspace_root();
    let target_dir = root.join("target").join("ebpf");
    // `cargo xtask` runs under rustup's proxy, which pins its children to the workspace's toolchain
    // (RUSTUP_TOOLCHAIN): the nightly route names its own, the Debian route sets RUSTC.
    let mut cmd = match route {
        Route::Nightly => {
            let mut cmd = cleaned(Command::new("rustup"));
            cmd.env_remove("RUSTUP_TOOLCHAIN")
                .args(["run", "nightly", "cargo", "build"])
                .args(["-Z", "build-std=core"]);
            cmd
        }
        Route::Debian => {
            let mut cmd = cleaned(cargo());
            cmd.env_remove("RUSTUP_TOOLCHAIN")
                .env("RUSTC", DEBIAN_RUSTC)
                .env("RUSTC_BOOTSTRAP", "1")
                .arg("build");
            cmd
        }
    };
    cmd.args(["--target", TARGET]);
    if !debug {
        cmd.arg("--release");
    }
    cmd.current_dir(root.join("ebpf"))
        .env("CARGO_TARGET_DIR", &target_dir)
        .env("RUSTFLAGS", RUSTFLAGS)
        .env("PATH", path_with(&linker_dir)?);
    run(&mut cmd)?;

    let profile = if debug { "debug" } else { "release" };
    let object = target_dir.join(TARGET).join(profile).join("weir-ebpf");
    if !object.is_file() {
        bail!(
            "the eBPF build succeeded but {} is missing",
            object.display()
        );
    }
    Ok(object)
}

/// Pick the first working route; on a Debian machine where we are root, install the Debian one.
fn choose_route() -> Result<Route> {
    if nightly_available() {
        return Ok(Route::Nightly);
    }
    if debian_available() {
        return Ok(Route::Debian);
    }
    if system::is_root() && system::is_debian() {
        step("no eBPF toolchain found; installing Debian's");
        apt_install(DEBIAN_PACKAGES)?;
        if debian_available() {
            return Ok(Route::Debian);
        }
        bail!(
            "installed {} but {DEBIAN_RUSTC} or {DEBIAN_BPF_CORE} is still missing",
            DEBIAN_PACKAGES.join(" ")
        );
    }
    bail!(
        "no toolchain for the eBPF programs. Install one of:\n  \
         - rustup's nightly with rust-src: `rustup toolchain install nightly --component rust-src`\n  \
         - on Debian 12, as root: `apt-get install -y {}`\n\
         and bpf-linker {BPF_LINKER_VERSION} (`cargo xtask build-ebpf` installs it once a route is there)",
        DEBIAN_PACKAGES.join(" ")
    )
}

fn nightly_available() -> bool {
    Command::new("rustup")
        .args(["component", "list", "--toolchain", "nightly", "--installed"])
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .any(|l| l.starts_with("rust-src"))
        })
}

fn debian_available() -> bool {
    let has_core = std::fs::read_dir(DEBIAN_BPF_CORE).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("libcore-"))
    });
    system::is_executable(Path::new(DEBIAN_RUSTC)) && has_core
}

/// Find bpf-linker on PATH or in cargo's bin directory, installing it if it is missing.
/// Returns the directory it is in.
fn ensure_bpf_linker(route: Route) -> Result<PathBuf> {
    if let Some(dir) = find_bpf_linker() {
        return Ok(dir);
    }
    step(&format!("installing bpf-linker {BPF_LINKER_VERSION}"));
    let mut cmd = cleaned(cargo());
    cmd.args([
        "install",
        "bpf-linker",
        "--version",
        BPF_LINKER_VERSION,
        "--locked",
    ]);
    match route {
        Route::Debian => {
            if system::is_root() && system::is_debian() {
                apt_install(DEBIAN_PACKAGES)?;
            }
            cmd.args(["--no-default-features", "--features", "llvm-22"])
                .env("LLVM_PREFIX", LLVM_PREFIX);
            run(&mut cmd).context(format!(
                "cannot install bpf-linker; it needs LLVM 22 (on Debian: `apt-get install -y {}`)",
                DEBIAN_PACKAGES.join(" ")
            ))?;
        }
        Route::Nightly => {
            if run(&mut cmd).is_err() {
                bail!(
                    "cannot install bpf-linker. It links against LLVM: install the LLVM development \
                     packages of the version bpf-linker {BPF_LINKER_VERSION} supports (e.g. on Debian 12: \
                     `apt-get install -y llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev`), then \
                     `LLVM_PREFIX=/usr/lib/llvm-22 cargo install bpf-linker --version {BPF_LINKER_VERSION} \
                     --locked --no-default-features --features llvm-22`"
                );
            }
        }
    }
    find_bpf_linker()
        .context("bpf-linker was installed but is neither on PATH nor in cargo's bin directory")
}

fn find_bpf_linker() -> Option<PathBuf> {
    let in_cargo_home = system::cargo_home().map(|home| home.join("bin"));
    if let Some(dir) = in_cargo_home.filter(|dir| system::is_executable(&dir.join("bpf-linker"))) {
        return Some(dir);
    }
    find_on_path("bpf-linker").and_then(|file| file.parent().map(Path::to_path_buf))
}

/// PATH with `dir` and cargo's bin directory in front.
fn path_with(dir: &Path) -> Result<std::ffi::OsString> {
    let rest = system::path_with_cargo_bin()?;
    std::env::join_paths(std::iter::once(dir.to_path_buf()).chain(std::env::split_paths(&rest)))
        .context("PATH has a directory that cannot be joined")
}

/// `cmd` without what the outer `cargo run` left in our environment that would steer a child cargo
/// elsewhere: another compiler, target dir or flags. Set the child's own after this.
fn cleaned(mut cmd: Command) -> Command {
    for var in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_TARGET_DIR",
        "CARGO_BUILD_RUSTC",
        "CARGO_BUILD_RUSTC_WRAPPER",
        "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_RUSTFLAGS",
    ] {
        cmd.env_remove(var);
    }
    cmd
}
