//! Sidecar pods through the node's real CNI chain and the real agent: their traffic goes to their
//! own istio-proxy (the stand-in) as istio-cni's sidecar rules send it, and istio's
//! `istio-validation` check passes in them. No ztunnel runs in these tests: a sidecar pod never
//! waits for one.
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    os::{
        fd::{AsFd, AsRawFd},
        unix::process::CommandExt,
    },
    process::Command as Process,
    time::Duration,
};

use weir_agent::policy::local::ObjectMeta;
use weir_common::{
    maps, ConnectionKey, NatEntry, PortKey, INBOUND_PORT, OUTBOUND_PORT, REROUTE_NAT_ENTRIES,
};
use weir_tests::{
    agent::Agent,
    chain::{ambient_policy, listed_pods, wait_for_metric, weir_only, CniChainNode as Node, WAIT},
    cni::Command,
    istio_iptables,
    netns::{ip, ip_output, owning_user_namespace},
    privileged, raw,
    sidecar::{as_proxy, sidecar_pod, Interception, SidecarStandIn, PROXY_ID},
    tcp_attempt, tcp_connect_from, tcp_request,
    traffic::{read_line, write_line},
    try_wait_until, udp_request,
    virtual_machine::VirtualMachine,
    wait_until, EchoServer, Families, Pod, PodSpec, TestNode, APP_PORT,
};

mod capture;
mod lifecycle;
mod rerouted;
mod validation;

/// A node whose policy makes `default/sidecar` the sidecar pod `meta`, its agent, and that pod
/// (made through the node's CNI chain).
fn sidecar_node(meta: ObjectMeta) -> Option<(Node, Agent, Pod)> {
    sidecar_node_in(Families::default(), meta)
}

/// [`sidecar_node`], its pods getting the addresses of `families`.
fn sidecar_node_in(families: Families, meta: ObjectMeta) -> Option<(Node, Agent, Pod)> {
    let node = Node::with_sidecar_pods_in(families, &[("sidecar", meta)])?;
    let agent = node.start_agent();
    let pod = node.pod("default", "sidecar").unwrap();
    Some((node, agent, pod))
}

/// Runs the `istio-validation` stand-in in the pod as the proxy's uid and gid; its exit code.
fn run_validation(pod: &Pod) -> i32 {
    run_validation_in(pod, false)
}

/// [`run_validation`], as the proxy's ids in the pod's own user namespace when
/// `in_user_namespace` (a pod with `hostUsers: false`), else as the node's.
fn run_validation_in(pod: &Pod, in_user_namespace: bool) -> i32 {
    let netns = pod.netns().open().unwrap();
    let userns = in_user_namespace.then(|| owning_user_namespace(netns.as_fd()).unwrap());
    let userns_fd = userns.as_ref().map(|fd| fd.as_raw_fd());
    let mut validation = Process::new(env!("CARGO_BIN_EXE_istio-validation"));
    validation.env("INSTANCE_IP", pod.ips()[0].to_string());
    let fd = netns.as_raw_fd();
    // SAFETY: async-signal-safe syscalls; the fds stay open until the child has exec'd. The
    // user namespace first (which owns the netns), the netns while the child may still enter
    // it, then the proxy's identity; supplementary groups are the node's to set.
    unsafe {
        validation.pre_exec(move || {
            let id = PROXY_ID;
            let failed = userns_fd.is_some_and(|u| libc::setns(u, libc::CLONE_NEWUSER) != 0)
                || libc::setns(fd, libc::CLONE_NEWNET) != 0
                || (userns_fd.is_none() && libc::setgroups(0, std::ptr::null()) != 0)
                || libc::setresgid(id, id, id) != 0
                || libc::setresuid(id, id, id) != 0;
            if failed {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = validation.output().unwrap();
    eprintln!(
        "istio-validation in {}: {}{}",
        pod.name(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output.status.code().unwrap_or(-1)
}

/// The entries of `pod`'s translation map in the pinned `REROUTE_NAT`, two per connection; zero
/// when it has none.
fn translations(node: &Node, pod: &Pod) -> usize {
    let cookie = pod.netns().cookie().unwrap();
    let map = node.test_node().pinned_map(maps::REROUTE_NAT).unwrap();
    let pods: aya::maps::HashOfMaps<_, u64> =
        aya::maps::HashOfMaps::try_from(aya::maps::Map::HashOfMaps(map)).unwrap();
    let Ok(translations) = pods.get(&cookie, 0) else {
        return 0;
    };
    let translations: aya::maps::HashMap<_, ConnectionKey, NatEntry> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(translations)).unwrap();
    translations.keys().filter_map(Result::ok).count()
}

fn addr(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}
