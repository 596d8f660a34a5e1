//! docs/configuration.md, the reference an operator reads, is generated from the command line the
//! agent parses (`weir_agent::cli::markdown()`), and names every flag, its environment variable
//! and the logging settings. Nothing here needs privileges.
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use weir_agent::cli::{markdown, Cli};

/// How to bring the file up to date.
const REGENERATE: &str = "WEIR_BLESS=1 cargo test -p weir-tests --test configuration";

fn reference() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md")
}

#[test]
fn docs_configuration_md_is_what_the_agents_command_line_generates() {
    let generated = markdown();
    let path = reference();
    if std::env::var_os("WEIR_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let written = std::fs::read_to_string(&path).unwrap_or_default();
    if written == generated {
        return;
    }
    let first_difference = written
        .lines()
        .zip(generated.lines())
        .position(|(was, now)| was != now)
        .unwrap_or_else(|| written.lines().count().min(generated.lines().count()));
    panic!(
        "{} differs from the agent's flags (agent/src/cli.rs) from line {}:\n  written:   {:?}\n  \
         generated: {:?}\nregenerate it with `{REGENERATE}`",
        path.display(),
        first_difference + 1,
        written
            .lines()
            .nth(first_difference)
            .unwrap_or("(end of file)"),
        generated
            .lines()
            .nth(first_difference)
            .unwrap_or("(end of file)"),
    );
}

#[test]
fn the_reference_names_every_subcommand_flag_and_environment_variable() {
    let text = markdown();
    let mut command = Cli::command();
    command.build();
    let commands = std::iter::once(&command).chain(
        command
            .get_subcommands()
            .filter(|subcommand| subcommand.get_name() != "help"),
    );
    for command in commands {
        if command.get_name() != "weir-agent" {
            let heading = format!("## `weir-agent {}`", command.get_name());
            assert!(text.contains(&heading), "no {heading}");
        }
        for arg in command.get_arguments() {
            let Some(long) = arg
                .get_long()
                .filter(|long| !["help", "version"].contains(long))
            else {
                continue;
            };
            assert!(
                text.contains(&format!("`--{long}")),
                "--{long} is not in the reference"
            );
            if let Some(env) = arg.get_env() {
                let env = format!("`{}`", env.to_string_lossy());
                assert!(
                    text.contains(&env),
                    "{env} (--{long}) is not in the reference"
                );
            }
        }
    }
    for variable in ["`RUST_LOG`", "`LOG_FORMAT`"] {
        assert!(
            text.contains(variable),
            "{variable} is not in the reference"
        );
    }
}

/// `weir-agent completion bash` (the built binary: `cargo build -p weir-agent` first) completes
/// every subcommand.
#[test]
fn the_bash_completion_script_names_every_subcommand() {
    let output = std::process::Command::new(weir_tests::agent::workspace_binary("weir-agent"))
        .args(["completion", "bash"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let script = String::from_utf8(output.stdout).unwrap();
    let mut command = Cli::command();
    command.build();
    for subcommand in command.get_subcommands() {
        let name = subcommand.get_name();
        assert!(script.contains(name), "{name} not in:\n{script}");
    }
}
