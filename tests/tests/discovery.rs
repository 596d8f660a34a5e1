//! Finding a running pod's network namespace (`Datapath::find_running_pod`) from real processes:
//! `sleep`s inside test pods' namespaces and inside cgroups that name a pod's UID as kubelet does.
use std::{
    fs::File,
    net::IpAddr,
    os::{fd::OwnedFd, unix::fs::MetadataExt},
    path::PathBuf,
    thread,
    time::Duration,
};

use weir_agent::datapath::{Datapath, DatapathConfig, PodNetns};
use weir_tests::privileged;
use weir_tests::{
    cgroup::{CgroupDriver, PodProcess},
    DatapathNode, NetNs, Pod, TestNode,
};

/// A test node with a datapath on it (the finder runs on the datapath's thread, in the node's
/// netns); uninstalled on drop.
struct Node {
    datapath: Datapath,
    node: DatapathNode,
}

impl Node {
    fn new() -> anyhow::Result<Self> {
        let node = DatapathNode::new()?;
        let datapath = Datapath::start(DatapathConfig {
            probe_bypass: false,
            ..node.node().datapath_config()
        })?;
        Ok(Self { datapath, node })
    }

    fn test_node(&self) -> &TestNode {
        self.node.node()
    }

    fn pod(&self, name: &str) -> Pod {
        self.node.pod(name)
    }

    fn find(&self, uid: &str, ips: &[IpAddr], hint: Option<PathBuf>) -> Option<PodNetns> {
        self.datapath
            .find_running_pod(uid, ips, hint)
            .wait()
            .expect("find_running_pod")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Err(error) = self.datapath.uninstall().wait() {
            eprintln!("uninstalling the datapath: {error:#}");
        }
    }
}

fn process(netns: &NetNs, uid: &str, driver: CgroupDriver) -> PodProcess {
    PodProcess::start(netns, uid, driver).expect("process in the pod's netns and cgroup")
}

fn inode(netns: OwnedFd) -> u64 {
    File::from(netns).metadata().unwrap().ino()
}

/// Asserts that `found` is `netns`, compared by inode.
fn assert_is(found: Option<PodNetns>, netns: &NetNs) -> PathBuf {
    let found = found.expect("a netns is found");
    assert_eq!(
        inode(found.netns),
        inode(netns.open().unwrap().into()),
        "found {} instead of {}",
        found.path.display(),
        netns.name()
    );
    found.path
}

fn found_by_uid(driver: CgroupDriver) {
    let node = privileged!(Node::new());
    let pod = node.pod("a");
    let running = process(pod.netns(), pod.uid(), driver);
    let path = assert_is(node.find(pod.uid(), &pod.ips(), None), pod.netns());
    assert_eq!(
        path,
        PathBuf::from(format!("/proc/{}/ns/net", running.pid()))
    );
}

#[test]
fn found_by_uid_in_a_systemd_cgroup() {
    found_by_uid(CgroupDriver::Systemd);
}

#[test]
fn found_by_uid_in_a_cgroupfs_cgroup() {
    found_by_uid(CgroupDriver::Cgroupfs);
}

#[test]
fn another_pods_netns_is_rejected_though_its_cgroup_names_the_pod() {
    let node = privileged!(Node::new());
    let (pod, other) = (node.pod("a"), node.pod("b"));
    // A PID reused by another pod: the process is in `other`'s netns, `pod`'s cgroup.
    let _impostor = process(other.netns(), pod.uid(), CgroupDriver::Systemd);
    assert!(node.find(pod.uid(), &pod.ips(), None).is_none());
    // The process was seen: given `other`'s IPs, its netns is the one found.
    assert_is(node.find(pod.uid(), &other.ips(), None), other.netns());
}

#[test]
fn the_oldest_matching_process_wins() {
    let node = privileged!(Node::new());
    let (a, b) = (node.pod("a"), node.pod("b"));
    let uid = a.uid();
    // Both namespaces hold one of the IPs asked for, so only the processes' age decides.
    let ips = [a.ipv4().into(), b.ipv4().into()];
    for (older, younger) in [(&a, &b), (&b, &a)] {
        let _older = process(older.netns(), uid, CgroupDriver::Systemd);
        // Start times count clock ticks (10 ms at USER_HZ 100).
        thread::sleep(Duration::from_millis(50));
        let _younger = process(younger.netns(), uid, CgroupDriver::Systemd);
        assert_is(node.find(uid, &ips, None), older.netns());
    }
}

#[test]
fn the_node_netns_is_never_returned() {
    let node = privileged!(Node::new());
    let pod = node.pod("a");
    let gateway = IpAddr::from(node.test_node().gateway_v4());
    let node_addresses = node
        .test_node()
        .run(weir_agent::datapath::netlink::non_loopback_addresses)
        .unwrap();
    assert!(
        node_addresses.contains(&gateway),
        "the IP asked for is the node's: {node_addresses:?}"
    );
    // As CRI-O's conmon: in the pod's cgroup, in the node's netns.
    let _conmon = process(node.test_node().netns(), pod.uid(), CgroupDriver::Systemd);
    assert!(node.find(pod.uid(), &[gateway], None).is_none());
}

#[test]
fn a_hint_is_used_only_when_it_holds_the_pods_ips() {
    let node = privileged!(Node::new());
    let (pod, other) = (node.pod("a"), node.pod("b"));
    let hint = pod.netns_path().to_path_buf();
    let path = assert_is(
        node.find(pod.uid(), &pod.ips(), Some(hint.clone())),
        pod.netns(),
    );
    assert_eq!(
        path, hint,
        "no process runs in the pod: the hint is what found it"
    );

    let stale = other.netns_path().to_path_buf();
    assert!(node
        .find(pod.uid(), &pod.ips(), Some(stale.clone()))
        .is_none());
    // A stale hint is only skipped: the pod's processes still find it.
    let _running = process(pod.netns(), pod.uid(), CgroupDriver::Cgroupfs);
    let path = assert_is(node.find(pod.uid(), &pod.ips(), Some(stale)), pod.netns());
    assert_ne!(path, other.netns_path());
}
