//! Runs the built `weir-cni` binary the way containerd does (verbatim env and stdin from
//! `data/containerd-1.6-cni-calls.txt`) against a fake agent on a temporary socket.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tempfile::TempDir;
use weir_cni::protocol::{self, Attachment, PodIp, PodRef, Request, Response, VerdictCache};

const SAMPLES: &str = include_str!("data/containerd-1.6-cni-calls.txt");

/// One recorded runtime call.
struct Call {
    env: Vec<(String, String)>,
    stdin: String,
}

/// The recorded calls in order: ADD, DEL at StopPodSandbox, DEL at RemovePodSandbox.
fn recorded_calls() -> Vec<Call> {
    let mut calls = Vec::new();
    let mut lines = SAMPLES.lines();
    while let Some(line) = lines.next() {
        if line != "--- env (CNI_*)" {
            continue;
        }
        let env = lines
            .by_ref()
            .take_while(|line| *line != "--- stdin")
            .filter_map(|line| line.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let stdin = lines.next().expect("stdin line").to_owned();
        calls.push(Call { env, stdin });
    }
    assert_eq!(calls.len(), 3, "ADD and two DELs");
    calls
}

fn prev_result(call: &Call) -> Value {
    serde_json::from_str::<Value>(&call.stdin).unwrap()["prevResult"].clone()
}

/// A temporary directory for the agent socket, the verdict cache and the log.
struct Node {
    dir: TempDir,
}

impl Node {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("agent.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("weir-cni.log")).unwrap_or_default()
    }

    fn write_verdicts(&self, cache: &VerdictCache) {
        let path = self.dir.path().join("verdicts.json");
        std::fs::write(path, serde_json::to_vec(cache).unwrap()).unwrap();
    }

    /// The recorded config as weir-cni's conflist entry, pointed at this node, plus `extra`.
    fn config(&self, recorded_stdin: &str, extra: Value) -> String {
        let mut conf: Value = serde_json::from_str(recorded_stdin).unwrap();
        let dir = self.dir.path();
        let ours = json!({
            "type": "weir-cni",
            "agent_socket": self.socket(),
            "verdict_cache": dir.join("verdicts.json"),
            "log_file": dir.join("weir-cni.log"),
        });
        for (key, value) in ours
            .as_object()
            .unwrap()
            .iter()
            .chain(extra.as_object().unwrap())
        {
            conf[key] = value.clone();
        }
        conf.to_string()
    }

    /// Runs `call` as recorded, with the config pointed at this node.
    fn exec(&self, call: &Call, extra: Value) -> Output {
        exec(&call.env, &self.config(&call.stdin, extra))
    }
}

fn exec(env: &[(String, String)], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_weir-cni"))
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// A stand-in for the agent: records each request and answers every connection with `reply`
/// (raw bytes, so tests can send garbage), or holds the connection open when `reply` is `None`.
struct FakeAgent {
    requests: Receiver<Request>,
}

impl FakeAgent {
    fn start(socket: &Path, reply: Option<Vec<u8>>) -> Self {
        let listener = UnixListener::bind(socket).unwrap();
        let (record, requests) = mpsc::channel();
        thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().map_while(Result::ok) {
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                if let Ok(request) = serde_json::from_str(&line) {
                    let _ = record.send(request);
                }
                match &reply {
                    Some(reply) => {
                        let _ = (&stream).write_all(reply);
                    }
                    None => held.push(stream),
                }
            }
        });
        Self { requests }
    }

    fn answering(socket: &Path, response: &Response) -> Self {
        let line = serde_json::to_string(response).unwrap() + "\n";
        Self::start(socket, Some(line.into_bytes()))
    }

    fn ok(socket: &Path) -> Self {
        Self::answering(socket, &Response::Ok { enrolled: true })
    }

    fn next_request(&self) -> Request {
        self.requests.recv_timeout(Duration::from_secs(5)).unwrap()
    }

    fn assert_no_request(&self) {
        assert!(self.requests.try_recv().is_err(), "the agent was contacted");
    }
}

/// Asserts success and returns stdout as JSON (stdout must be exactly one JSON value).
fn success_json(out: &Output) -> Value {
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON value")
}

fn assert_silent_success(out: &Output) {
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(out));
    assert!(
        out.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Asserts a CNI error result with `code` and returns it.
fn cni_error(out: &Output, code: u64) -> Value {
    assert_eq!(out.status.code(), Some(1), "stderr: {}", stderr(out));
    let err: Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON value");
    assert_eq!(err["code"], code, "{err}");
    for field in ["cniVersion", "msg", "details"] {
        assert!(err[field].is_string(), "{field} missing in {err}");
    }
    err
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn sample_pod() -> PodRef {
    PodRef {
        namespace: "node1-ns".into(),
        name: "pod-2".into(),
        uid: "de60a85b-b095-45a4-a025-7153957e26cf".into(),
    }
}

fn ambient_namespace_cache() -> VerdictCache {
    VerdictCache {
        ambient_namespaces: vec!["node1-ns".into()],
        ..VerdictCache::default()
    }
}

fn no_extra() -> Value {
    json!({})
}

#[test]
fn add_forwards_the_pod_and_passes_prev_result_through() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let agent = FakeAgent::ok(&node.socket());

    let out = node.exec(add, no_extra());
    assert_eq!(success_json(&out), prev_result(add));

    let request = agent.next_request();
    let recorded: Value = serde_json::from_str(&add.stdin).unwrap();
    let annotations = &recorded["runtimeConfig"]["io.kubernetes.cri.pod-annotations"];
    assert_eq!(
        request,
        Request {
            command: protocol::Command::Add,
            container_id: "4ea802200f955fb7cfeebbd932b27369f51eda79babb9e6fb4a4a881cc3ba353".into(),
            netns: "/var/run/netns/cni-d4e40d92-668d-7895-355b-671654e2efed".into(),
            ifname: "eth0".into(),
            pod: sample_pod(),
            ips: vec![PodIp {
                address: "10.99.0.3/24".into(),
                gateway: Some("10.99.0.1".into()),
                interface: Some("eth0".into()),
            }],
            annotations: serde_json::from_value(annotations.clone()).unwrap(),
            valid_attachments: vec![],
        }
    );
    assert!(node
        .log()
        .contains("ADD node1-ns/pod-2 container=4ea802200f95 enrolled"));
    assert!(
        out.stderr.is_empty(),
        "logs go to the log file: {}",
        stderr(&out)
    );
}

#[test]
fn add_prints_prev_result_byte_for_byte() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let _agent = FakeAgent::ok(&node.socket());
    // Splice the recorded prevResult text into the config untouched.
    let recorded: Value = serde_json::from_str(&add.stdin).unwrap();
    let start = add.stdin.find(r#""prevResult":"#).unwrap() + r#""prevResult":"#.len();
    let prev_text = &add.stdin[start..add.stdin.find(r#","runtimeConfig""#).unwrap()];
    assert_eq!(
        serde_json::from_str::<Value>(prev_text).unwrap(),
        recorded["prevResult"]
    );
    let stdin = add.stdin.replacen(
        r#""type":"recorder""#,
        &format!(
            r#""type":"weir-cni","agent_socket":{}"#,
            serde_json::to_string(&node.socket()).unwrap()
        ),
        1,
    );

    let out = exec(&add.env, &stdin);
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim_end(), prev_text);
}

#[test]
fn add_agent_error_becomes_a_cni_error() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let response = Response::Error {
        code: 999,
        msg: "ztunnel is not connected".into(),
        details: "no ZDS connection".into(),
    };
    let _agent = FakeAgent::answering(&node.socket(), &response);

    let err = cni_error(&node.exec(add, no_extra()), 999);
    assert_eq!(
        err,
        json!({"cniVersion": "1.0.0", "code": 999, "msg": "ztunnel is not connected",
               "details": "no ZDS connection"})
    );
}

#[test]
fn add_with_agent_down_fails_ambient_pods_with_try_again_later() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    node.write_verdicts(&ambient_namespace_cache());

    let err = cni_error(&node.exec(add, no_extra()), 11);
    let msg = err["msg"].as_str().unwrap();
    assert!(msg.contains(node.socket().to_str().unwrap()), "{msg}");
    assert!(msg.contains("ambient pod node1-ns/pod-2 cannot start without redirection"));
}

#[test]
fn add_with_agent_down_starts_non_ambient_pods() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    node.write_verdicts(&VerdictCache {
        ambient_namespaces: vec!["other".into()],
        ..VerdictCache::default()
    });

    assert_eq!(success_json(&node.exec(add, no_extra())), prev_result(add));
    assert!(node.log().contains("warn"), "log: {}", node.log());
}

#[test]
fn add_with_agent_down_and_no_verdict_cache_fails_closed() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let err = cni_error(&node.exec(add, no_extra()), 11);
    assert!(err["details"].as_str().unwrap().contains("verdicts.json"));
}

#[test]
fn add_with_a_silent_agent_times_out_and_uses_the_cache() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let agent = FakeAgent::start(&node.socket(), None);
    node.write_verdicts(&VerdictCache::default());

    let started = Instant::now();
    let out = node.exec(add, json!({"timeout_seconds": 1}));
    assert_eq!(success_json(&out), prev_result(add));
    assert!(started.elapsed() < Duration::from_secs(3));
    agent.next_request();
    assert!(node.log().contains("timed out"), "log: {}", node.log());
}

#[test]
fn add_in_an_excluded_namespace_never_reaches_the_agent() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let agent = FakeAgent::ok(&node.socket());

    let out = node.exec(add, json!({"exclude_namespaces": ["node1-ns"]}));
    assert_eq!(success_json(&out), prev_result(add));
    agent.assert_no_request();
}

#[test]
fn both_runtime_dels_reach_the_agent() {
    let [_, stop, remove] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let agent = FakeAgent::ok(&node.socket());

    assert_silent_success(&node.exec(stop, no_extra()));
    let request = agent.next_request();
    assert_eq!(request.command, protocol::Command::Del);
    assert_eq!(request.pod, sample_pod());
    assert_eq!(
        request.netns,
        "/var/run/netns/cni-d4e40d92-668d-7895-355b-671654e2efed"
    );

    assert_silent_success(&node.exec(remove, no_extra()));
    let request = agent.next_request();
    assert_eq!(request.netns, "");
    assert_eq!(request.pod, sample_pod());
    assert_eq!(
        request.container_id,
        "4ea802200f955fb7cfeebbd932b27369f51eda79babb9e6fb4a4a881cc3ba353"
    );
}

#[test]
fn del_succeeds_whatever_the_agent_does() {
    let [_, stop, remove] = &recorded_calls()[..] else {
        unreachable!()
    };
    let down = Node::new();
    let failing = Node::new();
    let error = Response::Error {
        code: 999,
        msg: "boom".into(),
        details: String::new(),
    };
    let _agent = FakeAgent::answering(&failing.socket(), &error);
    for node in [&down, &failing] {
        for call in [stop, remove] {
            assert_silent_success(&node.exec(call, no_extra()));
        }
    }
}

#[test]
fn check_reports_agent_errors_and_falls_back_offline() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let with_command = |command: &str| {
        let mut env = add.env.clone();
        env.retain(|(k, _)| k != "CNI_COMMAND");
        env.push(("CNI_COMMAND".into(), command.into()));
        env
    };
    let check = Call {
        env: with_command("CHECK"),
        stdin: add.stdin.clone(),
    };
    let node = Node::new();
    node.write_verdicts(&ambient_namespace_cache());
    cni_error(&node.exec(&check, no_extra()), 11);

    let error = Response::Error {
        code: 999,
        msg: "not redirected".into(),
        details: String::new(),
    };
    let _agent = FakeAgent::answering(&node.socket(), &error);
    cni_error(&node.exec(&check, no_extra()), 999);
}

#[test]
fn status_is_ready_even_without_the_agent() {
    let node = Node::new();
    let env = [("CNI_COMMAND".to_string(), "STATUS".to_string())];
    let config = node.config(r#"{"cniVersion":"1.1.0","name":"k8s"}"#, no_extra());

    // A failed STATUS would stop every new pod on the node, ambient or not.
    assert_silent_success(&exec(&env, &config));
    let _agent = FakeAgent::ok(&node.socket());
    assert_silent_success(&exec(&env, &config));
}

#[test]
fn gc_hands_the_valid_attachments_to_the_agent() {
    let node = Node::new();
    let env = [("CNI_COMMAND".to_string(), "GC".to_string())];
    let config = node.config(
        r#"{"cniVersion":"1.1.0","name":"k8s",
            "cni.dev/valid-attachments":[{"containerID":"c1","ifname":"eth0"}]}"#,
        no_extra(),
    );
    // Without the agent: an error the runtime logs, nothing removed.
    cni_error(&exec(&env, &config), 11);

    let agent = FakeAgent::ok(&node.socket());
    assert_silent_success(&exec(&env, &config));
    let request = agent.next_request();
    assert_eq!(request.command, protocol::Command::Gc);
    assert_eq!(
        request.valid_attachments,
        [Attachment {
            container_id: "c1".into(),
            ifname: "eth0".into()
        }]
    );

    // No list is no verdict on any pod.
    let without_list = node.config(r#"{"cniVersion":"1.1.0","name":"k8s"}"#, no_extra());
    cni_error(&exec(&env, &without_list), 7);
    agent.assert_no_request();
}

#[test]
fn version_lists_the_supported_versions() {
    let env = [("CNI_COMMAND".to_string(), "VERSION".to_string())];
    let info = success_json(&exec(&env, r#"{"cniVersion":"1.0.0"}"#));
    assert_eq!(
        info,
        json!({"cniVersion": "1.0.0",
               "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
    );
    assert_eq!(success_json(&exec(&env, ""))["cniVersion"], "1.1.0");
}

#[test]
fn malformed_input_gets_the_spec_error_codes() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let _agent = FakeAgent::ok(&node.socket());
    let config = node.config(&add.stdin, no_extra());
    let env_without = |name: &str| -> Vec<(String, String)> {
        add.env.iter().filter(|(k, _)| k != name).cloned().collect()
    };
    let env_with = |name: &str, value: &str| {
        let mut env = env_without(name);
        env.push((name.into(), value.into()));
        env
    };
    let without_prev_result = {
        let mut conf: Value = serde_json::from_str(&config).unwrap();
        conf.as_object_mut().unwrap().remove("prevResult");
        conf.to_string()
    };

    cni_error(&exec(&add.env, "{not json"), 6);
    cni_error(&exec(&add.env, ""), 6);
    cni_error(&exec(&env_without("CNI_COMMAND"), &config), 4);
    cni_error(&exec(&env_with("CNI_COMMAND", "FROB"), &config), 4);
    cni_error(&exec(&env_without("CNI_NETNS"), &config), 4);
    cni_error(&exec(&env_without("CNI_CONTAINERID"), &config), 4);
    // Not a Kubernetes pod (no pod name): passed through, never blocked.
    let passed = exec(&env_with("CNI_ARGS", "K8S_POD_NAMESPACE=a"), &config);
    assert_eq!(passed.status.code(), Some(0));
    cni_error(&exec(&env_with("CNI_ARGS", "no-equals"), &config), 4);
    cni_error(&exec(&add.env, &without_prev_result), 7);
    let err = cni_error(&exec(&add.env, &config.replace("1.0.0", "0.2.0")), 1);
    assert_eq!(err["cniVersion"], "0.2.0");
}

#[test]
fn garbage_from_the_agent_is_an_error_not_a_crash() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let replies: [&[u8]; 3] = [
        b"HTTP/1.1 200 OK\r\n\r\n",
        b"{\"result\":\"maybe\"}\n",
        &[b'x'; 1 << 20],
    ];
    for reply in replies {
        let node = Node::new();
        let _agent = FakeAgent::start(&node.socket(), Some(reply.to_vec()));
        let err = cni_error(&node.exec(add, no_extra()), 999);
        assert!(err["msg"].as_str().unwrap().contains("weir agent"), "{err}");
    }
}

#[test]
fn agent_hanging_up_without_answer_counts_as_unreachable() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let _agent = FakeAgent::start(&node.socket(), Some(Vec::new()));
    node.write_verdicts(&ambient_namespace_cache());
    cni_error(&node.exec(add, no_extra()), 11);
}
