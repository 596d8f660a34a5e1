//! The API server's part: the node a pod runs on, and weir's pod on a node.
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::{
    api::ListParams,
    config::{KubeConfigOptions, Kubeconfig},
    Api, Client, Config,
};

use crate::PodName;

/// The labels of the pods of weir's DaemonSet (deploy/chart/templates/daemonset.yaml).
pub const WEIR_POD_SELECTOR: &str =
    "app.kubernetes.io/name=weir,app.kubernetes.io/component=node-agent";

/// A client for the cluster kubectl would talk to.
pub struct Cluster {
    client: Client,
    /// The context's namespace, for pods named without one (as kubectl's `default`, unless set).
    default_namespace: String,
}

impl Cluster {
    /// The configuration kubectl would use: `kubeconfig` or else $KUBECONFIG or
    /// ~/.kube/config, at `context` or else its current context; with neither flag given, the
    /// in-cluster service account when there is no kubeconfig, as in a pod.
    pub async fn connect(kubeconfig: Option<&Path>, context: Option<&str>) -> Result<Self> {
        let config = if kubeconfig.is_none() && context.is_none() {
            Config::infer().await.context(
                "no kubeconfig ($KUBECONFIG, ~/.kube/config) nor in-cluster configuration",
            )?
        } else {
            let file = match kubeconfig {
                Some(path) => Kubeconfig::read_from(path),
                None => Kubeconfig::read(),
            }
            .context("reading the kubeconfig")?;
            let options = KubeConfigOptions {
                context: context.map(str::to_owned),
                ..KubeConfigOptions::default()
            };
            Config::from_custom_kubeconfig(file, &options)
                .await
                .context("loading the kubeconfig")?
        };
        let default_namespace = config.default_namespace.clone();
        let client = Client::try_from(config).context("making the API client")?;
        Ok(Self {
            client,
            default_namespace,
        })
    }

    /// The pod `name` in `namespace`, else in the context's namespace.
    pub fn pod_name(&self, namespace: Option<String>, name: String) -> PodName {
        PodName {
            namespace: namespace.unwrap_or_else(|| self.default_namespace.clone()),
            name,
        }
    }

    /// The node `pod` is scheduled to.
    pub async fn node_of(&self, pod: &PodName) -> Result<String> {
        let found = Api::<Pod>::namespaced(self.client.clone(), &pod.namespace)
            .get_opt(&pod.name)
            .await
            .with_context(|| format!("getting pod {pod}"))?
            .ok_or_else(|| anyhow!("pod {pod} not found"))?;
        found
            .spec
            .and_then(|spec| spec.node_name)
            .filter(|node| !node.is_empty())
            .ok_or_else(|| {
                anyhow!(
                    "pod {pod} is not scheduled yet (no spec.nodeName): there is no node, and \
                     no weir, to ask"
                )
            })
    }

    /// The name of weir's pod on `node`, in `namespace`. During a rollout a node may have two,
    /// one terminating: a running one not being deleted is chosen.
    pub async fn weir_pod(&self, namespace: &str, node: &str) -> Result<String> {
        let on_node = ListParams::default()
            .labels(WEIR_POD_SELECTOR)
            .fields(&format!("spec.nodeName={node}"));
        let pods = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .list(&on_node)
            .await
            .with_context(|| format!("listing weir's pods in namespace {namespace}"))?;
        pods.items
            .into_iter()
            .min_by_key(|pod| {
                let running = pod
                    .status
                    .as_ref()
                    .and_then(|status| status.phase.as_deref())
                    == Some("Running");
                (pod.metadata.deletion_timestamp.is_some(), !running)
            })
            .and_then(|pod| pod.metadata.name)
            .ok_or_else(|| {
                anyhow!(
                    "no weir pod on node {node}: no pod in namespace {namespace} with the labels \
                     {WEIR_POD_SELECTOR} runs there. weir may not run on that node (the \
                     DaemonSet's nodeSelector, affinity or tolerations leave it out), or it runs \
                     in another namespace (--weir-namespace)"
                )
            })
    }
}
