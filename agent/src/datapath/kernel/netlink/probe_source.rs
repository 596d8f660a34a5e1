//! The probe source address in the node's netns: kubelet's probes leave from it, so the
//! programs can tell them from other traffic of the node.
use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr},
};

use super::objects::Op;
use super::objects::{local_route, loopback_address, Object, RT_TABLE_LOCAL};
use super::transport::Rtnl;

/// Makes the probe source addresses local in the current (the node's) netns, so that a socket, and
/// the connect programs' `bpf_bind`, can bind to them; for the default addresses:
/// `ip route add local 169.254.7.127/32 dev lo table local`, and
/// `ip addr add fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 dev lo nodad preferred_lft 0`.
/// IPv4 needs only the route (an IPv4 socket binds to any address the `local` table has, and the
/// address never becomes a source candidate that way); IPv6 binds only to interface addresses.
/// The IPv6 address is deprecated from the start (`preferred_lft 0`) so source address selection
/// passes over it when the node has another global address: a ULA on `lo` would otherwise win the
/// longest-prefix rule for the node's own connections to other ULA destinations. Binding to a
/// deprecated address still works. Idempotent; IPv6 is skipped where it is disabled.
pub fn install_probe_source(v4: Ipv4Addr, v6: Ipv6Addr) -> io::Result<()> {
    Rtnl::new()?.apply(probe_source(v4, v6).map(|object| (Op::Add, object)))
}

/// Undoes [`install_probe_source`]; what is already gone is success.
pub fn remove_probe_source(v4: Ipv4Addr, v6: Ipv6Addr) -> io::Result<()> {
    Rtnl::new()?.apply(probe_source(v4, v6).map(|object| (Op::Delete, object)))
}

pub(super) fn probe_source(v4: Ipv4Addr, v6: Ipv6Addr) -> [Object; 2] {
    [
        Object::Route(local_route(v4.into(), 32, RT_TABLE_LOCAL)),
        Object::Address(loopback_address(v6)),
    ]
}
