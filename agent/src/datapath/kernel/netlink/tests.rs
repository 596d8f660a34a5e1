//! The rtnetlink client against a scratch network namespace.
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::AsFd;

use std::io;

use weir_common::{PROBE_SOURCE_V4, PROBE_SOURCE_V6};

use super::objects::Op;
use super::pod_changes::return_path;
use super::*;
use crate::datapath::kernel::netns::enter;
use crate::datapath::kernel::netns::testing::{ip, privileged, scratch_netns};

const FAMILIES: [&str; 2] = ["-4", "-6"];

/// The return path alone, as pod setup applies it.
fn install_return_path() -> io::Result<()> {
    Rtnl::new()?.apply(return_path().map(|object| (Op::Add, object)))
}

/// The return path's removal alone, as pod teardown applies it.
fn remove_return_path() -> io::Result<()> {
    let objects = return_path().into_iter().rev();
    Rtnl::new()?.apply(objects.map(|object| (Op::Delete, object)))
}

fn return_rules(family: &str) -> usize {
    let rules = ip(&[family, "rule", "show"]);
    rules
        .lines()
        .filter(|rule| *rule == "32764:\tfrom all fwmark 0x1000/0x1000 lookup 100")
        .count()
}

fn return_routes(family: &str) -> String {
    ip(&[family, "route", "show", "table", "100"])
}

#[test]
fn return_path_is_idempotent_and_removable() {
    let Some(netns) = privileged(scratch_netns) else {
        return;
    };
    let _guard = enter(netns.as_fd()).unwrap();
    for _ in 0..2 {
        install_return_path().unwrap();
        for family in FAMILIES {
            assert_eq!(return_rules(family), 1, "{family}");
            let routes = return_routes(family);
            assert_eq!(routes.lines().count(), 1, "{family}: {routes}");
            assert!(
                routes.starts_with("local default dev lo proto static"),
                "{routes}"
            );
        }
    }
    for _ in 0..2 {
        remove_return_path().unwrap();
        for family in FAMILIES {
            assert_eq!(return_rules(family), 0, "{family}");
            assert_eq!(return_routes(family), "", "{family}");
        }
    }
}

#[test]
fn return_path_skips_disabled_ipv6() {
    let Some(netns) = privileged(scratch_netns) else {
        return;
    };
    let _guard = enter(netns.as_fd()).unwrap();
    std::fs::write("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1").unwrap();
    install_return_path().unwrap();
    assert_eq!(return_rules("-4"), 1);
    assert!(return_routes("-4").starts_with("local default dev lo"));
    assert_eq!(return_routes("-6"), "");
    remove_return_path().unwrap();
    assert_eq!(return_rules("-4"), 0);
    assert_eq!(return_rules("-6"), 0);
}

fn bindable() -> [bool; 2] {
    let v4 = SocketAddr::from((PROBE_SOURCE_V4, 0));
    let v6 = SocketAddr::from((PROBE_SOURCE_V6, 0));
    [v4, v6].map(|address| match TcpListener::bind(address) {
        Ok(_) => true,
        Err(err) if err.raw_os_error() == Some(libc::EADDRNOTAVAIL) => false,
        Err(err) => panic!("bind {address}: {err}"),
    })
}

#[test]
fn probe_source_is_bindable_and_removable() {
    let Some(netns) = privileged(scratch_netns) else {
        return;
    };
    let _guard = enter(netns.as_fd()).unwrap();
    assert_eq!(bindable(), [false, false]);
    for _ in 0..2 {
        install_probe_source(PROBE_SOURCE_V4.into(), PROBE_SOURCE_V6.into()).unwrap();
        assert_eq!(bindable(), [true, true]);
        let route = ip(&["route", "show", "table", "local", "169.254.7.127"]);
        assert_eq!(route.lines().count(), 1, "{route}");
        let address = ip(&[
            "-6",
            "addr",
            "show",
            "dev",
            "lo",
            "to",
            "fd16:9254:7127:1337::/64",
        ]);
        assert_eq!(address.matches("inet6 ").count(), 1, "{address}");
        assert!(address.contains("deprecated"), "{address}");
    }
    for _ in 0..2 {
        remove_probe_source(PROBE_SOURCE_V4.into(), PROBE_SOURCE_V6.into()).unwrap();
        assert_eq!(bindable(), [false, false]);
    }
}

/// The node's own connections to a ULA destination through an interface without a global
/// address (a pod's veth in an IPv6 kind cluster) must not take the probe source as their
/// source address; without `preferred_lft 0` they do (longest common prefix).
#[test]
fn probe_source_is_not_a_source_address_candidate() {
    let Some(netns) = privileged(scratch_netns) else {
        return;
    };
    let _guard = enter(netns.as_fd()).unwrap();
    for (end, peer) in [("weir-n0", "weir-n1"), ("weir-p0", "weir-p1")] {
        ip(&["link", "add", end, "type", "veth", "peer", "name", peer]);
        ip(&["link", "set", end, "up"]);
        ip(&["link", "set", peer, "up"]);
    }
    ip(&["addr", "add", "fc00:f853::2/64", "dev", "weir-n0", "nodad"]);
    ip(&["route", "add", "fd00:10:244::/56", "dev", "weir-p0"]);
    install_probe_source(PROBE_SOURCE_V4.into(), PROBE_SOURCE_V6.into()).unwrap();
    let route = ip(&["-6", "route", "get", "fd00:10:244::5"]);
    assert!(route.contains("src fc00:f853::2 "), "{route}");
}

#[test]
fn empty_namespace_has_nothing_to_remove() {
    let Some(netns) = privileged(scratch_netns) else {
        return;
    };
    let _guard = enter(netns.as_fd()).unwrap();
    remove_return_path().unwrap();
    remove_probe_source(PROBE_SOURCE_V4.into(), PROBE_SOURCE_V6.into()).unwrap();
}

#[test]
fn non_loopback_interfaces_are_this_namespaces() {
    let Some(netns) = privileged(scratch_netns) else {
        return;
    };
    let _guard = enter(netns.as_fd()).unwrap();
    assert_eq!(non_loopback_interfaces().unwrap(), []);

    ip(&[
        "link", "add", "weir-t0", "type", "veth", "peer", "name", "weir-t1",
    ]);
    // Without an Ethernet header: its packets begin with the IP header.
    ip(&["tuntap", "add", "dev", "weir-t2", "mode", "tun"]);
    let index = |name: &str| -> u32 {
        let line = ip(&["-o", "link", "show", "dev", name]);
        line.split(':').next().unwrap().parse().unwrap()
    };
    let mut found = non_loopback_interfaces().unwrap();
    let mut expected =
        [("weir-t0", true), ("weir-t1", true), ("weir-t2", false)].map(|(name, ethernet)| Link {
            index: index(name),
            name: name.to_owned(),
            ethernet,
        });
    found.sort();
    expected.sort();
    assert_eq!(found, expected);
}

#[test]
fn routable_addresses_of_an_interface_leave_out_link_local_ones() {
    let Some(netns) = privileged(scratch_netns) else {
        return;
    };
    let _guard = enter(netns.as_fd()).unwrap();
    let mut rtnl = Rtnl::new().unwrap();
    assert!(rtnl.routable_addresses_of("eth0").unwrap().is_empty());

    ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "weir-t1",
    ]);
    for (address, dev) in [
        ("10.1.0.5/24", "eth0"),
        ("10.1.0.6/24", "eth0"),
        ("169.254.1.5/16", "eth0"),
        ("10.2.0.5/24", "weir-t1"),
    ] {
        ip(&["addr", "add", address, "dev", dev]);
    }
    for address in ["fd00::5/64", "fe80::5/64"] {
        ip(&["addr", "add", address, "dev", "eth0", "nodad"]);
    }
    // Up, eth0 gets the kernel's own link-local address too.
    ip(&["link", "set", "weir-t1", "up"]);
    ip(&["link", "set", "eth0", "up"]);
    let expected: Vec<IpAddr> = ["10.1.0.5", "10.1.0.6", "fd00::5"]
        .map(|ip| ip.parse().unwrap())
        .into();
    assert_eq!(rtnl.routable_addresses_of("eth0").unwrap(), expected);
    assert!(rtnl.routable_addresses_of("weir-t2").unwrap().is_empty());
}
