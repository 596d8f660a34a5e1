//! The maps shared with userspace; layouts come from `weir-common`.
//!
//! They are BTF-defined (the `.maps` section, libbpf's convention) rather than legacy `maps`
//! entries, so the kernel knows their key and value types and `bpftool map dump` shows every
//! entry field by field. All are pinned by name: a restarted agent finds the same state, and the
//! programs keep working while it is away.
use core::{ffi::c_void, ptr};

use aya_ebpf::{
    bindings::{bpf_sock, BPF_ANY, BPF_F_NO_PREALLOC},
    btf_maps::{
        lpm_trie::Key, Array, HashMap, HashOfMaps, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap,
    },
    helpers::generated::{
        bpf_map_delete_elem, bpf_map_lookup_elem, bpf_map_update_elem, bpf_sk_storage_get,
    },
    macros::btf_map,
};
use weir_common::{
    list, ConnectionKey, Endpoint, HandoffSlot, IpKey, NatEntry, NodeConfig, PodConfig,
    PodCounters, PortKey, RangeKey, HANDOFF_SLOTS, REROUTE_NAT_ENTRIES,
};

use crate::net::{is_v4_mapped, same_ip};

const BPF_SK_STORAGE_GET_F_CREATE: u64 = 1;
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

const MAX_PODS: usize = weir_common::MAX_PODS as usize;
/// Sidecar pods' list entries, node-wide: room for every pod at its full share (the agent
/// refuses a pod whose lists are larger), so that no pod's lists crowd out another's.
const MAX_SIDECAR_PORTS: usize = list::PORT_ENTRIES as usize;
const MAX_SIDECAR_RANGES: usize = list::RANGE_ENTRIES as usize;
/// Redirected connections between the app's connect and ztunnel's SO_ORIGINAL_DST question (a
/// few milliseconds; entries are removed once answered). LRU, so entries ztunnel never asked
/// about (connections that died first) are recycled.
const MAX_CONNECTIONS: usize = 65_536;
/// ztunnels connected at once: one, two while one replaces another.
const MAX_ZTUNNELS: usize = 8;
/// The most CPUs a node has: distribution kernels' `NR_CPUS`.
const MAX_CPUS: usize = 8_192;

/// Socket storage, hand-written: aya-ebpf 0.2's `SkStorage` takes only a sock_addr context, and
/// the sockops program reads the storage of the `bpf_sock` it is given. A BTF map definition
/// (each field's *type* carries one attribute; the loader reads them from BTF).
#[repr(C)]
pub struct SocketStorage<V> {
    r#type: *const [i32; 24], // BPF_MAP_TYPE_SK_STORAGE
    key: *const i32,
    value: *const V,
    max_entries: *const [i32; 0],
    /// Socket storage must be allocated per socket.
    map_flags: *const [i32; NO_PREALLOC],
}

// SAFETY: the definition is never read or written from Rust; the kernel owns the map.
unsafe impl<V> Sync for SocketStorage<V> {}

impl<V: Copy> SocketStorage<V> {
    pub const fn new() -> Self {
        Self {
            r#type: ptr::null(),
            key: ptr::null(),
            value: ptr::null(),
            max_entries: ptr::null(),
            map_flags: ptr::null(),
        }
    }

    #[inline(always)]
    fn as_ptr(&self) -> *mut c_void {
        self as *const Self as *mut c_void
    }

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

/// A SOCKHASH, hand-written for the same reason: aya-ebpf 0.2 has no BTF definition of it. The
/// value is a socket; programs store and take sockets, the agent never touches it.
#[repr(C)]
pub struct SocketHash<K, const MAX: usize> {
    r#type: *const [i32; 18], // BPF_MAP_TYPE_SOCKHASH
    key: *const K,
    value: *const u32, // a socket fd from userspace, as aya's `SockHash` reads it
    max_entries: *const [i32; MAX],
}

// SAFETY: as for SocketStorage.
unsafe impl<K, const MAX: usize> Sync for SocketHash<K, MAX> {}

impl<K, const MAX: usize> SocketHash<K, MAX> {
    pub const fn new() -> Self {
        Self {
            r#type: ptr::null(),
            key: ptr::null(),
            value: ptr::null(),
            max_entries: ptr::null(),
        }
    }

    #[inline(always)]
    fn as_ptr(&self) -> *mut c_void {
        self as *const Self as *mut c_void
    }

    /// Stores the socket (a full socket: a listener from a lookup) under `key`.
    #[inline(always)]
    pub fn insert(&self, key: &K, sk: *mut bpf_sock) -> bool {
        // SAFETY: `key` is on the stack; the kernel checks `sk` is a socket pointer.
        unsafe {
            bpf_map_update_elem(
                self.as_ptr(),
                key as *const K as *const c_void,
                sk as *const c_void,
                BPF_ANY as u64,
            ) == 0
        }
    }

    /// The socket under `key`, with a reference the caller must release, or null.
    #[inline(always)]
    pub fn get(&self, key: &K) -> *mut bpf_sock {
        // SAFETY: `key` is on the stack; a SOCKHASH lookup returns a referenced socket or null.
        unsafe { bpf_map_lookup_elem(self.as_ptr(), key as *const K as *const c_void) }.cast()
    }

    #[inline(always)]
    pub fn remove(&self, key: &K) {
        // SAFETY: `key` is on the stack.
        unsafe { bpf_map_delete_elem(self.as_ptr(), key as *const K as *const c_void) };
    }
}

// Per-pod maps are written by the agent only, a few times per pod: allocated per entry, so a
// node pays for the pods it has, not for the most it could have. The agent pins every map by
// name (aya-ebpf's BTF definitions carry no pinning attribute).

/// Enrolled pods by network namespace cookie.
#[btf_map]
static PODS: HashMap<u64, PodConfig, MAX_PODS, NO_PREALLOC> = HashMap::new();

/// Enrolled pods' addresses (v4-mapped for IPv4; link-local ones too) to their netns cookie: how
/// sockets on the node find the pod they connect to.
#[btf_map]
static POD_IPS: HashMap<IpKey, u64, { MAX_PODS * 4 }, NO_PREALLOC> = HashMap::new();

/// Enrolled pods' slots (the classid of weir's filters on their interfaces, `skb->tc_classid`)
/// to their netns cookie: how the inbound program knows whose interface it runs on, whatever
/// address a packet is for.
#[btf_map]
static POD_SLOTS: HashMap<u32, u64, MAX_PODS, NO_PREALLOC> = HashMap::new();

#[btf_map]
static POD_COUNTERS: PerCpuHashMap<u64, PodCounters, MAX_PODS, NO_PREALLOC> = PerCpuHashMap::new();

/// Original destination of each redirected socket, stored on the socket itself: it lives
/// exactly as long as the connection (getpeername and recvmsg need it until the end).
#[btf_map]
pub static SOCKET_ORIG_DST: SocketStorage<Endpoint> = SocketStorage::new();

/// Original destination of each redirected TCP connection, by the tuple ztunnel's side sees.
#[btf_map]
pub static CONN_ORIG_DST: LruHashMap<ConnectionKey, Endpoint, MAX_CONNECTIONS> = LruHashMap::new();

/// One REDIRECT-mode sidecar pod's translated connections, both ways: `(client, original)` to
/// the proxy's endpoint and `(client, proxy)` to the original ([`crate::reroute_nat`]). At its
/// bound a new SYN's entries take the place of the pod's least recently used ones: the
/// connection that had them breaks (what its VM sends is delivered locally and answered with a
/// reset, never let around the proxy), and no other pod's is touched. A SYN whose entries cannot be made at
/// all (no map yet, no memory) is dropped, counted in the pod's `dropped` and traced.
pub type PodTranslations = LruHashMap<ConnectionKey, NatEntry, { REROUTE_NAT_ENTRIES as usize }>;

/// Each REDIRECT-mode sidecar pod's own [`PodTranslations`], by netns cookie: the agent makes
/// a pod's map before it attaches the translating programs, and drops it with the pod. A map
/// per pod, because every KubeVirt VM has the same address: a VM's tuples are another pod's VM's
/// too, and in a map of the node one pod's VM would find (or push out) another's translations.
#[btf_map]
static REROUTE_NAT: HashOfMaps<u64, PodTranslations, MAX_PODS, NO_PREALLOC> = HashOfMaps::new();

/// A connection's translation in both directions, built where [`crate::reroute_nat`] needs it:
/// on the stack its keys would take the program past the 512 bytes it may have.
#[repr(C)]
pub struct Translation {
    /// `(client, original destination)`.
    pub forward: ConnectionKey,
    /// `(client, proxy)`.
    pub reverse: ConnectionKey,
}

/// Each CPU's [`Translation`] under construction; not pinned: nothing outlives a program run.
#[btf_map]
pub static NAT_SCRATCH: PerCpuArray<Translation, 1> = PerCpuArray::new();

/// Sidecar pods' port lists: present means listed.
#[btf_map]
static SIDECAR_PORTS: HashMap<PortKey, u8, MAX_SIDECAR_PORTS, NO_PREALLOC> = HashMap::new();

/// Sidecar pods' IP range lists: a lookup matches when a range of the pod's list holds the
/// address.
#[btf_map]
static SIDECAR_RANGES: LpmTrie<RangeKey, u8, MAX_SIDECAR_RANGES> = LpmTrie::new();

#[btf_map]
static NODE_CONFIG: Array<NodeConfig, 1> = Array::new();

/// ztunnel's listeners for the new connections tc is handing over through the socket lookup
/// (kernels before 6.5), under [`HandoffSlot::key`]: tc and the socket lookup of one SYN run on
/// the same CPU in one softirq pass, so only that CPU's slots need searching. A slot is taken
/// again once its SYN was looked up, or once it is stale (the kernel dropped the SYN after tc:
/// wrong MAC, bad checksum, an option it refuses), so such SYNs cannot pile up. Slots' keys
/// repeat, so the map holds at most `HANDOFF_SLOTS` listeners per CPU.
#[btf_map]
pub static HANDOFF: SocketHash<u32, { MAX_CPUS * HANDOFF_SLOTS as usize }> = SocketHash::new();

/// The connection each of a CPU's `HANDOFF` listeners is for.
#[btf_map]
pub static HANDOFF_CONNS: PerCpuArray<HandoffSlot, { HANDOFF_SLOTS as usize }> = PerCpuArray::new();

/// The cgroups of the connected ztunnels, as the agent saw them connect (see [`crate::ztunnel`]):
/// a few, more only while ztunnels overlap (an upgrade).
#[btf_map]
static ZTUNNEL_CGROUPS: HashMap<u64, u8, MAX_ZTUNNELS> = HashMap::new();

/// Whether a connected ztunnel's sockets are in cgroup `cgroup`.
#[inline(always)]
pub fn is_ztunnels_cgroup(cgroup: u64) -> bool {
    // SAFETY: only whether an entry exists is read, never the entry.
    unsafe { ZTUNNEL_CGROUPS.get(cgroup).is_some() }
}

/// The sockets ztunnel bound to its listening ports in ambient pods (the value unused): written
/// by the bind hook for ztunnel's cgroup, and by the agent for listeners ztunnel bound before
/// (see [`crate::ztunnel`]). tc cannot read a socket's cgroup, but can read this.
#[btf_map]
pub static ZTUNNEL_LISTENS: SocketStorage<u8> = SocketStorage::new();

/// The netns cookie the connect hook read for the agent's question on this socket (kernels
/// before 5.14, which have no `SO_NETNS_COOKIE`).
#[btf_map]
pub static NETNS_COOKIES: SocketStorage<u64> = SocketStorage::new();

// The agent replaces hash map values whole (a new element; the old one is freed after an RCU
// grace period), so a reference into a map stays valid for the program's run.

/// The enrolled pod whose netns cookie this is.
#[inline(always)]
pub fn pod(netns_cookie: u64) -> Option<&'static PodConfig> {
    // SAFETY: see above.
    unsafe { PODS.get(netns_cookie) }
}

/// The netns cookie of the enrolled pod that has this address.
#[inline(always)]
pub fn pod_with_ip(ip: &IpKey) -> Option<u64> {
    // SAFETY: see above.
    unsafe { POD_IPS.get(ip).copied() }
}

/// The netns cookie of the enrolled pod given this slot.
#[inline(always)]
pub fn pod_in_slot(slot: u32) -> Option<u64> {
    // SAFETY: see above.
    unsafe { POD_SLOTS.get(slot).copied() }
}

/// The translations of the pod whose netns cookie this is, once the agent has made its map.
#[inline(always)]
pub fn translations(netns_cookie: u64) -> Option<&'static PodTranslations> {
    // SAFETY: the agent inserts and removes whole maps, never changes one in place; the kernel
    // keeps a map it removes alive until the programs using it have run.
    unsafe { REROUTE_NAT.get(&netns_cookie) }
}

/// The original destination ztunnel's side of a redirected connection asks for.
#[inline(always)]
pub fn original_destination(connection: &ConnectionKey) -> Option<Endpoint> {
    // SAFETY: see above.
    unsafe { CONN_ORIG_DST.get(connection).copied() }
}

/// The node's settings: its netns cookie (zero when the probe bypass is off) and the probe
/// source. All zero until the agent writes them.
#[inline(always)]
pub fn node_config() -> Option<&'static NodeConfig> {
    NODE_CONFIG.get(0)
}

/// Whether `ip` is the probe source address of its family (never while the bypass is off).
#[inline(always)]
pub fn is_probe_source(ip: &IpKey) -> bool {
    node_config().is_some_and(|node| {
        node.host_netns_cookie != 0
            && (same_ip(ip, &IpKey::from_v4(node.probe_source_v4))
                || same_ip(ip, &IpKey::from_v6(node.probe_source_v6)))
    })
}

/// Bumps one of a pod's per-CPU counters.
#[inline(always)]
pub fn count(netns_cookie: u64, field: impl FnOnce(&mut PodCounters) -> &mut u64) {
    if let Some(counters) = POD_COUNTERS.get_ptr_mut(netns_cookie) {
        // SAFETY: per-CPU value, only this CPU writes it while this program runs.
        unsafe { *field(&mut *counters) += 1 };
    }
}

/// Whether `port` is in the sidecar pod's `list` (a `weir_common::list` value).
#[inline(always)]
pub fn port_listed(netns_cookie: u64, list: u8, port: u16) -> bool {
    let key = PortKey::new(netns_cookie, list, port);
    // SAFETY: the value is only tested for presence.
    unsafe { SIDECAR_PORTS.get(key).is_some() }
}

/// The value of the longest range of the sidecar pod's `list` that holds `ip`, among the ranges
/// of `ip`'s family: an IPv4-mapped address is IPv4, as the packet will be.
#[inline(always)]
fn range_value(netns_cookie: u64, list: u8, ip: &IpKey) -> Option<u8> {
    let key = Key::new(
        RangeKey::FULL_BITS,
        RangeKey::range(netns_cookie, list, *ip, !is_v4_mapped(ip)),
    );
    SIDECAR_RANGES.get(&key).copied()
}

/// Whether a range in the sidecar pod's `list` holds `ip`.
#[inline(always)]
pub fn range_listed(netns_cookie: u64, list: u8, ip: &IpKey) -> bool {
    range_value(netns_cookie, list, ip).is_some()
}

/// Whether the pod's route to `ip` leaves by one of its excluded interfaces.
#[inline(always)]
pub fn routed_out_of_excluded(netns_cookie: u64, ip: &IpKey) -> bool {
    range_value(netns_cookie, list::ROUTES, ip) == Some(list::ROUTE_EXCLUDED)
}
