//! `weir-agent trace` run as an operator runs it, next to a test's agent: its JSON lines
//! collected as they come, and whether the programs are recording.
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
};

use aya::maps::{Array, Map};
use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};
use serde_json::Value;
use weir_common::maps;

use crate::{
    agent::{workspace_binary, Agent},
    chain::{CniChainNode, WAIT},
    try_wait_until, wait_until,
};

/// A `weir-agent trace` process and the lines it printed so far.
pub struct Reader {
    child: Child,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl Reader {
    pub fn start(agent: &Agent, filters: &[&str]) -> Self {
        let mut child = Command::new(workspace_binary("weir-agent"))
            .arg("trace")
            .arg("--trace-socket")
            .arg(&agent.config.trace_socket)
            .args(["--output", "json"])
            .args(filters)
            .stdout(Stdio::piped())
            .spawn()
            .expect("running weir-agent trace");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().unwrap();
        let collected = lines.clone();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let line = line.unwrap();
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| panic!("not one JSON object: {line:?}"));
                collected.lock().unwrap().push(value);
            }
        });
        Self { child, lines }
    }

    /// The first decision that matches every field of `wanted`, within [`WAIT`].
    pub fn wait_for(&self, wanted: &Value) -> Value {
        let found = try_wait_until(WAIT, || {
            self.lines().into_iter().find(|line| matches(line, wanted))
        });
        found.unwrap_or_else(|| {
            let lines: Vec<String> = self.lines().iter().map(Value::to_string).collect();
            panic!("no decision matching {wanted} in:\n{}", lines.join("\n"))
        })
    }

    pub fn lines(&self) -> Vec<Value> {
        self.lines.lock().unwrap().clone()
    }

    /// Ctrl-C, as an operator stops it: a clean exit, within [`WAIT`].
    pub fn interrupt(mut self) {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT).unwrap();
        // On a timeout, dropping the reader kills the process.
        let status = wait_until(WAIT, "weir-agent trace to stop on Ctrl-C", || {
            self.child.try_wait().unwrap()
        });
        assert!(status.success(), "weir-agent trace exited with {status}");
    }
}

impl Drop for Reader {
    /// A test that failed before [`Reader::interrupt`] leaves no `weir-agent trace` behind.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether `line` has every field of `wanted`, with its value.
pub fn matches(line: &Value, wanted: &Value) -> bool {
    wanted
        .as_object()
        .unwrap()
        .iter()
        .all(|(key, value)| &line[key] == value)
}

/// Whether the programs write records (`TRACE_ON`, as bpftool shows it).
pub fn tracing_on(node: &CniChainNode) -> bool {
    let map = node.test_node().pinned_map(maps::TRACE_ON).unwrap();
    let flag: Array<_, u32> = Array::try_from(Map::Array(map)).unwrap();
    flag.get(&0, 0).unwrap() != 0
}

/// Waits until the programs record (`on`) or stop recording.
pub fn wait_until_tracing(node: &CniChainNode, on: bool) {
    wait_until(WAIT, &format!("tracing to be {on}"), || {
        tracing_on(node) == on
    });
}
