//! A test node for weir's datapath run in this process: the node and its pods (a [`TestNode`]),
//! and the datapath loaded by the test itself through `weir_agent::datapath`.

use anyhow::Result;
use weir_agent::{datapath::Datapath, workload::PodOptions};

use crate::{NodeOptions, Pod, TestNode};

/// A node of the test's own, whose datapath the test starts in its own process. Whatever
/// datapath is pinned for the node is removed when it is dropped, also when the test fails, so a
/// failed test leaves nothing attached.
pub struct DatapathNode {
    node: TestNode,
}

impl DatapathNode {
    /// A node with the default options.
    pub fn new() -> Result<Self> {
        Self::with_options(NodeOptions::default())
    }

    pub fn with_options(options: NodeOptions) -> Result<Self> {
        Ok(Self {
            node: TestNode::with_options(options)?,
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

    /// weir's datapath on the node (loaded, or taken over from the pins), with this process
    /// known as ztunnel: its ztunnel stand-ins run here.
    pub fn start_datapath(&self) -> Datapath {
        let datapath = Datapath::start(self.node.datapath_config()).expect("datapath starts");
        datapath
            .ztunnel_connected(std::process::id())
            .wait()
            .expect("this process known as ztunnel");
        datapath
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

impl Drop for DatapathNode {
    fn drop(&mut self) {
        crate::agent::remove_datapath(&self.node.datapath_config().pin_root);
    }
}
