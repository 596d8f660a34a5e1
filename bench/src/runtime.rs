//! Pod start as a container runtime runs it (CNI spec, "Execution Protocol"): each plugin of the
//! chain exec'd straight from the runtime's network namespace (the node's), with the `CNI_*`
//! environment and its configuration on stdin, each exec timed on its own.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::{json, Map, Value};
use weir_tests::chain::MESH;
use weir_tests::cni::{self, Command, NetworkConfigList, RuntimeConf};
use weir_tests::{ids, NetNs, TestNode};

/// A pod sandbox the runtime wired: its namespace and what its chain's ADD returned. Dropping it
/// runs DEL through the chain (reverse order) and `loopback`, then deletes the namespace.
pub struct Sandbox<'node> {
    node: &'node TestNode,
    chain: NetworkConfigList,
    netns: NetNs,
    runtime: RuntimeConf,
    /// The last plugin's ADD result, which the runtime caches and passes to DEL.
    result: Option<Value>,
}

/// How long one pod's ADD took: the whole of it, and each plugin's exec in the order run
/// (`loopback` first, then the chain's plugins).
pub struct AddTimes {
    pub whole: Duration,
    pub plugins: Vec<Duration>,
}

impl<'node> Sandbox<'node> {
    /// Creates the namespace of the pod `name` in the ambient namespace [`MESH`], then runs ADD
    /// on the node as containerd does: `loopback` (a network of its own, `CNI_IFNAME=lo`), then
    /// `chain`. The pod takes a port on the bridge of `chain`'s first plugin outside the node's
    /// own count: the caller keeps that bridge clear of other pods. The namespace's creation is
    /// not in the times.
    pub fn add(
        node: &'node TestNode,
        chain: NetworkConfigList,
        name: &str,
    ) -> Result<(Self, AddTimes)> {
        let netns = NetNs::create(name)?;
        // As the harness's pods: the bridge plugin waits for the pod's addresses to settle, which
        // is not meant to be a wait for duplicate address detection.
        for key in [
            "net.ipv6.conf.all.accept_dad",
            "net.ipv6.conf.default.accept_dad",
        ] {
            netns.sysctl(key, "0")?;
        }
        let uid = ids::uuid_v4();
        let runtime = RuntimeConf::kubernetes_pod(
            netns.path(),
            MESH,
            name,
            &uid,
            Map::new(),
            node.cni_path().to_vec(),
        );
        let mut sandbox = Self {
            node,
            chain,
            netns,
            runtime,
            result: None,
        };
        let times = node.run(|| sandbox.run_add())?;
        Ok((sandbox, times))
    }

    /// ADD from the calling thread, which is on the node.
    fn run_add(&mut self) -> Result<AddTimes> {
        let loopback = loopback_network();
        let start = Instant::now();
        let mut plugins = Vec::with_capacity(1 + self.chain.plugins.len());
        exec(
            &loopback,
            &loopback.plugins[0],
            Command::Add,
            &on_loopback(&self.runtime),
            None,
        )?;
        plugins.push(start.elapsed());
        for plugin in &self.chain.plugins {
            let one = Instant::now();
            let result = exec(
                &self.chain,
                plugin,
                Command::Add,
                &self.runtime,
                self.result.as_ref(),
            )?;
            plugins.push(one.elapsed());
            self.result = Some(result);
        }
        Ok(AddTimes {
            whole: start.elapsed(),
            plugins,
        })
    }
}

impl Drop for Sandbox<'_> {
    fn drop(&mut self) {
        let loopback = loopback_network();
        // Every DEL runs whatever the others did, as a runtime's do.
        let failures: Vec<anyhow::Error> = self.node.run(|| {
            let mut results: Vec<Result<Value>> = self
                .chain
                .plugins
                .iter()
                .rev()
                .map(|plugin| {
                    exec(
                        &self.chain,
                        plugin,
                        Command::Del,
                        &self.runtime,
                        self.result.as_ref(),
                    )
                })
                .collect();
            results.push(exec(
                &loopback,
                &loopback.plugins[0],
                Command::Del,
                &on_loopback(&self.runtime),
                None,
            ));
            results.into_iter().filter_map(Result::err).collect()
        });
        for failure in failures {
            eprintln!("warning: CNI DEL of {}: {failure:#}", self.netns.name());
        }
    }
}

/// containerd's loopback network: the `loopback` plugin alone.
fn loopback_network() -> NetworkConfigList {
    NetworkConfigList::new("cni-loopback", vec![json!({"type": "loopback"})])
}

fn on_loopback(runtime: &RuntimeConf) -> RuntimeConf {
    RuntimeConf {
        ifname: "lo".to_owned(),
        ..runtime.clone()
    }
}

/// `plugin` of `list` exec'd from the calling thread, as the runtime execs it: its binary found
/// in `CNI_PATH`, its configuration derived from the list's; returns what it printed.
fn exec(
    list: &NetworkConfigList,
    plugin: &Value,
    command: Command,
    runtime: &RuntimeConf,
    prev_result: Option<&Value>,
) -> Result<Value> {
    let config = list.plugin_config(plugin, runtime, prev_result);
    let binary = cni::find_plugin(plugin, &runtime.path)?;
    Ok(cni::invoke_from_this_thread(
        &binary, command, runtime, &config,
    )?)
}
