//! Fuzz targets for everything weir decodes from outside: the plugin's stdin and `CNI_*`
//! environment, the agent's CNI socket protocol, ztunnel's ZDS messages and the node's CNI
//! configuration files.
//!
//! The driver is property-based (proptest), not coverage-guided: cargo-fuzz needs a nightly
//! toolchain and this project builds on stable. Each target gets two kinds of input:
//! - structure-aware: generated messages, mostly valid, with fields drawn from the values that
//!   matter (every known command name and unknown ones, supported and unsupported versions,
//!   weir's own plugin type) so the valid paths are reached and must round-trip;
//! - byte mutations (bit flips, insertions of random bytes or JSON/protobuf tokens, deletions,
//!   duplications, truncations) of the seed corpus in `tests/tests/fuzz/corpus/<target>/`.
//!
//! Every target asserts that nothing panics, that what is refused is refused with a clear error,
//! and that what is accepted round-trips. A CI run does a short bounded pass ([`DEFAULT_CASES`]
//! per input kind and target); `WEIR_FUZZ_CASES=100000` runs a long one. A failure is shrunk to a
//! minimal input, printed: add it to the corpus (it is then replayed on every run) and fix it.
use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use proptest::{
    collection::{btree_map, vec},
    option,
    prelude::*,
    sample::select,
    test_runner::{Config, TestCaseError, TestRunner},
};
use prost::Message;
use serde_json::{json, Value};
use weir_agent::{
    cni_server::read_request,
    install::conflist::{plugin_entry, Format, NetworkConfig, Object},
    zds::{
        decode_answer, decode_hello,
        proto::{
            workload_request::Payload, workload_response, Ack, AddWorkload, DelWorkload,
            KeepWorkload, SnapshotSent, WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello,
        },
        Datagram, ZdsError,
    },
};
use weir_cni::{
    protocol::{Request, Response, MAX_REQUEST_BYTES},
    CniEnv,
};

/// Cases per input kind and target in a CI run: together well under the 30 s budget of this
/// file in a debug build on a shared machine.
const DEFAULT_CASES: u32 = 600;

fn cases() -> u32 {
    std::env::var("WEIR_FUZZ_CASES")
        .map(|value| value.parse().expect("WEIR_FUZZ_CASES is a number"))
        .unwrap_or(DEFAULT_CASES)
}

/// Runs `property` on `cases()` inputs from `strategy`; a failure panics with the shrunk input.
fn fuzz<S: Strategy>(
    target: &str,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        // Failures are kept in the corpus by hand, where every run replays them.
        failure_persistence: None,
        ..Config::default()
    });
    if let Err(failure) = runner.run(&strategy, property) {
        panic!("fuzz target {target}: {failure}");
    }
}

// ---------------------------------------------------------------------------------------------
// Byte mutation of the seed corpus.

/// The seeds of `target`, `tests/tests/fuzz/corpus/<target>/*`.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fuzz/corpus/{target}"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no seeds in {}", dir.display());
    files
        .iter()
        .map(|file| std::fs::read(file).unwrap())
        .collect()
}

/// Bytes that change the meaning of JSON or protobuf input more often than random ones do.
const TOKENS: &[&[u8]] = &[
    b"\"",
    b"\\",
    b"\\u0000",
    b"\\ud800",
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b"\n",
    b"null",
    b"true",
    b"-1",
    b"1e999",
    b"18446744073709551616",
    b"\"\"",
    b"{}",
    b"[]",
    b"\xff",
    b"\xf0\x9f\x92\xa9",
    b"\x00",
    b"\x08\x01",
    b"\x0a\x00",
    b"\x0a\xff\xff\xff\xff\x0f",
];

#[derive(Clone, Debug)]
enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Remove {
        at: usize,
        len: usize,
    },
    /// Copies `len` bytes from `from` to `at`: nests and repeats structures.
    Duplicate {
        from: usize,
        len: usize,
        at: usize,
    },
    Truncate {
        at: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let bytes = prop_oneof![
        vec(any::<u8>(), 1..16),
        select(TOKENS).prop_map(<[u8]>::to_vec),
    ];
    prop_oneof![
        4 => (any::<usize>(), 0..8u8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        4 => (any::<usize>(), bytes).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        2 => (any::<usize>(), 1..32usize).prop_map(|(at, len)| Mutation::Remove { at, len }),
        2 => (any::<usize>(), 1..256usize, any::<usize>())
            .prop_map(|(from, len, at)| Mutation::Duplicate { from, len, at }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

/// Applies `mutations` in order; positions are taken modulo the input's length at that point.
fn mutate(mut input: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for mutation in mutations {
        let position = |at: usize, len: usize| if len == 0 { 0 } else { at % len };
        match mutation {
            Mutation::FlipBit { at, bit } if !input.is_empty() => {
                let at = position(*at, input.len());
                input[at] ^= 1 << bit;
            }
            Mutation::Insert { at, bytes } => {
                let at = position(*at, input.len() + 1);
                input.splice(at..at, bytes.iter().copied());
            }
            Mutation::Remove { at, len } if !input.is_empty() => {
                let at = position(*at, input.len());
                input.drain(at..(at + len).min(input.len()));
            }
            Mutation::Duplicate { from, len, at } if !input.is_empty() => {
                let from = position(*from, input.len());
                let copy = input[from..(from + len).min(input.len())].to_vec();
                let at = position(*at, input.len() + 1);
                input.splice(at..at, copy);
            }
            Mutation::Truncate { at } => input.truncate(position(*at, input.len() + 1)),
            _ => {}
        }
    }
    input
}

/// A seed of `target`, mutated 0 to 8 times (unmutated seeds are replayed as they are).
fn mutated(target: &str) -> impl Strategy<Value = Vec<u8>> {
    (select(corpus(target)), vec(mutation(), 0..8))
        .prop_map(|(seed, mutations)| mutate(seed, &mutations))
}

// ---------------------------------------------------------------------------------------------
// Generators shared by the targets.

/// Strings with the characters that break parsers: separators, quotes, controls, non-ASCII.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z0-9-]{0,12}",
        1 => "[;=/\\\\\"\n\t\u{0}a-zé💩 ]{0,16}",
        1 => any::<String>(),
    ]
}

/// A command name as the runtime or the plugin may send it: every name either side knows (so a
/// command added to the protocol is covered without a change here) and unknown ones.
fn command_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(&["ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION"][..]).prop_map(String::from),
        1 => select(&["add", "Add", ""][..]).prop_map(String::from),
        1 => "[A-Z]{1,8}",
    ]
}

/// A pod address as CNI results write it, or not quite.
fn address() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (any::<[u8; 4]>(), 0..=32u8)
            .prop_map(|(ip, prefix)| format!("{}/{prefix}", std::net::Ipv4Addr::from(ip))),
        4 => (any::<[u16; 8]>(), 0..=128u8)
            .prop_map(|(ip, prefix)| format!("{}/{prefix}", std::net::Ipv6Addr::from(ip))),
        1 => text(),
    ]
}

// ---------------------------------------------------------------------------------------------
// Target: the plugin's stdin and environment (weir-cni).

/// Where the plugin would find the agent and its verdict cache: nowhere, so every run decides
/// alone, quickly, and touches nothing on the machine.
const NO_AGENT: &str = "/nonexistent/weir-fuzz/cni.sock";
const NO_CACHE: &str = "/nonexistent/weir-fuzz/verdicts.json";
const CNI_VERSIONS: &[&str] = &[
    "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0", "0.2.0", "2.0.0", "",
];

#[derive(Clone, Debug)]
struct PluginInput {
    env: CniEnv,
    stdin: Vec<u8>,
}

fn cni_args() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        select(
            &[
                "K8S_POD_NAMESPACE",
                "K8S_POD_NAME",
                "K8S_POD_UID",
                "IgnoreUnknown"
            ][..]
        )
        .prop_map(String::from),
        text(),
    ];
    prop_oneof![
        4 => vec((key, option::of(text())), 0..6).prop_map(|pairs| {
            pairs
                .into_iter()
                .map(|(key, value)| match value {
                    Some(value) => format!("{key}={value}"),
                    None => key,
                })
                .collect::<Vec<_>>()
                .join(";")
        }),
        1 => text(),
    ]
}

fn cni_env() -> impl Strategy<Value = CniEnv> {
    (
        option::of(command_name()),
        option::of(text()),
        option::of(prop_oneof![Just("/var/run/netns/fuzz".to_owned()), text()]),
        option::of(prop_oneof![Just("eth0".to_owned()), text()]),
        option::of(cni_args()),
    )
        .prop_map(|(command, container_id, netns, ifname, args)| CniEnv {
            command,
            container_id,
            netns,
            ifname,
            args,
        })
}

/// A network config as the runtime passes it to weir-cni, with prevResult in the config's
/// version (as runtimes convert it).
fn net_conf() -> impl Strategy<Value = Value> {
    let ip = (address(), option::of(address()), option::of(0..3u32)).prop_map(
        |(address, gateway, interface)| json!({"address": address, "gateway": gateway, "interface": interface}),
    );
    (
        select(CNI_VERSIONS),
        option::of(vec(ip, 0..3)),
        btree_map(text(), text(), 0..3),
        vec(text(), 0..3),
        prop_oneof![
            Just(json!(5)),
            Just(json!(0)),
            any::<i64>().prop_map(Value::from)
        ],
    )
        .prop_map(|(version, ips, annotations, exclude, timeout)| {
            let mut conf = json!({
                "cniVersion": version,
                "name": "fuzz",
                "type": "weir-cni",
                "agent_socket": NO_AGENT,
                "verdict_cache": NO_CACHE,
                "log_file": "/dev/null",
                "exclude_namespaces": exclude,
                "timeout_seconds": timeout,
                "runtimeConfig": {"io.kubernetes.cri.pod-annotations": annotations},
            });
            if let Some(ips) = ips {
                conf["prevResult"] = json!({
                    "cniVersion": version,
                    "interfaces": [{"name": "eth0"}, {"name": "veth", "sandbox": "/x"}],
                    "ips": ips,
                });
            }
            conf
        })
}

/// The plugin logs every refused input to stderr (the runtime's log); thousands of them would
/// bury the test output, so stderr goes to /dev/null while the target runs.
struct QuietStderr(Option<OwnedFd>);

impl QuietStderr {
    fn new() -> Self {
        // SAFETY: dup returns a new descriptor that nothing else owns.
        let saved = nix::unistd::dup(2)
            .ok()
            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
        let null = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        nix::unistd::dup2(null.as_raw_fd(), 2).unwrap();
        Self(saved)
    }
}

impl Drop for QuietStderr {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            let _ = nix::unistd::dup2(saved.as_raw_fd(), 2);
        }
    }
}

/// What must hold for every plugin run: an exit code of 0 or 1, and on 1 the spec's error
/// object with a code and a message.
fn plugin_outcome_is_valid(input: &PluginInput) -> Result<weir_cni::Outcome, TestCaseError> {
    let outcome = weir_cni::run(&input.env, input.stdin.as_slice());
    match outcome.exit_code {
        0 => {}
        1 => {
            let error: Value = serde_json::from_str(&outcome.stdout).map_err(|e| {
                TestCaseError::fail(format!(
                    "error output is not JSON ({e}): {:?}",
                    outcome.stdout
                ))
            })?;
            prop_assert!(
                error["code"].as_u64().is_some_and(|c| c > 0),
                "no code: {error}"
            );
            prop_assert!(
                error["msg"].as_str().is_some_and(|m| !m.is_empty()),
                "no msg: {error}"
            );
            prop_assert!(error["cniVersion"].is_string(), "no cniVersion: {error}");
            prop_assert!(outcome.stdout.ends_with('\n'));
        }
        other => prop_assert!(false, "exit code {other}"),
    }
    Ok(outcome)
}

#[test]
fn fuzz_plugin_stdin_and_env() {
    let _quiet = QuietStderr::new();
    fuzz(
        "plugin (generated)",
        (cni_env(), net_conf()),
        |(env, conf)| {
            let stdin = serde_json::to_vec(&conf).unwrap();
            let input = PluginInput { env, stdin };
            let outcome = plugin_outcome_is_valid(&input)?;
            // A successful ADD prints prevResult as the previous plugin wrote it, and without
            // one (a network of its own) an empty result.
            if input.env.command.as_deref() == Some("ADD") && outcome.exit_code == 0 {
                let printed = match conf.get("prevResult") {
                    Some(prev) => prev.clone(),
                    None => json!({ "cniVersion": conf["cniVersion"] }),
                };
                prop_assert_eq!(outcome.stdout, printed.to_string() + "\n");
            }
            Ok(())
        },
    );
    let runtime_env =
        select(&["ADD", "DEL", "CHECK", "VERSION", "STATUS"][..]).prop_flat_map(|command| {
            cni_args().prop_map(move |args| CniEnv {
                command: Some(command.to_owned()),
                container_id: Some("c0ffee".into()),
                netns: Some("/var/run/netns/fuzz".into()),
                ifname: Some("eth0".into()),
                args: Some(args),
            })
        });
    fuzz(
        "plugin (mutated corpus)",
        (runtime_env, mutated("plugin")),
        |(env, stdin)| plugin_outcome_is_valid(&PluginInput { env, stdin }).map(drop),
    );
}

// ---------------------------------------------------------------------------------------------
// Target: the agent's CNI socket protocol (weir_cni::protocol, cni_server's framing).

/// A request line as a plugin (or anything else on the socket) may write it: the fields of
/// [`Request`] with generated values, some missing or of the wrong type.
fn request_json() -> impl Strategy<Value = Value> {
    let ip = (address(), option::of(text()), option::of(text()))
        .prop_map(|(address, gateway, interface)| json!({"address": address, "gateway": gateway, "interface": interface}));
    let pod = (text(), text(), option::of(text())).prop_map(
        |(namespace, name, uid)| json!({"namespace": namespace, "name": name, "uid": uid}),
    );
    (
        command_name(),
        text(),
        option::of(text()),
        text(),
        pod,
        vec(ip, 0..3),
        btree_map(text(), text(), 0..3),
        select(&["", "container_id", "pod", "ips"][..]),
    )
        .prop_map(
            |(command, container_id, netns, ifname, pod, ips, annotations, drop)| {
                let mut request = json!({
                    "command": command,
                    "container_id": container_id,
                    "netns": netns,
                    "ifname": ifname,
                    "pod": pod,
                    "ips": ips,
                    "annotations": annotations,
                });
                request.as_object_mut().unwrap().remove(drop);
                request
            },
        )
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        any::<bool>().prop_map(|enrolled| Response::Ok { enrolled }),
        (any::<u32>(), text(), text()).prop_map(|(code, msg, details)| Response::Error {
            code,
            msg,
            details
        }),
    ]
}

fn framed(runtime: &tokio::runtime::Runtime, bytes: &[u8]) -> anyhow::Result<Option<Request>> {
    runtime.block_on(read_request(bytes))
}

/// What the agent's framing must make of `bytes`: nothing for nothing, an error for a first
/// line over the bound, else exactly what the line decodes to; and an accepted request
/// round-trips.
fn framing_is_exact(runtime: &tokio::runtime::Runtime, bytes: &[u8]) -> Result<(), TestCaseError> {
    let read = framed(runtime, bytes);
    let line = match bytes.iter().position(|&b| b == b'\n') {
        Some(end) => &bytes[..=end],
        None => bytes,
    };
    match read {
        Ok(None) => prop_assert!(bytes.is_empty()),
        Err(error) if line.len() > MAX_REQUEST_BYTES => {
            prop_assert!(format!("{error}").contains("larger than"), "{error:#}");
        }
        Err(_) => prop_assert!(serde_json::from_slice::<Request>(line).is_err()),
        Ok(Some(request)) => {
            prop_assert!(line.len() <= MAX_REQUEST_BYTES);
            prop_assert_eq!(&request, &serde_json::from_slice::<Request>(line).unwrap());
            let mut again = serde_json::to_vec(&request).unwrap();
            again.push(b'\n');
            prop_assert_eq!(framed(runtime, &again).unwrap(), Some(request));
        }
    }
    Ok(())
}

#[test]
fn fuzz_cni_socket_protocol() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    fuzz(
        "cni protocol (generated requests)",
        request_json(),
        |request| {
            let mut line = serde_json::to_vec(&request).unwrap();
            line.push(b'\n');
            let read = framed(&runtime, &line);
            match serde_json::from_value::<Request>(request) {
                Ok(expected) => prop_assert_eq!(read.unwrap(), Some(expected)),
                Err(_) => prop_assert!(read.is_err(), "accepted {read:?}"),
            }
            framing_is_exact(&runtime, &line)
        },
    );
    // Requests padded (JSON allows whitespace) to either side of the size bound.
    let padded = (request_json(), MAX_REQUEST_BYTES - 2..MAX_REQUEST_BYTES + 2);
    fuzz("cni protocol (size bound)", padded, |(request, total)| {
        let mut line = serde_json::to_vec(&request).unwrap();
        line.resize(total - 1, b' ');
        line.push(b'\n');
        framing_is_exact(&runtime, &line)
    });
    fuzz("cni protocol (responses)", response(), |response| {
        let line = serde_json::to_vec(&response).unwrap();
        prop_assert_eq!(serde_json::from_slice::<Response>(&line).unwrap(), response);
        Ok(())
    });
    fuzz(
        "cni protocol (mutated corpus)",
        mutated("cni-protocol"),
        |bytes| framing_is_exact(&runtime, &bytes),
    );
}

// ---------------------------------------------------------------------------------------------
// Target: ZDS, what the agent decodes from ztunnel (hello, answers) and what it encodes.

fn datagram(bytes: Vec<u8>) -> Datagram {
    Datagram {
        bytes,
        truncated: false,
        fds: Vec::new(),
    }
}

/// The only errors decoding may give: anything else (an I/O error, a timeout) is not about the
/// bytes.
fn is_decoding_error(error: &ZdsError) -> bool {
    matches!(
        error,
        ZdsError::Protocol(_) | ZdsError::ConnectionClosed | ZdsError::Nack(_)
    )
}

fn workload_request() -> impl Strategy<Value = WorkloadRequest> {
    let info =
        (text(), text(), text()).prop_map(|(name, namespace, service_account)| WorkloadInfo {
            name,
            namespace,
            service_account,
        });
    let payload = prop_oneof![
        (text(), option::of(info))
            .prop_map(|(uid, workload_info)| Payload::Add(AddWorkload { uid, workload_info })),
        text().prop_map(|uid| Payload::Keep(KeepWorkload { uid })),
        text().prop_map(|uid| Payload::Del(DelWorkload { uid })),
        Just(Payload::SnapshotSent(SnapshotSent {})),
    ];
    option::of(payload).prop_map(|payload| WorkloadRequest { payload })
}

#[test]
fn fuzz_zds_decoding() {
    let answers = option::of(text()).prop_map(|error| WorkloadResponse {
        payload: error.map(|error| workload_response::Payload::Ack(Ack { error })),
    });
    fuzz("zds (generated answers)", answers, |answer| {
        let decoded = decode_answer(&datagram(answer.encode_to_vec()));
        match answer.payload {
            // Encodes to nothing: a zero-length datagram is the peer's close.
            None => prop_assert!(matches!(decoded, Err(ZdsError::ConnectionClosed))),
            Some(workload_response::Payload::Ack(Ack { error })) if error.is_empty() => {
                prop_assert!(decoded.is_ok())
            }
            Some(workload_response::Payload::Ack(Ack { error })) => {
                prop_assert!(matches!(decoded, Err(ZdsError::Nack(e)) if e == error))
            }
        }
        Ok(())
    });
    fuzz("zds (generated hellos)", any::<i32>(), |version| {
        let hello = ZdsHello { version };
        match decode_hello(&datagram(hello.encode_to_vec())) {
            Ok(decoded) => prop_assert_eq!(decoded, hello),
            Err(error) => prop_assert!(version == 0 && matches!(error, ZdsError::ConnectionClosed)),
        }
        Ok(())
    });
    fuzz("zds (generated requests)", workload_request(), |request| {
        let bytes = request.encode_to_vec();
        prop_assert_eq!(WorkloadRequest::decode(bytes.as_slice()).unwrap(), request);
        Ok(())
    });
    let received = (mutated("zds"), any::<bool>(), 0..2usize);
    fuzz(
        "zds (mutated corpus)",
        received,
        |(bytes, truncated, fds)| {
            let datagram = Datagram {
                bytes,
                truncated,
                fds: (0..fds)
                    .map(|_| std::fs::File::open("/dev/null").unwrap().into())
                    .collect(),
            };
            for error in [
                decode_answer(&datagram).err(),
                decode_hello(&datagram).err(),
            ]
            .into_iter()
            .flatten()
            {
                prop_assert!(is_decoding_error(&error), "{error}");
            }
            if truncated || fds > 0 {
                prop_assert!(
                    decode_answer(&datagram).is_err(),
                    "a broken datagram accepted"
                );
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Target: the node's CNI configuration files, as weir's installer reads and rewrites them.

const WEIR: &str = "weir-cni";

fn plugin() -> impl Strategy<Value = Value> {
    let plugin_type = prop_oneof![
        4 => select(&["bridge", "calico", "cilium-cni", "portmap", WEIR][..]).prop_map(Value::from),
        1 => text().prop_map(Value::from),
        1 => Just(Value::Null),
    ];
    (
        plugin_type,
        option::of(text()),
        btree_map("[a-z]{1,6}", text(), 0..3),
    )
        .prop_map(|(plugin_type, name, extra)| {
            let mut plugin: Object = extra.into_iter().map(|(k, v)| (k, v.into())).collect();
            plugin.insert("type".into(), plugin_type);
            if let Some(name) = name {
                plugin.insert("name".into(), name.into());
            }
            Value::Object(plugin)
        })
}

fn config_file() -> impl Strategy<Value = (Format, Value)> {
    let list = (
        option::of(text()),
        select(CNI_VERSIONS),
        vec(plugin(), 0..5),
    )
        .prop_map(|(name, version, plugins)| {
            (
                Format::List,
                json!({"name": name, "cniVersion": version, "plugins": plugins}),
            )
        });
    let single = plugin().prop_map(|plugin| (Format::Single, plugin));
    prop_oneof![3 => list, 1 => single]
}

fn entry() -> Object {
    plugin_entry(WEIR, &json!({"agent_socket": NO_AGENT})).unwrap()
}

/// Whatever parses gets weir's entry as its last plugin, exactly once, other plugins kept in
/// order; the result parses again and holds the entry, and inserting again changes nothing.
fn insertion_is_exact(format: Format, bytes: &[u8]) -> Result<(), TestCaseError> {
    let Ok(config) = NetworkConfig::parse(format, bytes) else {
        return Ok(());
    };
    let others = |list: &Object| -> Vec<Value> {
        list["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|plugin| plugin["type"] != WEIR)
            .cloned()
            .collect()
    };
    let before = match &config {
        NetworkConfig::List(list) => others(list),
        NetworkConfig::Single(plugin) if plugin["type"] == WEIR => Vec::new(),
        NetworkConfig::Single(plugin) => vec![Value::Object(plugin.clone())],
    };
    let written = config.with_last(entry());
    prop_assert_eq!(others(&written), before);
    let text = serde_json::to_vec(&written).unwrap();
    let reread = NetworkConfig::parse(Format::List, &text);
    prop_assert!(
        reread.is_ok(),
        "weir wrote a list it cannot read: {reread:?}"
    );
    let reread = reread.unwrap();
    prop_assert!(reread.holds_last(&entry()));
    prop_assert_eq!(reread.with_last(entry()), written);
    Ok(())
}

#[test]
fn fuzz_conflist_parsing() {
    fuzz("conflist (generated)", config_file(), |(format, file)| {
        insertion_is_exact(format, &serde_json::to_vec(&file).unwrap())
    });
    let files = (
        mutated("conflist"),
        select(&[Format::List, Format::Single][..]),
    );
    fuzz("conflist (mutated corpus)", files, |(bytes, format)| {
        insertion_is_exact(format, &bytes)
    });
    let extras = prop_oneof![
        btree_map(text(), text(), 0..4).prop_map(|map| json!(map)),
        Just(json!({"capabilities": "not an object"})),
        Just(json!([])),
        Just(Value::Null),
    ];
    fuzz("conflist (plugin entry)", extras, |extra| {
        if let Ok(entry) = plugin_entry(WEIR, &extra) {
            prop_assert_eq!(&entry["type"], WEIR);
            prop_assert_eq!(
                &entry["capabilities"]["io.kubernetes.cri.pod-annotations"],
                true
            );
        }
        Ok(())
    });
}
