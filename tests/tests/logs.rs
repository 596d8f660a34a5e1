//! The agent's log lines as an operator's log pipeline gets them: `--log-format json` (or
//! `LOG_FORMAT=json`) writes one JSON object per line with istio's keys (`time`, `level`,
//! `scope`, `msg`), an error with its whole chain of causes, and every line about a pod, weir-cni's
//! among them, with the pod's `namespace`, `name` and `uid`; plain text written to a file has no
//! colour codes; an invalid `RUST_LOG` is reported, and `/logging` on the admin address changes
//! the filter of a running agent.
//!
//! The `weir-agent` tests run the built binary: `cargo build -p weir-agent` first. The pod and
//! `/logging` tests need privileges (they run the agent on a test node) and are skipped without
//! them.
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
    agent::{http_request, workspace_binary, AgentBinary},
    chain::{CniChainNode, MESH, WAIT},
    wait_until,
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
        .find(|line| line["level"] == "error")
        .unwrap_or_else(|| panic!("no error line in:\n{stderr}"));
    let message = error["msg"].as_str().unwrap();
    let opening = format!("opening {}", maps.display());
    assert!(message.starts_with(&opening), "{message}");
    // The cause under the context: the errno of the failed bpf(BPF_OBJ_GET).
    assert!(message.contains("(os error "), "{message}");
    for line in &lines {
        for field in ["time", "level", "scope", "msg"] {
            assert!(line[field].is_string(), "{field} in {line}");
        }
    }
}

/// A typo in `RUST_LOG` neither stops the agent nor goes unnoticed: a warning names the bad
/// directive and the filter used instead, and the lines that filter lets through are written.
#[test]
fn an_invalid_rust_log_is_reported_and_the_default_filter_used() {
    let dir = tempfile::tempdir().unwrap();
    let rust_log = "info,weir_agent::datapath=chatty";
    let env = [("RUST_LOG", rust_log), ("LOG_FORMAT", "json")];
    let (output, stderr) = weir_agent_pods(dir.path(), &[], &env);
    assert!(output.status.success(), "{stderr}");
    let lines = json_lines(&stderr);
    let warning = lines
        .iter()
        .find(|line| line["rust_log"] == rust_log)
        .unwrap_or_else(|| panic!("no warning about RUST_LOG in:\n{stderr}"));
    assert_eq!(warning["level"], "warn");
    let msg = warning["msg"].as_str().unwrap();
    assert!(msg.starts_with("RUST_LOG is not a valid filter"), "{msg}");
    assert!(msg.contains("\"weir_agent::datapath=chatty\""), "{msg}");
    assert_eq!(
        warning["filter"],
        EnvFilter::new(logging::DEFAULT_FILTER).to_string()
    );
    assert!(
        lines
            .iter()
            .any(|line| line["msg"] == "no weir maps pinned there"),
        "the default filter's lines: {stderr}"
    );
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
        .find(|line| line["msg"] == "no weir maps pinned there")
        .unwrap_or_else(|| panic!("no warning about the empty pin root in:\n{stderr}"));
    assert_eq!(warning["level"], "warn");
    assert_eq!(warning["scope"], "inspect");
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
/// ztunnel's Add, the datapath's own thread, and weir-cni's own, which the plugin hands to the
/// agent) names it the same way.
#[test]
fn every_line_about_an_enrolled_pod_carries_its_namespace_name_and_uid() {
    let node = privileged!(CniChainNode::new());
    let captured = Captured::default();
    let writer = captured.clone();
    // The agent runs in this process, on threads of its own: the subscriber is the process's.
    let (subscriber, _) = logging::subscriber(
        LogFormat::Json,
        EnvFilter::new("info,weir_agent=debug"),
        move || writer.clone(),
        false,
    );
    subscriber.try_init().unwrap();
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (pod, _) = node.ambient_pod(&ztunnel, "client");
    agent.stop().unwrap();

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let about_pod: Vec<Value> = json_lines(&text)
        .into_iter()
        .filter(|line| line["uid"] == pod.uid())
        .collect();
    let scopes: Vec<&str> = about_pod
        .iter()
        .filter_map(|line| line["scope"].as_str())
        .collect();
    for scope in ["enroll", "zds", "datapath", "cni"] {
        assert!(
            scopes.contains(&scope),
            "no line about the pod from {scope} in:\n{text}"
        );
    }
    for line in &about_pod {
        assert_eq!(line["namespace"], MESH, "{line}");
        assert_eq!(line["name"], "client", "{line}");
    }
    let plugin = about_pod
        .iter()
        .find(|line| line["scope"] == "cni")
        .unwrap();
    assert_eq!(plugin["msg"], "enrolled", "{plugin}");
    assert_eq!(plugin["command"], "ADD", "{plugin}");
    assert_eq!(plugin["level"], "info", "{plugin}");
}

/// `/logging` on a running agent's admin address: shows the filter, puts a valid one in force at
/// once and refuses an invalid one, which changes nothing; the health address, open to every
/// pod, does not serve it.
#[test]
fn the_log_filter_is_shown_and_changed_on_the_admin_address() {
    let node = privileged!(CniChainNode::new());
    // `RUST_LOG=warn`, as every agent process of the tests runs.
    let agent = node.start_agent_process(AgentBinary::Run {
        env: &[("LOG_FORMAT", "json")],
    });
    let admin = agent.config.admin_addr;
    let request = |method: &str, path: &str| {
        node.netns()
            .run(|| http_request(admin, method, path))
            .unwrap()
    };
    let shown = (200, "current log level is warn\n".to_owned());
    assert_eq!(request("GET", "/logging"), shown);

    let (status, body) = request("POST", "/logging?level=info,weir_agent::zds=chatty");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("\"weir_agent::zds=chatty\""), "{body}");
    assert!(body.ends_with("the log filter stays warn\n"), "{body}");
    let (status, body) = request("POST", "/logging");
    assert_eq!(status, 400, "{body}");
    assert_eq!(request("GET", "/logging"), shown);

    let (status, body) = request("POST", "/logging?level=info,weir_agent::datapath=debug");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("current log level is ")
            && body.contains("weir_agent::datapath=debug")
            && body.contains("info"),
        "{body}"
    );
    assert_eq!(request("GET", "/logging"), (200, body.clone()));
    // At info, which the old filter left out: the new one is in force.
    let changed = wait_until(WAIT, "the agent's line about the change", || {
        agent.log_lines().into_iter().find_map(|line| {
            let line: Value = serde_json::from_str(&line).ok()?;
            (line["msg"] == "log filter changed").then_some(line)
        })
    });
    assert_eq!(changed["level"], "info");
    assert_eq!(changed["before"], "warn");

    let health = agent.config.health_addr;
    let (status, _) = node
        .netns()
        .run(|| http_request(health, "POST", "/logging?level=debug"))
        .unwrap();
    assert_eq!(status, 404, "the health address changes no filter");
}
