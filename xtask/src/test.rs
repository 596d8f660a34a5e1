//! `cargo xtask test`: every test, in the order CI runs them.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use crate::system::{self, cargo};
use crate::vm::{self, Kernel, Series, Vm};
use crate::{bench, deny, ebpf, helm, image, packages, step, sweep};

/// The test targets that drive the kernel (program loading and attaching, packet paths, the
/// kernel's answers to faults): what runs on the other kernels, each whole or only its tests
/// whose names hold the filter given. `kernel_compat` is optional. Targets that only decode input
/// (`fuzz`) run the same on every kernel: this machine's suffices.
const KERNEL_FACING: &[(&str, Option<&str>)] = &[
    ("attacks", None),
    ("datapath", None),
    ("interfaces", None),
    ("faults", None),
    ("trace", None),
    ("sidecar", None),
    ("kernel_compat", None),
    // A node moved from istio-cni's rules to weir's programs and back, under traffic: both on
    // one pod at once, and conntrack's part in the hand-back.
    ("cluster", Some("takeover::")),
];
/// The guests have 2 vCPUs (emulated, under TCG). With 3 tests at a time, three fault tests on
/// 6.1 stopped making progress together; with 2, every target passes.
const GUEST_TEST_THREADS: u32 = 2;
/// A test executable that hangs in a guest fails its target after this, and the next one runs.
const GUEST_TARGET_TIMEOUT_SECS: u32 = 20 * 60;
/// The guest script says it is alive this often; a guest silent for [`GUEST_SILENCE_LIMIT`]
/// has stopped answering and is killed. Under emulation a guest has, rarely, stopped without a
/// word (its own timeouts with it) or ended before its last target: the targets it left without
/// a result run once more in a new guest, which the summary says.
const GUEST_ALIVE_INTERVAL_SECS: u32 = 30;
const GUEST_SILENCE_LIMIT: Duration = Duration::from_secs(5 * 60);
/// The guests' factor for every deadline the tests wait with (`WEIR_TEST_WAIT_SCALE`, read by
/// `tests/src/wait.rs`): their CPUs are emulated. A passing test waits only as long as the
/// thing takes, so the factor costs nothing where it was not needed.
const GUEST_WAIT_SCALE: u32 = 4;

pub fn run(host_only: bool, test_args: &[String]) -> Result<()> {
    step("checking test system packages");
    packages::ensure_test_packages()?;

    let object = ebpf::build(false)?;

    step("checking formatting");
    system::run(with_object(cargo(), &object).args(["fmt", "--all", "--", "--check"]))?;
    system::run(ebpf_on_host().args(["fmt", "--", "--check"]))?;

    build_test_binaries(&object)?;
    // The other kernels' guests, one after another, are most of the run: they start as soon as
    // the test executables are built, and everything else here runs beside them (the tests here
    // mostly wait on their pods and agents). Their output goes to a log file per kernel, printed
    // whole for a kernel that failed.
    let kernels = (!host_only)
        .then(|| Matrix::prepare(&object, &Series::ALL, false, &[]))
        .transpose()?
        .map(|matrix| thread::spawn(move || matrix.run(GuestOutput::LogFiles)));

    let host = lint(&object).and_then(|()| on_this_kernel(&object, test_args));
    let Some(kernels) = kernels else {
        return host;
    };
    if host.is_err() {
        step("the tests failed on this machine's kernel (the error follows); waiting for the other kernels'");
    }
    let kernels = kernels
        .join()
        .unwrap_or_else(|_| Err(anyhow!("the kernel matrix's thread panicked")));
    host.and(kernels)
}

/// clippy over the workspace and the kernel crate, and the kernel crate's helpers' unit tests.
fn lint(object: &Path) -> Result<()> {
    step("running clippy");
    system::run(with_object(cargo(), object).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // The kernel crate builds for the host too, so the host's clippy lints it and its pure
    // helpers have unit tests.
    system::run(ebpf_on_host().args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;

    step("testing the kernel crate's helpers on the host");
    system::run(ebpf_on_host().arg("test"))
}

/// The tests on this machine's kernel, the image's and the chart's among them, then the bench's
/// quick configuration and the dependencies' policy.
fn on_this_kernel(object: &Path, test_args: &[String]) -> Result<()> {
    // The image test runs the image as a node would.
    let agent = crate::target_dir()?.join("debug").join("weir-agent");
    let image = image::build(object, image::Profile::Test, Some(&agent))?;
    // The chart test renders deploy/chart.
    let helm = helm::ensure()?;

    let mut test = with_object(cargo(), object);
    test.args(["test", "--workspace"])
        .env(image::ARCHIVE_ENV, &image)
        .env(helm::HELM_ENV, &helm);
    privileged_test_runner(&mut test)?;
    test.args(test_args);

    step("sweeping leftovers of earlier test runs");
    sweep::run_privileged()?;
    step("running tests");
    let result = system::run(&mut test).and_then(|()| {
        step("running the bench's quick configuration (it runs; no figures)");
        bench::run_built(true, &[])
    });
    // After the tests, while the other kernels' guests still run: cargo-deny's first build
    // then costs CI no wall time.
    let result = result.and_then(|()| deny::check());
    step("sweeping leftovers of this test run");
    let swept = sweep::run_privileged();
    result.and(swept)
}

/// The binaries the tests run (weir-cni, weir-agent, weir-bench), built before any test runs:
/// the guests run them from this machine's target directory.
fn build_test_binaries(object: &Path) -> Result<()> {
    step("building the binaries the tests run (weir-cni, weir-agent, weir-bench)");
    system::run(with_object(cargo(), object).args(["build", "--workspace", "--bins"]))
}

/// `cargo xtask test-kernels`: the kernel-facing test executables (or all of them) in one guest
/// per kernel of `series`, with `filter` passed to each.
pub fn run_kernels(series: &[Series], all: bool, filter: &[String]) -> Result<()> {
    step("checking test system packages");
    // The guests run this machine's ip, bpftool and CNI plugins.
    packages::ensure_test_packages()?;
    let object = ebpf::build(false)?;
    kernel_matrix(&object, series, all, filter)
}

/// `cmd` from the workspace root, with the eBPF object the agent embeds.
fn with_object(mut cmd: Command, object: &Path) -> Command {
    cmd.current_dir(crate::workspace_root())
        .env("WEIR_EBPF_OBJECT", object);
    cmd
}

/// cargo in `ebpf/` (outside the workspace) with the workspace's toolchain, building for the
/// host into a target directory of its own.
fn ebpf_on_host() -> Command {
    let root = crate::workspace_root();
    let mut cmd = cargo();
    cmd.current_dir(root.join("ebpf"))
        .env("CARGO_TARGET_DIR", root.join("target").join("ebpf-host"));
    cmd
}

/// The privileged tests need root: when we are not, run the test executables (only them; the
/// build stays ours) under `sudo -E`.
fn privileged_test_runner(test: &mut Command) -> Result<()> {
    if system::is_root() {
        return Ok(());
    }
    if system::find_on_path("sudo").is_some() {
        println!("    not root: the test executables run under `sudo -E`");
        test.args(["--config", r#"target."cfg(all())".runner = "sudo -E""#]);
        return Ok(());
    }
    if system::in_ci() {
        bail!("the privileged tests need root: run `cargo xtask test` as root, or install sudo");
    }
    eprintln!("warning: not root and no sudo: the privileged tests will skip");
    Ok(())
}

/// Fetch the kernels, build the tests, run them in one guest per kernel, print the results.
fn kernel_matrix(object: &Path, series: &[Series], all: bool, filter: &[String]) -> Result<()> {
    build_test_binaries(object)?;
    Matrix::prepare(object, series, all, filter)?.run(GuestOutput::Streamed)
}

/// Where a guest's output goes.
#[derive(Clone, Copy)]
enum GuestOutput {
    /// To ours, as it comes.
    Streamed,
    /// To `target/vm/<series>.log`, printed whole when a target failed there; ours gets one line
    /// per target.
    LogFiles,
}

/// The kernels, the test executables and the guest script that runs them, ready to boot.
struct Matrix {
    vm: Vm,
    kernels: Vec<Kernel>,
    targets: Vec<TestTarget>,
    object: PathBuf,
    filter: Vec<String>,
}

impl Matrix {
    /// Fetches the kernels and builds the test executables (`build_test_binaries` first).
    fn prepare(object: &Path, series: &[Series], all: bool, filter: &[String]) -> Result<Self> {
        // Unpacking a kernel needs depmod (kmod) already.
        vm::ensure_vm_packages()?;
        let kernels = series
            .iter()
            .map(|&series| vm::kernel(series))
            .collect::<Result<Vec<_>>>()?;
        let Some(first) = kernels.first() else {
            bail!("no kernel to run the tests on");
        };
        step("building the test executables");
        let targets = test_targets(object, all)?;
        let vm = Vm::prepare(first)?;
        Ok(Self {
            vm,
            kernels,
            targets,
            object: object.to_owned(),
            filter: filter.to_vec(),
        })
    }

    /// Runs the tests in one guest per kernel, in turn, then prints the results.
    fn run(&self, output: GuestOutput) -> Result<()> {
        let runs = self
            .kernels
            .iter()
            .map(|kernel| self.run_on_kernel(kernel, output))
            .collect::<Result<Vec<_>>>()?;
        if let GuestOutput::LogFiles = output {
            for run in runs.iter().filter(|run| !run.passed()) {
                print_log(&vm::log_path(run.kernel.series))?;
            }
        }
        print_summary(&runs, &self.targets);
        let failed = runs.iter().filter(|run| !run.passed()).count();
        if failed > 0 {
            bail!("the tests failed on {failed} of {} kernels", runs.len());
        }
        Ok(())
    }
}

/// A failed kernel's log, whole, between two step lines.
fn print_log(log: &Path) -> Result<()> {
    step(&format!("{}, where the tests failed", log.display()));
    let mut stdout = io::stdout().lock();
    io::copy(
        &mut File::open(log).with_context(|| format!("cannot open {}", log.display()))?,
        &mut stdout,
    )?;
    writeln!(stdout, "==> end of {}", log.display())?;
    Ok(())
}

/// A test executable cargo built, as `cargo test` runs it.
struct TestTarget {
    label: String,
    executable: PathBuf,
    package_dir: PathBuf,
    /// Only its tests whose names hold this, unless the run is given a filter of its own.
    only: Option<&'static str>,
}

/// The test executables of the workspace (every one with `all`, else the kernel-facing ones),
/// from cargo's build messages.
fn test_targets(object: &Path, all: bool) -> Result<Vec<TestTarget>> {
    let out = with_object(cargo(), object)
        .args(["test", "--workspace", "--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the test executables failed: {}", out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut built: Vec<(String, TestTarget)> = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|message| test_target(&message))
        .collect();
    if all {
        let mut targets: Vec<TestTarget> = built.into_iter().map(|(_, target)| target).collect();
        targets.sort_by(|a, b| a.label.cmp(&b.label));
        return Ok(targets);
    }
    let mut targets = Vec::new();
    for &(name, only) in KERNEL_FACING {
        match built
            .iter()
            .position(|(kind, target)| kind == "test" && target.label == name)
        {
            Some(index) => targets.push(TestTarget {
                only,
                ..built.swap_remove(index).1
            }),
            None => println!("    no test target {name} in the workspace"),
        }
    }
    if targets.is_empty() {
        let names: Vec<&str> = KERNEL_FACING.iter().map(|(name, _)| *name).collect();
        bail!(
            "none of the kernel-facing test targets ({}) was built",
            names.join(", ")
        );
    }
    Ok(targets)
}

/// The test executable of a `compiler-artifact` message, with its target's kind (`test`, `lib`,
/// `bin`, ...).
fn test_target(message: &Value) -> Option<(String, TestTarget)> {
    if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
        return None;
    }
    let executable = PathBuf::from(message["executable"].as_str()?);
    let package_dir = Path::new(message["manifest_path"].as_str()?)
        .parent()?
        .to_path_buf();
    let name = message["target"]["name"].as_str()?;
    let kind = message["target"]["kind"][0].as_str()?.to_owned();
    // Integration tests go by their name; a crate's own unit tests by its name and kind.
    let label = if kind == "test" {
        name.to_owned()
    } else {
        format!("{name} ({kind})")
    };
    Some((
        kind,
        TestTarget {
            label,
            executable,
            package_dir,
            only: None,
        },
    ))
}

/// The guest's script: each test executable in turn as `cargo test` runs it (from its package's
/// directory, `CARGO_MANIFEST_DIR` set), as CI runs it (`CI=true`: privileged tests fail rather
/// than skip), each followed by a result marker; the kernel's warnings when one failed.
/// `targets`: each with its index in the matrix, which its result marker carries.
fn guest_script(object: &Path, targets: &[(usize, &TestTarget)], filter: &[String]) -> String {
    let marker = vm::MARKER;
    let quote = |path: &Path| vm::shell_quote(&path.to_string_lossy());
    let mut script = format!(
        r#"export CI=true RUST_BACKTRACE=1 WEIR_EBPF_OBJECT={object} WEIR_TEST_WAIT_SCALE={GUEST_WAIT_SCALE}
failed=0
(while sleep {GUEST_ALIVE_INTERVAL_SECS}; do echo "{marker}{alive}"; done) &
alive=$!
# run_target INDEX LABEL DIR EXECUTABLE ARGS...
run_target() {{
    local index=$1 label=$2 dir=$3
    shift 3
    echo "==> $(uname -r): $label"
    local start=$SECONDS
    (cd "$dir" && CARGO_MANIFEST_DIR="$dir" timeout --kill-after=10 {GUEST_TARGET_TIMEOUT_SECS} "$@")
    local status=$?
    echo "{marker}result $index $status $((SECONDS - start))"
    [ "$status" = 0 ] || failed=1
}}
"#,
        object = quote(object),
        alive = vm::ALIVE,
    );
    for (index, target) in targets {
        let own = target.only.filter(|_| filter.is_empty()).map(str::to_owned);
        let args: Vec<String> = std::iter::once(format!("--test-threads={GUEST_TEST_THREADS}"))
            .chain(filter.iter().cloned())
            .chain(own)
            .map(|arg| vm::shell_quote(&arg))
            .collect();
        script += &format!(
            "run_target {index} {} {} {} {}\n",
            vm::shell_quote(&target.label),
            quote(&target.package_dir),
            quote(&target.executable),
            args.join(" ")
        );
    }
    script += r#"kill "$alive"
if [ "$failed" != 0 ]; then
    echo "==> $(uname -r): the kernel's warnings and errors"
    dmesg --level=emerg,alert,crit,err,warn | tail -n 50
fi
exit "$failed"
"#;
    script
}

/// How one test executable ended in a guest.
struct TargetResult {
    status: i32,
    seconds: u64,
}

/// Whether a target ran and passed (no result: the guest died before it ended).
fn target_passed(result: &Option<TargetResult>) -> bool {
    result.as_ref().is_some_and(|result| result.status == 0)
}

/// One kernel's guest: when it was up, how long it took, each target's result (none when the
/// guest died first).
struct KernelRun<'a> {
    kernel: &'a Kernel,
    boot: vm::Boot,
    elapsed: Duration,
    results: Vec<Option<TargetResult>>,
    /// What ran again after a guest stopped answering.
    rerun: Option<String>,
}

impl KernelRun<'_> {
    fn passed(&self) -> bool {
        self.boot.status == 0 && self.results.iter().all(target_passed)
    }
}

impl Matrix {
    /// The targets in one guest of `kernel`; those left without a result by a guest that
    /// stopped answering or ended early, once more in a new one.
    fn run_on_kernel<'a>(&self, kernel: &'a Kernel, output: GuestOutput) -> Result<KernelRun<'a>> {
        let started = Instant::now();
        let mut out: Box<dyn Write> = match output {
            GuestOutput::Streamed => Box::new(io::stdout()),
            GuestOutput::LogFiles => {
                let log = vm::log_path(kernel.series);
                println!("    {kernel}: its guest's output goes to {}", log.display());
                Box::new(
                    File::create(&log)
                        .with_context(|| format!("cannot create {}", log.display()))?,
                )
            }
        };
        let mut results: Vec<Option<TargetResult>> = self.targets.iter().map(|_| None).collect();
        let mut rerun = None;
        let mut boot = self.boot(kernel, &mut out, &mut results)?;
        let left: Vec<&str> = (self.targets.iter().zip(&results))
            .filter(|(_, result)| result.is_none())
            .map(|(target, _)| target.label.as_str())
            .collect();
        if boot.boot_time.is_some() && !left.is_empty() {
            let how = match boot.stopped_answering {
                true => format!(
                    "said nothing for {} s and was stopped",
                    GUEST_SILENCE_LIMIT.as_secs()
                ),
                false => format!("ended (status {}) before its last target", boot.status),
            };
            let said = format!(
                "the {} guest {how}; {} ran again in a new guest",
                kernel.series,
                left.join(", ")
            );
            step(&said);
            writeln!(out, "==> {said}")?;
            rerun = Some(said);
            boot = self.boot(kernel, &mut out, &mut results)?;
        }
        Ok(KernelRun {
            kernel,
            boot,
            elapsed: started.elapsed(),
            results,
            rerun,
        })
    }

    /// One guest of `kernel`, running the targets without a result yet.
    fn boot(
        &self,
        kernel: &Kernel,
        out: &mut dyn Write,
        results: &mut [Option<TargetResult>],
    ) -> Result<vm::Boot> {
        let targets: Vec<(usize, &TestTarget)> = (self.targets.iter().enumerate())
            .filter(|(index, _)| results[*index].is_none())
            .collect();
        let script = guest_script(&self.object, &targets, &self.filter);
        self.vm
            .run(kernel, &script, out, Some(GUEST_SILENCE_LIMIT), |marker| {
                let Some((index, result)) = parse_result(marker) else {
                    println!("{}{marker}", vm::MARKER);
                    return;
                };
                if let Some(target) = self.targets.get(index) {
                    println!(
                        "<== {}: {}: {} after {} s",
                        kernel.series,
                        target.label,
                        describe(result.status),
                        result.seconds
                    );
                    results[index] = Some(result);
                }
            })
    }
}

/// `result INDEX STATUS SECONDS`, as the guest script prints it after each target.
fn parse_result(marker: &str) -> Option<(usize, TargetResult)> {
    let mut words = marker.strip_prefix("result ")?.split(' ');
    let index = words.next()?.parse().ok()?;
    let status = words.next()?.parse().ok()?;
    let seconds = words.next()?.parse().ok()?;
    Some((index, TargetResult { status, seconds }))
}

/// A test executable's exit status as bash reports it (128 + N: killed by signal N).
fn describe(status: i32) -> String {
    match status {
        0 => "passed".to_owned(),
        // timeout(1)'s: the target outlived GUEST_TARGET_TIMEOUT_SECS.
        124 => format!("FAILED (timed out after {GUEST_TARGET_TIMEOUT_SECS} s)"),
        129.. => format!("FAILED (killed by signal {})", status - 128),
        _ => format!("FAILED (exit {status})"),
    }
}

/// One line per kernel and target, then the count, as a plain closing line.
fn print_summary(runs: &[KernelRun], targets: &[TestTarget]) {
    step("the tests on other kernels");
    let width = targets.iter().map(|t| t.label.len()).max().unwrap_or(0);
    let (mut passed, mut failed) = (0, 0);
    for run in runs {
        let up = run.boot.boot_time.map_or("never came up".to_owned(), |t| {
            format!("up after {:.0} s", t.as_secs_f64())
        });
        println!(
            "{}: {up}, {:.0} s in all",
            run.kernel,
            run.elapsed.as_secs_f64()
        );
        for (target, result) in targets.iter().zip(&run.results) {
            let outcome = match result {
                Some(result) => format!("{:>5} s  {}", result.seconds, describe(result.status)),
                None => "    -    FAILED (no result: the guest died before it ended)".to_owned(),
            };
            if target_passed(result) {
                passed += 1;
            } else {
                failed += 1;
            }
            println!(
                "    {:<5} {:<width$}  {outcome}",
                run.kernel.series, target.label
            );
        }
        if run.boot.status != 0 && run.results.iter().all(target_passed) {
            println!("    the guest exited with status {}", run.boot.status);
        }
        if let Some(rerun) = &run.rerun {
            println!("    {rerun}");
        }
    }
    println!("kernels: {passed} passed, {failed} failed");
}
