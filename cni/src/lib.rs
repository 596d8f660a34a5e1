//! weir's chained CNI plugin: tells the node agent about pod network events so it can put
//! ambient pods into the mesh, and otherwise stays out of the way.
//!
//! The runtime runs the plugin last in the chain (the installer appends it to the conflist), or
//! Multus runs it as a network of its own (see `ADD` below). It
//! speaks CNI 0.3.0 to 1.1.0 and keeps no state: each run reads `CNI_*` from the environment
//! and the network config from stdin, asks the agent over its unix socket
//! ([`protocol`]: one JSON request line, one JSON response line) and prints the result on
//! stdout. Its log lines go to the agent once it has answered (the agent logs them with its own
//! lines about the pod), else to `log_file` or stderr; never to stdout.
//!
//! # Commands
//!
//! - `ADD`: sends the pod (from `CNI_ARGS`), netns, container id, the addresses from
//!   `prevResult` and the pod annotations (from `runtimeConfig`, capability
//!   `io.kubernetes.cri.pod-annotations`) to the agent. On `ok` it prints `prevResult`
//!   unchanged; an agent `error` becomes a CNI error. Pods in `exclude_namespaces` are passed
//!   through without asking the agent. Without `prevResult` (weir-cni as a network of its own,
//!   which Multus runs as an extra attachment, as istio-cni with `chained: false`) it sends no
//!   addresses, the agent reads them from the pod's `eth0`, and it prints an empty result,
//!   `{"cniVersion": <the config's>}`, as istio-cni does.
//! - `DEL`: tells the agent; works from the container id and pod alone (the runtime's second
//!   DEL has no netns and no `prevResult`). Only malformed input fails a DEL: never the agent.
//! - `CHECK`: asks the agent, like ADD, and prints nothing on success.
//! - `STATUS`: always ready (logged when the agent is down): a failed STATUS would stop every
//!   new pod on the node, and weir must never block pods that are not ambient.
//! - `GC`: nothing to collect (the agent tracks pods itself).
//! - `VERSION`: the supported spec versions.
//!
//! # When the agent does not answer
//!
//! - The agent took the connection and then gave no answer (it hung up, reset, or did not
//!   answer within `timeout_seconds`): ADD and CHECK fail with code 11 ("try again later"). The
//!   agent may be enrolling the pod at that very moment; the runtime retries.
//! - The agent cannot be reached at all (socket missing or refusing, connect timed out): ADD and
//!   CHECK ask the Kubernetes API server, as istio-cni's plugin does, with the kubeconfig the
//!   agent's installer writes (`kubeconfig`): the pod and its namespace, within 2 s, decided
//!   with the agent's rule ([`ambient`], with the conflist's `enablement_selectors`,
//!   `exclude_namespaces`, `system_namespace`, `pod_namespace`, `daemonset_name`). An ambient
//!   pod fails with 11 and waits for the agent (fail closed); any other pod goes ahead without
//!   redirection, with a warning in the log, so weir being down never stops pods that are not in
//!   the mesh.
//! - Only when the API server cannot tell either (no kubeconfig, unreachable, an error, or it
//!   does not have this very pod: none of that name, or another uid) does the verdict cache the
//!   agent keeps on disk decide ([`protocol::VerdictCache`]): a pod it names ambient fails with
//!   11, a pod it knows to be not ambient starts (with a warning), and a pod it does not know
//!   fails with 11 too, since it may carry the ambient label itself (the agent names every pod
//!   of the node it knows; a pod created since is unknown). A missing or unreadable cache fails
//!   every pod with 11 (the agent writes the cache before it installs the plugin, so a missing
//!   cache means weir is broken, and then nobody can tell which pods are ambient). Pods in
//!   `exclude_namespaces` never get this far.
//!
//! An answer that is not a valid response (garbage, over 16 KiB) is a bug and fails with 999.
//!
//! # Configuration (weir-cni's entry in the conflist)
//!
//! | field | default | meaning |
//! |---|---|---|
//! | `type` | | `"weir-cni"`, the binary's name |
//! | `agent_socket` | [`protocol::DEFAULT_AGENT_SOCKET`] | the agent's unix socket |
//! | `verdict_cache` | [`protocol::DEFAULT_VERDICT_CACHE`] | the agent's verdict cache, read only when neither the agent nor the API server can tell |
//! | `exclude_namespaces` | `["kube-system"]` | namespaces whose pods never reach the agent |
//! | `timeout_seconds` | `5` | bound on the whole exchange with the agent (connect, send, answer); at least 1 |
//! | `kubeconfig` | none | the API server and credentials to decide with while the agent cannot be reached (JSON) |
//! | `enablement_selectors` | istio's default rule | which pods are ambient, as the agent's `--ambient-enablement-selector` |
//! | `system_namespace` | `"istio-system"` | where ztunnel runs (its pods are never ambient) |
//! | `pod_namespace`, `daemonset_name` | `"istio-system"`, `"weir"` | weir's own pods, never ambient |
//! | `log_file` | none: stderr | file to append log lines to when the agent does not take them |
//! | `log_level` | `"info"` | `"error"`, `"warn"`, `"info"` or `"debug"`, for the lines written here |
//!
//! plus the standard `cniVersion` (required), `name`, `capabilities` (the installer declares
//! `{"io.kubernetes.cri.pod-annotations": true}`) and, filled in by the runtime, `prevResult` and
//! `runtimeConfig`.
//!
//! # Errors
//!
//! Failures print `{"cniVersion", "code", "msg", "details"}` and exit 1; `msg` names the cause.
//! Only what clears up without a new request is 11 ("try again later"): the agent out of reach
//! or silent (see above), ztunnel not yet acknowledging the pod, the agent not yet knowing the
//! pod or unable to read its policy, a kernel that is busy or short of memory. What can never
//! succeed as asked gets the spec's code for it: 1 incompatible version, 4 bad `CNI_*` variable
//! (also a `CNI_NETNS` with no network namespace there, or an ambient pod without
//! `K8S_POD_UID`), 5 stdin unreadable, 6 undecodable JSON, 7 invalid config (an ambient pod's
//! `prevResult` with an invalid address, or no address there nor on the pod's `eth0`), and 999
//! for the rest (the node's
//! own netns as an ambient pod's, a kernel without a feature weir needs, an agent answer that is
//! not one). An agent `error` keeps the agent's code.
pub mod ambient;
pub mod protocol;

mod agent;
mod apiserver;
mod config;
mod env;
mod error;
mod log;
mod plugin;

pub use env::CniEnv;
/// The codes of CNI error results, for the agent's responses too.
pub use error::code;
pub use plugin::{run, Outcome};
