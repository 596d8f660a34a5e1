//! weir's node agent: enrolls Istio ambient pods into ztunnel with eBPF instead of iptables.
//!
//! - [`datapath`]: the owner of every BPF object; `enroll`/`unenroll` a pod.
//! - [`netns`], [`netlink`]: per-pod network namespace work, done on the datapath's own thread.
//! - [`bpf_link`]: pinned cgroup links that outlive the agent.
pub mod bpf_link;
pub mod datapath;
pub mod netlink;
pub mod netns;
