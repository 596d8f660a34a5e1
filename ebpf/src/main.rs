//! weir's kernel side: every decision about an enrolled pod's traffic is made here.
//!
//! - [`outbound`]: cgroup `connect`/`sendmsg` send the app's TCP to ztunnel's 15001 and its DNS to
//!   15053; `getpeername`/`recvmsg` show the app the addresses it asked for. Also the node side:
//!   TCP from the node's own netns to an enrolled pod (kubelet probes) gets the probe source.
//! - [`original_dst`]: `sockops` remembers each redirected connection's original destination under
//!   the 4-tuple ztunnel's accepted socket sees; `getsockopt` answers `SO_ORIGINAL_DST` from it.
//! - [`inbound`]: tc ingress on the pod's interfaces hands new inbound connections to ztunnel's
//!   15006 listener with `bpf_sk_assign` (TPROXY semantics: the local address stays the original).
//! - [`handoff`]: the same hand-over through the socket lookup, on kernels before 6.5.
//! - [`reroute_nat`]: a REDIRECT-mode sidecar pod's rerouted interfaces, whose connections are
//!   translated to its proxy's 15001 and back.
//! - [`sidecar`]: the same hooks' decisions for a sidecar pod, whose traffic goes to its own
//!   istio-proxy (istio-cni's sidecar rules) instead of ztunnel.
//!
//! Every program is keyed on enrolled pods (their netns cookie, or their IPs on the wire) and lets
//! everything else through untouched: the cgroup programs are attached at the root cgroup and see
//! every socket on the node.
// Built for the host too (`cargo test` in ebpf/): the pure helpers have unit tests there.
#![cfg_attr(not(test), no_std)]
#![cfg_attr(not(test), no_main)]

mod diag;
mod maps;
mod net;
mod trace;

mod handoff;
mod in_pod;
mod inbound;
mod original_dst;
mod outbound;
mod reroute_nat;
mod sidecar;
mod ztunnel;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
