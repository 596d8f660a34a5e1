//! The `weir-cni` binary, run by the container runtime. All logic is in the `weir_cni` library.
use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let outcome = weir_cni::run(&weir_cni::CniEnv::from_process(), std::io::stdin().lock());
    // Not println!: it panics when stdout is closed, and there is nobody left to tell anyway.
    let _ = std::io::stdout()
        .lock()
        .write_all(outcome.stdout.as_bytes());
    ExitCode::from(outcome.exit_code)
}
