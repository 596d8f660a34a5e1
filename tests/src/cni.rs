//! Running CNI plugins exactly as a container runtime does (CNI spec 1.0.0, "Execution Protocol"):
//! exec the plugin binary with the parameters in `CNI_*` environment variables and the network
//! configuration as JSON on stdin; the result (or error) is JSON on stdout.
//!
//! The runtime process lives in the node's root network namespace, and plugins inherit it: the
//! bridge plugin creates `cni0` and the host end of each veth where it runs. Here the "node" is a
//! namespace of its own, so plugins are started inside it with `ip netns exec`, which also mounts
//! a `/sys` matching that namespace, as a real node has.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, ExitStatus, Stdio};

use serde_json::{json, Map, Value};

use crate::NetNs;

/// Debian's `containernetworking-plugins` (bridge, host-local, loopback, ...).
pub const REFERENCE_PLUGIN_DIR: &str = "/usr/lib/cni";

/// The CNI version of every configuration the harness writes (what containerd 1.6 sent).
pub const CNI_VERSION: &str = "1.0.0";

/// `CNI_COMMAND`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    /// CNI 1.1: no container, only `CNI_COMMAND` and `CNI_PATH` in the environment.
    Gc,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Gc => "GC",
        }
    }
}

/// The per-container parameters a runtime passes in the environment.
#[derive(Clone, Debug)]
pub struct RuntimeConf {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`; `None` passes it empty, as containerd's second DEL (RemovePodSandbox) does.
    pub netns: Option<PathBuf>,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_ARGS`, in this order, joined as `K=V;K=V`.
    pub args: Vec<(String, String)>,
    /// `CNI_PATH`: where plugin binaries (and the IPAM plugins they delegate to) are looked up.
    pub path: Vec<PathBuf>,
    /// Values for the capabilities plugins declare (`runtimeConfig`), e.g. `portMappings` or
    /// `io.kubernetes.cri.pod-annotations`; each plugin only gets the ones it declares.
    pub capability_args: Map<String, Value>,
}

impl RuntimeConf {
    /// A pod's sandbox as a Kubernetes runtime (containerd, CRI-O) describes it on `eth0`: its
    /// names and uid in `CNI_ARGS` and its annotations as a capability.
    pub fn kubernetes_pod(
        netns: &Path,
        namespace: &str,
        name: &str,
        uid: &str,
        annotations: Map<String, Value>,
        path: Vec<PathBuf>,
    ) -> Self {
        let container_id = crate::ids::container_id();
        Self {
            netns: Some(netns.to_owned()),
            ifname: "eth0".to_owned(),
            args: [
                ("IgnoreUnknown", "1"),
                ("K8S_POD_NAMESPACE", namespace),
                ("K8S_POD_NAME", name),
                ("K8S_POD_INFRA_CONTAINER_ID", &container_id),
                ("K8S_POD_UID", uid),
            ]
            .map(|(key, value)| (key.to_owned(), value.to_owned()))
            .into(),
            container_id,
            path,
            capability_args: Map::from_iter([(
                "io.kubernetes.cri.pod-annotations".to_owned(),
                annotations.into(),
            )]),
        }
    }

    fn env(&self, command: Command) -> Vec<(&'static str, OsString)> {
        let args = self
            .args
            .iter()
            .map(|(key, value)| format!("{key}={value}"))
            .collect::<Vec<_>>()
            .join(";");
        let path = std::env::join_paths(&self.path).unwrap_or_default();
        let mut env = vec![
            ("CNI_COMMAND", command.as_str().into()),
            ("CNI_CONTAINERID", self.container_id.clone().into()),
            ("CNI_NETNS", self.netns.clone().unwrap_or_default().into()),
            ("CNI_IFNAME", self.ifname.clone().into()),
            ("CNI_ARGS", args.into()),
            ("CNI_PATH", path),
        ];
        if command == Command::Gc {
            env.retain(|(name, _)| matches!(*name, "CNI_COMMAND" | "CNI_PATH"));
        }
        env
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CniError {
    #[error("cannot run CNI plugin {plugin}: {source}")]
    Spawn {
        plugin: PathBuf,
        source: std::io::Error,
    },
    #[error("CNI plugin type {0:?} not found in CNI_PATH {1:?}")]
    NotFound(String, Vec<PathBuf>),
    #[error("CNI plugin configuration has no \"type\": {0}")]
    NoType(Value),
    /// The plugin exited non-zero.
    #[error(transparent)]
    Plugin(Box<PluginFailure>),
    #[error("CNI {command} of {plugin} printed something that is not JSON ({source}): {stdout}")]
    BadOutput {
        plugin: PathBuf,
        command: &'static str,
        source: serde_json::Error,
        stdout: String,
    },
}

/// A plugin's failure: exit status, the error JSON it printed (`code`, `msg`, `details`) and
/// its stderr.
#[derive(Debug, thiserror::Error)]
#[error("CNI {command} of {plugin} failed ({status}): code {code:?}: {msg} {details} (stderr: {stderr})")]
pub struct PluginFailure {
    pub plugin: PathBuf,
    pub command: &'static str,
    pub status: ExitStatus,
    pub code: Option<u64>,
    pub msg: String,
    pub details: String,
    pub stderr: String,
}

/// Execs one plugin binary inside `runtime_netns` (where the runtime would be) with `config` on
/// stdin. Returns what it printed: the result for ADD, `Value::Null` when it printed nothing (DEL).
/// Spawned from a thread in the netns: the reference plugins reach interfaces over netlink and
/// sysctls through `/proc/sys` (both the caller's netns), so they need neither `ip netns exec`'s
/// process nor its mount of a matching `/sys`.
pub fn invoke(
    plugin: &Path,
    command: Command,
    runtime: &RuntimeConf,
    config: &Value,
    runtime_netns: &NetNs,
) -> Result<Value, CniError> {
    runtime_netns.run(|| invoke_from_this_thread(plugin, command, runtime, config))
}

/// Execs one plugin binary straight from the calling thread, so in that thread's network
/// namespace (the runtime's: run it on a thread inside the node, e.g. [`NetNs::run`]): when what
/// its execution costs is being measured.
pub fn invoke_from_this_thread(
    plugin: &Path,
    command: Command,
    runtime: &RuntimeConf,
    config: &Value,
) -> Result<Value, CniError> {
    run_plugin(Process::new(plugin), plugin, command, runtime, config)
}

/// Runs `process` (which execs `plugin`) as a runtime runs a plugin, and reads its answer.
fn run_plugin(
    mut process: Process,
    plugin: &Path,
    command: Command,
    runtime: &RuntimeConf,
    config: &Value,
) -> Result<Value, CniError> {
    let spawn_err = spawn_error(plugin);
    process
        .env_clear()
        .envs(plugin_env(runtime, command))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = process.spawn().map_err(spawn_err)?;
    let stdin = serde_json::to_vec(config).expect("a JSON value serializes");
    // The configuration is far smaller than a pipe buffer: write it all, then read the output.
    let written = child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(&stdin);
    let out = child.wait_with_output().map_err(spawn_err)?;
    written.map_err(spawn_err)?;
    answer(plugin, command, out.status, &out.stdout, &out.stderr)
}

/// The plugin could not be run, or its answer not read.
fn spawn_error(plugin: &Path) -> impl Fn(std::io::Error) -> CniError + Copy + '_ {
    |source| CniError::Spawn {
        plugin: plugin.to_owned(),
        source,
    }
}

/// A runtime passes its own environment plus the CNI variables; only PATH of ours is kept, so no
/// stray CNI_* of the test environment leaks in.
fn plugin_env(runtime: &RuntimeConf, command: Command) -> Vec<(&'static str, OsString)> {
    let path = std::env::var_os("PATH").map(|path| ("PATH", path));
    path.into_iter().chain(runtime.env(command)).collect()
}

/// What a plugin's exit and output say: its result, or why it failed.
fn answer(
    plugin: &Path,
    command: Command,
    status: ExitStatus,
    stdout: &[u8],
    stderr: &[u8],
) -> Result<Value, CniError> {
    let stdout = String::from_utf8_lossy(stdout).into_owned();
    let parsed = if stdout.trim().is_empty() {
        Ok(Value::Null)
    } else {
        serde_json::from_str(&stdout)
    };
    if !status.success() {
        let error = parsed.unwrap_or_default();
        let text = |key: &str| error[key].as_str().unwrap_or_default().to_owned();
        return Err(CniError::Plugin(Box::new(PluginFailure {
            plugin: plugin.to_owned(),
            command: command.as_str(),
            status,
            code: error["code"].as_u64(),
            msg: if error.is_null() { stdout } else { text("msg") },
            details: text("details"),
            stderr: String::from_utf8_lossy(stderr).trim().to_owned(),
        })));
    }
    parsed.map_err(|source| CniError::BadOutput {
        plugin: plugin.to_owned(),
        command: command.as_str(),
        source,
        stdout,
    })
}

/// Runs plugins from a process of its own (`weir-plugin-runner`), started on the node before the
/// caller opens its many descriptors: an exec closes each descriptor its process holds, about
/// 1 ms per 5,000 (a bench's pods' namespaces), which a runtime's exec does not pay.
pub struct PluginRunner {
    process: std::process::Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl PluginRunner {
    /// Starts the runner from a thread in `node`: the plugins it runs are on the node.
    pub fn start(node: &NetNs) -> std::io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("runner.sock");
        let binary = crate::agent::workspace_binary("weir-plugin-runner");
        let mut process = node.run(|| {
            Process::new(&binary)
                .arg(&socket)
                // Held open by `process` until it is dropped or this process dies: the runner
                // exits at its end.
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
        })?;
        let mut ready = String::new();
        let stdout = process.stdout.take().expect("stdout is piped");
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut ready)?;
        if ready.trim() != "listening" {
            let _ = process.kill();
            return Err(std::io::Error::other("weir-plugin-runner did not start"));
        }
        Ok(Self {
            process,
            socket,
            _dir: dir,
        })
    }

    /// [`invoke`], the plugin exec'd by the runner.
    pub fn invoke(
        &self,
        plugin: &Path,
        command: Command,
        runtime: &RuntimeConf,
        config: &Value,
    ) -> Result<Value, CniError> {
        let spawn_err = spawn_error(plugin);
        let env: Vec<(&str, String)> = (plugin_env(runtime, command).into_iter())
            .map(|(name, value)| (name, value.to_string_lossy().into_owned()))
            .collect();
        let request = json!({
            "program": plugin,
            "env": env,
            "stdin": config.to_string(),
        });
        let mut stream =
            std::os::unix::net::UnixStream::connect(&self.socket).map_err(spawn_err)?;
        stream
            .write_all(request.to_string().as_bytes())
            .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
            .map_err(spawn_err)?;
        let reply: Value = serde_json::from_reader(&stream)
            .map_err(|error| spawn_err(std::io::Error::other(error)))?;
        let status = reply["status"].as_i64().unwrap_or(-1) as i32;
        let text = |key: &str| reply[key].as_str().unwrap_or_default().as_bytes().to_vec();
        answer(
            plugin,
            command,
            std::os::unix::process::ExitStatusExt::from_raw(status),
            &text("stdout"),
            &text("stderr"),
        )
    }
}

impl Drop for PluginRunner {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// A network configuration list (a `.conflist`): plugins run in order for ADD, each getting the
/// previous one's result as `prevResult`, and in reverse order for DEL.
#[derive(Clone, Debug)]
pub struct NetworkConfigList {
    pub name: String,
    pub cni_version: String,
    /// Each plugin's configuration object, as in the file's `plugins` array.
    pub plugins: Vec<Value>,
}

impl NetworkConfigList {
    pub fn new(name: &str, plugins: Vec<Value>) -> Self {
        Self {
            name: name.to_owned(),
            cni_version: CNI_VERSION.to_owned(),
            plugins,
        }
    }

    /// A list as a runtime reads it from a `.conflist` file.
    pub fn from_json(list: &Value) -> Option<Self> {
        Some(Self {
            name: list["name"].as_str()?.to_owned(),
            cni_version: list["cniVersion"].as_str()?.to_owned(),
            plugins: list["plugins"].as_array()?.clone(),
        })
    }

    /// The list as a runtime reads it from the CNI config directory.
    pub fn to_json(&self) -> Value {
        json!({ "cniVersion": self.cni_version, "name": self.name, "plugins": self.plugins })
    }

    /// What the runtime feeds `plugin` on stdin (spec: "Deriving execution configuration from
    /// plugin configuration"): the plugin's object plus the list's `name` and `cniVersion`, the
    /// `runtimeConfig` entries for the capabilities it declares, and `prevResult` when there is one.
    pub fn plugin_config(
        &self,
        plugin: &Value,
        runtime: &RuntimeConf,
        prev_result: Option<&Value>,
    ) -> Value {
        let mut config = plugin.as_object().cloned().unwrap_or_default();
        config.insert("name".into(), self.name.clone().into());
        config.insert("cniVersion".into(), self.cni_version.clone().into());
        config.remove("capabilities");
        let runtime_config: Map<String, Value> = runtime
            .capability_args
            .iter()
            .filter(|(capability, _)| plugin["capabilities"][capability.as_str()] == true)
            .map(|(capability, value)| (capability.clone(), value.clone()))
            .collect();
        if !runtime_config.is_empty() {
            config.insert("runtimeConfig".into(), runtime_config.into());
        }
        if let Some(prev) = prev_result {
            config.insert("prevResult".into(), prev.clone());
        }
        config.into()
    }

    /// ADD through the whole chain; returns the last plugin's result (what the runtime caches).
    pub fn add(&self, runtime: &RuntimeConf, runtime_netns: &NetNs) -> Result<Value, CniError> {
        let mut prev_result: Option<Value> = None;
        for plugin in &self.plugins {
            let config = self.plugin_config(plugin, runtime, prev_result.as_ref());
            let binary = find_plugin(plugin, &runtime.path)?;
            prev_result = Some(invoke(
                &binary,
                Command::Add,
                runtime,
                &config,
                runtime_netns,
            )?);
        }
        Ok(prev_result.unwrap_or_default())
    }

    /// DEL through the chain in reverse, every plugin getting the cached ADD result as
    /// `prevResult` (`None` as in containerd's second DEL). Every plugin runs even when one
    /// fails; the first failure is returned.
    pub fn del(
        &self,
        runtime: &RuntimeConf,
        prev_result: Option<&Value>,
        runtime_netns: &NetNs,
    ) -> Result<(), CniError> {
        let mut first_error = None;
        for plugin in self.plugins.iter().rev() {
            let config = self.plugin_config(plugin, runtime, prev_result);
            let result = find_plugin(plugin, &runtime.path)
                .and_then(|binary| invoke(&binary, Command::Del, runtime, &config, runtime_netns));
            if let Err(err) = result {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The binary for a plugin configuration: its `type` looked up in `CNI_PATH`.
pub fn find_plugin(plugin: &Value, cni_path: &[PathBuf]) -> Result<PathBuf, CniError> {
    let kind = plugin["type"]
        .as_str()
        .ok_or_else(|| CniError::NoType(plugin.clone()))?;
    cni_path
        .iter()
        .map(|dir| dir.join(kind))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| CniError::NotFound(kind.to_owned(), cni_path.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> RuntimeConf {
        RuntimeConf {
            container_id: "c0ffee".into(),
            netns: None,
            ifname: "eth0".into(),
            args: vec![
                ("IgnoreUnknown".into(), "1".into()),
                ("K8S_POD_NAME".into(), "a".into()),
            ],
            path: vec!["/opt/cni/bin".into(), REFERENCE_PLUGIN_DIR.into()],
            capability_args: Map::from_iter([("portMappings".to_owned(), json!([]))]),
        }
    }

    #[test]
    fn plugin_config_follows_the_spec() {
        let list = NetworkConfigList::new(
            "net",
            vec![json!({"type": "weir", "capabilities": {"portMappings": true, "dns": true}})],
        );
        let prev = json!({"cniVersion": CNI_VERSION, "ips": []});
        let config = list.plugin_config(&list.plugins[0], &runtime(), Some(&prev));
        assert_eq!(
            config,
            json!({
                "type": "weir",
                "name": "net",
                "cniVersion": CNI_VERSION,
                "runtimeConfig": {"portMappings": []},
                "prevResult": prev,
            })
        );
        // A plugin without the capability gets no runtimeConfig, and the first plugin no prevResult.
        let plain = list.plugin_config(&json!({"type": "bridge"}), &runtime(), None);
        assert_eq!(
            plain,
            json!({"type": "bridge", "name": "net", "cniVersion": CNI_VERSION})
        );
    }

    #[test]
    fn environment_is_what_a_runtime_passes() {
        let env: Vec<(&str, String)> = runtime()
            .env(Command::Del)
            .into_iter()
            .map(|(key, value)| (key, value.into_string().unwrap()))
            .collect();
        assert_eq!(
            env,
            [
                ("CNI_COMMAND", "DEL".to_owned()),
                ("CNI_CONTAINERID", "c0ffee".to_owned()),
                ("CNI_NETNS", String::new()),
                ("CNI_IFNAME", "eth0".to_owned()),
                ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=a".to_owned()),
                ("CNI_PATH", "/opt/cni/bin:/usr/lib/cni".to_owned()),
            ]
        );
    }
}
