//! The context of a privileged test, reachable only through the privilege check: a test starts
//! with `let Some(fixture) = Fixture::privileged() else { return };` (or [`privileged`] for a
//! context of its own), so it cannot build a node and forget the check.

use anyhow::Result;
use weir_agent::{datapath::Datapath, workload::PodOptions};

use crate::{require_privileges, NodeOptions, Pod, TestNode};

/// Builds the context of a privileged test. `None` (after a skip line) when this process may not
/// run privileged tests; under CI that panics instead (see [`require_privileges`]). A context
/// that cannot be built fails the test.
pub fn privileged<T>(context: impl FnOnce() -> Result<T>) -> Option<T> {
    if !require_privileges() {
        return None;
    }
    Some(context().unwrap_or_else(|error| panic!("building the test's context: {error:#}")))
}

/// A test node of the test's own. Whatever datapath is pinned for the node is removed when the
/// fixture is dropped, also when the test fails, so a failed test leaves nothing attached.
pub struct Fixture {
    node: TestNode,
}

impl Fixture {
    /// A node with the default options.
    pub fn privileged() -> Option<Self> {
        Self::privileged_with(NodeOptions::default())
    }

    pub fn privileged_with(options: NodeOptions) -> Option<Self> {
        privileged(|| {
            Ok(Self {
                node: TestNode::with_options(options)?,
            })
        })
    }

    pub fn node(&self) -> &TestNode {
        &self.node
    }

    /// A pod in namespace `default`.
    pub fn pod(&self, name: &str) -> Pod {
        self.node
            .add_pod(name)
            .unwrap_or_else(|error| panic!("pod {name}: {error:#}"))
    }

    /// weir's datapath on the node (loaded, or taken over from the pins).
    pub fn start_datapath(&self) -> Datapath {
        Datapath::start(self.node.datapath_config()).expect("datapath starts")
    }

    /// The node's datapath with `pod` enrolled.
    pub fn enrolled(&self, pod: &Pod, options: PodOptions) -> Datapath {
        let datapath = self.start_datapath();
        datapath
            .enroll(pod.workload(options))
            .wait()
            .expect("pod enrolled");
        datapath
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        crate::agent::remove_datapath(&self.node.datapath_config().pin_root);
    }
}
