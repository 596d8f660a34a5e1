//! The kernel, and weir's objects in it that are not one pod's: what the running kernel
//! supports, the programs and their links, the filesystems they are pinned and attached on, the
//! maps of the connected ztunnels, and the sockets weir reaches a network namespace through.
//!
//! - `support.rs`: the kernel floor, its version, the program and map types weir loads.
//! - `programs.rs`: loading the object, attaching the cgroup and tc programs.
//! - `bpf_sys.rs`: the bpf syscalls aya does not offer.
//! - `mounts.rs`: bpffs and the cgroup v2 hierarchy.
//! - `handoff.rs`: the socket lookup hand-off on kernels before 6.5.
//! - `ztunnels.rs`: the connected ztunnels' cgroups and listeners.
//! - `netns.rs`: entering a network namespace, and what weir reads and sets in one.
//! - `netlink/`: the rtnetlink client.
//! - `connections.rs`: the netns's established TCP connections (sock_diag).
//! - `nftables.rs`: the nf_tables, ipset and conntrack client (another agent's netfilter objects).
//! - `xtables.rs`: the legacy iptables tables (another agent's rules iptables-legacy wrote).
pub(in crate::datapath) mod bpf_sys;
pub(in crate::datapath) mod connections;
pub(in crate::datapath) mod handoff;
pub(crate) mod mounts;
pub mod netlink;
pub mod netns;
pub(in crate::datapath) mod nftables;
pub(in crate::datapath) mod programs;
pub(crate) mod support;
pub(in crate::datapath) mod xtables;
pub(in crate::datapath) mod ztunnels;
