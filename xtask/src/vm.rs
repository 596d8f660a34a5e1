//! Guests on other kernels: Debian's kernel images booted in QEMU by virtme-ng (`vng`), which
//! shares this machine's root filesystem with the guest over 9p (read-only, with /tmp, /etc,
//! /var, ... as throwaway overlays), so the guest runs this machine's builds and tools (`ip`,
//! bpftool, the CNI plugins) as root against its own kernel.
//!
//! Kernels are Debian's generic `linux-image-*-amd64-unsigned` packages (the `-cloud-` ones have
//! no 9p), fetched from the Debian archive with an apt state of our own (the machine's package
//! lists are not touched) and kept, extracted, in `target/kernels/<series>/`: once a series is
//! there, no network is needed. `rm -rf target/kernels` fetches the newest ones again.

use std::fmt;
use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::ValueEnum;

use crate::system::{self, run};
use crate::{step, workspace_root};

/// What booting a kernel takes here: QEMU, and what vng builds the guest's initramfs from
/// (depmod, cpio, a static busybox); a Python venv for vng itself; the archive's keyring for the
/// kernels' package lists.
const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "kmod",
    "cpio",
    "busybox-static",
    "python3-venv",
    "debian-archive-keyring",
];
/// Pinned: the guest script relies on how this version's guest init hands back the exit status
/// (see [`PRELUDE`]).
const VIRTME_NG: &str = "virtme-ng==1.42";
const VIRTME_NG_VERSION: &str = "virtme-ng 1.42";
const ARCHIVE: &str = "http://deb.debian.org/debian";
const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";
const GUEST_MEMORY: &str = "3G";
const GUEST_CPUS: &str = "2";
/// The guests are emulated: what the kernel does at every allocation or indirect branch costs
/// tens of times what it costs on hardware. Zeroing each allocation (Debian's default) made 5.10,
/// whose 9p client allocates and zeroes two 512 KiB buffers per request, spend a third of its time
/// in memset; no test depends on either setting.
const GUEST_KERNEL_ARGS: &str = "mitigations=off init_on_alloc=0";
/// The 9p tag of the build's target directory, which the guest mounts over the root's view of it
/// with the page cache on: the root's 9p mount caches nothing, so every agent start read its
/// 100 MiB binary over 9p again. The host does not write there while a guest runs.
const TARGET_TAG: &str = "weir-target";
/// A kernel that boots under KVM reaches its panic (no root filesystem) in a second or two; one
/// that hangs (as nested KVM does on some hosts, right after "Probing EDD") never does.
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// Lines the guest script prints for xtask rather than for the log start with this.
pub const MARKER: &str = "weir-vm: ";

/// What every guest script starts with. vng's guest init finds the script's output ports through
/// udev's /dev/virtio-ports links; without udev on the host (as here) it runs the script on the
/// serial console, which vng discards. So the script makes the links itself and sends its output
/// to the stdout port; the init, finding the links, then hands the script's exit status to vng.
/// bpffs is not mounted by the init; the privileged tests and the agent need it.
const PRELUDE: &str = r#"mkdir -p /dev/virtio-ports
for port in /sys/class/virtio-ports/*; do
    ln -sf "/dev/${port##*/}" "/dev/virtio-ports/$(cat "$port/name")"
done
exec </dev/null >/dev/virtio-ports/virtme.stdout 2>&1
mount -t bpf bpf /sys/fs/bpf
"#;

/// A Debian kernel series the tests run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Series {
    #[value(name = "5.10")]
    V5_10,
    #[value(name = "6.1")]
    V6_1,
    #[value(name = "6.12")]
    V6_12,
}

impl Series {
    pub const ALL: [Series; 3] = [Series::V5_10, Series::V6_1, Series::V6_12];

    fn name(self) -> &'static str {
        match self {
            Series::V5_10 => "5.10",
            Series::V6_1 => "6.1",
            Series::V6_12 => "6.12",
        }
    }

    /// The Debian suite whose main component carries this series.
    fn suite(self) -> &'static str {
        match self {
            Series::V5_10 => "bullseye",
            Series::V6_1 => "bookworm",
            Series::V6_12 => "bookworm-backports",
        }
    }

    /// The series' generic unsigned image packages, as an apt-cache regex: the ABI number (5.10,
    /// 6.1) or the upstream patch level (6.12 from backports) changes as Debian moves on.
    fn package_regex(self) -> &'static str {
        match self {
            Series::V5_10 => r"^linux-image-5\.10\.0-[0-9]+-amd64-unsigned$",
            Series::V6_1 => r"^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$",
            Series::V6_12 => r"^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$",
        }
    }
}

impl fmt::Display for Series {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A kernel extracted from its Debian package into the cache.
pub struct Kernel {
    pub series: Series,
    pub package: String,
    pub version: String,
    root: PathBuf,
}

impl Kernel {
    /// The kernel's release (`uname -r`): the package name without its affixes.
    fn release(&self) -> &str {
        self.package
            .trim_start_matches("linux-image-")
            .trim_end_matches("-unsigned")
    }

    /// vng finds the modules from the image's path: `<root>/lib/modules/<release>` beside
    /// `<root>/boot/`.
    fn image(&self) -> PathBuf {
        self.root
            .join("boot")
            .join(format!("vmlinuz-{}", self.release()))
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} {})", self.series, self.package, self.version)
    }
}

/// Where a guest's output is kept when it is not streamed: `target/vm/<series>.log`.
pub fn log_path(series: Series) -> PathBuf {
    vm_dir().join(format!("{series}.log"))
}

fn vm_dir() -> PathBuf {
    workspace_root().join("target").join("vm")
}

/// `cargo xtask vm`: run `command` as root in a guest on `series`, from the workspace root.
/// Returns the command's exit status (255 also when the guest died before it finished).
pub fn run_command(series: Series, command: &[String]) -> Result<u8> {
    let kernel = kernel(series)?;
    let vm = Vm::prepare(&kernel)?;
    let root = workspace_root();
    let script = format!(
        "cd {}\n{}\n",
        shell_quote(&root.to_string_lossy()),
        command
            .iter()
            .map(|word| shell_quote(word))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let boot = vm.run(&kernel, &script, &mut io::stdout(), None, |line| {
        println!("{MARKER}{line}")
    })?;
    Ok(boot.status)
}

/// The tools on this machine that boot a guest, and whether KVM works here.
pub struct Vm {
    vng: PathBuf,
    kvm: bool,
    target: PathBuf,
}

/// How a guest ran.
pub struct Boot {
    /// The guest script's exit status; vng reports 255 when there was none (a kernel panic).
    pub status: u8,
    /// From starting vng to the script's first line: host setup, firmware, kernel and init.
    pub boot_time: Option<Duration>,
    /// The guest said nothing for longer than it was allowed, and was stopped.
    pub stopped_answering: bool,
}

/// The line a guest script prints (after [`MARKER`]) to say it is still running, for a
/// [`Vm::run`] with a silence limit.
pub const ALIVE: &str = "alive";

impl Vm {
    /// Install what booting takes (once), and see whether `kernel` boots under KVM.
    pub fn prepare(kernel: &Kernel) -> Result<Self> {
        step("checking the VM tools (QEMU, virtme-ng)");
        ensure_vm_packages()?;
        let vng = ensure_vng()?;
        // The guests' scripts, their logs and the KVM probe's console.
        let dir = vm_dir();
        fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let kvm = kvm_boots(&kernel.image())?;
        println!(
            "    guests run under {}",
            if kvm {
                "KVM"
            } else {
                "TCG (emulation: KVM is missing or hangs here)"
            }
        );
        let target = crate::target_dir()?;
        Ok(Self { vng, kvm, target })
    }

    /// Boot `kernel` and run `script` (bash, after [`PRELUDE`]) as root in it. The guest's
    /// output goes to `out`, except lines starting with [`MARKER`]: they go, without it, to
    /// `on_marker`. With `silence_limit`, a guest that prints nothing for that long (the script
    /// prints [`ALIVE`] markers meanwhile) has stopped answering: it is killed.
    pub fn run(
        &self,
        kernel: &Kernel,
        script: &str,
        out: &mut dyn Write,
        silence_limit: Option<Duration>,
        mut on_marker: impl FnMut(&str),
    ) -> Result<Boot> {
        // The guest reads the script over 9p: the kernel command line that vng would carry it
        // on holds 2 KiB.
        let dir = vm_dir();
        let file = dir.join(format!("guest-{}.sh", kernel.series));
        let up = format!("echo '{MARKER}up'\n");
        let target = shell_quote(&self.target.to_string_lossy());
        let cached_target = format!(
            "mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=512000,ro {TARGET_TAG} {target}\n"
        );
        fs::write(&file, format!("{PRELUDE}{cached_target}{up}{script}"))
            .with_context(|| format!("cannot write {}", file.display()))?;

        step(&format!("booting {kernel}"));
        let started = Instant::now();
        // qemu opens our stdout anew for the guest's output: a log file would be overwritten from
        // its start. A pipe of our own is safe, and lets us pick out the markers.
        let (reader, writer) = io::pipe().context("cannot make a pipe for the guest's output")?;
        let mut vng = self.vng_command(kernel, &file)?;
        vng.stdin(Stdio::null())
            .stdout(writer.try_clone().context("cannot duplicate a pipe")?)
            .stderr(writer)
            // Its own process group, QEMU in it: the watchdog kills them together.
            .process_group(0);
        let mut child = vng
            .spawn()
            .with_context(|| format!("cannot run {}", self.vng.display()))?;
        // The command holds the pipe's write end: the reader sees its end once vng's copies close.
        drop(vng);
        let watchdog = silence_limit.map(|limit| Watchdog::start(child.id(), limit));

        let mut boot_time = None;
        for line in BufReader::new(reader).split(b'\n') {
            let line = line.context("cannot read the guest's output")?;
            if let Some(watchdog) = &watchdog {
                watchdog.heard();
            }
            let text = String::from_utf8_lossy(&line);
            match text.trim_end().strip_prefix(MARKER) {
                Some(ALIVE) => {}
                Some("up") => {
                    let elapsed = started.elapsed();
                    boot_time = Some(elapsed);
                    writeln!(out, "    up after {:.1} s", elapsed.as_secs_f64())?;
                }
                Some(marker) => on_marker(marker),
                None => {
                    out.write_all(&line)?;
                    out.write_all(b"\n")?;
                }
            }
            out.flush()?;
        }
        let status = child.wait().context("cannot wait for vng")?;
        let stopped_answering = watchdog.is_some_and(Watchdog::stop);
        let code = match status.code() {
            Some(code) => code,
            None if stopped_answering => i32::from(u8::MAX),
            None => bail!("vng was killed: {status}"),
        };
        Ok(Boot {
            status: u8::try_from(code).unwrap_or(u8::MAX),
            boot_time,
            stopped_answering,
        })
    }

    fn vng_command(&self, kernel: &Kernel, script: &Path) -> Result<Command> {
        let mut cmd = Command::new(&self.vng);
        // vng runs its helpers (virtme-run) from PATH.
        cmd.env(
            "PATH",
            path_with(self.vng.parent().unwrap_or(Path::new("/")))?,
        )
        .arg("--run")
        .arg(kernel.image())
        .args(["--force-9p", "--user", "root"])
        .args(["--memory", GUEST_MEMORY, "--cpus", GUEST_CPUS])
        .args(["--append", GUEST_KERNEL_ARGS])
        .arg(format!(
            "--qemu-opts=-fsdev local,id={TARGET_TAG},path={},security_model=none,readonly=on,multidevs=remap \
             -device virtio-9p-pci,fsdev={TARGET_TAG},mount_tag={TARGET_TAG}",
            self.target.display()
        ));
        if !self.kvm {
            cmd.arg("--disable-kvm");
        }
        cmd.arg("--exec")
            .arg(format!("bash {}", shell_quote(&script.to_string_lossy())));
        Ok(cmd)
    }
}

/// The kernel of `series`: from the cache, else the newest package of the series in its suite,
/// downloaded and extracted into the cache.
pub fn kernel(series: Series) -> Result<Kernel> {
    let dir = kernels_dir().join(series.name());
    let record = dir.join("package");
    if let Ok(text) = fs::read_to_string(&record) {
        if let Some((package, version)) = text.trim().split_once(' ') {
            let kernel = Kernel {
                series,
                package: package.to_owned(),
                version: version.to_owned(),
                root: dir.join("root"),
            };
            if kernel.image().is_file() {
                println!("    kernel {kernel}, cached in {}", dir.display());
                return Ok(kernel);
            }
        }
    }

    step(&format!(
        "fetching the newest {series} kernel from Debian {}",
        series.suite()
    ));
    let apt = Apt::ready()?;
    let (package, version) = apt.newest(series)?;
    let kernel = Kernel {
        series,
        package,
        version,
        root: dir.join("root"),
    };
    println!("    kernel {kernel}");
    let deb = apt.download(&kernel.package, &kernel.version)?;
    extract(&deb, &kernel)?;
    fs::remove_file(&deb).with_context(|| format!("cannot remove {}", deb.display()))?;
    fs::write(&record, format!("{} {}\n", kernel.package, kernel.version))
        .with_context(|| format!("cannot write {}", record.display()))?;
    Ok(kernel)
}

fn kernels_dir() -> PathBuf {
    workspace_root().join("target").join("kernels")
}

/// Unpack the package into the kernel's root and index its modules, which vng loads from there
/// into the guest (9p, virtio, the modules the tests use).
fn extract(deb: &Path, kernel: &Kernel) -> Result<()> {
    let staging = kernel.root.with_extension("partial");
    for dir in [&staging, &kernel.root] {
        if dir.exists() {
            fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
        }
    }
    fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&staging))?;
    run(Command::new("depmod")
        .arg("-b")
        .arg(&staging)
        .arg(kernel.release()))?;
    fs::rename(&staging, &kernel.root)
        .with_context(|| format!("cannot move {} into place", staging.display()))
}

/// apt with its own sources, lists and cache under `target/kernels/apt/`: the kernels' suites,
/// without touching the machine's package state.
struct Apt {
    dir: PathBuf,
}

impl Apt {
    /// Write the sources and fetch their package lists.
    fn ready() -> Result<Self> {
        let dir = kernels_dir().join("apt");
        for sub in ["state/lists/partial", "cache/archives/partial", "download"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path)
                .with_context(|| format!("cannot create {}", path.display()))?;
        }
        let sources: String = Series::ALL
            .iter()
            .map(|series| {
                let suite = series.suite();
                format!("deb [signed-by={KEYRING}] {ARCHIVE} {suite} main\n")
            })
            .collect();
        let list = dir.join("sources.list");
        fs::write(&list, sources).with_context(|| format!("cannot write {}", list.display()))?;
        let apt = Self { dir };
        run(apt.command("apt-get").arg("update"))?;
        Ok(apt)
    }

    fn command(&self, program: &str) -> Command {
        let dir = self.dir.display();
        let mut cmd = Command::new(program);
        for option in [
            format!("Dir::Etc::SourceList={dir}/sources.list"),
            "Dir::Etc::SourceParts=-".to_owned(),
            format!("Dir::State={dir}/state"),
            format!("Dir::Cache={dir}/cache"),
            "APT::Get::List-Cleanup=0".to_owned(),
            // Downloads land in our directory, which apt's `_apt` user may not write to.
            "APT::Sandbox::User=root".to_owned(),
        ] {
            cmd.arg("-o").arg(option);
        }
        cmd.arg("-q");
        cmd
    }

    /// The series' package with the highest version, and that version.
    fn newest(&self, series: Series) -> Result<(String, String)> {
        let names = self.output(self.command("apt-cache").args([
            "search",
            "--names-only",
            series.package_regex(),
        ]))?;
        let names: Vec<&str> = names
            .lines()
            .filter_map(|line| line.split(' ').next())
            .collect();
        if names.is_empty() {
            bail!(
                "no package matches {} in Debian {}",
                series.package_regex(),
                series.suite()
            );
        }
        let stanzas = self.output(
            self.command("apt-cache")
                .args(["show", "--no-all-versions"])
                .args(&names),
        )?;
        let mut newest: Option<(String, String)> = None;
        for (package, version) in packages_and_versions(&stanzas) {
            let newer = match &newest {
                None => true,
                Some((_, best)) => version_newer(&version, best)?,
            };
            if newer {
                newest = Some((package, version));
            }
        }
        newest.context("apt-cache show listed no versions")
    }

    /// Download `package` at `version` and return the .deb's path.
    fn download(&self, package: &str, version: &str) -> Result<PathBuf> {
        let dir = self.dir.join("download");
        clear_dir(&dir)?;
        run(self
            .command("apt-get")
            .current_dir(&dir)
            .arg("download")
            .arg(format!("{package}={version}")))?;
        let mut debs = fs::read_dir(&dir)
            .with_context(|| format!("cannot list {}", dir.display()))?
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "deb"));
        debs.next()
            .with_context(|| format!("apt-get download left no .deb in {}", dir.display()))
    }

    fn output(&self, cmd: &mut Command) -> Result<String> {
        let out = cmd.output().context("cannot run apt-cache")?;
        if !out.status.success() {
            bail!(
                "apt-cache failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// (Package, Version) of each stanza of `apt-cache show`.
fn packages_and_versions(stanzas: &str) -> Vec<(String, String)> {
    stanzas
        .split("\n\n")
        .filter_map(|stanza| {
            let field = |name: &str| {
                stanza
                    .lines()
                    .find_map(|line| line.strip_prefix(name))
                    .map(|value| value.trim().to_owned())
            };
            Some((field("Package:")?, field("Version:")?))
        })
        .collect()
}

/// Whether Debian version `a` is newer than `b`, as dpkg orders them.
fn version_newer(a: &str, b: &str) -> Result<bool> {
    let status = Command::new("dpkg")
        .args(["--compare-versions", a, "gt", b])
        .status()
        .context("cannot run dpkg --compare-versions")?;
    Ok(status.success())
}

fn clear_dir(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
    }
    Ok(())
}

/// Install the VM packages when we can (root on Debian); otherwise fail with what is missing.
pub fn ensure_vm_packages() -> Result<()> {
    if !system::is_debian() {
        bail!(
            "booting Debian's kernels needs a Debian machine (apt) with {}",
            VM_PACKAGES.join(" ")
        );
    }
    if system::is_root() {
        return system::apt_install(VM_PACKAGES);
    }
    let missing = system::missing_packages(VM_PACKAGES);
    if !missing.is_empty() {
        bail!(
            "missing packages for the VMs: sudo apt-get install -y {}",
            missing.join(" ")
        );
    }
    Ok(())
}

/// vng in a venv of the project's (`target/vm/venv`), installed from PyPI on first use.
fn ensure_vng() -> Result<PathBuf> {
    let venv = workspace_root().join("target").join("vm").join("venv");
    let vng = venv.join("bin").join("vng");
    let installed = Command::new(&vng)
        .arg("--version")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == VIRTME_NG_VERSION);
    if installed {
        return Ok(vng);
    }
    step(&format!("installing {VIRTME_NG} into {}", venv.display()));
    // Debian's python3: the one python3-venv belongs to, whatever else is on PATH.
    run(Command::new("/usr/bin/python3")
        .args(["-m", "venv", "--clear"])
        .arg(&venv))?;
    run(Command::new(venv.join("bin").join("pip")).args(["install", "-q", VIRTME_NG]))?;
    Ok(vng)
}

/// Whether `image` boots under KVM: booted without a root filesystem, a kernel panics at the end
/// of its boot and QEMU exits (`-no-reboot`). Its console goes to `target/vm/kvm-probe.log`.
fn kvm_boots(image: &Path) -> Result<bool> {
    if !Path::new("/dev/kvm").exists() {
        return Ok(false);
    }
    let log = vm_dir().join("kvm-probe.log");
    let _ = fs::remove_file(&log);
    println!(
        "    probing KVM (at most {} s)",
        KVM_PROBE_TIMEOUT.as_secs()
    );
    let mut qemu = Command::new("qemu-system-x86_64")
        .args(["-enable-kvm", "-cpu", "host", "-m", "512M"])
        .args(["-display", "none", "-monitor", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .arg("-kernel")
        .arg(image)
        .args(["-append", "console=ttyS0 panic=-1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot run qemu-system-x86_64")?;
    let deadline = Instant::now() + KVM_PROBE_TIMEOUT;
    while Instant::now() < deadline {
        if qemu.try_wait()?.is_some() {
            let console = fs::read_to_string(&log).unwrap_or_default();
            return Ok(console.contains("Kernel panic"));
        }
        thread::sleep(Duration::from_millis(100));
    }
    qemu.kill().context("cannot stop the KVM probe")?;
    qemu.wait()?;
    Ok(false)
}

/// PATH with `dir` in front.
fn path_with(dir: &Path) -> Result<std::ffi::OsString> {
    let rest = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(std::iter::once(dir.to_path_buf()).chain(std::env::split_paths(&rest)))
        .context("PATH has a directory that cannot be joined")
}

/// `word` as one word for the guest's bash.
pub fn shell_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// Kills a guest (vng's process group) that has printed nothing for its silence limit.
struct Watchdog {
    state: std::sync::Arc<(std::sync::Mutex<WatchdogState>, std::sync::Condvar)>,
    thread: thread::JoinHandle<()>,
}

struct WatchdogState {
    last_heard: Instant,
    done: bool,
    fired: bool,
}

impl Watchdog {
    fn start(group: u32, limit: Duration) -> Self {
        let state = std::sync::Arc::new((
            std::sync::Mutex::new(WatchdogState {
                last_heard: Instant::now(),
                done: false,
                fired: false,
            }),
            std::sync::Condvar::new(),
        ));
        let thread = thread::spawn({
            let state = state.clone();
            move || {
                let (lock, wake) = &*state;
                let mut guard = lock.lock().unwrap();
                while !guard.done {
                    let silent = guard.last_heard.elapsed();
                    if silent >= limit {
                        guard.fired = true;
                        // SAFETY: kill(2) on the process group vng leads.
                        unsafe { libc::kill(-(group as i32), libc::SIGKILL) };
                        return;
                    }
                    guard = wake.wait_timeout(guard, limit - silent).unwrap().0;
                }
            }
        });
        Self { state, thread }
    }

    fn heard(&self) {
        self.state.0.lock().unwrap().last_heard = Instant::now();
    }

    /// Stops watching; whether the guest was killed.
    fn stop(self) -> bool {
        let (lock, wake) = &*self.state;
        lock.lock().unwrap().done = true;
        wake.notify_all();
        drop(self.thread.join());
        let fired = lock.lock().unwrap().fired;
        fired
    }
}
