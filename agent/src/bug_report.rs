//! `weir-agent bug-report`: one archive holding what a report about this node needs, for an
//! operator to attach as it is. Every part is collected on its own: a part that cannot be had
//! (no agent answering, no pins) is named with why in `errors.txt` and the rest is still
//! written. Credentials never go in: the CNI net dir's files are listed by name and size, and
//! only the configuration files the runtime reads (`.conf`, `.conflist`, `.json`) are copied,
//! with the values of keys that name a secret replaced.
use std::{
    fmt::Write as _,
    fs,
    io::{self, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use flate2::{write::GzEncoder, Compression};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use weir_common::ABI_VERSION;

use crate::{check, datapath, inspect};

/// What the archive is made from: the agent's paths and addresses, as `run` is given them.
pub struct Sources {
    pub pin_root: PathBuf,
    pub state_file: PathBuf,
    pub cni_net_dir: PathBuf,
    /// The running agent's metrics address.
    pub metrics_addr: SocketAddr,
    /// The running agent's admin address (loopback), which serves its recent log lines.
    pub admin_addr: SocketAddr,
    pub check: check::CheckConfig,
}

/// Entries dumped per map at most: a bug needs their shape, not every pod of a large node.
const MAP_ENTRIES: u32 = 4096;
/// How long the running agent has to answer.
const AGENT_TIMEOUT: Duration = Duration::from_secs(5);
/// Keys whose values are credentials, wherever they appear in a copied configuration file.
const SECRET_KEYS: [&str; 5] = [
    "token",
    "password",
    "secret",
    "key-data",
    "certificate-data",
];

/// The archive's files, in the order they are written.
#[derive(Default)]
struct Archive {
    files: Vec<(String, Vec<u8>)>,
    errors: String,
}

impl Archive {
    fn add(&mut self, name: &str, content: impl Into<Vec<u8>>) {
        self.files.push((name.to_owned(), content.into()));
    }

    /// Adds what `part` gives under `name`, or its failure to `errors.txt`.
    fn add_part(&mut self, name: &str, part: Result<String>) {
        match part {
            Ok(text) => self.add(name, text),
            Err(error) => {
                let _ = writeln!(self.errors, "{name}: {error:#}");
            }
        }
    }

    /// The gzip-compressed tar of every file under `weir-bug-report/`.
    fn write(mut self, out: impl Write) -> Result<()> {
        if !self.errors.is_empty() {
            let errors = std::mem::take(&mut self.errors);
            self.add("errors.txt", errors);
        }
        let mut tar = tar::Builder::new(GzEncoder::new(out, Compression::default()));
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        for (name, content) in &self.files {
            let mut header = tar::Header::new_gnu();
            header.set_size(content.len() as u64);
            header.set_mode(0o644);
            header.set_mtime(now);
            header.set_cksum();
            tar.append_data(&mut header, format!("weir-bug-report/{name}"), &content[..])?;
        }
        tar.into_inner()?.finish()?.flush()?;
        Ok(())
    }
}

/// Collects the report and writes it to `output` (`-`: standard output, for
/// `kubectl exec ... -- weir-agent bug-report --output - > report.tar.gz`).
pub async fn write(sources: &Sources, output: &Path) -> Result<()> {
    let mut archive = Archive::default();
    archive.add("version.txt", version());
    archive.add_part("check.txt", Ok(check_lines(&sources.check).await));
    archive.add_part("pods.txt", pods(sources, false));
    archive.add_part("pods.json", pods(sources, true));
    archive.add_part(
        "metrics.txt",
        agent_get(sources.metrics_addr, "/metrics").await,
    );
    archive.add_part("logs.txt", agent_get(sources.admin_addr, "/logs").await);
    archive.add_part("bpf/maps.txt", maps(&sources.pin_root));
    archive.add_part("bpf/programs.txt", programs());
    archive.add_part("bpf/pins.txt", pins(&sources.pin_root));
    match cni_files(&sources.cni_net_dir) {
        Ok(files) => {
            for (name, content) in files {
                archive.add(&name, content);
            }
        }
        Err(error) => archive.add_part("cni/", Err(error)),
    }
    if output == Path::new("-") {
        archive.write(io::stdout().lock())
    } else {
        let file =
            fs::File::create(output).with_context(|| format!("creating {}", output.display()))?;
        archive.write(io::BufWriter::new(file))?;
        eprintln!("wrote {}", output.display());
        Ok(())
    }
}

/// weir's version and map layout, the kernel and the machine.
fn version() -> String {
    let read = |path: &str| {
        fs::read_to_string(path).unwrap_or_else(|error| format!("unreadable: {error}\n"))
    };
    let inbound = datapath::running_inbound_path();
    format!(
        "weir-agent {}\nmap layout {ABI_VERSION}\ninbound hand-off {inbound}\narchitecture {}\nkernel {}",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::ARCH,
        read("/proc/version"),
    )
}

/// `weir-agent check`'s lines.
async fn check_lines(config: &check::CheckConfig) -> String {
    check::all(config)
        .await
        .iter()
        .map(|finding| format!("{finding}\n"))
        .collect()
}

/// `weir-agent pods`, as a table or JSON.
fn pods(sources: &Sources, json: bool) -> Result<String> {
    let rows = inspect::pods(&sources.pin_root, &sources.state_file)?;
    if json {
        inspect::json(&rows)
    } else {
        Ok(inspect::table(&rows))
    }
}

/// What the running agent answers at `path` on `addr`.
async fn agent_get(addr: SocketAddr, path: &str) -> Result<String> {
    // The agent listens on every address when told 0.0.0.0 or [::]: ask it on loopback.
    let addr = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port())
        }
        _ => addr,
    };
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            return Err(anyhow!("the agent answered {status}"));
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(AGENT_TIMEOUT, fetch)
        .await
        .map_err(|_| anyhow!("no answer within {AGENT_TIMEOUT:?}"))?
        .with_context(|| format!("the agent's {path} at {addr}"))
}

/// Every pinned map: its type, sizes and fill, then its entries in hex, `key: value`.
fn maps(pin_root: &Path) -> Result<String> {
    let dumps = datapath::map_dump(pin_root, MAP_ENTRIES)?;
    if dumps.is_empty() {
        return Ok(format!("nothing pinned under {}\n", pin_root.display()));
    }
    let mut text = String::new();
    for dump in &dumps {
        let _ = writeln!(
            text,
            "{} {}: key {} B, value {} B, max {} entries, {}{} shown",
            dump.name,
            dump.kind,
            dump.key_size,
            dump.value_size,
            dump.capacity,
            dump.entries.len(),
            if dump.truncated {
                " (more left out)"
            } else {
                ""
            },
        );
        for (key, value) in &dump.entries {
            let _ = writeln!(text, "  {}: {}", hex(key), hex(value));
        }
    }
    Ok(text)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// weir's programs loaded in the kernel (every name starts with `weir_`).
fn programs() -> Result<String> {
    let mut text = String::new();
    for program in aya::programs::loaded_programs() {
        let program = program?;
        let Some(name) = program
            .name_as_str()
            .filter(|name| name.starts_with("weir_"))
        else {
            continue;
        };
        let kind = program.program_type();
        let _ = writeln!(text, "{} {name} {kind:?}", program.id());
    }
    Ok(text)
}

/// Every path under the pin root: the maps of each layout, the links by pod.
fn pins(pin_root: &Path) -> Result<String> {
    let mut text = String::new();
    let mut dirs = vec![pin_root.to_owned()];
    while let Some(dir) = dirs.pop() {
        let mut entries = fs::read_dir(&dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .collect::<io::Result<Vec<_>>>()?;
        entries.sort_by_key(fs::DirEntry::path);
        for entry in entries {
            let path = entry.path();
            let _ = writeln!(text, "{}", path.display());
            if entry.file_type()?.is_dir() {
                dirs.push(path);
            }
        }
    }
    Ok(text)
}

/// `cni/listing.txt` (every file: mode, size, name) and each configuration file the runtime
/// reads, its secrets replaced.
fn cni_files(net_dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut entries = fs::read_dir(net_dir)
        .with_context(|| format!("listing {}", net_dir.display()))?
        .collect::<io::Result<Vec<_>>>()?;
    entries.sort_by_key(fs::DirEntry::file_name);
    let mut listing = String::new();
    let mut files = Vec::new();
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        let metadata = entry.metadata()?;
        let _ = writeln!(
            listing,
            "{:o} {:>8} {name}",
            metadata.permissions().mode() & 0o7777,
            metadata.len()
        );
        let is_config = [".conf", ".conflist", ".json"]
            .iter()
            .any(|extension| name.ends_with(extension));
        if metadata.is_file() && is_config {
            let content = fs::read(entry.path())?;
            files.push((format!("cni/{name}"), without_secrets(&content)));
        }
    }
    files.insert(0, ("cni/listing.txt".to_owned(), listing.into_bytes()));
    Ok(files)
}

/// A JSON file with the values of secret-naming keys replaced; anything else is left out whole,
/// since what it holds cannot be told.
fn without_secrets(content: &[u8]) -> Vec<u8> {
    fn redact(value: &mut Value) {
        match value {
            Value::Object(object) => {
                for (key, value) in object.iter_mut() {
                    let key = key.to_ascii_lowercase();
                    if SECRET_KEYS.iter().any(|secret| key.contains(secret)) {
                        *value = Value::String("<redacted>".into());
                    } else {
                        redact(value);
                    }
                }
            }
            Value::Array(values) => values.iter_mut().for_each(redact),
            _ => {}
        }
    }
    match serde_json::from_slice::<Value>(content) {
        Ok(mut json) => {
            redact(&mut json);
            serde_json::to_vec_pretty(&json).unwrap_or_default()
        }
        Err(error) => format!("not JSON ({error}): left out\n").into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_copied_configs_are_replaced_and_unparsable_files_left_out() {
        let config = br#"{"plugins": [{"type": "x", "kubernetes": {"token": "abc", "kubeconfig": "/k"}, "Password": "p"}]}"#;
        let copied = String::from_utf8(without_secrets(config)).unwrap();
        assert!(
            !copied.contains("abc") && !copied.contains("\"p\""),
            "{copied}"
        );
        assert!(copied.contains("/k"), "{copied}");
        let copied = String::from_utf8(without_secrets(b"token: abc")).unwrap();
        assert!(!copied.contains("abc"), "{copied}");
    }
}
