//! docs/configuration.md, the reference an operator reads, is generated from the command line the
//! agent parses (`weir_agent::cli::markdown()`), and names every flag, its environment variable,
//! istio-cni's variables and the logging settings; the built `weir-agent` reads istio-cni's
//! variables as the reference says, and refuses those it cannot honour. Nothing here needs
//! privileges; the binary's tests need `cargo build -p weir-agent` first.
use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use clap::CommandFactory;
use serde_json::json;
use weir_agent::cli::{istio::ISTIO_SETTINGS, markdown, Cli};
use weir_tests::agent::workspace_binary;

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
    for setting in ISTIO_SETTINGS {
        let variable = format!("`{}`", setting.name);
        assert!(
            text.contains(&variable),
            "istio-cni's {variable} is not in the reference"
        );
    }
    for variable in ["`RUST_LOG`", "`LOG_FORMAT`"] {
        assert!(
            text.contains(variable),
            "{variable} is not in the reference"
        );
    }
}

/// `weir-agent args…` with `env` added to an environment without weir's or istio-cni's
/// variables: (status and stdout, stderr).
fn weir_agent(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let mut command = Command::new(workspace_binary("weir-agent"));
    for (name, _) in std::env::vars() {
        let istio = ISTIO_SETTINGS.iter().any(|setting| setting.name == name);
        if istio || name.starts_with("WEIR_") || name == "LOG_FORMAT" {
            command.env_remove(name);
        }
    }
    let output = command
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("running weir-agent");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output, stderr)
}

/// `weir-agent check` in an istio-cni DaemonSet's environment looks where istio-cni's variables
/// say, and logs each one it read.
#[test]
fn the_agent_reads_istio_cni_s_variables() {
    let dir = tempfile::tempdir().unwrap();
    let net_dir = dir.path().join("net.d");
    std::fs::create_dir(&net_dir).unwrap();
    let primary = net_dir.join("10-bridge.conflist");
    std::fs::write(
        &primary,
        json!({"cniVersion": "1.0.0", "name": "pods", "plugins": [{"type": "bridge"}]}).to_string(),
    )
    .unwrap();
    let zds_socket = dir.path().join("ztunnel/ztunnel.sock");
    let pin_root = dir.path().join("pins");
    let (output, stderr) = weir_agent(
        &["check", "--pin-root", pin_root.to_str().unwrap()],
        &[
            ("MOUNTED_CNI_NET_DIR", net_dir.to_str().unwrap()),
            ("ZTUNNEL_UDS_ADDRESS", zds_socket.to_str().unwrap()),
            ("AMBIENT_ENABLED", "true"),
            ("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "false"),
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(&format!(
            "primary CNI network config: {}",
            primary.display()
        )),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("ZDS socket {}", zds_socket.display())),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "MOUNTED_CNI_NET_DIR={0} read as WEIR_CNI_NET_DIR={0}",
            net_dir.display()
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP is ignored"),
        "{stderr}"
    );
}

/// A setting weir cannot honour, or one setting given two values, stops the agent before it
/// does anything, with a message naming the variables.
#[test]
fn the_agent_refuses_istio_cni_s_variables_it_cannot_honour() {
    let dir = tempfile::tempdir().unwrap();
    let pods = [
        "pods",
        "--pin-root",
        dir.path().to_str().unwrap(),
        "--state-file",
        "/nonexistent/pods.json",
    ];
    let (output, stderr) = weir_agent(&pods, &[("AMBIENT_ENABLED", "false")]);
    assert!(!output.status.success(), "{stderr}");
    assert!(output.stdout.is_empty(), "{stderr}");
    assert!(
        stderr.contains("AMBIENT_ENABLED=\"false\" cannot be honoured"),
        "{stderr}"
    );

    let (output, stderr) = weir_agent(
        &pods,
        &[
            ("WEIR_CNI_NET_DIR", "/etc/cni/net.d"),
            ("MOUNTED_CNI_NET_DIR", "/host/etc/cni/net.d"),
        ],
    );
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("WEIR_CNI_NET_DIR and MOUNTED_CNI_NET_DIR=/host/etc/cni/net.d give"),
        "{stderr}"
    );
}

/// `weir-agent completion bash` (the built binary: `cargo build -p weir-agent` first) completes
/// every subcommand.
#[test]
fn the_bash_completion_script_names_every_subcommand() {
    let (output, stderr) = weir_agent(&["completion", "bash"], &[]);
    assert!(output.status.success(), "{stderr}");
    let script = String::from_utf8(output.stdout).unwrap();
    let mut command = Cli::command();
    command.build();
    for subcommand in command.get_subcommands() {
        let name = subcommand.get_name();
        assert!(script.contains(name), "{name} not in:\n{script}");
    }
}
