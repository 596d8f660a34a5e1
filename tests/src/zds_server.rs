//! weir's own ZDS server on a runtime of its own, for tests that drive it from blocking code
//! against the ztunnel side ([`crate::ZdsZtunnel`]).

use std::future::Future;
use std::path::Path;

use prometheus_client::registry::Registry;
use weir_agent::zds::{self, ZdsConfig, ZdsHandle};

pub struct ZdsServer {
    pub handle: ZdsHandle,
    /// Its metrics, as the agent would serve them.
    pub registry: Registry,
    runtime: tokio::runtime::Runtime,
}

impl ZdsServer {
    /// Serves `socket_path` (with no datapath to tell ztunnel's cgroup to). The test thread
    /// stays free to block on a client.
    pub fn start(socket_path: &Path) -> Self {
        let mut registry = Registry::default();
        let config = ZdsConfig {
            socket_path: socket_path.to_owned(),
        };
        let (handle, serve) = zds::start(config, None, &mut registry).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.spawn(serve);
        Self {
            handle,
            registry,
            runtime,
        }
    }

    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }
}
