//! The pods the pinned maps hold, read the way an operator's tool reads them: the maps are opened
//! read-only from their pins (the kernel refuses writes through such an fd), no program is loaded
//! and no link taken over, so the agent that owns them is not disturbed. A restarted owner
//! rebuilds its index from the same entries.
use std::{collections::HashMap as StdHashMap, net::IpAddr, os::fd::AsFd, path::Path};

use anyhow::{Context, Result};
use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    Array, HashMap, Map, MapData, MapError, MapInfo, MapType, PerCpuArray, PerCpuHashMap,
};
use ipnet::IpNet;
use weir_common::{
    maps, IpKey, NodeConfig, PodConfig, PodCounters, PortKey, RangeKey, TraceVerdict, POD_UID_LEN,
};

use crate::datapath::kernel::bpf_sys;
use crate::datapath::{
    maps_dir,
    pod::config::{ip_addr, pod_options, sum_over_cpus},
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

/// The drops and refusals of every pod on the node since the maps were pinned, by verdict
/// (summed over CPUs), every denying verdict listed; `None` when nothing is pinned.
pub fn denials(pin_root: &Path) -> Result<Option<Vec<(TraceVerdict, u64)>>> {
    let dir = maps_dir(pin_root);
    if !dir.exists() {
        return Ok(None);
    }
    let counts: PerCpuArray<MapData, u64> = open_pinned(&dir, maps::DENIALS)?;
    TraceVerdict::ALL
        .into_iter()
        .filter(|verdict| verdict.denies())
        .map(|verdict| {
            let per_cpu = counts
                .get(&u32::from(verdict as u8), 0)
                .with_context(|| format!("reading {}", maps::DENIALS))?;
            Ok((verdict, per_cpu.iter().sum()))
        })
        .collect::<Result<_>>()
        .map(Some)
}

/// How full one of weir's pinned maps is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapFill {
    pub name: &'static str,
    pub entries: u32,
    pub capacity: u32,
}

/// One of weir's maps in this build's layout, opened read-only from its pin.
struct PinnedMap {
    name: &'static str,
    map: MapData,
    info: MapInfo,
    kind: Option<MapType>,
}

/// The maps pinned under `pin_root` in this build's layout (those not pinned are left out).
fn pinned_maps(pin_root: &Path) -> Result<Vec<PinnedMap>> {
    let dir = maps_dir(pin_root);
    let mut pinned = Vec::new();
    for name in maps::ALL {
        let path = dir.join(name);
        let fd = match bpf_sys::open_pinned_read_only(&path) {
            Ok(fd) => fd,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(error).with_context(|| format!("opening {}", path.display())),
        };
        let map = MapData::from_fd(fd).with_context(|| format!("reading {}", path.display()))?;
        let info = map.info()?;
        pinned.push(PinnedMap {
            name,
            kind: info.map_type().ok(),
            map,
            info,
        });
    }
    Ok(pinned)
}

impl PinnedMap {
    /// Whether its entries come and go (hashes, LRU hashes, tries), so that its fill means
    /// something: arrays are always full.
    fn fills(&self) -> bool {
        matches!(
            self.kind,
            Some(
                MapType::Hash
                    | MapType::LruHash
                    | MapType::PerCpuHash
                    | MapType::LruPerCpuHash
                    | MapType::LpmTrie
                    | MapType::HashOfMaps
            )
        )
    }

    /// Whether its keys can be walked: the ring buffer and socket storage have none.
    fn walkable(&self) -> bool {
        !matches!(
            self.kind,
            Some(MapType::RingBuf | MapType::SkStorage) | None
        )
    }

    /// The length of a value as a lookup returns it: every possible CPU's for a per-CPU map.
    fn value_len(&self) -> Result<usize> {
        let size = self.info.value_size() as usize;
        Ok(match self.kind {
            Some(MapType::PerCpuHash | MapType::LruPerCpuHash | MapType::PerCpuArray) => {
                let cpus = aya::util::nr_cpus()
                    .map_err(|(what, error)| anyhow::anyhow!("{what}: {error}"))?;
                size.next_multiple_of(8) * cpus
            }
            _ => size,
        })
    }

    fn key_size(&self) -> usize {
        self.info.key_size() as usize
    }
}

/// The fill of every pinned map in this build's layout whose entries come and go. Empty when
/// nothing is pinned there.
pub fn map_fill(pin_root: &Path) -> Result<Vec<MapFill>> {
    pinned_maps(pin_root)?
        .into_iter()
        .filter(PinnedMap::fills)
        .map(|pinned| {
            let capacity = pinned.info.max_entries();
            let entries = bpf_sys::count_keys(pinned.map.fd().as_fd(), pinned.key_size(), capacity)
                .with_context(|| format!("counting the entries of {}", pinned.name))?;
            Ok(MapFill {
                name: pinned.name,
                entries,
                capacity,
            })
        })
        .collect()
}

/// One pinned map's entries, raw, as `bpftool map dump` shows them.
pub struct MapDump {
    pub name: &'static str,
    /// The kernel's map type, as aya names it.
    pub kind: String,
    pub key_size: u32,
    pub value_size: u32,
    pub capacity: u32,
    /// Keys and values (every CPU's, for a per-CPU map); none for a map whose keys cannot be
    /// walked (the ring buffer, socket storage).
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// Whether entries were left out beyond the `at_most` asked.
    pub truncated: bool,
}

/// Every pinned map of this build's layout, with up to `at_most` entries each.
pub fn map_dump(pin_root: &Path, at_most: u32) -> Result<Vec<MapDump>> {
    pinned_maps(pin_root)?
        .into_iter()
        .map(|pinned| {
            let mut keys = Vec::new();
            if pinned.walkable() {
                // One more than asked: whether any was left out.
                bpf_sys::for_each_key(
                    pinned.map.fd().as_fd(),
                    pinned.key_size(),
                    at_most + 1,
                    |key| keys.push(key.to_vec()),
                )
                .with_context(|| format!("walking {}", pinned.name))?;
            }
            let truncated = keys.len() > at_most as usize;
            keys.truncate(at_most as usize);
            let value_len = pinned.value_len()?;
            let mut entries = Vec::new();
            for key in keys {
                let value = bpf_sys::map_lookup(pinned.map.fd().as_fd(), &key, value_len)
                    .with_context(|| format!("reading an entry of {}", pinned.name))?;
                // Gone since the walk saw its key.
                if let Some(value) = value {
                    entries.push((key, value));
                }
            }
            Ok(MapDump {
                name: pinned.name,
                kind: pinned
                    .kind
                    .map_or_else(|| "unknown".to_owned(), |kind| format!("{kind:?}")),
                key_size: pinned.info.key_size(),
                value_size: pinned.info.value_size(),
                capacity: pinned.info.max_entries(),
                entries,
                truncated,
            })
        })
        .collect()
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
pub(in crate::datapath) struct PodEntry {
    pub uid: String,
    pub netns_cookie: u64,
    pub config: PodConfig,
    pub ips: Vec<IpKey>,
}

/// Every pod in `PODS`, with its uid read from its `PodConfig`.
pub(in crate::datapath) fn pod_entries(
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

/// The entries the programs look up to decide a pod's connection, looked up the same way through
/// read-only fds on the pins: the pod's own entry, which pod holds an address, the node's probe
/// source, and a sidecar pod's port and range lists (the range trie answers with the kernel's own
/// longest-prefix match).
pub struct PinnedLookups {
    pods: HashMap<MapData, u64, PodConfig>,
    pod_ips: HashMap<MapData, IpKey, u64>,
    node: Array<MapData, NodeConfig>,
    ports: HashMap<MapData, PortKey, u8>,
    ranges: LpmTrie<MapData, RangeKey, u8>,
}

/// A lookup's value; `None` where the map has no such key.
fn found<V>(result: Result<V, MapError>) -> Result<Option<V>> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(error) => Err(error.into()),
    }
}

impl PinnedLookups {
    /// The maps pinned under `pin_root` in this build's layout; `None` when nothing is pinned
    /// there.
    pub fn open(pin_root: &Path) -> Result<Option<Self>> {
        let dir = maps_dir(pin_root);
        if !dir.exists() {
            return Ok(None);
        }
        Ok(Some(Self {
            pods: open_pinned(&dir, maps::PODS)?,
            pod_ips: open_pinned(&dir, maps::POD_IPS)?,
            node: open_pinned(&dir, maps::NODE_CONFIG)?,
            ports: open_pinned(&dir, maps::SIDECAR_PORTS)?,
            ranges: open_pinned(&dir, maps::SIDECAR_RANGES)?,
        }))
    }

    pub fn pod(&self, netns_cookie: u64) -> Result<Option<PodConfig>> {
        found(self.pods.get(&netns_cookie, 0))
    }

    /// The netns cookie of the pod `POD_IPS` indexes `ip` for.
    pub fn pod_with_ip(&self, ip: &IpKey) -> Result<Option<u64>> {
        found(self.pod_ips.get(ip, 0))
    }

    /// `NODE_CONFIG`: all zero until the agent writes it.
    pub fn node_config(&self) -> Result<NodeConfig> {
        Ok(self.node.get(&0, 0)?)
    }

    /// Whether `port` is in the pod's `list` (a `weir_common::list` value).
    pub fn port_listed(&self, netns_cookie: u64, list: u8, port: u16) -> Result<bool> {
        Ok(found(self.ports.get(&PortKey::new(netns_cookie, list, port), 0))?.is_some())
    }

    /// The value of the longest range of the pod's `list` holding `ip`, among the ranges of
    /// `ip`'s family.
    pub fn range_value(&self, netns_cookie: u64, list: u8, ip: &IpKey) -> Result<Option<u8>> {
        let key = Key::new(
            RangeKey::FULL_BITS,
            RangeKey::range(netns_cookie, list, *ip, ip.v4().is_none()),
        );
        found(self.ranges.get(&key, 0))
    }

    /// Every port of the pod's lists, as `(list, port)`, sorted.
    pub fn ports_of(&self, netns_cookie: u64) -> Result<Vec<(u8, u16)>> {
        let mut ports = Vec::new();
        for key in self.ports.keys() {
            let key = key?;
            if key.netns_cookie == netns_cookie {
                ports.push((key.list, key.port));
            }
        }
        ports.sort_unstable();
        Ok(ports)
    }

    /// Every range of the pod's lists (its routes among them), as `(list, range, value)`,
    /// sorted.
    pub fn ranges_of(&self, netns_cookie: u64) -> Result<Vec<(u8, IpNet, u8)>> {
        let cookie = netns_cookie.to_ne_bytes();
        let mut ranges = Vec::new();
        for key in self.ranges.keys() {
            let key = key?;
            let data = key.data();
            if data.netns_cookie != cookie {
                continue;
            }
            let value = found(self.ranges.get(&key, 0))?.unwrap_or_default();
            let bits = key.prefix_len().saturating_sub(RangeKey::BITS_BEFORE_IP);
            let range = if data.list & RangeKey::IPV6 != 0 {
                IpNet::new(IpAddr::from(data.ip.octets), bits as u8)
            } else {
                let v4 = data.ip.v4().unwrap_or_default();
                IpNet::new(IpAddr::from(v4), bits.saturating_sub(96) as u8)
            }
            .context("a range key with an impossible prefix")?;
            ranges.push(((data.list & 0xff) as u8, range, value));
        }
        ranges.sort_unstable();
        Ok(ranges)
    }
}
