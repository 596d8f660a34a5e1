//! A pod as the maps hold it: its `PODS` entry from the workload (and the options back from
//! it), its addresses as map keys, its counters summed over CPUs; and what makes a pod
//! impossible to enroll.
use std::{
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::Result;
use aya::maps::PerCpuValues;
use weir_common::{
    IpKey, PodConfig, PodCounters, POD_DNS_CAPTURE, POD_EXCLUDED_INTERFACES, POD_HAS_IPV4,
    POD_HAS_IPV6, POD_INBOUND_ALL_PORTS, POD_INBOUND_BYPASS, POD_LOOPBACK_INCLUDED,
    POD_OUTBOUND_ALL_RANGES, POD_SIDECAR, POD_SIDECAR_IPV6, POD_SOCKET_LOOKUP_HANDOFF, POD_TPROXY,
    POD_UID_LEN,
};

use crate::workload::{AllOr, InterceptionMode, PodOptions, SidecarRedirect, Workload};

/// Why a pod can never be enrolled as asked, however often it is tried again: the namespace
/// named for it is not a pod's, or the pod cannot be told apart in the maps. Every other
/// enrollment failure may pass (the kernel busy or short of memory, the agent's own trouble).
#[derive(Debug, thiserror::Error)]
pub enum Unenrollable {
    /// Nothing at the netns path: the sandbox's namespace is gone, or never was.
    #[error("pod netns {} does not exist", .0.display())]
    NetnsMissing(PathBuf),
    /// Something other than a network namespace at the path (a netns file left behind once
    /// the namespace was unmounted, or another kind of namespace).
    #[error("pod netns {} is not a network namespace", .0.display())]
    NotANetns(PathBuf),
    #[error("refusing to redirect the node's own network namespace as pod {uid}")]
    NodeNetns { uid: String },
    #[error("pod uid {0:?} must be 1 to {POD_UID_LEN} bytes")]
    InvalidUid(String),
    #[error("pod {uid} has no IP")]
    NoIp { uid: String },
}

impl Unenrollable {
    /// An error opening the pod netns at `path`: with nothing there, the pod can never be
    /// enrolled.
    pub(in crate::datapath) fn on_open(path: &Path, error: io::Error) -> anyhow::Error {
        if error.kind() == io::ErrorKind::NotFound {
            Self::NetnsMissing(path.to_owned()).into()
        } else {
            anyhow::Error::new(error).context(format!("opening pod netns {}", path.display()))
        }
    }

    /// An error entering the pod netns opened from `path`: setns takes namespaces only, so
    /// anything else there is EINVAL.
    pub(in crate::datapath) fn on_enter(path: &Path, error: io::Error) -> anyhow::Error {
        if error.raw_os_error() == Some(libc::EINVAL) {
            Self::NotANetns(path.to_owned()).into()
        } else {
            anyhow::Error::new(error).context("entering the pod netns")
        }
    }
}

pub(super) fn pod_config(pod: &Workload, handoff: bool) -> Result<PodConfig> {
    if pod.uid.is_empty() || pod.uid.len() > POD_UID_LEN {
        return Err(Unenrollable::InvalidUid(pod.uid.clone()).into());
    }
    if pod.ips.is_empty() {
        return Err(Unenrollable::NoIp {
            uid: pod.uid.clone(),
        }
        .into());
    }
    let mut config = PodConfig {
        flags: 0,
        ipv4: [0; 4],
        ipv6: [0; 16],
        uid: [0; POD_UID_LEN],
        proxy_uid: 0,
        proxy_gid: 0,
    };
    config.uid[..pod.uid.len()].copy_from_slice(pod.uid.as_bytes());
    for ip in &pod.ips {
        match ip {
            IpAddr::V4(v4) if !config.has(POD_HAS_IPV4) => {
                config.ipv4 = v4.octets();
                config.flags |= POD_HAS_IPV4;
            }
            IpAddr::V6(v6) if !config.has(POD_HAS_IPV6) => {
                config.ipv6 = v6.octets();
                config.flags |= POD_HAS_IPV6;
            }
            _ => {}
        }
    }
    if pod.options.inbound_bypass {
        config.flags |= POD_INBOUND_BYPASS;
    }
    if pod.options.dns_capture {
        config.flags |= POD_DNS_CAPTURE;
    }
    if handoff {
        config.flags |= POD_SOCKET_LOOKUP_HANDOFF;
    }
    if let Some(sidecar) = &pod.sidecar {
        set_sidecar(&mut config, sidecar, &pod.ips);
    }
    Ok(config)
}

/// A sidecar pod's flags and proxy identity; its port and range lists go to maps of their own.
fn set_sidecar(config: &mut PodConfig, sidecar: &SidecarRedirect, ips: &[IpAddr]) {
    config.flags |= POD_SIDECAR;
    config.proxy_uid = sidecar.proxy_uid;
    config.proxy_gid = sidecar.proxy_gid;
    // istio's rule: IPv6 is captured when the pod's first address is IPv6, or with
    // ISTIO_DUAL_STACK when it has one at all.
    let ipv6 = match ips.first() {
        Some(IpAddr::V6(_)) => true,
        _ => sidecar.dual_stack && ips.iter().any(IpAddr::is_ipv6),
    };
    let flags = [
        (POD_SIDECAR_IPV6, ipv6),
        (POD_DNS_CAPTURE, sidecar.dns_capture),
        (
            POD_INBOUND_ALL_PORTS,
            sidecar.include_inbound_ports == AllOr::All,
        ),
        (
            POD_OUTBOUND_ALL_RANGES,
            sidecar.include_outbound_ranges == AllOr::All,
        ),
        (
            POD_LOOPBACK_INCLUDED,
            matches!(&sidecar.include_outbound_ranges,
                AllOr::Only(ranges) if ranges.iter().any(|range| range.addr().is_loopback())),
        ),
        (POD_TPROXY, sidecar.mode == InterceptionMode::Tproxy),
        (
            POD_EXCLUDED_INTERFACES,
            !sidecar.exclude_interfaces.is_empty(),
        ),
    ];
    // The ambient DNS default does not apply: the proxy's own setting decides.
    config.flags &= !POD_DNS_CAPTURE;
    for (flag, on) in flags {
        if on {
            config.flags |= flag;
        }
    }
}

/// A pod's options, as its `PodConfig` flags carry them.
pub(in crate::datapath) fn pod_options(config: &PodConfig) -> PodOptions {
    PodOptions {
        inbound_bypass: config.has(POD_INBOUND_BYPASS),
        dns_capture: config.has(POD_DNS_CAPTURE),
        // Kept per interface, not in the pod's entry: not recovered from the maps.
        reroute_interfaces: Vec::new(),
    }
}

pub(in crate::datapath) fn sum_over_cpus(per_cpu: &PerCpuValues<PodCounters>) -> PodCounters {
    per_cpu
        .iter()
        .fold(PodCounters::default(), |sum, c| PodCounters {
            outbound: sum.outbound + c.outbound,
            inbound: sum.inbound + c.inbound,
            dns: sum.dns + c.dns,
            bypassed: sum.bypassed + c.bypassed,
            dropped: sum.dropped + c.dropped,
        })
}

pub fn ip_key(ip: IpAddr) -> IpKey {
    match ip {
        IpAddr::V4(v4) => IpKey::from_v4(v4.octets()),
        IpAddr::V6(v6) => IpKey::from_v6(v6.octets()),
    }
}

pub fn ip_addr(key: &IpKey) -> IpAddr {
    match key.v4() {
        Some(v4) => IpAddr::from(v4),
        None => IpAddr::from(key.octets),
    }
}
