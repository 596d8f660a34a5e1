//! Runs CNI plugins for a harness whose own process holds thousands of descriptors (a bench's
//! pods' namespaces): an exec closes every one of them first, about 1 ms per 5,000, which a
//! container runtime does not pay. Started early, this process holds a handful, and its children
//! inherit its network namespace.
//!
//! Usage: `weir-plugin-runner <socket path>`. Each connection carries one request, a JSON object
//! (`program`, `env` as `[name, value]` pairs, `stdin`), then the client's shutdown of its
//! writing half; the answer is `{"status": <raw wait status>, "stdout": ..., "stderr": ...}`.
//! One thread per connection, so plugins run as concurrently as they are asked for. It exits when
//! its stdin closes: its starter is gone, however it ended.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: weir-plugin-runner SOCKET");
    let listener = UnixListener::bind(&path).unwrap_or_else(|error| panic!("{path}: {error}"));
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    // Ready: the socket is bound.
    println!("listening");
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        std::thread::spawn(move || {
            if let Err(error) = serve(stream) {
                eprintln!("weir-plugin-runner: {error}");
            }
        });
    }
}

fn serve(mut stream: UnixStream) -> std::io::Result<()> {
    let mut request = Vec::new();
    stream.read_to_end(&mut request)?;
    let request: Value = serde_json::from_slice(&request)?;
    let env = request["env"].as_array().cloned().unwrap_or_default();
    let mut child = Command::new(request["program"].as_str().unwrap_or_default())
        .env_clear()
        .envs(
            env.iter()
                .filter_map(|pair| Some((pair.get(0)?.as_str()?, pair.get(1)?.as_str()?))),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let input = request["stdin"]
        .as_str()
        .unwrap_or_default()
        .as_bytes()
        .to_vec();
    let written = child.stdin.take().expect("piped").write_all(&input);
    let output = child.wait_with_output()?;
    written?;
    let answer = json!({
        "status": output.status.into_raw(),
        "stdout": String::from_utf8_lossy(&output.stdout),
        "stderr": String::from_utf8_lossy(&output.stderr),
    });
    stream.write_all(answer.to_string().as_bytes())
}
