//! The pods the pinned maps hold, read the way an operator's tool reads them: the maps are opened
//! read-only from their pins (the kernel refuses writes through such an fd), no program is loaded
//! and no link taken over, so the agent that owns them is not disturbed. A restarted owner
//! rebuilds its index from the same entries.
use std::{collections::HashMap as StdHashMap, net::IpAddr, os::fd::AsFd, path::Path};

use anyhow::{Context, Result};
use aya::maps::{HashMap, Map, MapData, MapError, MapType, PerCpuHashMap};
use weir_common::{maps, IpKey, PodConfig, PodCounters, POD_UID_LEN};

use super::bpf_sys;
use super::{
    maps_dir,
    pod_config::{ip_addr, pod_options, sum_over_cpus},
};
use crate::workload::{Mode, PodOptions};

/// One pod as the pinned maps hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinnedPod {
    pub uid: String,
    pub netns_cookie: u64,
    /// Every address `POD_IPS` indexes for the pod: its own IPs and the other addresses of its
    /// interfaces (IPv6 link-local ones), sorted.
    pub ips: Vec<IpAddr>,
    pub options: PodOptions,
    pub mode: Mode,
    /// Summed over CPUs; `None` while the pod's counters entry is not there (an enrollment or a
    /// removal is under way).
    pub counters: Option<PodCounters>,
}

/// The pods pinned under `pin_root` in this build's map layout; `None` when nothing is pinned
/// there. Other layouts' maps (an upgrade under way) have other value layouts and are not read.
pub fn pinned_pods(pin_root: &Path) -> Result<Option<Vec<PinnedPod>>> {
    let dir = maps_dir(pin_root);
    if !dir.exists() {
        return Ok(None);
    }
    let pods_map = open_pinned(&dir, maps::PODS)?;
    let pod_ips = open_pinned(&dir, maps::POD_IPS)?;
    let counters: PerCpuHashMap<MapData, u64, PodCounters> = open_pinned(&dir, maps::POD_COUNTERS)?;
    let pods = pod_entries(&pods_map, &pod_ips)
        .into_iter()
        .map(|entry| {
            let mut ips: Vec<IpAddr> = entry.ips.iter().map(ip_addr).collect();
            ips.sort();
            PinnedPod {
                counters: counters
                    .get(&entry.netns_cookie, 0)
                    .ok()
                    .map(|per_cpu| sum_over_cpus(&per_cpu)),
                uid: entry.uid,
                netns_cookie: entry.netns_cookie,
                ips,
                options: pod_options(&entry.config),
                mode: if entry.config.has(weir_common::POD_SIDECAR) {
                    Mode::Sidecar
                } else {
                    Mode::Ambient
                },
            }
        })
        .collect();
    Ok(Some(pods))
}

/// How full one of weir's pinned maps is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapFill {
    pub name: &'static str,
    pub entries: u32,
    pub capacity: u32,
}

/// The fill of every pinned map in this build's layout whose entries come and go (hashes, LRU
/// hashes, tries); arrays are always full and the ring buffer and socket storage have no count.
/// Empty when nothing is pinned there.
pub fn map_fill(pin_root: &Path) -> Result<Vec<MapFill>> {
    let dir = maps_dir(pin_root);
    let mut fills = Vec::new();
    for name in maps::ALL {
        let path = dir.join(name);
        let fd = match bpf_sys::open_pinned_read_only(&path) {
            Ok(fd) => fd,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(error).with_context(|| format!("opening {}", path.display())),
        };
        let map = MapData::from_fd(fd).with_context(|| format!("reading {}", path.display()))?;
        let info = map.info()?;
        let counted = matches!(
            info.map_type(),
            Ok(MapType::Hash
                | MapType::LruHash
                | MapType::PerCpuHash
                | MapType::LruPerCpuHash
                | MapType::LpmTrie
                | MapType::HashOfMaps)
        );
        if !counted {
            continue;
        }
        let capacity = info.max_entries();
        let entries = bpf_sys::count_keys(map.fd().as_fd(), info.key_size() as usize, capacity)
            .with_context(|| format!("counting the entries of {}", path.display()))?;
        fills.push(MapFill {
            name,
            entries,
            capacity,
        });
    }
    Ok(fills)
}

fn open_pinned<T: TryFrom<Map, Error = MapError>>(dir: &Path, name: &str) -> Result<T> {
    let path = dir.join(name);
    let fd = bpf_sys::open_pinned_read_only(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    MapData::from_fd(fd)
        .and_then(Map::from_map_data)
        .and_then(T::try_from)
        .with_context(|| format!("{} is not the map this build expects", path.display()))
}

/// A pod's entry in `PODS`, with the addresses `POD_IPS` indexes for it.
pub(super) struct PodEntry {
    pub uid: String,
    pub netns_cookie: u64,
    pub config: PodConfig,
    pub ips: Vec<IpKey>,
}

/// Every pod in `PODS`, with its uid read from its `PodConfig`.
pub(super) fn pod_entries(
    pods_map: &HashMap<MapData, u64, PodConfig>,
    pod_ips: &HashMap<MapData, IpKey, u64>,
) -> Vec<PodEntry> {
    let mut ips_by_cookie: StdHashMap<u64, Vec<IpKey>> = StdHashMap::new();
    for (ip, cookie) in pod_ips.iter().flatten() {
        ips_by_cookie.entry(cookie).or_default().push(ip);
    }
    pods_map
        .iter()
        .flatten()
        .map(|(netns_cookie, config)| {
            let uid_len = config
                .uid
                .iter()
                .position(|b| *b == 0)
                .unwrap_or(POD_UID_LEN);
            PodEntry {
                uid: String::from_utf8_lossy(&config.uid[..uid_len]).into_owned(),
                netns_cookie,
                config,
                ips: ips_by_cookie.remove(&netns_cookie).unwrap_or_default(),
            }
        })
        .collect()
}
