//! A node as kubelet's runtime drives it, for the tests that go through the whole CNI chain:
//! the node's conflist with weir-cni chained by weir's installer, the ambient policy, the real
//! agent, and calls to weir-cni alone as the runtime makes them.
use std::{collections::BTreeMap, net::IpAddr, path::Path, sync::Arc, time::Duration};

use weir_agent::policy::{
    local::{LocalPolicy, ObjectMeta},
    DATAPLANE_MODE_LABEL,
};
use weir_common::OUTBOUND_PORT;

use crate::{
    agent::{workspace_binary, Agent, AgentBinary, AgentProcess, NodeFiles},
    cni::{Command, RuntimeConf},
    tcp_request,
    zds_client::ZdsZtunnel,
    DatapathNode, EchoServer, Families, Metrics, NetNs, NodeOptions, Pod, PodSpec, TestNode,
    ZtunnelStandIn,
};

/// How long a test waits for something the agent does on its own: a deadline, not a pause (a
/// passing test waits only as long as the thing takes), generous enough for an emulated CPU (the
/// kernel VMs of `cargo xtask test-kernels`), where a pod's ADD alone can take seconds.
pub const WAIT: Duration = Duration::from_secs(30);
/// The ambient namespace of [`ambient_policy`].
pub const MESH: &str = "mesh";

/// The namespace `mesh` is ambient; `default` is not.
pub fn ambient_policy() -> LocalPolicy {
    let mut policy = LocalPolicy::default();
    policy.namespaces.insert(
        MESH.into(),
        ObjectMeta {
            labels: BTreeMap::from([(DATAPLANE_MODE_LABEL.into(), "ambient".into())]),
            ..ObjectMeta::default()
        },
    );
    policy
}

/// A node as kubelet's runtime sees it, for weir-agent to run on: its CNI config directory (where
/// weir's installer chains weir-cni), the ambient policy, and the agent's files. The agent runs
/// in this process ([`CniChainNode::start_agent`]) or in one of its own
/// ([`CniChainNode::start_agent_process`]); agents here stop as an upgrade does, leaving the
/// datapath in place, which the node removes when dropped.
pub struct CniChainNode {
    pub files: NodeFiles,
    pub node: DatapathNode,
}

impl CniChainNode {
    pub fn new() -> anyhow::Result<Self> {
        Self::with_families(Families::default())
    }

    /// A node whose pods get the addresses of `families`.
    pub fn with_families(families: Families) -> anyhow::Result<Self> {
        let files = NodeFiles::new()?;
        files.write_policy(&ambient_policy())?;
        let node = DatapathNode::with_options(NodeOptions {
            families,
            ..files.node_options()
        })?;
        Ok(Self { files, node })
    }

    /// A node whose policy also names the sidecar pods `default/<name>`; `None` where the test
    /// cannot run (see [`crate::require_privileges`]).
    pub fn with_sidecar_pods(sidecars: &[(&str, ObjectMeta)]) -> Option<Self> {
        Self::with_sidecar_pods_in(Families::default(), sidecars)
    }

    /// [`CniChainNode::with_sidecar_pods`], its pods getting the addresses of `families`.
    pub fn with_sidecar_pods_in(
        families: Families,
        sidecars: &[(&str, ObjectMeta)],
    ) -> Option<Self> {
        if !crate::require_privileges() {
            return None;
        }
        let node = Self::with_families(families).expect("a test node");
        let mut policy = ambient_policy();
        for (name, pod) in sidecars {
            policy.pods.insert(format!("default/{name}"), pod.clone());
        }
        node.files.write_policy(&policy).unwrap();
        Some(node)
    }

    pub fn test_node(&self) -> &TestNode {
        self.node.node()
    }

    pub fn netns(&self) -> &NetNs {
        self.test_node().netns()
    }

    /// weir-agent, in this process, ready.
    pub fn start_agent(&self) -> Agent {
        Agent::start(self.files.agent_config(self.netns()).unwrap()).expect("agent ready")
    }

    /// A plain `server` pod with an echo app, and an ambient pod `name` that ztunnel received.
    pub fn server_and_ambient_pod(
        &self,
        ztunnel: &ZdsZtunnel,
        name: &str,
    ) -> (Pod, EchoServer, Pod, Arc<ZtunnelStandIn>) {
        let server = self.pod("default", "server").unwrap();
        let echo = EchoServer::app(&server).unwrap();
        let (pod, stand_in) = self.ambient_pod(ztunnel, name);
        (server, echo, pod, stand_in)
    }

    /// An ambient pod `name`, once ztunnel received it.
    pub fn ambient_pod(&self, ztunnel: &ZdsZtunnel, name: &str) -> (Pod, Arc<ZtunnelStandIn>) {
        let pod = self.pod(MESH, name).unwrap();
        let stand_in = ztunnel
            .wait_for_pod(pod.uid(), WAIT)
            .expect("ztunnel got the pod's netns over ZDS");
        (pod, stand_in)
    }

    /// weir-agent as `binary`, in a process of its own, ready.
    pub fn start_agent_process(&self, binary: AgentBinary) -> AgentProcess {
        AgentProcess::start(&self.files, self.netns(), binary).expect("agent ready")
    }

    /// The agent, with ztunnel connected to it.
    pub fn start_agent_and_ztunnel(&self) -> (Agent, ZdsZtunnel) {
        let agent = self.start_agent();
        let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).expect("ztunnel connects");
        (agent, ztunnel)
    }

    pub fn pod(&self, namespace: &str, name: &str) -> anyhow::Result<Pod> {
        self.test_node().add_pod_with(PodSpec {
            namespace: namespace.into(),
            ..PodSpec::new(name)
        })
    }
}

/// Sends `msg` from the ambient pod `client` to `server`'s app (`echo`): the app answers, and
/// ztunnel (`stand_in`) took the connection on 15001 with the app as its original destination.
pub fn assert_through_ztunnel(
    client: &Pod,
    stand_in: &ZtunnelStandIn,
    server: &Pod,
    echo: &EchoServer,
    msg: &str,
) {
    let target = server.app_v4();
    let reply = client.run(|| tcp_request(target, msg)).unwrap();
    assert_eq!(reply.response, echo.reply_to(msg));
    assert!(
        stand_in
            .wait_for(
                |s| s.listener == OUTBOUND_PORT && s.original_dst == Some(target),
                WAIT
            )
            .is_some(),
        "{} reached {target} around ztunnel's 15001",
        client.name()
    );
}

/// Sends `msg` from `client` to `server`'s app (`echo`): the app answers, and got the connection
/// straight from the client's address.
pub fn assert_direct(client: &Pod, server: &Pod, echo: &EchoServer, msg: &str) {
    let target = server.app_v4();
    let reply = client.run(|| tcp_request(target, msg)).unwrap();
    assert_eq!(reply.response, echo.reply_to(msg));
    let received = echo.wait_for(|r| r.line == msg, WAIT).unwrap();
    assert_eq!(received.peer.ip(), IpAddr::V4(client.ipv4()));
}

/// Runs the built `weir-agent pods` on the agent's pins and `state_file` with `args`; returns
/// its output, parsed when it is JSON.
pub fn pods_command(agent: &Agent, state_file: &Path, args: &[&str]) -> serde_json::Value {
    let output = std::process::Command::new(workspace_binary("weir-agent"))
        .arg("pods")
        .arg("--pin-root")
        .arg(&agent.config.datapath.pin_root)
        .arg("--state-file")
        .arg(state_file)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(&stdout).unwrap_or(serde_json::Value::String(stdout))
}

/// The rows `weir-agent pods --output json` lists for the agent's pins and state file.
pub fn listed_pods(agent: &Agent) -> Vec<serde_json::Value> {
    match pods_command(agent, &agent.config.state_file, &["--output", "json"]) {
        serde_json::Value::Array(rows) => rows,
        other => panic!("not a JSON array: {other:#}"),
    }
}

/// Waits until the agent's /metrics has the sample `name` with `labels` at `value`.
pub fn wait_for_metric(agent: &Agent, name: &str, labels: &[(&str, &str)], value: f64) {
    Metrics::wait_for(agent.config.metrics_addr, WAIT, name, labels, value);
}

/// The node's conflist as the installer left it: bridge, then weir-cni.
pub fn weir_conflist(node: &CniChainNode) -> crate::cni::NetworkConfigList {
    let list: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.files.net_dir().join("10-weir-test.conflist")).unwrap(),
    )
    .unwrap();
    crate::cni::NetworkConfigList::from_json(&list).unwrap()
}

/// A call to weir-cni alone, configured as the node's conflist configures it.
pub fn weir_only(
    node: &CniChainNode,
    command: Command,
    runtime: &RuntimeConf,
    prev_result: Option<&serde_json::Value>,
) -> Result<serde_json::Value, crate::cni::CniError> {
    let conflist = weir_conflist(node);
    let weir = conflist.plugins.last().unwrap().clone();
    let config = conflist.plugin_config(&weir, runtime, prev_result);
    let binary = crate::cni::find_plugin(&weir, &runtime.path).unwrap();
    crate::cni::invoke(&binary, command, runtime, &config, node.netns())
}

/// The runtime's GC of the node's network (CNI 1.1), naming `valid` pods' attachments as the
/// ones it still has; run through weir-cni alone, as the runtime runs it for each plugin.
pub fn gc(node: &CniChainNode, valid: &[&Pod]) -> Result<serde_json::Value, crate::cni::CniError> {
    let conflist = weir_conflist(node);
    let weir = conflist.plugins.last().unwrap().clone();
    let runtime = RuntimeConf {
        container_id: String::new(),
        netns: None,
        ifname: String::new(),
        args: Vec::new(),
        path: node.test_node().cni_path().to_vec(),
        capability_args: Default::default(),
    };
    let mut config = conflist.plugin_config(&weir, &runtime, None);
    // GC exists from 1.1.0 on: a runtime sends it for a conflist of that version only.
    config["cniVersion"] = "1.1.0".into();
    config["cni.dev/valid-attachments"] = valid
        .iter()
        .map(|pod| {
            serde_json::json!({
                "containerID": pod.runtime_conf().container_id,
                "ifname": pod.runtime_conf().ifname,
            })
        })
        .collect();
    let binary = crate::cni::find_plugin(&weir, &runtime.path).unwrap();
    crate::cni::invoke(&binary, Command::Gc, &runtime, &config, node.netns())
}
