//! weir's test harness: a node and its pods as network namespaces wired by the real CNI reference
//! plugins, small blocking traffic helpers, and a ztunnel stand-in that honours ztunnel's in-pod
//! contract (listeners, marks, original-destination lookup, source-preserving dials).
//!
//! The harness works with or without weir's datapath (only [`Fixture::start_datapath`] and
//! [`agent`] load it), so a broken datapath shows up as a failed (timed out) request, never as a
//! hung test.
//!
//! ```no_run
//! use weir_tests::{tcp_request, EchoServer, Fixture};
//!
//! let Some(fixture) = Fixture::privileged() else { return };
//! let (client, server) = (fixture.pod("a"), fixture.pod("b"));
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
mod fixture;
pub mod istio_iptables;
pub mod netns;
pub mod node;
pub mod raw;
pub mod sockopt;
pub mod traffic;
pub mod zds_client;
pub mod ztunnel;

pub mod ids;
mod server;

pub use apiserver::{ApiRequest, ApiServer};
pub use fixture::{privileged, Fixture};
pub use netns::NetNs;
pub use node::{FailedAdd, NodeOptions, Pod, PodSpec, TestNode};
pub use traffic::{
    tcp_request, udp_request, udp_request_connected, EchoServer, Received, Reply, UdpReply,
};
pub use zds_client::{NetnsId, ZdsEvent, ZdsReply, ZdsZtunnel};
pub use ztunnel::{Dial, Seen, ZtunnelStandIn};

/// The port the pods' apps listen on ([`EchoServer::app`]).
pub const APP_PORT: u16 = 8080;

/// How long any single network operation of the harness (connect, read, write, receive) may take.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether this process may run the privileged tests: they create network namespaces, veths and
/// bridges, which needs `CAP_NET_ADMIN` and `CAP_SYS_ADMIN`; being root (euid 0) is taken as
/// having them.
///
/// When not privileged: under CI (`CI=true`) this panics, because a skipped test there would look
/// like a passed one; elsewhere it prints a skip line and returns false. Tests get their context
/// through [`Fixture::privileged`] or [`privileged`], which check this first.
pub fn require_privileges() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!(
            "privileged tests must run under CI, but this process is not root: \
             run them as root (`cargo xtask test` does)"
        );
    }
    let test = std::thread::current().name().unwrap_or("test").to_owned();
    eprintln!("skipping {test}: needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)");
    false
}
