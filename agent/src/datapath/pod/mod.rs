//! Enrolling a pod. [`Owner::enroll`](crate::datapath::owner::Owner::enroll), in `enroll.rs`, is
//! the one place a pod's redirection is put in place; unenrollment is beside it. The rest is what
//! it writes and reads for one pod.
//!
//! - `enroll.rs`: enrollment and unenrollment; `enroll_steps.rs`: the time each step takes.
//! - `config.rs`: the pod's `PODS` entry and addresses as map keys, and what makes a pod
//!   impossible to enroll.
//! - `slots.rs`: the pod's slot, which its tc filters carry.
//! - `sidecar_lists.rs`: a sidecar pod's port and range lists.
//! - `translations.rs`: a REDIRECT-mode sidecar pod's translation map.
//! - `userns.rs`: the proxy's ids in a pod with a user namespace of its own.
//! - `netns_setup.rs`: what enrollment puts in the pod's netns besides map entries.
//! - `interface_watch.rs`: interfaces and addresses that change after enrollment.
//! - `discovery.rs`: a running pod's netns found on the node.
//! - `istio_rules.rs`: istio-cni's in-pod rules, taken over and removed.
pub(in crate::datapath) mod config;
pub(in crate::datapath) mod discovery;
pub(in crate::datapath) mod enroll;
pub(in crate::datapath) mod enroll_steps;
pub(in crate::datapath) mod interface_watch;
pub mod istio_rules;
pub(in crate::datapath) mod netns_setup;
pub(in crate::datapath) mod sidecar_lists;
pub(in crate::datapath) mod slots;
pub(in crate::datapath) mod translations;
mod userns;
