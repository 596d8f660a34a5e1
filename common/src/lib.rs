//! The ABI between weir's eBPF programs and its userspace.
//!
//! Every map key and value both sides read is defined here, once, `#[repr(C)]` with explicit
//! padding (hash keys must not contain uninitialised bytes). A layout change is one edit here and a
//! bump of [`ABI_VERSION`]: maps are pinned under a directory named after the version, so an agent
//! with a new layout never reads maps written with an old one.
#![no_std]

/// Version of the map layouts below; part of the pin path (`<pin root>/abi-<N>`).
pub const ABI_VERSION: u32 = 9;

/// ztunnel marks every socket it opens inside a pod with this `SO_MARK`...
pub const ZTUNNEL_MARK: u32 = 0x539;
/// ...and istio matches it under this mask.
pub const ZTUNNEL_MARK_MASK: u32 = 0xfff;
/// Set on ztunnel's source-preserving dials to its own pod. With `tcp_fwmark_accept` the app's
/// accepted socket inherits it, and a policy rule on this bit routes the app's replies back to
/// ztunnel's transparent socket (istio's connmark 0x111 + table 100, without conntrack). A bit of
/// its own: a rule on 0x539 itself would catch ztunnel's outbound dials too.
pub const RETURN_MARK: u32 = 0x1000;
/// The policy routing table holding `local 0.0.0.0/0 dev lo` (and `::/0`) inside enrolled pods.
pub const RETURN_ROUTE_TABLE: u32 = 100;

/// The highest slot a pod is given. weir's tc filters on a pod's interfaces carry the pod's slot
/// as their classid, which the kernel hands the program in `skb->tc_classid` (16 bits): the
/// attachment, not a packet's destination address, tells the inbound program whose interface it
/// runs on. Below the tc hooks' own minors (0xfff2, 0xfff3), and above the most pods a node
/// can enroll, with room for a pod that holds two slots for a moment (a sandbox recreated).
pub const MAX_POD_SLOT: u32 = 0x7fff;

/// ztunnel's in-pod listeners.
pub const OUTBOUND_PORT: u16 = 15001;
pub const INBOUND_PORT: u16 = 15006;
pub const HBONE_PORT: u16 = 15008;
pub const DNS_PROXY_PORT: u16 = 15053;
pub const DNS_PORT: u16 = 53;

/// Where a sidecar's Envoy makes its inbound passthrough connections to the app from
/// (`127.0.0.6`, `::6`): never redirected.
pub const PASSTHROUGH_SOURCE_V4: [u8; 4] = [127, 0, 0, 6];
pub const PASSTHROUGH_SOURCE_V6: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6];

/// Source address of node-local TCP to enrolled pods (kubelet probes), by default (istio's
/// `HOST_PROBE_SNAT_IP`); the pod lets it through. Also the address of the agent's netns-cookie
/// question, whatever the probe source is.
pub const PROBE_SOURCE_V4: [u8; 4] = [169, 254, 7, 127];
/// fd16:9254:7127:1337:ffff:ffff:ffff:ffff, by default (istio's `HOST_PROBE_SNAT_IPV6`).
pub const PROBE_SOURCE_V6: [u8; 16] = [
    0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
];

/// An IP address in 16 bytes; IPv4 is stored IPv4-mapped (`::ffff:a.b.c.d`) so that v4, v6 and
/// v4-mapped sockets share one key shape.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IpKey {
    pub octets: [u8; 16],
}

impl IpKey {
    pub const fn from_v4(v4: [u8; 4]) -> Self {
        Self {
            octets: [
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, v4[0], v4[1], v4[2], v4[3],
            ],
        }
    }

    pub const fn from_v6(octets: [u8; 16]) -> Self {
        Self { octets }
    }

    /// The IPv4 address when this is an IPv4-mapped key.
    pub fn v4(&self) -> Option<[u8; 4]> {
        let o = &self.octets;
        let mapped = o[..10].iter().all(|b| *b == 0) && o[10] == 0xff && o[11] == 0xff;
        mapped.then(|| [o[12], o[13], o[14], o[15]])
    }
}

/// An IP address and a port (host byte order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub ip: IpKey,
    pub port: u16,
    pub _pad: u16,
}

impl Endpoint {
    pub const fn new(ip: IpKey, port: u16) -> Self {
        Self { ip, port, _pad: 0 }
    }
}

/// A redirected TCP connection as ztunnel's accepted socket sees it: the app's address and the
/// listener's. Pod IPs are unique on a node, so no netns is needed to make this key unique.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnectionKey {
    pub client: Endpoint,
    pub listener: Endpoint,
}

/// Slots each CPU has for connections tc is handing to ztunnel through the socket lookup
/// (kernels before 6.5): a receive batch runs tc for each of its packets before any socket
/// lookup, so each SYN of a batch needs a slot of its own. Batches hold 8 packets by default
/// (`net.core.gro_normal_batch`), and a NAPI poll at most 64.
pub const HANDOFF_SLOTS: u32 = 64;
/// A hand-off slot whose SYN's socket lookup has not come after this long never will (the
/// kernel dropped the SYN between tc and the lookup): its slot may be taken again. A batch's tc
/// runs take microseconds; a slot is never taken again while its SYN's lookup can still come.
pub const HANDOFF_STALE_NS: u64 = 10_000_000;

/// One CPU's hand-off slot (`HANDOFF_CONNS`): the connection whose listener is in
/// `HANDOFF` under the CPU's and slot's key, and when tc stored it (zero: free).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandoffSlot {
    pub connection: ConnectionKey,
    pub stored_ns: u64,
}

impl HandoffSlot {
    /// The `HANDOFF` key of slot `slot` of CPU `cpu`.
    pub const fn key(cpu: u32, slot: u32) -> u32 {
        cpu * HANDOFF_SLOTS + slot
    }
}

/// The most pods one node's maps hold.
pub const MAX_PODS: u32 = 16_384;

/// The most entries a REDIRECT-mode sidecar pod's translation map (its `REROUTE_NAT` map) holds:
/// two per connection, so 8,192 open connections of the VMs behind its rerouted interfaces.
pub const REROUTE_NAT_ENTRIES: u32 = 16_384;

/// One direction of a connection translated on a REDIRECT-mode sidecar pod's rerouted interface,
/// in the pod's own translation map under the tuple that direction's packets carry: the VM's
/// `(client, original destination)`, or the proxy's `(client, proxy)`. Each field has one
/// writer, this direction's program or the other's, so neither overwrites the other's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatEntry {
    /// The other end these packets are given: the proxy's endpoint, or the original destination.
    pub to: Endpoint,
    /// The acknowledgment number that acknowledges the other direction's FIN, once `peer_fin`.
    pub peer_fin_ack: u32,
    /// Non-zero once the other direction's FIN has passed (its program sets it).
    pub peer_fin: u8,
    /// Non-zero once this direction has acknowledged the other's FIN.
    pub peer_fin_acked: u8,
    pub _pad: [u8; 2],
}

impl NatEntry {
    pub const fn new(to: Endpoint) -> Self {
        Self {
            to,
            peer_fin_ack: 0,
            peer_fin: 0,
            peer_fin_acked: 0,
            _pad: [0; 2],
        }
    }
}

/// `PodConfig::flags` bits.
pub const POD_HAS_IPV4: u32 = 1 << 0;
pub const POD_HAS_IPV6: u32 = 1 << 1;
/// `ambient.istio.io/bypass-inbound-capture=true`.
pub const POD_INBOUND_BYPASS: u32 = 1 << 2;
/// DNS capture on (the node default, `ambient.istio.io/dns-capture` overrides).
pub const POD_DNS_CAPTURE: u32 = 1 << 3;
/// The pod's netns has the hand-off program attached: on kernels before 6.5, where tc cannot
/// `bpf_sk_assign` a packet to ztunnel's reuseport listener, inbound hands new connections to it
/// through the socket lookup instead. Without it such a connection is dropped, never delivered.
pub const POD_SOCKET_LOOKUP_HANDOFF: u32 = 1 << 4;
/// A sidecar pod: its traffic goes to its own istio-proxy as istio-cni's sidecar rules send it,
/// and the flags below and the `SIDECAR_PORTS` and `SIDECAR_RANGES` entries say how.
pub const POD_SIDECAR: u32 = 1 << 5;
/// Sidecar: IPv6 is captured (istio installs its ip6tables rules); otherwise IPv6 passes.
pub const POD_SIDECAR_IPV6: u32 = 1 << 6;
/// Sidecar: every inbound TCP port but the excluded ones is captured (`includeInboundPorts: *`);
/// otherwise only the included ones.
pub const POD_INBOUND_ALL_PORTS: u32 = 1 << 7;
/// Sidecar: every outbound destination is captured (`includeOutboundIPRanges: *`); otherwise
/// only the included ranges.
pub const POD_OUTBOUND_ALL_RANGES: u32 = 1 << 8;
/// Sidecar: an included range holds a loopback address, so the app's loopback traffic is not
/// let through outright (istio drops its `-o lo` RETURN rule).
pub const POD_LOOPBACK_INCLUDED: u32 = 1 << 9;
/// Sidecar in TPROXY mode: inbound 15008 is captured like any port.
pub const POD_TPROXY: u32 = 1 << 10;
/// Sidecar with `excludeInterfaces`: its routes are in its `ROUTES` list, and nothing routed out
/// of an excluded interface is captured.
pub const POD_EXCLUDED_INTERFACES: u32 = 1 << 11;

/// UDP port of the netns cookie question: on kernels before 5.14 (no `SO_NETNS_COOKIE`) the agent
/// connects a UDP socket in a netns to the probe source address on this port, and the connect
/// hook stores the netns cookie on the socket (`NETNS_COOKIES`) and refuses the connect.
pub const NETNS_COOKIE_PORT: u16 = 1;

/// Length of the pod uid field; a Kubernetes uid is 36 bytes.
pub const POD_UID_LEN: usize = 40;

/// One enrolled pod, keyed by its network namespace cookie in the `PODS` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodConfig {
    pub flags: u32,
    pub ipv4: [u8; 4],
    pub ipv6: [u8; 16],
    /// metadata.uid, NUL-padded: lets a restarted agent (and `bpftool`) tell which pod this is.
    pub uid: [u8; POD_UID_LEN],
    /// A sidecar pod's proxy identity: sockets of this uid or gid are never redirected outbound
    /// (istio's `--uid-owner`/`--gid-owner`). Zero for ambient pods.
    pub proxy_uid: u32,
    pub proxy_gid: u32,
}

impl PodConfig {
    pub const fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }
}

/// Which of a sidecar pod's lists a `SIDECAR_PORTS` or `SIDECAR_RANGES` entry is in.
pub mod list {
    /// The most sidecar pods the node-wide list maps (`SIDECAR_PORTS`, `SIDECAR_RANGES`) hold
    /// at once at their full share: far more than a node runs (kubelet's default is 110 pods),
    /// so that no pod, and no namespace of pods, can take the room another pod's lists need.
    pub const PODS_AT_FULL_SHARE: u32 = 1_024;
    /// A pod's full share of `SIDECAR_PORTS`: its four port lists together.
    pub const PORTS_PER_POD: u32 = 128;
    /// A pod's full share of `SIDECAR_RANGES`: its two range lists and its routes together.
    pub const RANGES_PER_POD: u32 = 256;
    /// `SIDECAR_PORTS`'s size: 2 MiB of hash buckets, entries allocated as they are added.
    pub const PORT_ENTRIES: u32 = PODS_AT_FULL_SHARE * PORTS_PER_POD;
    /// `SIDECAR_RANGES`'s size (an LPM trie allocates per entry, never up front).
    pub const RANGE_ENTRIES: u32 = PODS_AT_FULL_SHARE * RANGES_PER_POD;

    pub const INBOUND_INCLUDE: u8 = 1;
    pub const INBOUND_EXCLUDE: u8 = 2;
    pub const OUTBOUND_INCLUDE: u8 = 3;
    pub const OUTBOUND_EXCLUDE: u8 = 4;
    /// The pod's main routing table: each route's destination, with the value
    /// [`ROUTE_EXCLUDED`] when it leaves by an excluded interface, else 1. The longest prefix
    /// holding an address is the route the kernel takes to it (policy rules aside).
    pub const ROUTES: u8 = 5;
    pub const ROUTE_EXCLUDED: u8 = 2;
}

/// A port in one of a sidecar pod's port lists (`SIDECAR_PORTS`, value `u8` 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortKey {
    pub netns_cookie: u64,
    pub port: u16,
    /// A [`list`] value.
    pub list: u8,
    pub _pad: [u8; 5],
}

impl PortKey {
    pub const fn new(netns_cookie: u64, list: u8, port: u16) -> Self {
        Self {
            netns_cookie,
            port,
            list,
            _pad: [0; 5],
        }
    }
}

/// The data of a `SIDECAR_RANGES` LPM trie key (after its prefix length): a pod's list and an
/// address family, then the address. A range of prefix `p` is stored with prefix length
/// [`RangeKey::BITS_BEFORE_IP`] plus `p` (plus 96 for IPv4, stored IPv4-mapped); a lookup uses
/// [`RangeKey::FULL_BITS`].
///
/// The family is part of the key, ahead of the address, so that an IPv6 range never holds an
/// IPv4 address, as istio keeps its iptables and ip6tables rules apart: `::/0` would otherwise
/// hold every IPv4-mapped address, and `excludeOutboundIPRanges: "::/0"` let the app's IPv4
/// around its sidecar.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RangeKey {
    /// The netns cookie's native-endian bytes: a byte array keeps the key free of padding.
    pub netns_cookie: [u8; 8],
    /// A [`list`] value, with [`RangeKey::IPV6`] for an IPv6 range or address, in a word so the
    /// address stays 4-byte aligned.
    pub list: u32,
    pub ip: IpKey,
}

impl RangeKey {
    pub const BITS_BEFORE_IP: u32 = 96;
    pub const FULL_BITS: u32 = Self::BITS_BEFORE_IP + 128;
    /// The family bit of [`RangeKey::list`].
    pub const IPV6: u32 = 1 << 8;

    /// The key of a range of `list`: `ip` is its network, IPv4-mapped for an IPv4 range; `v6`
    /// says which family the range was written in (an IPv6 range inside `::ffff:0:0/96` holds
    /// no IPv4 address, as no IPv6 packet carries one).
    pub const fn range(netns_cookie: u64, list: u8, ip: IpKey, v6: bool) -> Self {
        Self {
            netns_cookie: netns_cookie.to_ne_bytes(),
            list: list as u32 | if v6 { Self::IPV6 } else { 0 },
            ip,
        }
    }
}

/// Per-pod counters, one copy per CPU in the `POD_COUNTERS` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounters {
    /// TCP connects sent to ztunnel's outbound listener.
    pub outbound: u64,
    /// Inbound connections handed to ztunnel's inbound listener.
    pub inbound: u64,
    /// DNS queries (UDP sockets and TCP connects) sent to ztunnel's DNS proxy.
    pub dns: u64,
    /// Connections let through uncaptured: probes from the node, inbound bypass.
    pub bypassed: u64,
    /// Inbound packets dropped because they could not be steered to ztunnel: fragmented TCP for
    /// no connection, headers the program cannot walk, new connections while ztunnel is not
    /// listening.
    pub dropped: u64,
}

/// Node-wide settings, the single entry of the `NODE_CONFIG` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeConfig {
    /// Cookie of the node's own network namespace: TCP from there to an enrolled pod is a probe
    /// and gets the probe source. Zero turns the probe bypass off.
    pub host_netns_cookie: u64,
    /// When not zero, only sockets of this cgroup (v2 id: kubelet's) get the probe source.
    pub probe_cgroup: u64,
    /// The probe source addresses.
    pub probe_source_v6: [u8; 16],
    pub probe_source_v4: [u8; 4],
    pub _pad: [u8; 4],
}

/// One redirect decision, written to the `TRACE_EVENTS` ring buffer while tracing is on.
///
/// Addresses as the program saw them: for outbound, `destination` is the original destination
/// the app asked for and `target` where the call was sent; for inbound, `target` is ztunnel's
/// listener the connection was handed to. `target` is zero when the verdict sends nothing
/// anywhere (a pass or a drop).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceRecord {
    /// The enrolled pod's netns cookie; zero when the program cannot tell the pod (a rerouted
    /// interface, a frame dropped before its addresses were read).
    pub netns_cookie: u64,
    pub source: Endpoint,
    pub destination: Endpoint,
    pub target: Endpoint,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub protocol: u8,
    /// A [`TraceHook`].
    pub hook: u8,
    /// A [`TraceVerdict`].
    pub verdict: u8,
    pub _pad: u8,
}

/// Where a decision was made (`TraceRecord::hook`).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceHook {
    Connect = 1,
    Sendmsg = 2,
    TcIngress = 3,
    Reroute = 4,
    Getsockopt = 5,
}

/// What was decided (`TraceRecord::verdict`).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceVerdict {
    /// Sent to the outbound listener (15001): ztunnel's, or a sidecar's proxy.
    Outbound = 1,
    /// Handed to the inbound listener (15006).
    Inbound = 2,
    /// Sent to the DNS proxy (15053).
    Dns = 3,
    /// A kubelet probe from the node: bound to, or let in from, the probe source address.
    ProbeBypass = 4,
    /// Inbound let through: the pod's `ambient.istio.io/bypass-inbound-capture`.
    PassInboundBypass = 5,
    /// ztunnel's own socket.
    PassZtunnel = 6,
    /// To loopback or to the pod's own address.
    PassLocal = 7,
    /// HBONE (15008) to ztunnel's own listener.
    PassHbone = 8,
    /// Not captured: UDP other than DNS.
    PassUncaptured = 9,
    /// Dropped: a first fragment of a new connection, which ztunnel could never receive whole.
    DropFragment = 10,
    /// Dropped: headers the program cannot read or walk.
    DropUnparsable = 11,
    /// Dropped: more VLAN tags than the program walks.
    DropVlan = 12,
    /// Dropped: 15008 to a listener that is not ztunnel's.
    DropHboneNotZtunnel = 13,
    /// Dropped: ztunnel is not listening in the pod.
    DropNoZtunnel = 14,
    /// Dropped: a rerouted SYN whose tuple another connection holds, or whose translation its
    /// pod's map could not take.
    DropTupleTaken = 15,
    /// Refused: a connection to the probe source address.
    RefuseProbeAddress = 16,
    /// Refused: the pod has no CNI address of the destination's family.
    RefuseNoAddress = 17,
    /// Refused: no room on the socket to record its original destination.
    RefuseNoRoom = 18,
    /// `SO_ORIGINAL_DST` answered with `destination`.
    OriginalDst = 19,
    /// A sidecar's own proxy socket (its uid or gid), or its inbound passthrough (127.0.0.6).
    PassProxy = 20,
    /// Not captured by a sidecar pod's lists: an excluded port or range, or one not included.
    PassExcluded = 21,
    /// A sidecar's proxy to its own pod, sent to its inbound listener (15006).
    Hairpin = 22,
    /// Dropped: a sidecar pod's proxy is not listening (15006, or 15001 for a rerouted
    /// interface).
    DropNoProxy = 23,
}

impl TraceHook {
    pub const ALL: [Self; 5] = [
        Self::Connect,
        Self::Sendmsg,
        Self::TcIngress,
        Self::Reroute,
        Self::Getsockopt,
    ];

    pub fn from_u8(value: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|hook| *hook as u8 == value)
    }
}

impl TraceVerdict {
    pub const ALL: [Self; 23] = [
        Self::Outbound,
        Self::Inbound,
        Self::Dns,
        Self::ProbeBypass,
        Self::PassInboundBypass,
        Self::PassZtunnel,
        Self::PassLocal,
        Self::PassHbone,
        Self::PassUncaptured,
        Self::DropFragment,
        Self::DropUnparsable,
        Self::DropVlan,
        Self::DropHboneNotZtunnel,
        Self::DropNoZtunnel,
        Self::DropTupleTaken,
        Self::RefuseProbeAddress,
        Self::RefuseNoAddress,
        Self::RefuseNoRoom,
        Self::OriginalDst,
        Self::PassProxy,
        Self::PassExcluded,
        Self::Hairpin,
        Self::DropNoProxy,
    ];

    pub fn from_u8(value: u8) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|verdict| *verdict as u8 == value)
    }

    /// Whether the connection or packet was dropped (`Drop*`) or its connect refused
    /// (`Refuse*`): the verdicts counted node-wide in [`maps::DENIALS`].
    pub const fn denies(self) -> bool {
        matches!(
            self,
            Self::DropFragment
                | Self::DropUnparsable
                | Self::DropVlan
                | Self::DropHboneNotZtunnel
                | Self::DropNoZtunnel
                | Self::DropTupleTaken
                | Self::DropNoProxy
                | Self::RefuseProbeAddress
                | Self::RefuseNoAddress
                | Self::RefuseNoRoom
        )
    }
}

/// Entries of [`maps::DENIALS`]: one per verdict value, with room for verdicts to come.
pub const DENIAL_SLOTS: u32 = 32;

/// Map names, as pinned under `<pin root>/abi-<ABI_VERSION>/`.
pub mod maps {
    /// Keyed by the pod's netns cookie (`u64`) in every layout version, whatever its value: a
    /// newer agent retires an older layout by deleting the pods it migrated from it.
    pub const PODS: &str = "PODS";
    pub const POD_IPS: &str = "POD_IPS";
    /// An enrolled pod's slot (`u32`, see [`super::MAX_POD_SLOT`]) to its netns cookie (`u64`).
    pub const POD_SLOTS: &str = "POD_SLOTS";
    pub const POD_COUNTERS: &str = "POD_COUNTERS";
    pub const SOCKET_ORIG_DST: &str = "SOCKET_ORIG_DST";
    pub const CONN_ORIG_DST: &str = "CONN_ORIG_DST";
    pub const NODE_CONFIG: &str = "NODE_CONFIG";
    /// ztunnel's listeners tc is handing new connections to through the socket lookup, by
    /// [`super::HandoffSlot::key`].
    pub const HANDOFF: &str = "HANDOFF";
    /// Per-CPU array of [`super::HandoffSlot`]s: the connections `HANDOFF`'s listeners are for.
    pub const HANDOFF_CONNS: &str = "HANDOFF_CONNS";
    /// The cgroup (v2) ids of the connected ztunnels (`u64` to `u8`, the value unused): a socket
    /// is ztunnel's when it has ztunnel's mark and one of these.
    pub const ZTUNNEL_CGROUPS: &str = "ZTUNNEL_CGROUPS";
    /// Socket storage (`u8`, unused) on the sockets ztunnel bound to its listening ports in
    /// ambient pods: how tc tells ztunnel's listeners from a pod's.
    pub const ZTUNNEL_LISTENS: &str = "ZTUNNEL_LISTENS";
    /// The netns cookie the connect hook answered on a socket (`NETNS_COOKIE_PORT`).
    pub const NETNS_COOKIES: &str = "NETNS_COOKIES";
    /// `u32` at index 0: non-zero while a reader is tracing (`weir-agent trace`).
    pub const TRACE_ON: &str = "TRACE_ON";
    /// Ring buffer of [`super::TraceRecord`]s.
    pub const TRACE_EVENTS: &str = "TRACE_EVENTS";
    /// Per-CPU `u64` at index 0: records the ring buffer had no room for.
    pub const TRACE_LOST: &str = "TRACE_LOST";
    /// Per-CPU `u64` at a verdict's value ([`super::TraceVerdict::denies`]): the drops and
    /// refusals of every pod on the node, traced or not.
    pub const DENIALS: &str = "DENIALS";
    /// REDIRECT-mode sidecar pods' translated rerouted connections: a hash of maps, a pod's
    /// netns cookie (`u64`) to its own LRU map of [`super::ConnectionKey`] to
    /// [`super::NatEntry`], both ways, at most [`super::REROUTE_NAT_ENTRIES`].
    pub const REROUTE_NAT: &str = "REROUTE_NAT";
    /// Sidecar pods' port lists ([`super::PortKey`]).
    pub const SIDECAR_PORTS: &str = "SIDECAR_PORTS";
    /// Sidecar pods' IP range lists, an LPM trie of [`super::RangeKey`].
    pub const SIDECAR_RANGES: &str = "SIDECAR_RANGES";
    /// Every map, each pinned under its name.
    pub const ALL: [&str; 19] = [
        PODS,
        POD_IPS,
        POD_SLOTS,
        POD_COUNTERS,
        SOCKET_ORIG_DST,
        CONN_ORIG_DST,
        NODE_CONFIG,
        HANDOFF,
        HANDOFF_CONNS,
        ZTUNNEL_CGROUPS,
        ZTUNNEL_LISTENS,
        NETNS_COOKIES,
        TRACE_ON,
        TRACE_EVENTS,
        TRACE_LOST,
        DENIALS,
        SIDECAR_PORTS,
        SIDECAR_RANGES,
        REROUTE_NAT,
    ];
}

/// Global variables in the object file, set by the loader before the programs load.
pub mod globals {
    /// `u8`: non-zero turns on the programs' aya-log diagnostics (`weir-agent --bpf-log`).
    pub const LOG_ENABLED: &str = "LOG_ENABLED";
}

/// Program names in the object file.
pub mod programs {
    pub const CONNECT4: &str = "weir_connect4";
    pub const CONNECT6: &str = "weir_connect6";
    pub const SENDMSG4: &str = "weir_sendmsg4";
    pub const SENDMSG6: &str = "weir_sendmsg6";
    pub const RECVMSG4: &str = "weir_recvmsg4";
    pub const RECVMSG6: &str = "weir_recvmsg6";
    pub const GETPEERNAME4: &str = "weir_getpeername4";
    pub const GETPEERNAME6: &str = "weir_getpeername6";
    pub const BIND4: &str = "weir_bind4";
    pub const BIND6: &str = "weir_bind6";
    pub const SOCKOPS: &str = "weir_sockops";
    pub const GETSOCKOPT: &str = "weir_getsockopt";
    pub const INBOUND: &str = "weir_inbound";
    /// In place of `INBOUND` on interfaces without an Ethernet header.
    pub const INBOUND_L3: &str = "weir_inbound_l3";
    /// In place of `INBOUND` on a pod's `istio.io/reroute-virtual-interfaces`.
    pub const REROUTE: &str = "weir_reroute";
    /// In place of `REROUTE` for a sidecar pod in REDIRECT mode, with `NAT_OUT` on the same
    /// interfaces' egress.
    pub const NAT_IN: &str = "weir_nat_in";
    pub const NAT_OUT: &str = "weir_nat_out";
    /// Every tc program.
    pub const TC: [&str; 5] = [INBOUND, INBOUND_L3, REROUTE, NAT_IN, NAT_OUT];
    /// sk_lookup, attached to a pod's netns on kernels before 6.5.
    pub const HANDOFF: &str = "weir_handoff";
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain old data, `#[repr(C)]`, every byte pattern valid, padding explicit.
    unsafe impl aya::Pod for super::IpKey {}
    unsafe impl aya::Pod for super::Endpoint {}
    unsafe impl aya::Pod for super::ConnectionKey {}
    unsafe impl aya::Pod for super::NatEntry {}
    unsafe impl aya::Pod for super::PodConfig {}
    unsafe impl aya::Pod for super::PodCounters {}
    unsafe impl aya::Pod for super::NodeConfig {}
    unsafe impl aya::Pod for super::TraceRecord {}
    unsafe impl aya::Pod for super::PortKey {}
    unsafe impl aya::Pod for super::RangeKey {}
    unsafe impl aya::Pod for super::HandoffSlot {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel keeps 15 characters of a map's name: a longer one shows cut short in
    /// `bpftool map list`, unlike its pin.
    #[test]
    fn every_map_name_fits_the_kernels_15_characters() {
        for name in maps::ALL {
            assert!(name.len() <= 15, "{name} is {} characters", name.len());
        }
    }

    #[test]
    fn layouts_have_no_hidden_padding() {
        use core::mem::size_of;
        assert_eq!(size_of::<IpKey>(), 16);
        assert_eq!(size_of::<Endpoint>(), 20);
        assert_eq!(size_of::<ConnectionKey>(), 40);
        assert_eq!(size_of::<NatEntry>(), 20 + 4 + 1 + 1 + 2);
        assert_eq!(size_of::<PodConfig>(), 4 + 4 + 16 + POD_UID_LEN + 8);
        assert_eq!(size_of::<PortKey>(), 16);
        assert_eq!(size_of::<RangeKey>(), 28);
        assert_eq!(RangeKey::FULL_BITS as usize, 8 * size_of::<RangeKey>());
        assert_eq!(size_of::<PodCounters>(), 40);
        assert_eq!(size_of::<HandoffSlot>(), 48);
        assert_eq!(size_of::<TraceRecord>(), 8 + 3 * 20 + 4);
    }

    #[test]
    fn v4_keys_are_v4_mapped() {
        let key = IpKey::from_v4([10, 1, 2, 3]);
        assert_eq!(key.v4(), Some([10, 1, 2, 3]));
        assert_eq!(IpKey::from_v6(PROBE_SOURCE_V6).v4(), None);
    }
}
