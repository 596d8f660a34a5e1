//! REDIRECT-mode sidecar pods' translation maps (`REROUTE_NAT`): each such pod with rerouted
//! interfaces has a map of its own, which the translating programs find by the pod's netns
//! cookie. Its own, so that one pod's VMs, which have the same addresses as every other pod's
//! (KubeVirt's masquerade binding), can neither reach nor push out another pod's translations;
//! the map bounds the pod's translations at [`REROUTE_NAT_ENTRIES`].
//!
//! The agent makes `REROUTE_NAT` itself, before the object is loaded: aya would make its
//! template for pods' maps with BTF, and kernels from 5.15 to 6.1 refuse a pod's map (made
//! without) whose BTF-ness differs from the template's, as they compare where a timer lies in
//! the value, which BTF alone tells. Template and pods' maps are made the one way, [`pod_map`].
use std::{
    io,
    mem::size_of,
    os::fd::{AsFd, OwnedFd},
    path::Path,
};

use anyhow::{Context, Result};
use aya::{
    maps::{HashMap, HashOfMaps, MapData, MapError},
    Ebpf,
};
use aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_LRU_HASH;
use tracing::debug;
use weir_common::{maps, ConnectionKey, NatEntry, PodConfig, MAX_PODS, REROUTE_NAT_ENTRIES};

use super::enroll::BPF_NOEXIST;
use crate::datapath::kernel::{bpf_sys, programs};

/// The kernel's name of each pod's map (at most 15 bytes).
const POD_MAP_NAME: &str = "REROUTE_NAT_POD";

/// Pins a new, empty `REROUTE_NAT` at `path`, unless one is pinned there, for the loader to
/// take over.
pub(in crate::datapath) fn pin_empty(path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    let template = pod_map().context("making the template of pods' translation maps")?;
    let outer: OwnedFd = bpf_sys::create_hash_of_maps(
        maps::REROUTE_NAT,
        size_of::<u64>() as u32,
        MAX_PODS,
        bpf_sys::BPF_F_NO_PREALLOC,
        template.fd().as_fd(),
    )
    .with_context(|| format!("making {}", maps::REROUTE_NAT))?;
    bpf_sys::pin_object(outer.as_fd(), path).with_context(|| format!("pinning {}", path.display()))
}

/// A new, empty map for one pod's translations.
fn pod_map() -> Result<MapData> {
    let definition = aya_obj::Map::new_from_params(
        BPF_MAP_TYPE_LRU_HASH as u32,
        size_of::<ConnectionKey>() as u32,
        size_of::<NatEntry>() as u32,
        REROUTE_NAT_ENTRIES,
        0,
    );
    Ok(MapData::create(definition, POD_MAP_NAME, None)?)
}

/// The pinned `REROUTE_NAT`: netns cookie to the pod's map.
pub(in crate::datapath) struct Translations {
    maps: HashOfMaps<MapData, u64>,
}

impl Translations {
    /// Takes the map; the maps of pods no longer in `pods_map` (an earlier agent stopped
    /// between removing a pod's entry and its map) go.
    pub(in crate::datapath) fn take(
        ebpf: &mut Ebpf,
        pods_map: &HashMap<MapData, u64, PodConfig>,
    ) -> Result<Self> {
        let mut maps: HashOfMaps<MapData, u64> = programs::take_map(ebpf, maps::REROUTE_NAT)?;
        let gone: Vec<u64> = maps
            .keys()
            .filter_map(Result::ok)
            .filter(|netns_cookie| pods_map.get(netns_cookie, 0).is_err())
            .collect();
        for netns_cookie in gone {
            debug!(
                netns_cookie,
                "dropping the translations of a pod no longer enrolled"
            );
            let _ = maps.remove(&netns_cookie);
        }
        Ok(Self { maps })
    }

    /// Gives the pod in netns `netns_cookie` its map, unless it has one: the translations of
    /// its open connections are kept across re-enrollments and agent restarts.
    pub(super) fn make(&mut self, netns_cookie: u64) -> Result<()> {
        if self.maps.get(&netns_cookie, 0).is_ok() {
            return Ok(());
        }
        let map = pod_map().context("making the pod's translation map")?;
        match self.maps.insert(netns_cookie, &map, BPF_NOEXIST) {
            Err(MapError::SyscallError(error))
                if error.io_error.kind() == io::ErrorKind::AlreadyExists =>
            {
                Ok(())
            }
            other => other.context("indexing the pod's translation map"),
        }
    }

    /// Drops the pod's map, and with it every translation of its connections.
    pub(super) fn remove(&mut self, netns_cookie: u64) {
        let _ = self.maps.remove(&netns_cookie);
    }
}
