//! A VM behind an interface of a pod, as KubeVirt runs one: what
//! `istio.io/reroute-virtual-interfaces` is for.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::netns::{ip, NetNs};
use crate::Pod;

/// A VM behind a veth in a pod, as KubeVirt puts one behind a tap: its end is in a network
/// namespace of its own, and its default route is the pod.
pub struct VirtualMachine {
    pub netns: NetNs,
    /// The pod's end.
    pub interface: &'static str,
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
}

impl VirtualMachine {
    pub fn behind(pod: &Pod, interface: &'static str) -> Self {
        let netns = NetNs::create("vm").unwrap();
        let (pod_ns, vm_ns) = (pod.netns().name(), netns.name());
        let commands: [&[&str]; 10] = [
            &[
                "-n", pod_ns, "link", "add", interface, "type", "veth", "peer", "name", "eth0",
                "netns", vm_ns,
            ],
            &[
                "-n",
                pod_ns,
                "addr",
                "add",
                "192.168.77.1/24",
                "dev",
                interface,
            ],
            &[
                "-n",
                pod_ns,
                "addr",
                "add",
                "fd77::1/64",
                "dev",
                interface,
                "nodad",
            ],
            &["-n", pod_ns, "link", "set", interface, "up"],
            &["-n", vm_ns, "addr", "add", "192.168.77.2/24", "dev", "eth0"],
            &[
                "-n",
                vm_ns,
                "addr",
                "add",
                "fd77::2/64",
                "dev",
                "eth0",
                "nodad",
            ],
            &["-n", vm_ns, "link", "set", "eth0", "up"],
            &["-n", vm_ns, "link", "set", "lo", "up"],
            &[
                "-n",
                vm_ns,
                "route",
                "add",
                "default",
                "via",
                "192.168.77.1",
            ],
            &[
                "-n", vm_ns, "-6", "route", "add", "default", "via", "fd77::1",
            ],
        ];
        for command in commands {
            ip(command).unwrap();
        }
        Self {
            netns,
            interface,
            ipv4: Ipv4Addr::new(192, 168, 77, 2),
            ipv6: "fd77::2".parse().unwrap(),
        }
    }

    pub fn ips(&self) -> [IpAddr; 2] {
        [self.ipv4.into(), self.ipv6.into()]
    }
}
