//! Talking to the node agent: one request line out, one response line back, within a deadline.
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::protocol::{Request, Response, VerdictCache, MAX_REQUEST_BYTES};

/// A response is a short status line; anything longer is not one.
const MAX_RESPONSE_BYTES: usize = 16 * 1024;

#[derive(Debug, PartialEq, Eq)]
pub enum Failure {
    /// No connection, and why: the socket is missing or refuses, or the connect timed out (an
    /// agent whose accept backlog is full). The agent has not seen the request, so the caller
    /// may decide without it.
    Unreachable(String),
    /// The agent took the connection, then no answer came: it hung up, reset, or did not answer
    /// in time. It may be enrolling the pod this very moment, so nobody else may decide.
    NoAnswer(String),
    /// The agent answered something that is not a response: a bug, never a reason to guess.
    Invalid(String),
}

/// Sends `request` and waits for the verdict; `timeout` bounds the whole exchange.
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Response, Failure> {
    let deadline = Instant::now() + timeout;
    let line = encode(request)?;
    let mut stream =
        connect(socket, timeout).map_err(|err| Failure::Unreachable(describe(&err)))?;
    let no_answer = |err: io::Error| Failure::NoAnswer(describe(&err));
    send(&mut stream, &line, deadline).map_err(no_answer)?;
    let answer = receive(&stream, deadline).map_err(no_answer)?;
    if answer.is_empty() {
        return Err(Failure::NoAnswer(
            "the agent closed the connection without answering".into(),
        ));
    }
    if answer.len() > MAX_RESPONSE_BYTES {
        return Err(Failure::Invalid(format!(
            "weir agent response exceeds {MAX_RESPONSE_BYTES} bytes"
        )));
    }
    serde_json::from_slice(answer.trim_ascii_end())
        .map_err(|e| Failure::Invalid(format!("weir agent sent an invalid response: {e}")))
}

/// Whether the agent accepts connections (STATUS). The connection is closed without a request.
pub fn probe(socket: &Path, timeout: Duration) -> Result<(), String> {
    connect(socket, timeout)
        .map(drop)
        .map_err(|err| describe(&err))
}

pub fn load_verdicts(path: &Path) -> Result<VerdictCache, String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The request as one line. Kubernetes allows 256 KiB of annotations (a
/// `last-applied-configuration` alone can be large) but the agent refuses requests over
/// `MAX_REQUEST_BYTES`; when the full set does not fit, only Istio's annotations (the ones
/// that steer redirection) are sent.
fn encode(request: &Request) -> Result<String, Failure> {
    let to_line = |request: &Request| {
        serde_json::to_string(request)
            .map(|json| json + "\n")
            .map_err(|e| Failure::Invalid(format!("cannot encode request: {e}")))
    };
    let line = to_line(request)?;
    if line.len() <= MAX_REQUEST_BYTES {
        return Ok(line);
    }
    let mut trimmed = request.clone();
    trimmed
        .annotations
        .retain(|key, _| is_istio_annotation(key));
    let line = to_line(&trimmed)?;
    if line.len() <= MAX_REQUEST_BYTES {
        Ok(line)
    } else {
        Err(Failure::Invalid(format!(
            "request exceeds {MAX_REQUEST_BYTES} bytes even with only Istio annotations"
        )))
    }
}

/// `istio.io/…`, `ambient.istio.io/…`, `sidecar.istio.io/…` and the like.
fn is_istio_annotation(key: &str) -> bool {
    key.split_once('/')
        .is_some_and(|(domain, _)| domain == "istio.io" || domain.ends_with(".istio.io"))
}

/// `UnixStream::connect` has no timeout and blocks while the agent's accept backlog is full (a
/// hung agent), so the connect runs on a helper thread that is abandoned on timeout; the
/// process exits soon after anyway.
fn connect(socket: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let (done, result) = mpsc::channel();
    let path = socket.to_owned();
    thread::Builder::new()
        .name("connect".into())
        .spawn(move || {
            let _ = done.send(UnixStream::connect(path));
        })?;
    result
        .recv_timeout(timeout)
        .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")))
}

fn send(stream: &mut UnixStream, line: &str, deadline: Instant) -> io::Result<()> {
    stream.set_write_timeout(Some(remaining(deadline)?))?;
    stream.write_all(line.as_bytes())?;
    // Tells an agent that reads to end of stream that the request is complete.
    stream.shutdown(Shutdown::Write)
}

/// Reads up to the first newline, or one byte past the limit so an oversized answer is seen.
fn receive(stream: &UnixStream, deadline: Instant) -> io::Result<Vec<u8>> {
    stream.set_read_timeout(Some(remaining(deadline)?))?;
    let limit = MAX_RESPONSE_BYTES as u64 + 1;
    let mut answer = Vec::new();
    BufReader::new(stream.take(limit)).read_until(b'\n', &mut answer)?;
    Ok(answer)
}

fn remaining(deadline: Instant) -> io::Result<Duration> {
    // A zero timeout means "block forever" to the socket calls, so running out is an error here.
    Some(deadline.saturating_duration_since(Instant::now()))
        .filter(|left| !left.is_zero())
        .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
}

/// Why the agent could not be reached; socket timeouts surface as `WouldBlock`.
fn describe(err: &io::Error) -> String {
    match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "timed out".into(),
        _ => err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Command, PodRef};

    fn request_with_annotations(annotations: &[(&str, String)]) -> Request {
        Request {
            command: Command::Add,
            container_id: "c".into(),
            netns: "/var/run/netns/x".into(),
            ifname: "eth0".into(),
            pod: PodRef::default(),
            ips: vec![],
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            valid_attachments: vec![],
            plugin_log: None,
        }
    }

    #[test]
    fn oversized_requests_keep_only_istio_annotations() {
        let big = "x".repeat(MAX_REQUEST_BYTES);
        let request = request_with_annotations(&[
            ("kubectl.kubernetes.io/last-applied-configuration", big),
            ("ambient.istio.io/dns-capture", "false".into()),
            ("istio.io/reroute-virtual-interfaces", "a".into()),
        ]);
        let sent: Request = serde_json::from_str(&encode(&request).unwrap()).unwrap();
        let keys: Vec<&str> = sent.annotations.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "ambient.istio.io/dns-capture",
                "istio.io/reroute-virtual-interfaces"
            ]
        );
    }

    #[test]
    fn small_requests_keep_every_annotation() {
        let request = request_with_annotations(&[("a/b", "c".into())]);
        let line = encode(&request).unwrap();
        assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), request);
    }

    #[test]
    fn istio_annotation_domains() {
        assert!(is_istio_annotation("sidecar.istio.io/status"));
        assert!(is_istio_annotation("istio.io/x"));
        assert!(!is_istio_annotation("notistio.io/x"));
        assert!(!is_istio_annotation("istio.io"));
    }

    #[test]
    fn an_accepted_connection_without_an_answer_is_no_answer() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let request = request_with_annotations(&[]);
        // Never accepted, never answered: the kernel took the connection all the same.
        let err = call(&socket, &request, Duration::from_millis(200)).unwrap_err();
        assert_eq!(err, Failure::NoAnswer("timed out".into()));
        drop(listener);
        let err = call(&socket, &request, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, Failure::Unreachable(why) if why.contains("refused")));
    }

    #[test]
    fn a_missing_socket_is_unreachable() {
        let socket = Path::new("/nonexistent/weir.sock");
        let request = request_with_annotations(&[]);
        let err = call(socket, &request, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, Failure::Unreachable(why) if why.contains("No such file")));
        assert!(probe(socket, Duration::from_secs(1)).is_err());
    }
}
