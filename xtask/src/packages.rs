//! The Debian packages the demo, the tests and the bench install when they run as root on Debian.

use anyhow::Result;

use crate::system;

/// What a throwaway node runs: the CNI plugins that wire its pods (loopback, bridge, host-local),
/// `ip`, and bpftool, which shows what the datapath holds.
const NODE_PACKAGES: &[&str] = &["containernetworking-plugins", "iproute2", "bpftool"];

/// What the privileged tests run besides a throwaway node's packages: istio's iptables rules and
/// the ipsets and nftables table of its probe SNAT, containerd, which runs weir's image in the image test, qemu, which runs its arm64 binaries
/// there, and Prometheus with promtool, which the monitoring test runs the alert rules and the
/// dashboard's queries in.
const TEST_PACKAGES: &[&str] = &[
    "iptables",
    "ipset",
    "nftables",
    "containerd",
    "qemu-user-static",
    "prometheus",
];

/// A throwaway node's packages (the demo's).
pub fn ensure_node_packages() -> Result<()> {
    system::ensure_packages(NODE_PACKAGES, "the demo cannot wire its pods")
}

/// The tests' packages, which are also the bench's: it wires pods, reads map memory and runs
/// istio's rules the same way.
pub fn ensure_test_packages() -> Result<()> {
    system::ensure_packages(
        &[NODE_PACKAGES, TEST_PACKAGES].concat(),
        "the privileged tests will fail or skip",
    )
}
