//! weir-agent on a test node: the real agent (`weir_agent::app::run`) in this process, on its
//! own thread and tokio runtime, with every path (sockets, CNI directories, pins) private to the
//! node, so tests run in parallel.
use std::{
    net::{Ipv4Addr, SocketAddr, TcpListener},
    os::{fd::AsFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use tempfile::TempDir;
use weir_agent::{
    app,
    cluster::ClusterConfig,
    config::{AgentConfig, SourceConfig},
    datapath::{Datapath, DatapathConfig},
    policy::{local::LocalPolicy, PolicyConfig},
};

use crate::{netns::NETNS_DIR, wait::try_wait_until, ApiServer, Metrics, NetNs, NodeOptions};

/// A built binary of this workspace (`weir-cni`, `weir-agent`), next to the test executable's
/// directory. `cargo xtask test` builds them before the tests run.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> or target/<profile>/<bin>
    let profile_dir = exe
        .ancestors()
        .find(|dir| dir.join(name).exists())
        .map(Path::to_path_buf);
    match profile_dir {
        Some(dir) => dir.join(name),
        None => panic!(
            "{name} is not built next to {}: run `cargo build --workspace --bins` first \
             (`cargo xtask test` does)",
            exe.display()
        ),
    }
}

/// A node's CNI directories and weir's files, as a real node has them.
pub struct NodeFiles {
    dir: TempDir,
}

impl NodeFiles {
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("weir-t-node-").tempdir()?;
        for sub in ["net.d", "bin", "run"] {
            std::fs::create_dir(dir.path().join(sub))?;
        }
        Ok(Self { dir })
    }

    pub fn net_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    pub fn bin_dir(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    pub fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    pub fn policy_file(&self) -> PathBuf {
        self.dir.path().join("policy.json")
    }

    pub fn write_policy(&self, policy: &LocalPolicy) -> Result<()> {
        std::fs::write(self.policy_file(), serde_json::to_vec_pretty(policy)?)?;
        Ok(())
    }

    /// A test node whose runtime reads the CNI config from `net.d` and finds plugins in `bin`,
    /// as kubelet's runtime does on a real node.
    pub fn node_options(&self) -> NodeOptions {
        NodeOptions {
            plugin_dirs: vec![self.bin_dir()],
            conflist_dir: Some(self.net_dir()),
            ..NodeOptions::default()
        }
    }

    /// The agent's configuration for `node`.
    pub fn agent_config(&self, node: &NetNs) -> Result<AgentConfig> {
        let [health, metrics, admin] = own_loopback_ports()?;
        Ok(agent_config_at(
            self.dir.path(),
            node.name(),
            health,
            metrics,
            admin,
        ))
    }
}

/// The configuration [`NodeFiles::agent_config`] gives, for the node files at `dir`.
pub fn agent_config_at(
    dir: &Path,
    node_netns: &str,
    health_addr: SocketAddr,
    metrics_addr: SocketAddr,
    admin_addr: SocketAddr,
) -> AgentConfig {
    let run = dir.join("run");
    AgentConfig {
        datapath: datapath_config(node_netns),
        policy: PolicyConfig::default(),
        source: SourceConfig::File(dir.join("policy.json")),
        cni_socket: run.join("cni.sock"),
        verdict_cache: run.join("verdicts.json"),
        state_file: run.join("pods.json"),
        trace_socket: run.join("trace.sock"),
        zds_socket: run.join("ztunnel.sock"),
        cni_bin_dir: dir.join("bin"),
        cni_net_dir: dir.join("net.d"),
        cni_placement: weir_agent::install::CniPlacement::default(),
        cni_plugin: workspace_binary("weir-cni"),
        cni_plugin_log: Some(run.join("weir-cni.log")),
        service_account: None,
        health_addr,
        metrics_addr,
        admin_addr,
        uninstall_on_exit: false,
        hand_back_to_istio_cni: None,
        orphan_sweep_interval: Duration::from_secs(60),
    }
}

/// The datapath of the test node whose network namespace is `/var/run/netns/<node_netns>`: pins
/// in a bpffs directory private to the node, so tests run in parallel (`cargo xtask sweep`
/// removes them after a killed run), and kubelet probes coming from the node's namespace.
pub fn datapath_config(node_netns: &str) -> DatapathConfig {
    DatapathConfig {
        pin_root: Path::new("/sys/fs/bpf").join(node_netns),
        cgroup: None,
        node_netns: Some(Path::new(NETNS_DIR).join(node_netns)),
        ..DatapathConfig::default()
    }
}

impl NodeFiles {
    /// A kubeconfig file for the cluster `api`, as a node agent outside the cluster uses.
    pub fn kubeconfig(&self, api: &ApiServer) -> Result<PathBuf> {
        let kubeconfig = self.dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig())?;
        Ok(kubeconfig)
    }

    /// The agent's configuration for `node` when it follows the cluster `api` as `node_name`,
    /// through a kubeconfig file as a node agent outside the cluster would.
    pub fn cluster_agent_config(
        &self,
        node: &NetNs,
        api: &ApiServer,
        node_name: &str,
    ) -> Result<AgentConfig> {
        let kubeconfig = self.kubeconfig(api)?;
        Ok(AgentConfig {
            source: SourceConfig::Cluster(ClusterConfig {
                kubeconfig: Some(kubeconfig),
                node_name: node_name.to_owned(),
                resync_interval: std::time::Duration::from_secs(60),
                broken_pods: Default::default(),
            }),
            ..self.agent_config(node)?
        })
    }
}

/// Removes whatever datapath is pinned at `pin_root` (programs detached, pins gone): what a test
/// leaves when its agent stopped the way an upgrade does, keeping redirection in place, or when
/// it failed before uninstalling.
pub(crate) fn remove_datapath(pin_root: &Path) {
    if !pin_root.exists() {
        return;
    }
    let config = DatapathConfig {
        pin_root: pin_root.to_path_buf(),
        cgroup: None,
        probe_bypass: false,
        ..DatapathConfig::default()
    };
    if let Err(error) = Datapath::start(config).and_then(|datapath| datapath.uninstall().wait()) {
        eprintln!("removing the datapath at {}: {error:#}", pin_root.display());
    }
}

/// `N` distinct ports, free now, on a loopback address of their own: no other agent this
/// process configures is given that address. An agent waits for a port another process holds
/// (as it does for a node agent leaving the node), so a port picked twice would have another
/// test's agent answer for one still starting.
fn own_loopback_ports<const N: usize>() -> Result<[SocketAddr; N]> {
    static AGENTS: AtomicU32 = AtomicU32::new(1);
    let agent = AGENTS.fetch_add(1, Ordering::Relaxed);
    // 127.0.0.0/8 is all loopback: the process and the agent's number make the address.
    let [_, _, high, low] = agent.to_be_bytes();
    let address = Ipv4Addr::new(127, 1 + (std::process::id() % 250) as u8, high, low);
    // Held until all are picked, so that they differ.
    let listeners = (0..N)
        .map(|_| TcpListener::bind((address, 0)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let addrs = (listeners.iter())
        .map(TcpListener::local_addr)
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok(addrs.try_into().expect("N addresses"))
}

/// How long an agent may take to become ready: it loads and verifies the programs first, which
/// takes seconds on an emulated CPU (the kernel VMs) and a loaded CI machine.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// A running agent; stopped (SIGTERM-like: leaves the datapath in place) by [`Agent::stop`].
pub struct Agent {
    pub config: AgentConfig,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<Result<()>>>,
}

impl Agent {
    /// Starts the agent and waits until it reports ready (plugin installed, serving).
    pub fn start(config: AgentConfig) -> Result<Self> {
        let agent = Self::spawn(config)?;
        agent.wait_ready(READY_TIMEOUT)?;
        Ok(agent)
    }

    /// Starts the agent without waiting for it to be ready.
    pub fn spawn(config: AgentConfig) -> Result<Self> {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run_config = config.clone();
        let thread = thread::Builder::new()
            .name("weir-agent".into())
            .spawn(move || {
                tokio::runtime::Runtime::new()?.block_on(app::run(run_config, async {
                    let _ = stopped.await;
                }))
            })?;
        Ok(Self {
            config,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Waits until the agent reports ready on /readyz.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        try_wait_until(timeout, || {
            if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
                return Some(Err(anyhow!("the agent exited while starting")));
            }
            (http_status(self.config.health_addr, "/readyz").ok() == Some(200)).then_some(Ok(()))
        })
        .unwrap_or_else(|| bail!("the agent was not ready within {timeout:?}"))
    }

    /// What its /metrics serves now.
    pub fn metrics(&self) -> Metrics {
        Metrics::scrape(self.config.metrics_addr).expect("the agent's /metrics")
    }

    /// Stops the agent as SIGTERM does and returns its result.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| anyhow::anyhow!("the agent thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Err(error) = self.shutdown() {
            eprintln!("stopping the agent: {error:#}");
        }
    }
}

/// A plain HTTP/1.0 GET on loopback; returns the status code.
pub fn http_status(addr: SocketAddr, path: &str) -> Result<u16> {
    Ok(http_get(addr, path)?.0)
}

/// A plain HTTP/1.0 GET on loopback; returns the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    http_request(addr, "GET", path)
}

/// A plain HTTP/1.0 request without a body on loopback; returns the status code and the body.
pub fn http_request(addr: SocketAddr, method: &str, path: &str) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("no HTTP status")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Which binary an [`AgentProcess`] runs.
#[derive(Clone, Copy)]
pub enum AgentBinary<'a> {
    /// `weir-agent run`, the production binary, configured by its flags as the DaemonSet
    /// configures it, with `env` added to its environment.
    Run { env: &'a [(&'a str, &'a str)] },
    /// `weir-agent run` following the cluster at `kubeconfig` as the node `node_name`, instead of
    /// a policy file.
    RunInCluster {
        kubeconfig: &'a Path,
        node_name: &'a str,
    },
    /// `weir-agent-with-failpoints`, held for good at the fault-injection point `pause_at` (a
    /// `fail::fail_point!` name in the agent) when one is given.
    WithFailpoints { pause_at: Option<&'a str> },
}

/// `weir-agent run` with `config`'s paths and addresses as flags, its other settings the
/// binary's defaults; the caller adds where the pods' policy comes from.
fn run_command(config: &AgentConfig) -> std::process::Command {
    agent_command(config, "run")
}

/// `weir-agent <subcommand>` with the paths and addresses of the agent `config` configures, as
/// the flags of `run` (which `check` and `bug-report` take too).
pub fn agent_command(config: &AgentConfig, subcommand: &str) -> std::process::Command {
    let mut command = std::process::Command::new(workspace_binary("weir-agent"));
    command
        .arg("--pin-root")
        .arg(&config.datapath.pin_root)
        .arg(subcommand)
        .arg("--cni-socket")
        .arg(&config.cni_socket)
        .arg("--verdict-cache")
        .arg(&config.verdict_cache)
        .arg("--state-file")
        .arg(&config.state_file)
        .arg("--trace-socket")
        .arg(&config.trace_socket)
        .arg("--zds-socket")
        .arg(&config.zds_socket)
        .arg("--cni-bin-dir")
        .arg(&config.cni_bin_dir)
        .arg("--cni-net-dir")
        .arg(&config.cni_net_dir)
        .arg("--owned-cni-config-filename")
        .arg(&config.cni_placement.owned_file)
        .arg("--cni-plugin")
        .arg(&config.cni_plugin)
        .arg("--health-addr")
        .arg(config.health_addr.to_string())
        .arg("--metrics-addr")
        .arg(config.metrics_addr.to_string())
        .arg("--admin-addr")
        .arg(config.admin_addr.to_string())
        .env("RUST_LOG", "warn");
    command
}

/// The agent in a process of its own, in the node's network namespace (host network, as the
/// DaemonSet runs it), so a test can count its fds and memory or SIGKILL it. Dropping it stops it
/// with SIGTERM, which leaves the datapath for the fixture to remove.
pub struct AgentProcess {
    /// Where it serves and keeps its files (`Run` is given these paths and addresses as flags;
    /// its other settings are the binary's defaults).
    pub config: AgentConfig,
    child: std::process::Child,
    /// The process's stdout lines, read on a thread of their own.
    lines: std::sync::mpsc::Receiver<String>,
    /// Its log lines (stderr) so far, read on a thread of their own, which also passes them on
    /// to the test's stderr.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl AgentProcess {
    /// Starts `binary` for `node` with `files` and waits until it is ready.
    pub fn start(files: &NodeFiles, node: &NetNs, binary: AgentBinary) -> Result<Self> {
        let config = files.agent_config(node)?;
        let mut command = match binary {
            AgentBinary::Run { env } => {
                let mut command = run_command(&config);
                command
                    .arg("--policy-file")
                    .arg(files.policy_file())
                    .envs(env.iter().copied());
                command
            }
            AgentBinary::RunInCluster {
                kubeconfig,
                node_name,
            } => {
                let mut command = run_command(&config);
                command
                    .arg("--kubeconfig")
                    .arg(kubeconfig)
                    .args(["--node-name", node_name]);
                command
            }
            AgentBinary::WithFailpoints { pause_at } => {
                let mut command =
                    std::process::Command::new(workspace_binary("weir-agent-with-failpoints"));
                command
                    .arg(node.name())
                    .arg(files.dir.path())
                    .arg(config.health_addr.to_string())
                    .arg(config.metrics_addr.to_string())
                    .arg(config.admin_addr.to_string())
                    .args(pause_at);
                command
            }
        };
        let node_netns = node.open()?;
        command
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        // SAFETY: setns is async-signal-safe, and the fd stays open until spawn returns.
        unsafe {
            command.pre_exec(move || crate::netns::enter(node_netns.as_fd()));
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {:?}", command.get_program()))?;
        let stdout = child.stdout.take().context("the agent's stdout")?;
        let (line_tx, lines) = std::sync::mpsc::channel();
        thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if line_tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = child.stderr.take().context("the agent's stderr")?;
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = log.clone();
        thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                eprintln!("{line}");
                kept.lock().unwrap().push(line);
            }
        });
        let mut agent = Self {
            config,
            child,
            lines,
            log,
        };
        try_wait_until(READY_TIMEOUT, || {
            match agent.child.try_wait() {
                Ok(Some(status)) => {
                    return Some(Err(anyhow!("the agent exited while starting: {status}")))
                }
                Ok(None) => {}
                Err(error) => return Some(Err(error.into())),
            }
            let ready = node.run(|| http_status(agent.config.health_addr, "/readyz").ok());
            (ready == Some(200)).then_some(Ok(()))
        })
        .unwrap_or_else(|| bail!("the agent was not ready within {READY_TIMEOUT:?}"))?;
        Ok(agent)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its resident memory (`VmRSS` of `/proc/<pid>/status`), in bytes.
    pub fn rss_bytes(&self) -> Result<u64> {
        self.memory_status("VmRSS")
    }

    /// The most resident memory it has had (`VmHWM`), in bytes.
    pub fn peak_rss_bytes(&self) -> Result<u64> {
        self.memory_status("VmHWM")
    }

    fn memory_status(&self, field: &str) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        let kib: u64 = status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("no {field} in the agent's /proc/<pid>/status"))?;
        Ok(kib * 1024)
    }

    /// The CPU time it has used so far, user and system (`utime` + `stime` of
    /// `/proc/<pid>/stat`), over all its threads.
    pub fn cpu_time(&self) -> Result<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))?;
        // The fields after `(comm)`, which may hold spaces, start with the state (field 3);
        // utime and stime are fields 14 and 15, in clock ticks.
        let after_comm = stat
            .rsplit_once(')')
            .context("no (comm) in /proc/<pid>/stat")?
            .1;
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        let ticks = |field: usize| -> Result<u64> {
            fields
                .get(field - 3)
                .and_then(|value| value.parse().ok())
                .with_context(|| format!("no field {field} in /proc/<pid>/stat"))
        };
        // SAFETY: sysconf only reads a configuration value.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if per_second <= 0 {
            bail!("sysconf(_SC_CLK_TCK) failed");
        }
        let total = ticks(14)? + ticks(15)?;
        Ok(Duration::from_secs_f64(total as f64 / per_second as f64))
    }

    /// Its log lines so far.
    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the agent says it stopped at its pause point.
    pub fn wait_until_paused(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + crate::wait::scaled(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with("paused at ") => return Ok(()),
                Ok(_) => {}
                Err(_) => bail!("the agent did not reach its pause point within {timeout:?}"),
            }
        }
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        // Gone already when `kill` ran: then there is nothing to signal.
        if let Ok(None) = self.child.try_wait() {
            let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = self.child.wait();
        }
    }
}
