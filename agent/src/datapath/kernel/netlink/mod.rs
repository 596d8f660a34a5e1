//! A tiny synchronous rtnetlink client for the few routing and tc objects weir owns.
//!
//! An [`Rtnl`] is one `NETLINK_ROUTE` socket, and a netlink socket acts on the network namespace
//! of the thread that created it: made on the datapath thread after [`super::netns::enter`], it
//! changes the pod's namespace, not the node's. An enrollment makes one and does everything
//! through it: the netns cookie, one link and one address dump, then one datagram for the return
//! path and one for the tc objects (see [`Rtnl::attach_programs`]), since round trips and sockets
//! are much of a pod's enrollment time. The kernel handles every request of a datagram, in
//! order, even after an earlier one failed.
//!
//! Everything is idempotent: adds use `NLM_F_EXCL`, so an object already there is reported as
//! `EEXIST` (this is what makes a rerun not duplicate a rule: without `NLM_F_EXCL` the kernel
//! happily adds the same rule twice), and deleting what is not there is success too.
//!
//! - `transport`: the socket, its datagrams, dumps and acknowledgements.
//! - `objects`: the rules, routes, addresses and tc objects weir adds, as netlink messages.
//! - `errno`: which answers mean an object is already as wanted, or its family is off.
//! - `pod_state`: what a pod's namespace holds: its interfaces and addresses, its routes and
//!   rules, and whether weir's filter and return path are still in place.
//! - `pod_changes`: what changes it: the return path, programs, rerouting rules, teardown.
//! - `probe_source`: the node's probe source address.
//! - `changes`: the subscription to every namespace's link and address changes.
mod changes;
mod errno;
mod objects;
mod pod_changes;
mod pod_state;
mod probe_source;
mod transport;

pub use changes::{follow_route_changes, recv_change, subscribe_interface_changes, Change};
pub use objects::TcProgram;
pub use pod_changes::{PodSetup, Reroute, ReturnPath};
pub use pod_state::{
    non_loopback_addresses, non_loopback_interfaces, reroute_rules, Link, WeirFilter,
};
pub use probe_source::{install_probe_source, remove_probe_source};
pub use transport::Rtnl;

#[cfg(test)]
mod tests;
