//! The verdict the programs would give one connection of an enrolled pod, decided from the
//! entries they read, in their order: `ebpf/src/outbound.rs` (`redirect`) and
//! `ebpf/src/sidecar.rs` (`outbound`) at connect and sendmsg, `ebpf/src/inbound.rs` (`decide`)
//! at tc ingress. The programs cannot run outside the kernel, so the rules are followed here
//! step by step; `tests/tests/explain.rs` checks each prediction against what `weir-agent
//! trace` then records.
//!
//! Only what the maps tell is decided: the caller is taken to be the app (not ztunnel's
//! socket, not the sidecar proxy's uid or gid, not bound to 127.0.0.6), the packet a whole new
//! connection's first, and where the outcome hangs on a listener in the pod, that is named.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::{Context, Result};
use serde::Serialize;
use weir_common::{
    list, PodConfig, TraceHook, TraceVerdict, DNS_PORT, DNS_PROXY_PORT, HBONE_PORT, INBOUND_PORT,
    OUTBOUND_PORT, PASSTHROUGH_SOURCE_V6, POD_DNS_CAPTURE, POD_EXCLUDED_INTERFACES, POD_HAS_IPV4,
    POD_HAS_IPV6, POD_INBOUND_ALL_PORTS, POD_INBOUND_BYPASS, POD_LOOPBACK_INCLUDED,
    POD_OUTBOUND_ALL_RANGES, POD_SIDECAR, POD_SIDECAR_IPV6, POD_TPROXY,
};

use crate::{
    datapath::{ip_key, PinnedLookups},
    trace::{hook_name, verdict_name},
};

/// What one connection would meet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Prediction {
    /// connect, sendmsg or tc-ingress, as `weir-agent trace` names it.
    pub hook: &'static str,
    pub protocol: &'static str,
    /// The sender's address; for outbound the pod's of the destination's family (its port is
    /// chosen later), none where the pod has none.
    pub source: Option<SocketAddr>,
    pub destination: SocketAddr,
    /// The verdict `weir-agent trace` records; none where the programs let the connection
    /// through untouched without a record.
    pub verdict: Option<&'static str>,
    /// Where it is sent (a proxy's listener), for a verdict that sends it somewhere.
    pub target: Option<SocketAddr>,
    /// The rule that decided, in words.
    pub rule: String,
    /// What would decide otherwise that the maps cannot tell (a listener in the pod).
    pub unless: Option<String>,
}

/// An outbound call from the app in the pod.
#[derive(Clone, Copy, Debug)]
pub struct Outbound {
    pub destination: SocketAddr,
    /// A datagram sent with an address (sendmsg), rather than a TCP connect.
    pub udp: bool,
}

/// The pod whose connection is predicted: its netns cookie and entry.
pub struct Pod<'a> {
    pub netns_cookie: u64,
    pub config: &'a PodConfig,
    pub maps: &'a PinnedLookups,
}

/// The decision, as a program reaches it.
struct Decided {
    verdict: Option<TraceVerdict>,
    target: Option<SocketAddr>,
    rule: String,
    unless: Option<String>,
}

fn decided(verdict: TraceVerdict, rule: impl Into<String>) -> Result<Decided> {
    Ok(Decided {
        verdict: Some(verdict),
        target: None,
        rule: rule.into(),
        unless: None,
    })
}

fn sent(verdict: TraceVerdict, target: SocketAddr, rule: impl Into<String>) -> Result<Decided> {
    Ok(Decided {
        target: Some(target),
        ..decided(verdict, rule)?
    })
}

fn untraced(rule: impl Into<String>) -> Result<Decided> {
    Ok(Decided {
        verdict: None,
        target: None,
        rule: rule.into(),
        unless: None,
    })
}

impl Pod<'_> {
    fn has(&self, flag: u32) -> bool {
        self.config.has(flag)
    }

    /// The pod's address of `like`'s family (`in_pod::pod_address_like`).
    pub fn address_like(&self, like: IpAddr) -> Option<IpAddr> {
        match like {
            IpAddr::V4(_) => self
                .has(POD_HAS_IPV4)
                .then(|| IpAddr::from(self.config.ipv4)),
            IpAddr::V6(_) => self
                .has(POD_HAS_IPV6)
                .then(|| IpAddr::from(self.config.ipv6)),
        }
    }

    /// Whether `POD_IPS` indexes `ip` for this pod (`in_pod::pod_owns`).
    fn owns(&self, ip: IpAddr) -> Result<bool> {
        Ok(self.maps.pod_with_ip(&ip_key(ip))? == Some(self.netns_cookie))
    }

    fn port_listed(&self, list: u8, port: u16) -> Result<bool> {
        self.maps.port_listed(self.netns_cookie, list, port)
    }

    fn range_listed(&self, list: u8, ip: IpAddr) -> Result<bool> {
        Ok(self
            .maps
            .range_value(self.netns_cookie, list, &ip_key(ip))?
            .is_some())
    }

    /// Whether `ip` is the node's probe source of its family (`maps::is_probe_source`): never
    /// while the probe bypass is off.
    fn is_probe_source(&self, ip: IpAddr) -> Result<bool> {
        let node = self.maps.node_config()?;
        Ok(node.host_netns_cookie != 0
            && (ip == IpAddr::from(node.probe_source_v4)
                || ip == IpAddr::from(node.probe_source_v6)))
    }

    /// The outbound call's prediction.
    pub fn outbound(&self, call: Outbound) -> Result<Prediction> {
        let destination = canonical(call.destination);
        let decided = self.decide_outbound(destination, call.udp)?;
        let hook = if call.udp {
            TraceHook::Sendmsg
        } else {
            TraceHook::Connect
        };
        Ok(Prediction {
            hook: hook_name(hook),
            protocol: if call.udp { "udp" } else { "tcp" },
            source: self
                .address_like(destination.ip())
                .map(|ip| SocketAddr::new(ip, 0)),
            destination,
            verdict: decided.verdict.map(verdict_name),
            target: decided.target,
            rule: decided.rule,
            unless: decided.unless,
        })
    }

    fn decide_outbound(&self, dst: SocketAddr, udp: bool) -> Result<Decided> {
        // `on_outbound`: an unconnected datagram is looked at only for DNS or the probe source.
        if udp && dst.port() != DNS_PORT && !self.is_probe_source(dst.ip())? {
            return untraced("a datagram other than DNS: the sendmsg hook leaves it alone");
        }
        if self.has(POD_SIDECAR) {
            self.sidecar_outbound(dst, !udp)
        } else {
            self.ambient_outbound(dst, !udp)
        }
    }

    /// `outbound::redirect`.
    fn ambient_outbound(&self, dst: SocketAddr, tcp: bool) -> Result<Decided> {
        if self.is_probe_source(dst.ip())? {
            return decided(
                TraceVerdict::RefuseProbeAddress,
                "the node's probe source address: refused from inside a pod",
            );
        }
        if dst.ip().is_loopback() || self.owns(dst.ip())? {
            return decided(
                TraceVerdict::PassLocal,
                "loopback or one of the pod's own addresses",
            );
        }
        if dst.port() == DNS_PORT && self.has(POD_DNS_CAPTURE) {
            return sent(
                TraceVerdict::Dns,
                SocketAddr::new(loopback_like(dst.ip()), DNS_PROXY_PORT),
                "port 53 with DNS capture on: to ztunnel's DNS proxy",
            );
        }
        if !tcp {
            return decided(TraceVerdict::PassUncaptured, "UDP other than DNS");
        }
        match self.address_like(dst.ip()) {
            Some(ip) => sent(
                TraceVerdict::Outbound,
                SocketAddr::new(ip, OUTBOUND_PORT),
                "TCP from an ambient pod: to ztunnel's outbound listener at the pod's address",
            ),
            None => decided(
                TraceVerdict::RefuseNoAddress,
                "the pod has no CNI address of the destination's family",
            ),
        }
    }

    /// `sidecar::outbound`, for the app (neither the proxy's uid nor its gid).
    fn sidecar_outbound(&self, dst: SocketAddr, tcp: bool) -> Result<Decided> {
        let ip = dst.ip();
        let v6 = ip.is_ipv6();
        if v6 && !self.has(POD_SIDECAR_IPV6) {
            return decided(
                TraceVerdict::PassExcluded,
                "IPv6, which istio does not capture in this pod",
            );
        }
        if !v6 && !self.has(POD_HAS_IPV4) && !ip.is_loopback() {
            return decided(
                TraceVerdict::PassExcluded,
                "IPv4 from a pod without an IPv4 address",
            );
        }
        if self.has(POD_EXCLUDED_INTERFACES)
            && self
                .maps
                .range_value(self.netns_cookie, list::ROUTES, &ip_key(ip))?
                == Some(list::ROUTE_EXCLUDED)
        {
            return decided(
                TraceVerdict::PassExcluded,
                "routed out of an excluded interface (excludeInterfaces)",
            );
        }
        if self.port_listed(list::OUTBOUND_EXCLUDE, dst.port())? {
            return decided(
                TraceVerdict::PassExcluded,
                format!("port {} is in excludeOutboundPorts", dst.port()),
            );
        }
        let local =
            ip.is_loopback() || ip == IpAddr::V6(PASSTHROUGH_SOURCE_V6.into()) || self.owns(ip)?;
        let dns_capture = self.has(POD_DNS_CAPTURE);
        if local
            && !self.has(POD_LOOPBACK_INCLUDED)
            && (!dns_capture || (tcp && dst.port() != DNS_PORT))
        {
            return decided(
                TraceVerdict::PassLocal,
                "to the pod itself (loopback or its own address)",
            );
        }
        if dns_capture && dst.port() == DNS_PORT {
            return sent(
                TraceVerdict::Dns,
                SocketAddr::new(loopback_like(ip), DNS_PROXY_PORT),
                "port 53 with the proxy's DNS capture (ISTIO_META_DNS_CAPTURE): to its DNS proxy",
            );
        }
        if ip == loopback_like(ip) {
            return decided(TraceVerdict::PassLocal, "to 127.0.0.1 or ::1");
        }
        if !tcp {
            return decided(TraceVerdict::PassUncaptured, "UDP other than DNS");
        }
        if self.range_listed(list::OUTBOUND_EXCLUDE, ip)? {
            return decided(TraceVerdict::PassExcluded, "in excludeOutboundIPRanges");
        }
        let rule = if self.port_listed(list::OUTBOUND_INCLUDE, dst.port())? {
            format!("port {} is in includeOutboundPorts", dst.port())
        } else if self.has(POD_OUTBOUND_ALL_RANGES) {
            "includeOutboundIPRanges is *".to_owned()
        } else if self.range_listed(list::OUTBOUND_INCLUDE, ip)? {
            "in includeOutboundIPRanges".to_owned()
        } else {
            return decided(
                TraceVerdict::PassExcluded,
                "neither in includeOutboundIPRanges nor to a port in includeOutboundPorts",
            );
        };
        let listener = self.address_like(ip).unwrap_or_else(|| loopback_like(ip));
        sent(
            TraceVerdict::Outbound,
            SocketAddr::new(listener, OUTBOUND_PORT),
            format!("TCP {rule}: to the sidecar's outbound listener"),
        )
    }

    /// A new TCP connection from `source` to the pod's `port` (`inbound::decide`, for a SYN no
    /// socket owns yet).
    pub fn inbound(&self, source: IpAddr, port: u16) -> Result<Prediction> {
        let source = source.to_canonical();
        let pod_ip = self.address_like(source).with_context(|| {
            format!("the pod has no address of {source}'s family to connect to")
        })?;
        let destination = SocketAddr::new(pod_ip, port);
        let decided = self.decide_inbound(source, destination)?;
        Ok(Prediction {
            hook: hook_name(TraceHook::TcIngress),
            protocol: "tcp",
            source: Some(SocketAddr::new(source, 0)),
            destination,
            verdict: decided.verdict.map(verdict_name),
            target: decided.target,
            rule: decided.rule,
            unless: decided.unless,
        })
    }

    fn decide_inbound(&self, source: IpAddr, destination: SocketAddr) -> Result<Decided> {
        let port = destination.port();
        let sidecar = self.has(POD_SIDECAR);
        if sidecar {
            if let Some(passes) = self.sidecar_passes_inbound(port, source.is_ipv6())? {
                return untraced(passes);
            }
        } else if port == HBONE_PORT {
            return Ok(Decided {
                unless: Some(
                    "dropped (drop-hbone-not-ztunnel) if a listener not ztunnel's holds 15008"
                        .into(),
                ),
                ..untraced("HBONE (15008): to ztunnel's own listener, untouched")?
            });
        }
        if self.is_probe_source(source)? {
            return decided(
                TraceVerdict::ProbeBypass,
                "from the node's probe source address: a kubelet probe, let through",
            );
        }
        if self.has(POD_INBOUND_BYPASS) {
            return decided(
                TraceVerdict::PassInboundBypass,
                "the pod bypasses inbound capture (ambient.istio.io/bypass-inbound-capture)",
            );
        }
        let (rule, absent) = if sidecar {
            (
                "to the sidecar's inbound listener (15006), keeping its destination",
                "dropped (drop-no-proxy) while the proxy is not listening on 15006",
            )
        } else {
            (
                "to ztunnel's inbound listener (15006), keeping its destination",
                "dropped (drop-no-ztunnel) while ztunnel is not listening on 15006 in the pod",
            )
        };
        Ok(Decided {
            unless: Some(absent.into()),
            ..sent(
                TraceVerdict::Inbound,
                SocketAddr::new(destination.ip(), INBOUND_PORT),
                rule,
            )?
        })
    }

    /// Why a sidecar pod's inbound TCP to `port` is not captured (`sidecar::captures_inbound`),
    /// if it is not.
    fn sidecar_passes_inbound(&self, port: u16, v6: bool) -> Result<Option<String>> {
        if v6 && !self.has(POD_SIDECAR_IPV6) {
            return Ok(Some(
                "IPv6, which istio does not capture in this pod".into(),
            ));
        }
        if port == HBONE_PORT && !self.has(POD_TPROXY) {
            return Ok(Some("15008 is not captured in REDIRECT mode".into()));
        }
        Ok(if self.has(POD_INBOUND_ALL_PORTS) {
            self.port_listed(list::INBOUND_EXCLUDE, port)?
                .then(|| format!("port {port} is in excludeInboundPorts"))
        } else {
            (!self.port_listed(list::INBOUND_INCLUDE, port)?)
                .then(|| format!("port {port} is not in includeInboundPorts"))
        })
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address the programs take it for.
fn canonical(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(address.ip().to_canonical(), address.port())
}

/// The loopback address of `like`'s family.
fn loopback_like(like: IpAddr) -> IpAddr {
    match like {
        IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
        IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
    }
}
