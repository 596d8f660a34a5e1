//! The agent's log lines as an operator's log pipeline gets them: `--log-format json` (or
//! `LOG_FORMAT=json`) writes one JSON object per line, an error with its whole chain of causes,
//! and every line about a pod with the pod's `namespace`, `name` and `uid`; plain text written to
//! a file has no colour codes.
//!
//! The `weir-agent` tests run the built binary: `cargo build -p weir-agent` first. The pod test
//! needs privileges (it enrolls a pod through the CNI chain) and is skipped without them.
use std::{
    fs::File,
    path::Path,
    process::{Command, Output, Stdio},
    sync::{Arc, Mutex},
};

use serde_json::Value;
use tracing_subscriber::{util::SubscriberInitExt, EnvFilter};
use weir_agent::logging::{self, LogFormat};
use weir_tests::privileged;
use weir_tests::{
    agent::workspace_binary,
    chain::{CniChainNode, MESH},
};

/// `weir-agent args…` with `env` set and RUST_LOG and LOG_FORMAT unset (the defaults apply),
/// its stderr written to a file, as a log collector or `2> file` gets it: (exit status, stderr).
fn weir_agent(args: &[&str], env: &[(&str, &str)], dir: &Path) -> (Output, String) {
    let stderr_path = dir.join("stderr");
    let stderr = File::create(&stderr_path).unwrap();
    let output = Command::new(workspace_binary("weir-agent"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("LOG_FORMAT")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stderr(stderr)
        .output()
        .expect("running weir-agent");
    (output, std::fs::read_to_string(stderr_path).unwrap())
}

/// `weir-agent [global_args…] pods` with its pin root and state file in `dir`, as [`weir_agent`]
/// runs it.
fn weir_agent_pods(dir: &Path, global_args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let state_file = dir.join("pods.json");
    let mut args = global_args.to_vec();
    args.extend([
        "pods",
        "--pin-root",
        dir.to_str().unwrap(),
        "--state-file",
        state_file.to_str().unwrap(),
    ]);
    weir_agent(&args, env, dir)
}

/// Every line of `text` as a JSON object; panics on a line that is not one.
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|line| match serde_json::from_str::<Value>(line) {
            Ok(object @ Value::Object(_)) => object,
            _ => panic!("not a JSON object: {line:?}\nin:\n{text}"),
        })
        .collect()
}

/// `weir-agent pods` on a pin root whose map directory is there but holds no maps: it fails
/// opening the first map, an error with a cause (the errno).
#[test]
fn json_lines_are_one_object_each_and_an_error_carries_its_causes() {
    let dir = tempfile::tempdir().unwrap();
    let maps = dir.path().join(format!("abi-{}", weir_common::ABI_VERSION));
    std::fs::create_dir(&maps).unwrap();
    let (output, stderr) = weir_agent_pods(dir.path(), &["--log-format", "json"], &[]);
    assert!(!output.status.success(), "{stderr}");
    let lines = json_lines(&stderr);
    let error = lines
        .iter()
        .find(|line| line["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no ERROR line in:\n{stderr}"));
    let message = error["message"].as_str().unwrap();
    let opening = format!("opening {}", maps.display());
    assert!(message.starts_with(&opening), "{message}");
    // The cause under the context: the errno of the failed bpf(BPF_OBJ_GET).
    assert!(message.contains("(os error "), "{message}");
    for line in &lines {
        for field in ["timestamp", "level", "target", "message"] {
            assert!(line[field].is_string(), "{field} in {line}");
        }
    }
}

#[test]
fn log_format_is_read_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let pin_root = dir.path().to_str().unwrap();
    let (output, stderr) = weir_agent_pods(dir.path(), &[], &[("LOG_FORMAT", "json")]);
    assert!(output.status.success(), "{stderr}");
    let lines = json_lines(&stderr);
    let warning = lines
        .iter()
        .find(|line| line["message"] == "no weir maps pinned there")
        .unwrap_or_else(|| panic!("no warning about the empty pin root in:\n{stderr}"));
    assert_eq!(warning["level"], "WARN");
    assert_eq!(warning["target"], "weir_agent::inspect");
    assert_eq!(
        warning["pin_root"], pin_root,
        "the event's field, at the top level"
    );
}

#[test]
fn plain_lines_written_to_a_file_have_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let (output, stderr) = weir_agent_pods(dir.path(), &[], &[]);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("no weir maps pinned there"), "{stderr}");
    assert!(
        !stderr.contains('\x1b'),
        "escape codes in a file: {stderr:?}"
    );
}

/// Log lines in memory, as a writer for a subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A pod enrolled through the CNI chain: each of the agent's lines about it (the CNI request,
/// ztunnel's Add, the datapath's own thread) names it the same way.
#[test]
fn every_line_about_an_enrolled_pod_carries_its_namespace_name_and_uid() {
    let node = privileged!(CniChainNode::new());
    let captured = Captured::default();
    let writer = captured.clone();
    // The agent runs in this process, on threads of its own: the subscriber is the process's.
    logging::subscriber(
        LogFormat::Json,
        EnvFilter::new("info,weir_agent=debug"),
        move || writer.clone(),
        false,
    )
    .try_init()
    .unwrap();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (pod, _) = node.ambient_pod(&ztunnel, "client");
    agent.stop().unwrap();

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let about_pod: Vec<Value> = json_lines(&text)
        .into_iter()
        .filter(|line| line["uid"] == pod.uid())
        .collect();
    let targets: Vec<&str> = about_pod
        .iter()
        .filter_map(|line| line["target"].as_str())
        .collect();
    for target in [
        "weir_agent::enroll",
        "weir_agent::zds",
        "weir_agent::datapath::pods",
    ] {
        assert!(
            targets.contains(&target),
            "no line about the pod from {target} in:\n{text}"
        );
    }
    for line in &about_pod {
        assert_eq!(line["namespace"], MESH, "{line}");
        assert_eq!(line["name"], "client", "{line}");
    }
}
