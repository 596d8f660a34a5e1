//! weir's node agent: enrolls Istio ambient pods into ztunnel with eBPF instead of iptables.
//!
//! - [`app`]: the agent as a whole, its parts started in order; [`config`]: what it is told.
//! - [`enroll`]: the one path a pod takes into the mesh and out (`Enroller::enroll`), recovery
//!   at start, CNI GC and the orphan sweep.
//! - [`policy`]: which pods are ambient, with which options (istio's rules), from a local file;
//!   the verdict cache the plugin falls back on.
//! - [`report`]: where pods' statuses and warnings go (`Reporter`), and the warnings themselves.
//! - [`cluster`]: the Kubernetes side: reflectors, the policy decided from them, the status
//!   annotation and Events, the reconcile loop and pod repair, the SIGTERM rule, the node
//!   condition.
//! - [`readiness`]: whether the agent serves its node, and why not.
//! - [`workload`]: a pod as the agent knows it: its name, what is enrolled, its options and
//!   status.
//! - [`state`]: the agent's record of enrolled pods, for the next agent after a restart.
//! - [`datapath`]: the owner of every BPF object; `enroll`/`unenroll` a pod's redirection, with
//!   its per-pod network namespace work (`datapath::netns`, `datapath::netlink`) on its own thread.
//! - [`hand_back`]: leaving the node to istio-cni's node agent without a window.
//! - [`check`]: what weir needs of the node and the cluster, one line per requirement
//!   (`weir-agent check`, and the agent at start).
//! - [`cli`]: `weir-agent`'s command line, and the configuration reference generated from it.
//! - [`logging`]: log lines as plain text or JSON, with the fields of the pod they concern.
//! - [`inspect`]: `weir-agent pods`, what the node holds, from the pinned maps and the state file.
//! - [`root_only`]: the files that name pods, and the peers of weir's unix sockets, kept to root.
//! - [`cni_server`], [`zds`], [`install`], [`http`]: the edges: the CNI plugin (its requests
//!   turned into enrollment steps and responses), ztunnel, the node's CNI configuration, health
//!   and metrics.
pub mod app;
pub mod bug_report;
pub mod check;
pub mod cli;
pub mod cluster;
pub mod cni_server;
pub mod config;
pub mod datapath;
pub mod enroll;
pub mod explain;
pub mod hand_back;
pub mod http;
pub mod inspect;
pub mod install;
pub mod logging;
pub mod metrics;
pub mod policy;
pub mod readiness;
pub mod report;
pub mod root_only;
pub mod state;
pub mod trace;
pub mod workload;
pub mod zds;
