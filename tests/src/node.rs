//! A node and its pods, wired the way a node's container runtime wires them.
//!
//! The node is a network namespace standing in for the node's root namespace: kubelet probes and
//! "other hosts" live there, and the CNI plugins run there. Each pod is a namespace of its own,
//! given `lo` by the `loopback` plugin and `eth0` (a veth on the node's `cni0` bridge, one IPv4
//! and one IPv6 address from host-local IPAM) by the `bridge` plugin. A node made for thousands
//! of pods has more bridges (`cni1`, ...), each with address ranges of its own.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};
use tempfile::TempDir;
use weir_agent::{
    datapath::DatapathConfig,
    workload::{PodName, PodOptions, Workload},
};

use crate::cni::{self, NetworkConfigList, RuntimeConf};
use crate::ids;
use crate::netns::{self, NetNs};

/// The pod network's bridge on every node.
pub const BRIDGE: &str = "cni0";
/// The conflist's network name.
pub const NETWORK_NAME: &str = "weir-test";
/// Pods one bridge takes: a Linux bridge has at most 1,024 ports (`BR_MAX_PORTS`; the bridge
/// plugin then fails with "exchange full"), and each pod's veth is one.
pub const PODS_PER_BRIDGE: usize = 1023;
/// Most [`NodeOptions::extra_bridges`]: bridge `k`'s addresses are `10.(244+k).x.y`.
const MAX_EXTRA_BRIDGES: usize = 11;

/// Knobs for [`TestNode::with_options`].
#[derive(Clone, Debug, Default)]
pub struct NodeOptions {
    /// Plugins chained after `bridge` in the node's conflist, in order (e.g. weir's CNI plugin).
    pub chained_plugins: Vec<Value>,
    /// Directories searched for plugin binaries before the reference plugins' (`CNI_PATH`).
    pub plugin_dirs: Vec<PathBuf>,
    /// A CNI config directory, as on a real node: the node writes its conflist there (as the
    /// primary CNI does), and reads the first conflist there for every pod (as the runtime
    /// does), so a plugin another component inserts into it (weir's installer) is chained.
    pub conflist_dir: Option<PathBuf>,
    /// Room for thousands of pods (the bench's scale runs): the IPv4 range spans the rest of
    /// 10.244.0.0/16 from this node's /24 on, instead of the /24 alone (253 pods).
    pub wide_ipv4_range: bool,
    /// Bridges beside `cni0`, for more pods than one bridge takes ([`PODS_PER_BRIDGE`]): bridge
    /// `k` is `cni<k>`, with `10.(244+k)...` and `fd00:10:(244+k)...` in place of `10.244...` and
    /// `fd00:10:244...` (so a node's pods never share a range). A pod goes on the first bridge
    /// with a free port; its chain is the node's conflist with that bridge as the first plugin.
    pub extra_bridges: usize,
    /// The address families the node's pods get, in the order their CNI results list them.
    pub families: Families,
}

/// Which addresses a node's pods get, first address first (Kubernetes' `status.podIP`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Families {
    /// IPv4, then IPv6.
    #[default]
    DualStack,
    /// IPv6, then IPv4.
    DualStackIpv6First,
    /// IPv6 alone.
    Ipv6Only,
}

/// What a pod is, as far as the runtime and the CNI plugins can tell.
#[derive(Clone, Debug)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    /// Passed to plugins that declare the `io.kubernetes.cri.pod-annotations` capability.
    pub annotations: BTreeMap<String, String>,
    /// `metadata.uid`: a new one when `None`. A pod whose sandbox the runtime recreates after a
    /// failed ADD keeps its uid.
    pub uid: Option<String>,
    /// `hostUsers: false`: the pod's netns is owned by a user namespace of its own, whose ids
    /// are the node's from this one on.
    pub user_namespace: Option<u32>,
}

impl PodSpec {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            namespace: "default".to_owned(),
            annotations: BTreeMap::new(),
            uid: None,
            user_namespace: None,
        }
    }
}

/// A node: its namespace, its IPAM state and its CNI configuration. Pods keep the node alive
/// (its namespace is deleted after the last pod is torn down), so drop order never matters.
pub struct TestNode {
    shared: Arc<Node>,
}

impl Node {
    /// The conflist a runtime would use now for a pod on bridge `bridge`: the first in the
    /// config directory, if the node has one, else its own; on an extra bridge with that bridge's
    /// plugin in place of the first.
    fn network_on(&self, bridge: usize) -> Result<NetworkConfigList> {
        let mut network = self.network()?;
        if bridge > 0 {
            network.plugins[0] = self.bridges[bridge].plugin.clone();
        }
        Ok(network)
    }

    /// Takes a port on the first bridge with one free; [`Node::release_port`] gives it back.
    fn take_port(&self) -> Result<usize> {
        for (index, bridge) in self.bridges.iter().enumerate() {
            let taken = bridge
                .pods
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |pods| {
                    (pods < PODS_PER_BRIDGE).then_some(pods + 1)
                });
            if taken.is_ok() {
                return Ok(index);
            }
        }
        bail!(
            "the node is full: {} bridge(s) of {PODS_PER_BRIDGE} pods (NodeOptions::extra_bridges)",
            self.bridges.len()
        )
    }

    fn release_port(&self, bridge: usize) {
        self.bridges[bridge].pods.fetch_sub(1, Ordering::Relaxed);
    }

    /// The conflist a runtime would use now: the first in the config directory, if the node has
    /// one, else its own.
    fn network(&self) -> Result<NetworkConfigList> {
        let Some(dir) = &self.conflist_dir else {
            return Ok(self.network.clone());
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "conflist"))
            .collect();
        files.sort();
        let file = files
            .first()
            .with_context(|| format!("no conflist in {}", dir.display()))?;
        let list: Value = serde_json::from_slice(&std::fs::read(file)?)
            .with_context(|| format!("parsing {}", file.display()))?;
        NetworkConfigList::from_json(&list)
            .with_context(|| format!("{} is not a conflist", file.display()))
    }
}

struct Node {
    netns: NetNs,
    /// host-local's `dataDir`: IPAM state private to this node, never `/var/lib/cni`.
    ipam_dir: TempDir,
    subnet: u8,
    network: NetworkConfigList,
    /// `cni0` (the first plugin of `network`), then the extra bridges.
    bridges: Vec<Bridge>,
    conflist_dir: Option<PathBuf>,
    /// containerd runs the loopback plugin as a network of its own, with `CNI_IFNAME=lo`.
    loopback: NetworkConfigList,
    cni_path: Vec<PathBuf>,
}

/// One of the node's bridges: its plugin configuration and how many pods it holds.
struct Bridge {
    plugin: Value,
    pods: AtomicUsize,
}

impl TestNode {
    pub fn new() -> Result<Self> {
        Self::with_options(NodeOptions::default())
    }

    pub fn with_options(options: NodeOptions) -> Result<Self> {
        // The stand-ins for ztunnel run in this process: weir tells ztunnel apart by its cgroup.
        crate::cgroup::in_a_cgroup_of_its_own()?;
        // Distinct subnets for the nodes of one process: isolated by namespaces anyway, but
        // addresses in a failure message then say which node they belong to.
        static SUBNETS: AtomicU8 = AtomicU8::new(0);
        let subnet = SUBNETS.fetch_add(1, Ordering::Relaxed);

        let netns = NetNs::create("node")?;
        // DAD would hold new IPv6 addresses "tentative" (unusable) for a second or more.
        for (key, value) in [
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
        ] {
            netns.sysctl(key, value)?;
        }
        netns::ip(&["-n", netns.name(), "link", "set", "lo", "up"])?;

        let ipam_dir = tempfile::Builder::new()
            .prefix(ids::PREFIX)
            .tempdir()
            .context("cannot create the IPAM data directory")?;
        if options.extra_bridges > MAX_EXTRA_BRIDGES {
            bail!("at most {MAX_EXTRA_BRIDGES} extra bridges");
        }
        let bridges: Vec<Bridge> = (0..=options.extra_bridges as u8)
            .map(|index| Bridge {
                plugin: bridge_plugin(index, subnet, &options, ipam_dir.path()),
                pods: AtomicUsize::new(0),
            })
            .collect();
        let bridge = bridges[0].plugin.clone();
        let plugins = std::iter::once(bridge)
            .chain(options.chained_plugins)
            .collect();
        let network = NetworkConfigList::new(NETWORK_NAME, plugins);
        if let Some(dir) = &options.conflist_dir {
            let file = dir.join(format!("10-{NETWORK_NAME}.conflist"));
            std::fs::write(&file, serde_json::to_vec_pretty(&network.to_json())?)
                .with_context(|| format!("writing {}", file.display()))?;
        }
        let cni_path = options
            .plugin_dirs
            .into_iter()
            .chain([PathBuf::from(cni::REFERENCE_PLUGIN_DIR)])
            .collect();
        Ok(Self {
            shared: Arc::new(Node {
                netns,
                ipam_dir,
                subnet,
                network,
                bridges,
                conflist_dir: options.conflist_dir,
                loopback: NetworkConfigList::new("cni-loopback", vec![json!({"type": "loopback"})]),
                cni_path,
            }),
        })
    }

    /// The node's namespace ("the host").
    pub fn netns(&self) -> &NetNs {
        &self.shared.netns
    }

    /// weir's datapath on this node.
    pub fn datapath_config(&self) -> DatapathConfig {
        crate::agent::datapath_config(self.netns().name())
    }

    /// One of the maps of the datapath pinned for this node, opened as bpftool would.
    pub fn pinned_map(&self, name: &str) -> Result<aya::maps::MapData> {
        let pin_root = self.datapath_config().pin_root;
        let path = pin_root
            .join(format!("abi-{}", weir_common::ABI_VERSION))
            .join(name);
        aya::maps::MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))
    }

    /// The pinned address index (`POD_IPS`), as bpftool would open it.
    pub fn pinned_pod_ips(
        &self,
    ) -> Result<aya::maps::HashMap<aya::maps::MapData, weir_common::IpKey, u64>> {
        let map = self.pinned_map(weir_common::maps::POD_IPS)?;
        Ok(aya::maps::HashMap::try_from(aya::maps::Map::HashMap(map))?)
    }

    /// Runs `f` on the node, where kubelet probes and other hosts' servers live.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.shared.netns.run(f)
    }

    /// The bridge's IPv4 address (the pods' gateway; host-local hands out `.1` as gateway and the
    /// bridge plugin assigns it on the first pod's ADD).
    pub fn gateway_v4(&self) -> Ipv4Addr {
        address_v4(0, self.shared.subnet, 1)
    }

    /// The bridge's IPv6 address, `fd00:10:244:<n>::1`.
    pub fn gateway_v6(&self) -> Ipv6Addr {
        address_v6(0, self.shared.subnet, 1)
    }

    /// The conflist pods are wired with (the bridge plugin, then [`NodeOptions::chained_plugins`]).
    pub fn network(&self) -> &NetworkConfigList {
        &self.shared.network
    }

    /// `CNI_PATH`.
    pub fn cni_path(&self) -> &[PathBuf] {
        &self.shared.cni_path
    }

    /// host-local's `dataDir`.
    pub fn ipam_dir(&self) -> &Path {
        self.shared.ipam_dir.path()
    }

    /// The conflist a runtime would use now for a pod on `cni0`: the first in the node's CNI
    /// config directory (with whatever another component chained into it), if it has one.
    pub fn runtime_network(&self) -> Result<NetworkConfigList> {
        self.shared.network()
    }

    /// Creates pod `name` in namespace `default`.
    pub fn add_pod(&self, name: &str) -> Result<Pod> {
        self.add_pod_with(PodSpec::new(name))
    }

    /// Creates the pod's namespace and runs CNI ADD for it: `loopback`, then the conflist.
    pub fn add_pod_with(&self, spec: PodSpec) -> Result<Pod> {
        self.try_add_pod(spec)?.map_err(|failed| failed.error)
    }

    /// Like [`TestNode::add_pod_with`], but when the conflist's ADD fails the sandbox is kept,
    /// as the runtime holds it between the failure and its teardown (dropping it runs CNI DEL
    /// and deletes the namespace, as the runtime does).
    pub fn try_add_pod(&self, spec: PodSpec) -> Result<Result<Pod, Box<FailedAdd>>> {
        self.wire(spec, Chain::Whole)
    }

    /// A pod wired by the node's primary CNI alone: `loopback` and the conflist's first plugin
    /// (`bridge`), as a sandbox is before the runtime runs the plugins chained after it (or on a
    /// node where none is), so that a test can run those itself; its [`Pod::prev_result`] is
    /// what they get. Dropping it runs DEL through the whole conflist, as the runtime does.
    pub fn add_pod_primary(&self, spec: PodSpec) -> Result<Pod> {
        self.wire(spec, Chain::Primary)?
            .map_err(|failed| failed.error)
    }

    fn wire(&self, spec: PodSpec, chain: Chain) -> Result<Result<Pod, Box<FailedAdd>>> {
        let netns = match spec.user_namespace {
            Some(first_id) => NetNs::create_in_user_namespace(&spec.name, first_id)?,
            None => NetNs::create(&spec.name)?,
        };
        for key in [
            "net.ipv6.conf.all.accept_dad",
            "net.ipv6.conf.default.accept_dad",
        ] {
            netns.sysctl(key, "0")?;
        }
        let uid = spec.uid.clone().unwrap_or_else(ids::uuid_v4);
        let annotations: Map<String, Value> = spec
            .annotations
            .iter()
            .map(|(key, value)| (key.clone(), value.clone().into()))
            .collect();
        let runtime = RuntimeConf::kubernetes_pod(
            netns.path(),
            &spec.namespace,
            &spec.name,
            &uid,
            annotations,
            self.shared.cni_path.clone(),
        );
        let container_id = runtime.container_id.clone();
        // From here on the wiring's Drop undoes whatever part of the ADD happened, and gives the
        // bridge's port back.
        let bridge = self.shared.take_port()?;
        let mut wiring = Wiring {
            netns,
            runtime,
            result: None,
            bridge,
            node: self.shared.clone(),
        };
        let node = &self.shared;
        let loopback = RuntimeConf {
            ifname: "lo".to_owned(),
            ..wiring.runtime.clone()
        };
        let mut network = node.network_on(bridge)?;
        if chain == Chain::Primary {
            network.plugins.truncate(1);
        }
        let start = Instant::now();
        node.loopback
            .add(&loopback, &node.netns)
            .with_context(|| format!("loopback ADD for pod {}", spec.name))?;
        let added = network.add(&wiring.runtime, &node.netns);
        let cni_add = start.elapsed();
        let (result, failure) = match added {
            Ok(result) => (wiring.result.insert(result).clone(), None),
            // The plugins before the failing one left their addresses in the sandbox; where
            // they left none (no eth0: the failing one made it and took it back), the ADD's own
            // error is what tells why.
            Err(error) => (
                sandbox_addresses(&wiring.netns).unwrap_or_else(|_| json!({ "ips": [] })),
                Some(error),
            ),
        };
        let name = spec.name.clone();
        let pod = Pod {
            spec,
            uid,
            container_id,
            ips: result_ips(&result),
            cni_add,
            wiring,
        };
        Ok(match failure {
            None => Ok(pod),
            Some(error) => Err(Box::new(FailedAdd {
                error: anyhow::Error::new(error).context(format!("CNI ADD for pod {name}")),
                sandbox: pod,
            })),
        })
    }
}

/// A pod: a namespace with `lo` and `eth0` wired by CNI. Dropping it runs CNI DEL (`bridge`
/// releases the address and deletes the veth) and deletes the namespace.
pub struct Pod {
    spec: PodSpec,
    uid: String,
    container_id: String,
    /// In the CNI result's order: the first is the pod's `status.podIP`.
    ips: Vec<IpAddr>,
    cni_add: Duration,
    wiring: Wiring,
}

/// How much of the node's chain wires a pod.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Chain {
    Whole,
    Primary,
}

impl std::fmt::Debug for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pod")
            .field("namespace", &self.spec.namespace)
            .field("name", &self.spec.name)
            .field("uid", &self.uid)
            .field("ips", &self.ips())
            .finish()
    }
}

impl Pod {
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    pub fn namespace(&self) -> &str {
        &self.spec.namespace
    }

    /// `metadata.uid`.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The sandbox's container id (`CNI_CONTAINERID`).
    pub fn container_id(&self) -> &str {
        &self.container_id
    }

    /// The pod's IPv4 address; the pod must have one.
    pub fn ipv4(&self) -> Ipv4Addr {
        self.address("IPv4", |ip| match ip {
            IpAddr::V4(ip) => Some(ip),
            IpAddr::V6(_) => None,
        })
    }

    /// The pod's IPv6 address; the pod must have one.
    pub fn ipv6(&self) -> Ipv6Addr {
        self.address("IPv6", |ip| match ip {
            IpAddr::V6(ip) => Some(ip),
            IpAddr::V4(_) => None,
        })
    }

    /// The pod's first address that `pick` takes (one `family`); the pod must have one.
    fn address<T>(&self, family: &str, pick: fn(IpAddr) -> Option<T>) -> T {
        self.ips
            .iter()
            .find_map(|ip| pick(*ip))
            .unwrap_or_else(|| panic!("pod {} has no {family} address", self.name()))
    }

    /// Where the pod's app listens ([`crate::APP_PORT`]) on its IPv4 address.
    pub fn app_v4(&self) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.ipv4()), crate::APP_PORT)
    }

    /// Where the pod's app listens ([`crate::APP_PORT`]) on its IPv6 address.
    pub fn app_v6(&self) -> SocketAddr {
        SocketAddr::new(IpAddr::V6(self.ipv6()), crate::APP_PORT)
    }

    /// `eth0`'s IPv6 link-local address, once duplicate address detection has let it be used
    /// (bounded by [`crate::IO_TIMEOUT`]). No CNI result names it, yet neighbours on the bridge
    /// reach the pod's listeners through it.
    pub fn link_local(&self) -> Result<Ipv6Addr> {
        let mut listed = String::new();
        let found = crate::wait::try_wait_until(crate::IO_TIMEOUT, || {
            // `-tentative` lists only addresses that finished duplicate address detection.
            let addresses = match eth0_addresses(self.netns(), &["scope", "link", "-tentative"]) {
                Ok((addresses, all)) => {
                    listed = all;
                    addresses
                }
                Err(error) => return Some(Err(error)),
            };
            addresses
                .iter()
                .find_map(|cidr| cidr.split('/').next()?.parse().ok())
                .map(Ok)
        });
        found.unwrap_or_else(|| Err(anyhow!("no usable link-local address on eth0: {listed:?}")))
    }

    /// How long the sandbox's CNI ADD took (loopback, then the conflist), as the runtime would
    /// time it: the plugins' executions, not the namespace's creation.
    pub fn cni_add_duration(&self) -> Duration {
        self.cni_add
    }

    /// `eth0`'s MAC address, where frames for the pod go on the bridge.
    pub fn mac(&self) -> [u8; 6] {
        let shown =
            crate::netns::ip_output(&["-n", self.netns().name(), "-br", "link", "show", "eth0"])
                .expect("ip link show eth0");
        // `eth0@if7  UP  aa:bb:cc:dd:ee:ff <BROADCAST,...>`
        let mac = shown
            .split_whitespace()
            .find(|word| word.len() == 17 && word.matches(':').count() == 5)
            .unwrap_or_else(|| panic!("no MAC address in {shown:?}"));
        let mut octets = [0u8; 6];
        for (octet, hex) in octets.iter_mut().zip(mac.split(':')) {
            *octet = u8::from_str_radix(hex, 16).expect("hex octet");
        }
        octets
    }

    /// Its addresses, first address first.
    pub fn ips(&self) -> Vec<IpAddr> {
        self.ips.clone()
    }

    pub fn netns(&self) -> &NetNs {
        &self.wiring.netns
    }

    pub fn netns_path(&self) -> &Path {
        self.wiring.netns.path()
    }

    /// The pod as weir's datapath enrolls it.
    pub fn workload(&self, options: PodOptions) -> Workload {
        Workload {
            uid: self.uid.clone(),
            pod: PodName::new(&self.spec.namespace, &self.spec.name),
            service_account: None,
            netns: self.netns_path().to_path_buf(),
            ips: self.ips().to_vec(),
            options,
            attachment: None,
            sidecar: None,
        }
    }

    /// Runs `f` inside the pod.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.wiring.netns.run(f)
    }

    /// The parameters the pod's CNI calls were made with (to chain further calls the same way).
    pub fn runtime_conf(&self) -> &RuntimeConf {
        &self.wiring.runtime
    }

    /// The result of the pod's CNI ADD, as a runtime caches it and passes it on as `prevResult`.
    pub fn prev_result(&self) -> &Value {
        self.wiring
            .result
            .as_ref()
            .expect("a pod exists only after a successful ADD")
    }
}

/// The part of a pod that must be undone: declared so that the pod's namespace goes before the
/// node reference (fields drop in order, after `Drop::drop`).
struct Wiring {
    netns: NetNs,
    runtime: RuntimeConf,
    result: Option<Value>,
    /// The bridge whose port the pod holds.
    bridge: usize,
    node: Arc<Node>,
}

impl Drop for Wiring {
    fn drop(&mut self) {
        let node = &self.node;
        let loopback = RuntimeConf {
            ifname: "lo".to_owned(),
            ..self.runtime.clone()
        };
        // Both DELs run whatever the other did, as a runtime would.
        let network = node.network_on(self.bridge).unwrap_or_else(|error| {
            eprintln!("CNI DEL with the node's own conflist: {error:#}");
            let mut network = node.network.clone();
            network.plugins[0] = node.bridges[self.bridge].plugin.clone();
            network
        });
        let results = [
            network.del(&self.runtime, self.result.as_ref(), &node.netns),
            node.loopback.del(&loopback, None, &node.netns),
        ];
        for err in results.into_iter().filter_map(Result::err) {
            eprintln!("warning: CNI DEL of {}: {err}", self.netns.name());
        }
        node.release_port(self.bridge);
    }
}

/// A pod whose CNI ADD failed, and its sandbox as the failed ADD left it.
#[derive(Debug)]
pub struct FailedAdd {
    pub error: anyhow::Error,
    pub sandbox: Pod,
}

/// The global addresses on the sandbox's `eth0`, in a CNI result's shape.
fn sandbox_addresses(netns: &NetNs) -> Result<Value> {
    let (addresses, _) = eth0_addresses(netns, &["scope", "global"])?;
    let ips: Vec<Value> = addresses
        .into_iter()
        .map(|address| json!({ "address": address }))
        .collect();
    Ok(json!({ "ips": ips }))
}

/// The addresses (`address/prefix`, both families) that `ip addr show dev eth0 <filter>` lists
/// in `netns`, and the listing itself for error messages.
fn eth0_addresses(netns: &NetNs, filter: &[&str]) -> Result<(Vec<String>, String)> {
    let command = ["-n", netns.name(), "-o", "addr", "show", "dev", "eth0"];
    let listed = netns::ip_output(&[&command[..], filter].concat())?;
    let addresses = listed
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|word| *word == "inet" || *word == "inet6")?;
            words.next().map(str::to_owned)
        })
        .collect();
    Ok((addresses, listed))
}

/// A CNI result's `ips`, in its order.
fn result_ips(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
        .collect()
}

/// The `bridge` plugin's configuration for bridge `index` (0: `cni0`) of node `subnet`, with
/// host-local IPAM state under `ipam_dir` (a directory per extra bridge, as their ranges differ),
/// handing out the families of `options` in their order.
fn bridge_plugin(index: u8, subnet: u8, options: &NodeOptions, ipam_dir: &Path) -> Value {
    let (name, data_dir) = match index {
        0 => (BRIDGE.to_owned(), ipam_dir.to_owned()),
        _ => (format!("cni{index}"), ipam_dir.join(format!("cni{index}"))),
    };
    let ipv4 = (
        json!([ipv4_range(index, subnet, options.wide_ipv4_range)]),
        json!({ "dst": "0.0.0.0/0" }),
    );
    let ipv6 = (
        json!([{ "subnet": format!("{}/64", address_v6(index, subnet, 0)) }]),
        json!({ "dst": "::/0" }),
    );
    let families = match options.families {
        Families::DualStack => vec![ipv4, ipv6],
        Families::DualStackIpv6First => vec![ipv6, ipv4],
        Families::Ipv6Only => vec![ipv6],
    };
    let (ranges, routes): (Vec<Value>, Vec<Value>) = families.into_iter().unzip();
    json!({
        "type": "bridge",
        "bridge": name,
        "isGateway": true,
        "ipMasq": false,
        "hairpinMode": true,
        "ipam": {
            "type": "host-local",
            "dataDir": data_dir,
            "ranges": ranges,
            "routes": routes,
        },
    })
}

/// host-local's IPv4 range for bridge `bridge` of node `subnet`: its /24, or (wide) the /16
/// from that /24 on, with the same gateway either way.
fn ipv4_range(bridge: u8, subnet: u8, wide: bool) -> Value {
    if !wide {
        return json!({ "subnet": format!("{}/24", address_v4(bridge, subnet, 0)) });
    }
    json!({
        "subnet": format!("{}/16", address_v4(bridge, 0, 0)),
        "rangeStart": address_v4(bridge, subnet, 2).to_string(),
        "gateway": address_v4(bridge, subnet, 1).to_string(),
    })
}

/// `10.(244+bridge).<subnet>.<host>`.
fn address_v4(bridge: u8, subnet: u8, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244 + bridge, subnet, host)
}

/// `fd00:10:(244+bridge):<subnet>::<host>`.
fn address_v6(bridge: u8, subnet: u8, host: u8) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x10,
        0x244 + u16::from(bridge),
        subnet.into(),
        0,
        0,
        0,
        host.into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_bridges_get_names_ranges_and_ipam_state_of_their_own() {
        let ipam = Path::new("/ipam");
        let first = bridge_plugin(0, 3, &NodeOptions::default(), ipam);
        // cni0 is what every other test's pods are wired to: its addresses never move.
        assert_eq!(first["bridge"], "cni0");
        assert_eq!(first["ipam"]["dataDir"], "/ipam");
        assert_eq!(
            first["ipam"]["ranges"],
            json!([[{"subnet": "10.244.3.0/24"}], [{"subnet": "fd00:10:244:3::/64"}]])
        );
        let wide = NodeOptions {
            wide_ipv4_range: true,
            ..NodeOptions::default()
        };
        let second = bridge_plugin(2, 3, &wide, ipam);
        assert_eq!(second["bridge"], "cni2");
        assert_eq!(second["ipam"]["dataDir"], "/ipam/cni2");
        assert_eq!(
            second["ipam"]["ranges"],
            json!([
                [{"subnet": "10.246.0.0/16", "rangeStart": "10.246.3.2", "gateway": "10.246.3.1"}],
                [{"subnet": "fd00:10:246:3::/64"}]
            ])
        );
    }
}
