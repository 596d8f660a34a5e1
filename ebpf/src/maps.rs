//! The maps shared with userspace; layouts come from `weir-common`.
//!
//! They are BTF-defined (the `.maps` section, libbpf's convention) rather than legacy `maps`
//! entries, so the kernel knows their key and value types and `bpftool map dump` shows every
//! entry field by field. All are pinned by name: a restarted agent finds the same state, and the
//! programs keep working while it is away.
use core::{ffi::c_void, ptr};

use aya_ebpf::{
    bindings::bpf_sock,
    helpers::gen::{
        bpf_map_delete_elem, bpf_map_lookup_elem, bpf_map_update_elem, bpf_sk_storage_get,
    },
};
use weir_common::{ConnectionKey, Endpoint, IpKey, NodeConfig, PodConfig, PodCounters};

const BPF_MAP_TYPE_HASH: usize = 1;
const BPF_MAP_TYPE_ARRAY: usize = 2;
const BPF_MAP_TYPE_PERCPU_HASH: usize = 5;
const BPF_MAP_TYPE_LRU_HASH: usize = 9;
const BPF_MAP_TYPE_SK_STORAGE: usize = 24;
/// Allocate entries when inserted, not up front (socket storage requires it).
const BPF_F_NO_PREALLOC: usize = 1;
const BPF_SK_STORAGE_GET_F_CREATE: u64 = 1;
const LIBBPF_PIN_BY_NAME: usize = 1;

const MAX_PODS: usize = 16_384;
/// Redirected connections between the app's connect and ztunnel's SO_ORIGINAL_DST question (a
/// few milliseconds; entries are removed once answered). LRU, so entries ztunnel never asked
/// about (connections that died first) are recycled.
const MAX_CONNECTIONS: usize = 65_536;

/// A BTF map definition: each field's *type* carries one map attribute (the pointers are never
/// dereferenced); the loader reads them from BTF and creates the map.
#[repr(C)]
pub struct Map<K, V, const TYPE: usize, const MAX_ENTRIES: usize, const FLAGS: usize = 0> {
    r#type: *const [i32; TYPE],
    key: *const K,
    value: *const V,
    max_entries: *const [i32; MAX_ENTRIES],
    map_flags: *const [i32; FLAGS],
    pinning: *const [i32; LIBBPF_PIN_BY_NAME],
}

// SAFETY: the definition is never read or written from Rust; the kernel owns the map.
unsafe impl<K, V, const TYPE: usize, const MAX_ENTRIES: usize, const FLAGS: usize> Sync
    for Map<K, V, TYPE, MAX_ENTRIES, FLAGS>
{
}

impl<K, V, const TYPE: usize, const MAX_ENTRIES: usize, const FLAGS: usize>
    Map<K, V, TYPE, MAX_ENTRIES, FLAGS>
{
    pub const fn new() -> Self {
        Self {
            r#type: ptr::null(),
            key: ptr::null(),
            value: ptr::null(),
            max_entries: ptr::null(),
            map_flags: ptr::null(),
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

/// A value attached to each socket, freed with the socket: nothing to expire or evict.
type SocketStorage<V> = Map<i32, V, BPF_MAP_TYPE_SK_STORAGE, 0, BPF_F_NO_PREALLOC>;

impl<V: Copy> SocketStorage<V> {
    /// The socket's value, if one was stored.
    #[inline(always)]
    pub fn of(&self, sk: *mut bpf_sock) -> Option<V> {
        // SAFETY: `sk` is a socket pointer the verifier tracks; the helper returns null or a
        // pointer to this socket's V.
        let value = unsafe { bpf_sk_storage_get(self.as_ptr(), sk.cast(), ptr::null_mut(), 0) };
        (!value.is_null()).then(|| unsafe { *(value as *const V) })
    }

    /// Stores `value` on the socket; false when the kernel cannot allocate it.
    #[inline(always)]
    pub fn set(&self, sk: *mut bpf_sock, value: &V) -> bool {
        // SAFETY: as in `of`; with F_CREATE the helper allocates a zeroed V if there is none.
        let slot = unsafe {
            bpf_sk_storage_get(
                self.as_ptr(),
                sk.cast(),
                ptr::null_mut(),
                BPF_SK_STORAGE_GET_F_CREATE,
            )
        } as *mut V;
        if slot.is_null() {
            return false;
        }
        // SAFETY: non-null slot of type V owned by this socket.
        unsafe { *slot = *value };
        true
    }
}

/// Per-pod maps are written by the agent only, a few times per pod: allocated per entry, so a
/// node pays for the pods it has, not for the most it could have.
type HashMap<K, V, const N: usize> = Map<K, V, BPF_MAP_TYPE_HASH, N, BPF_F_NO_PREALLOC>;
type PerCpuHashMap<K, V, const N: usize> =
    Map<K, V, BPF_MAP_TYPE_PERCPU_HASH, N, BPF_F_NO_PREALLOC>;
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
pub static POD_IPS: HashMap<IpKey, u64, { MAX_PODS * 4 }> = Map::new();

#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static POD_COUNTERS: PerCpuHashMap<u64, PodCounters, MAX_PODS> = Map::new();

/// Original destination of each redirected socket, stored on the socket itself: it lives
/// exactly as long as the connection (getpeername and recvmsg need it until the end).
#[unsafe(link_section = ".maps")]
#[unsafe(no_mangle)]
pub static SOCKET_ORIG_DST: SocketStorage<Endpoint> = Map::new();

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
