//! istio's in-pod iptables rules, applied as istio applies them (`iptables-restore --noflush`
//! inside the pod), in both rule sets weir reproduces with eBPF:
//! - ambient ([`apply`]): istio-cni's redirection to ztunnel, with its policy routing, IPv4 and
//!   IPv6. The harness uses it to check the ztunnel stand-in against the real contract without
//!   weir;
//! - sidecar ([`apply_sidecar`]): istio-init's (or istio-cni's sidecar mode's) redirection to the
//!   pod's own istio-proxy, with every default.
//!
//! Both are the comparators for weir's datapath in the bench.
//!
//! On the node, istio-cni's agent also SNATs the node's TCP to ambient pods (an ipset of their
//! addresses) to the probe source ([`apply_host_probe_snat`]), which its in-pod rules let
//! through to the app: weir takes a node over with it in place.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use weir_common::{
    DNS_PORT, DNS_PROXY_PORT, HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT, PASSTHROUGH_SOURCE_V4,
    PROBE_SOURCE_V4, PROBE_SOURCE_V6, ZTUNNEL_MARK, ZTUNNEL_MARK_MASK,
};

use crate::netns::{self, NetNs};
use crate::sidecar::PROXY_ID;
use crate::Pod;

/// istio's connmark for connections ztunnel dialed into the pod, and the policy routing table
/// that brings the app's replies to them back to ztunnel.
pub const CONNMARK: u32 = 0x111;
pub const ROUTE_TABLE: u32 = 100;

/// The iptables istio-cni's agent writes its rules with: the node's, which is nf_tables on most
/// nodes (`iptables-nft`, this machine's `iptables`), or legacy on older ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Nft,
    Legacy,
}

/// Installs the rules and routes in the pod's namespace `pod`, as istio's `AddInpodMarkIPRule` and
/// `AddLoopbackRoutes` do after its iptables rules.
pub fn apply(pod: &NetNs, backend: Backend) -> Result<()> {
    for family in [Family::V4, Family::V6] {
        restore(pod, &[], family, backend, &rules(family))?;
        let (table, mark, mask) = (ROUTE_TABLE.to_string(), CONNMARK, ZTUNNEL_MARK_MASK);
        let fwmark = format!("{mark:#x}/{mask:#x}");
        let any = family.any();
        // istio ignores a rule that exists (netlink's EEXIST): weir adds it ahead of istio on a
        // pod it hands back.
        let added = netns::ip(&[
            "-n",
            pod.name(),
            family.flag(),
            "rule",
            "add",
            "fwmark",
            &fwmark,
            "pref",
            "32764",
            "lookup",
            &table,
        ]);
        if let Err(error) = added {
            if !format!("{error:#}").contains("File exists") {
                return Err(error);
            }
        }
        // istio replaces the route (netlink's RouteReplace): another agent's identical route,
        // weir's on a pod handed back, is no error.
        netns::ip(&[
            "-n",
            pod.name(),
            family.flag(),
            "route",
            "replace",
            "local",
            &any,
            "dev",
            "lo",
            "table",
            &table,
        ])?;
    }
    Ok(())
}

/// Writes [`apply`]'s iptables rules, both families, as a process of the pod would: by
/// `iptables-restore` run in the pod's netns under `wrapper` (a command such as `setpriv` or
/// `unshare` that runs the rest with other credentials or in namespaces of its own).
pub fn restore_as(pod: &NetNs, wrapper: &[&str]) -> Result<()> {
    for family in [Family::V4, Family::V6] {
        restore(pod, wrapper, family, Backend::Nft, &rules(family))?;
    }
    Ok(())
}

/// Installs istio-init's sidecar rules for a pod with every default (REDIRECT, the proxy's uid
/// and gid 1337, every outbound range and inbound port captured but the proxy's own ports, no DNS
/// capture) in the pod's namespace `pod`. IPv4 only: istio adds the IPv6 rules only when the
/// pod's first address is IPv6.
pub fn apply_sidecar(pod: &NetNs) -> Result<()> {
    restore(pod, &[], Family::V4, Backend::Nft, &sidecar_rules())
}

/// istio-cni's probe SNAT as its agent writes it on the node when it starts, with iptables
/// (istio's `hostprobe_ipv6.golden`), and the ipsets of ambient pod addresses it keeps, holding
/// `pods`: in `node`'s netns.
pub fn apply_host_probe_snat(node: &NetNs, pods: &[&Pod], backend: Backend) -> Result<()> {
    for family in [Family::V4, Family::V6] {
        let (set, ipset_family) = match family {
            Family::V4 => ("istio-inpod-probes-v4", "inet"),
            Family::V6 => ("istio-inpod-probes-v6", "inet6"),
        };
        let ipset = |args: &[&str]| {
            let mut command = vec!["netns", "exec", node.name(), "ipset"];
            command.extend_from_slice(args);
            netns::ip(&command)
        };
        ipset(&["create", set, "hash:ip", "family", ipset_family])?;
        for pod in pods {
            let ip = match family {
                Family::V4 => IpAddr::from(pod.ipv4()),
                Family::V6 => IpAddr::from(pod.ipv6()),
            };
            ipset(&["add", set, &ip.to_string()])?;
        }
        let rules = format!(
            "*nat\n:ISTIO_POSTRT - [0:0]\n-A POSTROUTING -j ISTIO_POSTRT\n-A ISTIO_POSTRT -m owner \
             --socket-exists -p tcp -m set --match-set {set} dst -j SNAT --to-source {}\nCOMMIT\n",
            family.probe_source()
        );
        restore(node, &[], family, backend, &rules)?;
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn flag(self) -> &'static str {
        match self {
            Family::V4 => "-4",
            Family::V6 => "-6",
        }
    }

    fn restore_command(self, backend: Backend) -> &'static str {
        match (self, backend) {
            (Family::V4, Backend::Nft) => "iptables-restore",
            (Family::V6, Backend::Nft) => "ip6tables-restore",
            (Family::V4, Backend::Legacy) => "iptables-legacy-restore",
            (Family::V6, Backend::Legacy) => "ip6tables-legacy-restore",
        }
    }

    fn loopback(self) -> String {
        match self {
            Family::V4 => format!("{}/32", Ipv4Addr::LOCALHOST),
            Family::V6 => format!("{}/128", Ipv6Addr::LOCALHOST),
        }
    }

    fn probe_source(self) -> IpAddr {
        match self {
            Family::V4 => PROBE_SOURCE_V4.into(),
            Family::V6 => PROBE_SOURCE_V6.into(),
        }
    }

    fn any(self) -> String {
        match self {
            Family::V4 => "0.0.0.0/0".into(),
            Family::V6 => "::/0".into(),
        }
    }
}

/// istio-cni's in-pod rule set (`iptables-restore` input) for one family.
fn rules(family: Family) -> String {
    let lo = family.loopback();
    let probe = family.probe_source();
    let mark = format!("{ZTUNNEL_MARK:#x}/{ZTUNNEL_MARK_MASK:#x}");
    let connmark = format!("{CONNMARK:#x}/{ZTUNNEL_MARK_MASK:#x}");
    format!(
        "\
*mangle
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark {mark} -j CONNMARK --set-xmark {connmark}
-A ISTIO_OUTPUT -m connmark --mark {connmark} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
*nat
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -s {probe} -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d {probe} -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d {lo} -p tcp ! --dport {HBONE_PORT} -m mark ! --mark {mark} -j REDIRECT --to-ports {INBOUND_PORT}
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark {mark} -m udp --dport {DNS_PORT} -j REDIRECT --to-port {DNS_PROXY_PORT}
-A ISTIO_OUTPUT ! -d {lo} -p tcp --dport {DNS_PORT} -m mark ! --mark {mark} -j REDIRECT --to-ports {DNS_PROXY_PORT}
-A ISTIO_OUTPUT -p tcp -m mark --mark {connmark} -j ACCEPT
-A ISTIO_OUTPUT ! -d {lo} -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d {lo} -p tcp -m mark ! --mark {mark} -j REDIRECT --to-ports {OUTBOUND_PORT}
COMMIT
"
    )
}

/// istio-init's sidecar rule set (`iptables-restore` input), IPv4, every default; first match
/// wins. Left alone: the proxy's inbound passthrough (from 127.0.0.6), its own connections out
/// and the app's loopback traffic; the proxy's connections to the pod's own address (over lo) go
/// to its inbound listener, as if they had come in.
fn sidecar_rules() -> String {
    let lo = Family::V4.loopback();
    let passthrough = Ipv4Addr::from(PASSTHROUGH_SOURCE_V4);
    format!(
        "\
*nat
:ISTIO_INBOUND - [0:0]
:ISTIO_IN_REDIRECT - [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_REDIRECT - [0:0]
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp --dport {HBONE_PORT} -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports {INBOUND_PORT}
-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -p tcp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -p udp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -s {passthrough}/32 -o lo -j RETURN
-A ISTIO_OUTPUT ! -d {lo} -o lo -p tcp ! --dport {HBONE_PORT} -m owner --uid-owner {PROXY_ID} -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner {PROXY_ID} -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner {PROXY_ID} -j RETURN
-A ISTIO_OUTPUT ! -d {lo} -o lo -p tcp ! --dport {HBONE_PORT} -m owner --gid-owner {PROXY_ID} -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner {PROXY_ID} -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner {PROXY_ID} -j RETURN
-A ISTIO_OUTPUT -d {lo} -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
COMMIT
"
    )
}

/// Feeds `rules` to the family's `iptables-restore --noflush` inside the pod, as istio does.
fn restore(
    pod: &NetNs,
    wrapper: &[&str],
    family: Family,
    backend: Backend,
    rules: &str,
) -> Result<()> {
    let command = family.restore_command(backend);
    let mut child = Command::new("ip")
        .args(["netns", "exec", pod.name()])
        .args(wrapper)
        .args([command, "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {command}"))?;
    let written = child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(rules.as_bytes());
    let out = child.wait_with_output()?;
    written.with_context(|| format!("cannot feed {command}"))?;
    if !out.status.success() {
        bail!(
            "{command} in {} failed ({}): {}",
            pod.name(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
