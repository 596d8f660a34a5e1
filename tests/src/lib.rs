//! weir's test harness: a node and its pods as network namespaces wired by the real CNI reference
//! plugins, small blocking traffic helpers, and a ztunnel stand-in that honours ztunnel's in-pod
//! contract (listeners, marks, original-destination lookup, source-preserving dials).
//!
//! The harness works with or without weir's datapath (only [`DatapathNode::start_datapath`] and
//! [`agent`] load it), so a broken datapath shows up as a failed (timed out) request, never as a
//! hung test. `tests/README.md` maps it.
//!
//! ```no_run
//! use weir_tests::{privileged, tcp_request, DatapathNode, EchoServer};
//!
//! let node = privileged!(DatapathNode::new());
//! let (client, server) = (node.pod("a"), node.pod("b"));
//! let echo = EchoServer::start(server.netns(), "b", (server.ipv4(), 8080).into()).unwrap();
//! let reply = client.run(|| tcp_request(echo.addr(), "hi")).unwrap();
//! assert_eq!(reply.response, echo.reply_to("hi"));
//! ```

use std::time::Duration;

pub mod agent;
pub mod apiserver;
pub mod cgroup;
pub mod chain;
pub mod cni;
mod datapath_node;
pub mod istio_cni;
pub mod istio_iptables;
pub mod metrics;
pub mod netns;
pub mod node;
pub mod raw;
pub mod receive_batch;
pub mod sidecar;
pub mod sockopt;
pub mod trace_reader;
pub mod traffic;
pub mod traffic_loop;
pub mod tunnel;
pub mod virtual_machine;
pub mod wait;
pub mod zds_client;
pub mod zds_server;
pub mod ztunnel;

pub mod ids;
mod server;

pub use apiserver::{ApiRequest, ApiServer};
pub use datapath_node::DatapathNode;
pub use istio_cni::{IstioCniAgent, IstioCniError};
pub use metrics::Metrics;
pub use netns::NetNs;
pub use node::{FailedAdd, Families, NodeOptions, Pod, PodSpec, TestNode};
pub use traffic::{
    tcp_attempt, tcp_connect_from, tcp_request, tcp_request_within, udp_request,
    udp_request_connected, EchoServer, Received, Reply, UdpReply,
};
pub use wait::{try_wait_until, wait_until, wait_until_async};
pub use zds_client::{NetnsId, ZdsEvent, ZdsReply, ZdsZtunnel};
pub use ztunnel::{Dial, Seen, ZtunnelStandIn};

/// The port the pods' apps listen on ([`EchoServer::app`]).
pub const APP_PORT: u16 = 8080;

/// How long any single network operation of the harness (connect, read, write, receive) takes at
/// most on a node; [`io_timeout`] stretches it where everything runs slower.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// [`IO_TIMEOUT`] stretched by the wait scale: the bound of an operation that must succeed, which
/// in an emulated guest may need a SYN's retransmissions (one second, then two more).
pub fn io_timeout() -> Duration {
    wait::scaled(IO_TIMEOUT)
}

/// Whether this process may run the privileged tests: they create network namespaces, veths and
/// bridges, which needs `CAP_NET_ADMIN` and `CAP_SYS_ADMIN`; being root (euid 0) is taken as
/// having them.
///
/// When not privileged: under CI (`CI=true`) this panics, because a skipped test there would look
/// like a passed one; elsewhere it prints a skip line and returns false. Tests check it through
/// [`privileged!`].
pub fn require_privileges() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    skip_or_fail(
        "needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); under CI, privileged tests must run: run them \
         as root (`cargo xtask test` does)",
    );
    false
}

/// The one way a test skips: under CI (`CI=true`) it panics with `reason`, because a skipped
/// test there would look like a passed one; elsewhere it prints `skipping <test>: <reason>`, and
/// the test returns.
pub fn skip_or_fail(reason: &str) {
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!("{reason}");
    }
    let test = std::thread::current().name().unwrap_or("test").to_owned();
    eprintln!("skipping {test}: {reason}");
}

/// The program a test runs: the path in the environment variable `env` when it is set, else
/// `name` on PATH. When there is none: under CI (`CI=true`) this panics, because a skipped test
/// there would look like a passed one; elsewhere it prints a skip line saying how to get it
/// (`hint`) and returns `None`.
pub fn required_program(name: &str, env: Option<&str>, hint: &str) -> Option<std::path::PathBuf> {
    if let Some(path) = env.and_then(std::env::var_os) {
        return Some(path.into());
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|file| file.is_file())
    });
    if on_path.is_none() {
        skip_or_fail(&format!("no {name}: {hint}"));
    }
    on_path
}

/// The opening of every privileged test: returns from the test (after a skip line) when this
/// process may not run privileged tests, and under CI fails it instead (see
/// [`require_privileges`]).
///
/// `privileged!()` only checks; `privileged!(context)` checks, then builds the test's context
/// from `context` (an `anyhow::Result`, which may use `?`) and evaluates to it: a context that
/// cannot be built fails the test.
///
/// ```no_run
/// use weir_tests::{privileged, DatapathNode};
///
/// let node = privileged!(DatapathNode::new());
/// ```
#[macro_export]
macro_rules! privileged {
    () => {
        if !$crate::require_privileges() {
            return;
        }
    };
    ($context:expr) => {{
        $crate::privileged!();
        (|| -> ::anyhow::Result<_> { $context })()
            .unwrap_or_else(|error| panic!("building the test's context: {error:#}"))
    }};
}
