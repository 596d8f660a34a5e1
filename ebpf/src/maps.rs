//! The maps shared with userspace; layouts come from `weir-common`.
//!
//! They are BTF-defined (the `.maps` section, libbpf's convention) rather than legacy `maps`
//! entries, so the kernel knows their key and value types and `bpftool map dump` shows every
//! entry field by field. All are pinned by name: a restarted agent finds the same state, and the
//! programs keep working while it is away.
use core::{ffi::c_void, ptr};

use aya_ebpf::helpers::gen::{bpf_map_delete_elem, bpf_map_lookup_elem, bpf_map_update_elem};
use weir_common::{ConnectionKey, Endpoint, IpKey, NodeConfig, PodConfig, PodCounters};

const BPF_MAP_TYPE_HASH: usize = 1;
const BPF_MAP_TYPE_ARRAY: usize = 2;
const BPF_MAP_TYPE_PERCPU_HASH: usize = 5;
const BPF_MAP_TYPE_LRU_HASH: usize = 9;
const LIBBPF_PIN_BY_NAME: usize = 1;

const MAX_PODS: usize = 16_384;
/// In-flight redirected connections; LRU so a busy node recycles the oldest, long-answered ones.
const MAX_CONNECTIONS: usize = 262_144;

/// A BTF map definition: each field's *type* carries one map attribute (the pointers are never
/// dereferenced); the loader reads them from BTF and creates the map.
#[repr(C)]
pub struct Map<K, V, const TYPE: usize, const MAX_ENTRIES: usize> {
    r#type: *const [i32; TYPE],
    key: *const K,
    value: *const V,
    max_entries: *const [i32; MAX_ENTRIES],
    pinning: *const [i32; LIBBPF_PIN_BY_NAME],
}

// SAFETY: the definition is never read or written from Rust; the kernel owns the map.
unsafe impl<K, V, const TYPE: usize, const MAX_ENTRIES: usize> Sync
    for Map<K, V, TYPE, MAX_ENTRIES>
{
}

impl<K, V, const TYPE: usize, const MAX_ENTRIES: usize> Map<K, V, TYPE, MAX_ENTRIES> {
    pub const fn new() -> Self {
        Self {
            r#type: ptr::null(),
            key: ptr::null(),
            value: ptr::null(),
            max_entries: ptr::null(),
            pinning: ptr::null(),
        }
    }

    #[inline(always)]
    fn as_ptr(&self) -> *mut c_void {
        self as *const Self as *mut c_void
    }

    /// The value for `key`, read-only.
    #[inline(always)]
    pub fn get(&self, key: &K) -> Option<&V> {
        // SAFETY: the helper returns null or a pointer to a live value of type V.
        unsafe {
            (bpf_map_lookup_elem(self.as_ptr(), key as *const K as *const c_void) as *const V)
                .as_ref()
        }
    }

    /// The value for `key`, for in-place updates (per-CPU values belong to this CPU).
    #[inline(always)]
    pub fn get_ptr_mut(&self, key: &K) -> Option<*mut V> {
        // SAFETY: as in `get`.
        let value = unsafe { bpf_map_lookup_elem(self.as_ptr(), key as *const K as *const c_void) };
        (!value.is_null()).then_some(value as *mut V)
    }

    #[inline(always)]
    pub fn insert(&self, key: &K, value: &V) -> Result<(), i64> {
        // SAFETY: key and value point to live values of the map's types.
        let ret = unsafe {
            bpf_map_update_elem(
                self.as_ptr(),
                key as *const K as *const c_void,
                value as *const V as *const c_void,
                0,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(ret)
        }
    }

    #[allow(dead_code)]
    #[inline(always)]
    pub fn remove(&self, key: &K) -> Result<(), i64> {
        // SAFETY: key points to a live value of the map's key type.
        let ret = unsafe { bpf_map_delete_elem(self.as_ptr(), key as *const K as *const c_void) };
        if ret == 0 {
            Ok(())
        } else {
            Err(ret)
        }
    }
}

type HashMap<K, V, const N: usize> = Map<K, V, BPF_MAP_TYPE_HASH, N>;
type PerCpuHashMap<K, V, const N: usize> = Map<K, V, BPF_MAP_TYPE_PERCPU_HASH, N>;
type LruHashMap<K, V, const N: usize> = Map<K, V, BPF_MAP_TYPE_LRU_HASH, N>;
type Array<V, const N: usize> = Map<u32, V, BPF_MAP_TYPE_ARRAY, N>;

/// Enrolled pods by network namespace cookie.
#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static PODS: HashMap<u64, PodConfig, MAX_PODS> = Map::new();

/// Enrolled pods' IPs (v4-mapped for IPv4) to their netns cookie: how packets on the wire and
/// sockets on the node find the pod.
#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static POD_IPS: HashMap<IpKey, u64, { MAX_PODS * 2 }> = Map::new();

#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static POD_COUNTERS: PerCpuHashMap<u64, PodCounters, MAX_PODS> = Map::new();

/// Original destination of each redirected socket, by socket cookie.
#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static SOCKET_ORIG_DST: LruHashMap<u64, Endpoint, MAX_CONNECTIONS> = Map::new();

/// Original destination of each redirected TCP connection, by the tuple ztunnel's side sees.
#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static CONN_ORIG_DST: LruHashMap<ConnectionKey, Endpoint, MAX_CONNECTIONS> = Map::new();

#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static NODE_CONFIG: Array<NodeConfig, 1> = Map::new();

/// Bumps one of a pod's per-CPU counters.
#[inline(always)]
pub fn count(netns_cookie: u64, field: impl FnOnce(&mut PodCounters) -> &mut u64) {
    if let Some(counters) = POD_COUNTERS.get_ptr_mut(&netns_cookie) {
        // SAFETY: per-CPU value, only this CPU writes it while this program runs.
        unsafe { *field(&mut *counters) += 1 };
    }
}
