//! Runs the built `weir-cni` binary the way containerd does (verbatim env and stdin from
//! `data/containerd-1.6-cni-calls.txt`) against a fake agent on a temporary socket, and, when
//! the agent is away, a fake Kubernetes API server on a loopback port.
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tempfile::TempDir;
use weir_cni::protocol::{
    self, Attachment, LogLevel, LogRecord, PluginLog, PodIp, PodRef, Request, Response,
    VerdictCache,
};

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
    /// The LOG requests, the plugin's lines, apart from the requests about pods.
    plugin_logs: Receiver<Request>,
}

impl FakeAgent {
    fn start(socket: &Path, reply: Option<Vec<u8>>) -> Self {
        let listener = UnixListener::bind(socket).unwrap();
        let (record, requests) = mpsc::channel();
        let (record_log, plugin_logs) = mpsc::channel();
        thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().map_while(Result::ok) {
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                if let Ok(request) = serde_json::from_str::<Request>(&line) {
                    let _ = match request.command {
                        protocol::Command::Log => record_log.send(request),
                        _ => record.send(request),
                    };
                }
                match &reply {
                    Some(reply) => {
                        let _ = (&stream).write_all(reply);
                    }
                    None => held.push(stream),
                }
            }
        });
        Self {
            requests,
            plugin_logs,
        }
    }

    /// Accepts each connection and closes it at once, before the request is read: the plugin
    /// sees a reset or a broken pipe.
    fn resetting(socket: &Path, _reply: Option<Vec<u8>>) -> Self {
        let listener = UnixListener::bind(socket).unwrap();
        let (_record, requests) = mpsc::channel();
        let (_record_log, plugin_logs) = mpsc::channel();
        thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                drop(stream);
            }
        });
        Self {
            requests,
            plugin_logs,
        }
    }

    fn answering(socket: &Path, response: &Response) -> Self {
        let line = serde_json::to_string(response).unwrap() + "\n";
        Self::start(socket, Some(line.into_bytes()))
    }

    /// An agent from before [`protocol::Command::Log`]: the ADD enrolled, the LOG undecodable.
    fn before_log(socket: &Path) -> Self {
        let listener = UnixListener::bind(socket).unwrap();
        let (record, requests) = mpsc::channel();
        thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                let response = match serde_json::from_str::<Request>(&line) {
                    Ok(request) if request.command != protocol::Command::Log => {
                        let _ = record.send(request);
                        Response::Ok { enrolled: true }
                    }
                    _ => Response::Error {
                        code: 6,
                        msg: "malformed request".into(),
                        details: "unknown variant `LOG`, expected one of `ADD`, `DEL`, `CHECK`, \
                                  `GC`"
                            .into(),
                    },
                };
                let reply = serde_json::to_string(&response).unwrap() + "\n";
                let _ = (&stream).write_all(reply.as_bytes());
            }
        });
        let (_record_log, plugin_logs) = mpsc::channel();
        Self {
            requests,
            plugin_logs,
        }
    }

    fn ok(socket: &Path) -> Self {
        Self::answering(socket, &Response::Ok { enrolled: true })
    }

    fn next_request(&self) -> Request {
        self.requests.recv_timeout(Duration::from_secs(5)).unwrap()
    }

    fn next_plugin_log(&self) -> Request {
        self.plugin_logs
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
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

/// A verdict cache that knows the sample pod, not ambient, outside ambient namespaces.
fn plain_pod_cache() -> VerdictCache {
    VerdictCache {
        ambient_namespaces: vec!["other".into()],
        other_pods: vec!["node1-ns/pod-2".into()],
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
            plugin_log: None,
        }
    );
    // The run's lines go to the agent that answered, about the same pod and container.
    let log = agent.next_plugin_log();
    assert_eq!(
        (&log.pod, &log.container_id),
        (&request.pod, &request.container_id)
    );
    assert!(log.annotations.is_empty() && log.ips.is_empty());
    assert_eq!(
        log.plugin_log,
        Some(PluginLog {
            command: protocol::Command::Add,
            records: vec![LogRecord {
                level: LogLevel::Info,
                msg: "enrolled".into(),
            }],
        })
    );
    assert_eq!(node.log(), "", "the agent took the lines");
    assert!(out.stderr.is_empty(), "{}", stderr(&out));
}

/// An agent older than the plugin's LOG answers it as a request it cannot decode: the plugin
/// writes its lines to its log file instead, as before.
#[test]
fn an_agent_that_does_not_take_the_lines_leaves_them_in_the_log_file() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let agent = FakeAgent::before_log(&node.socket());

    let out = node.exec(add, no_extra());
    assert_eq!(success_json(&out), prev_result(add));
    assert_eq!(agent.next_request().command, protocol::Command::Add);
    assert!(
        node.log()
            .contains("ADD node1-ns/pod-2 container=4ea802200f95 enrolled"),
        "log: {}",
        node.log()
    );
    assert!(
        out.stderr.is_empty(),
        "logs go to the log file: {}",
        stderr(&out)
    );
}

/// A network of its own (a Multus attachment, as istio-cni with `chained: false`): no
/// `prevResult`, so the agent gets no addresses (it reads them in the pod) and the result is
/// empty, in the config's version.
#[test]
fn add_without_prev_result_asks_the_agent_without_addresses_and_prints_an_empty_result() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let agent = FakeAgent::ok(&node.socket());
    let env: Vec<(String, String)> = add
        .env
        .iter()
        .map(|(key, value)| match key.as_str() {
            "CNI_IFNAME" => (key.clone(), "net1".to_owned()),
            _ => (key.clone(), value.clone()),
        })
        .collect();
    for version in ["0.3.1", "1.0.0", "1.1.0"] {
        let mut conf: Value = serde_json::from_str(&node.config(&add.stdin, no_extra())).unwrap();
        let conf = conf.as_object_mut().unwrap();
        conf.remove("prevResult");
        conf.insert("name".into(), "istio-cni".into());
        conf.insert("cniVersion".into(), version.into());
        let out = exec(&env, &Value::from(conf.clone()).to_string());
        assert_eq!(success_json(&out), json!({ "cniVersion": version }));
        let request = agent.next_request();
        assert_eq!(request.command, protocol::Command::Add);
        assert_eq!(request.ips, []);
        assert_eq!(request.ifname, "net1");
        assert_eq!(request.pod, sample_pod());
    }

    // Not a Kubernetes pod: passed through without the agent, as with a prevResult.
    let mut conf: Value = serde_json::from_str(&node.config(&add.stdin, no_extra())).unwrap();
    conf.as_object_mut().unwrap().remove("prevResult");
    let not_a_pod: Vec<(String, String)> = env
        .iter()
        .filter(|(key, _)| key != "CNI_ARGS")
        .cloned()
        .collect();
    let out = exec(&not_a_pod, &conf.to_string());
    assert_eq!(success_json(&out), json!({ "cniVersion": "1.0.0" }));
    agent.assert_no_request();
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
    node.write_verdicts(&plain_pod_cache());

    assert_eq!(success_json(&node.exec(add, no_extra())), prev_result(add));
    assert!(node.log().contains("warn"), "log: {}", node.log());
}

#[test]
fn add_with_agent_down_fails_pods_unknown_to_the_verdict_cache() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    // Not in an ambient namespace, but the pod may carry the ambient label itself.
    node.write_verdicts(&VerdictCache {
        ambient_namespaces: vec!["other".into()],
        ..VerdictCache::default()
    });

    let err = cni_error(&node.exec(add, no_extra()), 11);
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.contains("pod node1-ns/pod-2 is unknown to the verdict cache"),
        "{msg}"
    );
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

/// A verdict cache that names the sample pod as not ambient (opted out of an ambient namespace).
fn opted_out_cache() -> VerdictCache {
    VerdictCache {
        ambient_namespaces: vec!["node1-ns".into()],
        opted_out_pods: vec!["node1-ns/pod-2".into()],
        ..VerdictCache::default()
    }
}

#[test]
fn add_with_an_agent_that_accepts_and_never_answers_fails_with_try_again_later() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    // Whatever the cache says: an agent that took the request may be enrolling the pod.
    for cache in [VerdictCache::default(), opted_out_cache()] {
        let node = Node::new();
        let agent = FakeAgent::start(&node.socket(), None);
        node.write_verdicts(&cache);

        let started = Instant::now();
        let err = cni_error(&node.exec(add, json!({"timeout_seconds": 1})), 11);
        assert!(started.elapsed() < Duration::from_secs(3));
        agent.next_request();
        let msg = err["msg"].as_str().unwrap();
        assert!(msg.contains(node.socket().to_str().unwrap()), "{msg}");
        assert!(msg.contains("did not answer"), "{msg}");
        assert!(msg.contains("pod node1-ns/pod-2 waits"), "{msg}");
        assert!(
            err["details"].as_str().unwrap().contains("timed out"),
            "{err}"
        );
    }
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
fn agent_hanging_up_without_answer_fails_with_try_again_later() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    for cache in [VerdictCache::default(), opted_out_cache()] {
        // Reads the request and closes; closes without reading it (a reset).
        for hang_up in [FakeAgent::start, FakeAgent::resetting] {
            let node = Node::new();
            let _agent = hang_up(&node.socket(), Some(Vec::new()));
            node.write_verdicts(&cache);
            let err = cni_error(&node.exec(add, no_extra()), 11);
            let msg = err["msg"].as_str().unwrap();
            assert!(msg.contains("did not answer"), "{msg}");
            assert!(msg.contains("pod node1-ns/pod-2 waits"), "{msg}");
        }
    }
}

/// A stand-in for the Kubernetes API server: answers `GET`s of the objects it holds with their
/// JSON as the API server serves it (`/api/v1/namespaces/NS` and `/api/v1/namespaces/NS/pods/NAME`),
/// anything else with a 404 `Status`; over HTTPS with `tls`, plain http without. It records
/// each request line and its `Authorization` header.
struct FakeApiServer {
    url: String,
    requests: Arc<Mutex<Vec<ApiRequest>>>,
}

/// A request line and its `Authorization` header.
type ApiRequest = (String, Option<String>);

impl FakeApiServer {
    fn start(objects: &[Value]) -> Self {
        Self::start_with(objects, None)
    }

    fn start_with(objects: &[Value], tls: Option<Arc<rustls::ServerConfig>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut by_path = BTreeMap::new();
        for object in objects {
            let metadata = &object["metadata"];
            let name = metadata["name"].as_str().unwrap();
            let path = match object["kind"].as_str().unwrap() {
                "Namespace" => format!("/api/v1/namespaces/{name}"),
                "Pod" => format!(
                    "/api/v1/namespaces/{}/pods/{name}",
                    metadata["namespace"].as_str().unwrap()
                ),
                kind => panic!("the stand-in serves no {kind}"),
            };
            by_path.insert(path, object.to_string());
        }
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let (by_path, seen, tls) = (by_path.clone(), seen.clone(), tls.clone());
                thread::spawn(move || {
                    let _ = match tls {
                        Some(config) => {
                            let session = rustls::ServerConnection::new(config).unwrap();
                            serve_api(rustls::StreamOwned::new(session, stream), &by_path, &seen)
                        }
                        None => serve_api(stream, &by_path, &seen),
                    };
                });
            }
        });
        Self {
            url: format!("{scheme}://127.0.0.1:{port}"),
            requests,
        }
    }

    fn requests(&self) -> Vec<ApiRequest> {
        self.requests.lock().unwrap().clone()
    }
}

/// One request, one answer, then the connection closes.
fn serve_api(
    mut stream: impl std::io::Read + Write,
    by_path: &BTreeMap<String, String>,
    seen: &Mutex<Vec<ApiRequest>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(&mut stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut authorization = None;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header)?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("authorization") {
                authorization = Some(value.trim().to_owned());
            }
        }
    }
    let request_line = request_line.trim_end().to_owned();
    let path = request_line
        .split(' ')
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    seen.lock().unwrap().push((request_line, authorization));
    let (status, body) = match by_path.get(&path) {
        Some(object) => ("200 OK", object.clone()),
        None => ("404 Not Found", not_found(&path).to_string()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

/// The API server's 404, a `Status` object.
fn not_found(path: &str) -> Value {
    let name = path.rsplit('/').next().unwrap_or_default();
    let kind = if path.contains("/pods/") {
        "pods"
    } else {
        "namespaces"
    };
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("{kind} \"{name}\" not found"), "reason": "NotFound",
           "details": {"name": name, "kind": kind}, "code": 404})
}

/// The namespace as `GET /api/v1/namespaces/NAME` returns it.
fn namespace_object(name: &str, labels: Value) -> Value {
    let mut all_labels = json!({"kubernetes.io/metadata.name": name});
    all_labels
        .as_object_mut()
        .unwrap()
        .extend(labels.as_object().unwrap().clone());
    json!({"kind": "Namespace", "apiVersion": "v1",
           "metadata": {"name": name, "uid": "5f1a9a51-7d0e-4b0c-9b59-8c6c2f3c9d11",
                        "resourceVersion": "208", "creationTimestamp": "2026-11-30T04:10:00Z",
                        "labels": all_labels,
                        "managedFields": [{"manager": "kubectl-label", "operation": "Update",
                                           "apiVersion": "v1", "time": "2026-11-30T04:18:00Z",
                                           "fieldsType": "FieldsV1",
                                           "fieldsV1": {"f:metadata": {"f:labels": {}}}}]},
           "spec": {"finalizers": ["kubernetes"]},
           "status": {"phase": "Active"}})
}

/// The sample pod as `GET /api/v1/namespaces/node1-ns/pods/pod-2` returns it while its sandbox
/// is being created, with `labels`.
fn sample_pod_object(labels: Value) -> Value {
    json!({"kind": "Pod", "apiVersion": "v1",
           "metadata": {"name": "pod-2", "generateName": "pod-", "namespace": "node1-ns",
                        "uid": sample_pod().uid, "resourceVersion": "1187",
                        "creationTimestamp": "2026-11-30T04:19:06Z",
                        "labels": labels,
                        "annotations": {"kubernetes.io/egress-bandwidth": "20M",
                                        "kubernetes.io/ingress-bandwidth": "10M"},
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                             "name": "pod-7d9c", "uid": "0b1e7f0c-35c1-4c11-a5e4-0c8f7e3b5a21",
                                             "controller": true, "blockOwnerDeletion": true}]},
           "spec": {"volumes": [],
                    "containers": [{"name": "app", "image": "nginx:1.27",
                                    "ports": [{"hostPort": 18080, "containerPort": 8080,
                                               "protocol": "TCP"}],
                                    "resources": {}, "terminationMessagePath": "/dev/termination-log",
                                    "terminationMessagePolicy": "File",
                                    "imagePullPolicy": "IfNotPresent"}],
                    "restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
                    "dnsPolicy": "ClusterFirst", "serviceAccountName": "default",
                    "serviceAccount": "default", "nodeName": "node1",
                    "securityContext": {}, "schedulerName": "default-scheduler",
                    "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                     "effect": "NoExecute", "tolerationSeconds": 300}],
                    "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority"},
           "status": {"phase": "Pending", "qosClass": "BestEffort",
                      "conditions": [{"type": "PodScheduled", "status": "True",
                                      "lastProbeTime": null,
                                      "lastTransitionTime": "2026-11-30T04:19:06Z"}],
                      "hostIP": "192.168.1.20", "hostIPs": [{"ip": "192.168.1.20"}],
                      "startTime": "2026-11-30T04:19:06Z"}})
}

const TOKEN: &str = "eyJhbGciOiJSUzI1NiIsImtpZCI6IndlaXIifQ.c2VydmljZWFjY291bnQ.c2ln";

impl Node {
    /// A kubeconfig naming `server`, with a bearer token and, for HTTPS, the CA inline, as
    /// weir's installer writes it for the plugin.
    fn write_kubeconfig(&self, server: &str, ca_pem: Option<&[u8]>) -> PathBuf {
        let mut cluster = json!({"server": server});
        if let Some(pem) = ca_pem {
            cluster["certificate-authority-data"] = base64(pem).into();
        }
        let kubeconfig = json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "local", "cluster": cluster}],
            "users": [{"name": "weir-cni", "user": {"token": TOKEN}}],
            "contexts": [{"name": "weir-cni", "context": {"cluster": "local", "user": "weir-cni"}}],
            "current-context": "weir-cni",
        });
        let path = self.dir.path().join("weir-kubeconfig");
        std::fs::write(&path, serde_json::to_vec_pretty(&kubeconfig).unwrap()).unwrap();
        path
    }
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The agent's socket is absent, the API server answers with `objects`: what happens to the
/// sample pod's ADD, with the verdict cache `cache`.
fn add_with_the_agent_away(
    objects: &[Value],
    cache: &VerdictCache,
) -> (Output, Node, FakeApiServer) {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    node.write_verdicts(cache);
    let api = FakeApiServer::start(objects);
    let kubeconfig = node.write_kubeconfig(&api.url, None);
    let out = node.exec(add, json!({"kubeconfig": kubeconfig}));
    (out, node, api)
}

/// The plugin asked for the sample pod, with the kubeconfig's bearer token on every request.
fn assert_asked_for_the_pod(api: &FakeApiServer) {
    let requests = api.requests();
    let lines: Vec<&str> = requests.iter().map(|(line, _)| line.as_str()).collect();
    assert!(
        lines.contains(&"GET /api/v1/namespaces/node1-ns/pods/pod-2 HTTP/1.1"),
        "{lines:?}"
    );
    for (_, authorization) in &requests {
        assert_eq!(
            authorization.as_deref(),
            Some(format!("Bearer {TOKEN}").as_str())
        );
    }
}

#[test]
fn agent_away_and_api_server_says_ambient_namespace_fails_with_try_again_later() {
    let objects = [
        namespace_object("node1-ns", json!({"istio.io/dataplane-mode": "ambient"})),
        sample_pod_object(json!({"app": "web", "pod-template-hash": "7d9c"})),
    ];
    // The cache was written before the namespace was labelled: it does not name the pod.
    let (out, node, api) = add_with_the_agent_away(&objects, &VerdictCache::default());
    let err = cni_error(&out, 11);
    let msg = err["msg"].as_str().unwrap();
    assert!(msg.contains(node.socket().to_str().unwrap()), "{msg}");
    assert!(msg.contains("unreachable"), "{msg}");
    assert!(msg.contains("ambient pod node1-ns/pod-2 waits"), "{msg}");
    assert_asked_for_the_pod(&api);
    assert_eq!(api.requests().len(), 2, "pod and namespace");
}

#[test]
fn agent_away_and_api_server_says_ambient_pod_fails_with_try_again_later() {
    let objects = [
        namespace_object("node1-ns", json!({})),
        sample_pod_object(json!({"app": "web", "istio.io/dataplane-mode": "ambient"})),
    ];
    let (out, _node, api) = add_with_the_agent_away(&objects, &VerdictCache::default());
    let err = cni_error(&out, 11);
    assert!(err["msg"]
        .as_str()
        .unwrap()
        .contains("ambient pod node1-ns/pod-2 waits"));
    assert_asked_for_the_pod(&api);
}

#[test]
fn agent_away_and_api_server_says_not_ambient_passes_prev_result_through() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    // The cache names the namespace ambient; the API server has it unlabelled since.
    let unlabelled = [
        namespace_object("node1-ns", json!({})),
        sample_pod_object(json!({"app": "web"})),
    ];
    let (out, node, api) = add_with_the_agent_away(&unlabelled, &ambient_namespace_cache());
    assert_eq!(success_json(&out), prev_result(add));
    assert!(node.log().contains("not ambient"), "log: {}", node.log());
    assert_asked_for_the_pod(&api);

    // Opted out of an ambient namespace.
    let opted_out = [
        namespace_object("node1-ns", json!({"istio.io/dataplane-mode": "ambient"})),
        sample_pod_object(json!({"app": "web", "istio.io/dataplane-mode": "none"})),
    ];
    let (out, _node, api) = add_with_the_agent_away(&opted_out, &ambient_namespace_cache());
    assert_eq!(success_json(&out), prev_result(add));
    assert_asked_for_the_pod(&api);
}

#[test]
fn agent_away_and_a_pod_of_another_uid_is_decided_by_the_cache() {
    let mut other = sample_pod_object(json!({"istio.io/dataplane-mode": "ambient"}));
    other["metadata"]["uid"] = "0c3e1f2a-7d41-4c1e-9a0b-2b6f3d8e9a10".into();
    let objects = [
        namespace_object("node1-ns", json!({"istio.io/dataplane-mode": "ambient"})),
        other,
    ];
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    // The cache knows the pod as not ambient: it starts, although the other pod is ambient.
    let (out, node, api) = add_with_the_agent_away(&objects, &plain_pod_cache());
    assert_eq!(success_json(&out), prev_result(add));
    assert!(node.log().contains("uid"), "log: {}", node.log());
    assert_asked_for_the_pod(&api);
    // The cache names its namespace: it waits.
    let (out, _node, _api) = add_with_the_agent_away(&objects, &ambient_namespace_cache());
    let err = cni_error(&out, 11);
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.contains("ambient pod node1-ns/pod-2 cannot start without redirection"),
        "{msg}"
    );
}

#[test]
fn agent_away_and_api_server_over_https_with_the_kubeconfigs_ca() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let objects = [
        namespace_object("node1-ns", json!({"istio.io/dataplane-mode": "ambient"})),
        sample_pod_object(json!({})),
    ];
    let api = FakeApiServer::start_with(&objects, Some(tls_server_config()));
    let node = Node::new();
    node.write_verdicts(&plain_pod_cache());
    let ca = include_bytes!("data/apiserver-ca.crt");
    let kubeconfig = node.write_kubeconfig(&api.url, Some(ca));
    let err = cni_error(&node.exec(add, json!({"kubeconfig": kubeconfig})), 11);
    assert!(err["msg"]
        .as_str()
        .unwrap()
        .contains("ambient pod node1-ns/pod-2 waits"));
    assert_eq!(api.requests().len(), 2, "pod and namespace");

    // A server the kubeconfig's CA did not sign is not believed: the cache decides.
    let other_ca = include_bytes!("data/apiserver.crt");
    let kubeconfig = node.write_kubeconfig(&api.url, Some(other_ca));
    let out = node.exec(add, json!({"kubeconfig": kubeconfig}));
    assert_eq!(success_json(&out), prev_result(add));
    assert!(node.log().contains("API server"), "log: {}", node.log());
}

/// The stand-in's certificate for 127.0.0.1, signed by `data/apiserver-ca.crt` (test-only keys,
/// valid until 2126).
fn tls_server_config() -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
    let chain = vec![CertificateDer::from_pem_slice(include_bytes!("data/apiserver.crt")).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(include_bytes!("data/apiserver.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    Arc::new(config)
}

#[test]
fn agent_and_api_server_away_the_cache_decides() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    // A port nobody listens on.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let node = Node::new();
    let kubeconfig = node.write_kubeconfig(&url, None);
    let config = json!({"kubeconfig": kubeconfig});

    node.write_verdicts(&ambient_namespace_cache());
    let err = cni_error(&node.exec(add, config.clone()), 11);
    let msg = err["msg"].as_str().unwrap();
    assert!(msg.contains("ambient pod node1-ns/pod-2 cannot start without redirection"));

    node.write_verdicts(&VerdictCache::default());
    let err = cni_error(&node.exec(add, config.clone()), 11);
    let msg = err["msg"].as_str().unwrap();
    assert!(msg.contains("unknown to the verdict cache"), "{msg}");

    node.write_verdicts(&plain_pod_cache());
    assert_eq!(
        success_json(&node.exec(add, config.clone())),
        prev_result(add)
    );

    // No kubeconfig where the config says: the same.
    let missing = json!({"kubeconfig": node.dir.path().join("absent")});
    assert_eq!(success_json(&node.exec(add, missing)), prev_result(add));
}

#[test]
fn agent_reachable_the_api_server_is_never_asked() {
    let [add, ..] = &recorded_calls()[..] else {
        unreachable!()
    };
    let node = Node::new();
    let _agent = FakeAgent::ok(&node.socket());
    let api = FakeApiServer::start(&[]);
    let kubeconfig = node.write_kubeconfig(&api.url, None);
    let out = node.exec(add, json!({"kubeconfig": kubeconfig}));
    assert_eq!(success_json(&out), prev_result(add));
    assert!(api.requests().is_empty());
}
