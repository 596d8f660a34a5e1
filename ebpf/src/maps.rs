//! The maps shared with userspace; layouts come from `weir-common`. All are pinned by name, so a
//! restarted agent finds the same state and the programs keep working while it is away.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuHashMap},
};
use weir_common::{ConnectionKey, Endpoint, IpKey, NodeConfig, PodConfig, PodCounters};

const MAX_PODS: u32 = 16_384;
/// In-flight redirected connections; LRU so a busy node recycles the oldest, long-answered ones.
const MAX_CONNECTIONS: u32 = 262_144;

/// Enrolled pods by network namespace cookie.
#[map]
pub static PODS: HashMap<u64, PodConfig> = HashMap::pinned(MAX_PODS, 0);

/// Enrolled pods' IPs (v4-mapped for IPv4) to their netns cookie: how packets on the wire and
/// sockets on the node find the pod.
#[map]
pub static POD_IPS: HashMap<IpKey, u64> = HashMap::pinned(MAX_PODS * 2, 0);

#[map]
pub static POD_COUNTERS: PerCpuHashMap<u64, PodCounters> = PerCpuHashMap::pinned(MAX_PODS, 0);

/// Original destination of each redirected socket, by socket cookie.
#[map]
pub static SOCKET_ORIG_DST: LruHashMap<u64, Endpoint> = LruHashMap::pinned(MAX_CONNECTIONS, 0);

/// Original destination of each redirected TCP connection, by the tuple ztunnel's side sees.
#[map]
pub static CONN_ORIG_DST: LruHashMap<ConnectionKey, Endpoint> =
    LruHashMap::pinned(MAX_CONNECTIONS, 0);

#[map]
pub static NODE_CONFIG: Array<NodeConfig> = Array::pinned(1, 0);

/// Bumps one of a pod's per-CPU counters.
#[inline(always)]
pub fn count(netns_cookie: u64, field: impl FnOnce(&mut PodCounters) -> &mut u64) {
    if let Some(counters) = POD_COUNTERS.get_ptr_mut(&netns_cookie) {
        // SAFETY: per-CPU value, only this CPU writes it while this program runs.
        unsafe { *field(&mut *counters) += 1 };
    }
}
