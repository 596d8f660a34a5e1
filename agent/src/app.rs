//! The agent as a whole: every part started in the right order, stopped on request.
use std::{
    future::Future,
    sync::{Arc, Mutex},
};

use anyhow::{Context, Result};
use futures::FutureExt;
use prometheus_client::registry::Registry;
use tracing::{info, warn};

use crate::{
    check::{self, CheckConfig},
    cluster::{
        self,
        node_condition::{NodeConditionWriter, HEARTBEAT_INTERVAL},
        policy::ClusterSource,
        reconcile::{ProbeSnat, Reconciler},
        repair::{BrokenPods, Repair},
        report::ApiReporter,
        shutdown,
        sidecar_repair::SidecarRepair,
    },
    cni_server::{CniHandler, CniServer},
    config::{AgentConfig, SourceConfig},
    datapath::Datapath,
    enroll::Enroller,
    hand_back, http,
    install::{InstallConfig, InstallStatus, Installer, PLUGIN_NAME},
    metrics,
    policy::{local::LocalSource, Policy},
    readiness::Readiness,
    report::{NoReporter, Reporter, Warning},
    trace,
    workload::PodName,
    zds::{self, ZdsConfig},
};

/// Runs the agent until `shutdown` resolves.
pub async fn run(config: AgentConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    // Before anything is loaded: a node that lacks what weir needs is told so, requirement by
    // requirement, not by a failure deep in the datapath.
    check::before_start(&CheckConfig::of(&config)).await?;
    let mut registry = Registry::default();

    // The order matters: everything that serves pods is up before the plugin is installed, so
    // the first ADD the runtime sends can be answered.
    let datapath = Arc::new(Datapath::start(config.datapath.clone())?);
    datapath.register_metrics(&mut registry);
    metrics::register(&mut registry, &config.datapath.pin_root, &config.state_file);
    let (zds, zds_serve) = zds::start(
        ZdsConfig {
            socket_path: config.zds_socket.clone(),
        },
        Some(datapath.clone()),
        &mut registry,
    )
    .context("starting the ZDS server")?;
    // Until the first reconcile pass is done (below), a snapshot would miss pods, and ztunnel
    // drops the pods a snapshot does not name.
    zds.hold_snapshots();
    let snapshots = zds.clone();
    // In a cluster, the reflectors feed a reconcile loop besides the enrollment path.
    let (policy, reporter, in_cluster): (Arc<dyn Policy>, Arc<dyn Reporter>, _) =
        match &config.source {
            SourceConfig::File(file) => {
                let policy = LocalSource::new(
                    config.policy.clone(),
                    file.clone(),
                    config.verdict_cache.clone(),
                )?;
                (Arc::new(policy), Arc::new(NoReporter), None)
            }
            SourceConfig::Cluster(cluster) => {
                let client = cluster::connect(cluster)
                    .await
                    .context("following the cluster")?;
                let source = ClusterSource::start(
                    config.policy.clone(),
                    &client,
                    &cluster.node_name,
                    config.verdict_cache.clone(),
                );
                let reflectors = source.reflectors().clone();
                let reporter = ApiReporter::new(
                    client.clone(),
                    config.policy.own.pod_name.clone(),
                    reflectors.clone(),
                );
                reporter.register_metrics(&mut registry);
                let in_cluster = InCluster {
                    node_condition: NodeConditionWriter::new(
                        &client,
                        &cluster.node_name,
                        HEARTBEAT_INTERVAL,
                    ),
                    client,
                    broken_pods: cluster.broken_pods,
                    node_name: cluster.node_name.clone(),
                    reflectors,
                    resync_interval: cluster.resync_interval,
                };
                (source, Arc::new(reporter), Some(in_cluster))
            }
        };
    let enroller = Enroller::new(
        datapath.clone(),
        zds,
        reporter.clone(),
        config.state_file.clone(),
    );
    let cni_handler = CniHandler::new(enroller.clone(), policy.clone(), reporter.clone());
    cni_handler.register_metrics(&mut registry);
    enroller.register_metrics(&mut registry);
    enroller
        .recover()
        .await
        .context("recovering enrolled pods")?;
    // Not ready before one full reconcile pass (where there is one): until then pods may be
    // enrolled that should not be, or missing.
    let (first_pass_tx, mut first_pass) = tokio::sync::watch::channel(in_cluster.is_none());
    let reconciler = in_cluster.as_ref().map(|in_cluster| {
        in_cluster.reflectors.register_metrics(&mut registry);
        let repair = Repair::new(in_cluster.client.clone(), in_cluster.broken_pods.action);
        let sidecars = SidecarRepair::new(
            enroller.clone(),
            in_cluster.reflectors.clone(),
            reporter.clone(),
            repair.clone(),
            in_cluster.broken_pods.repair_in_place,
            in_cluster.resync_interval,
        );
        let reconciler = Reconciler::new(
            enroller.clone(),
            in_cluster.reflectors.clone(),
            config.policy.clone(),
            reporter.clone(),
            in_cluster.resync_interval,
            repair,
            // One handing the node back leaves it to istio-cni's agent, which may be starting.
            config.hand_back_to_istio_cni.is_none().then(|| ProbeSnat {
                datapath: datapath.clone(),
                net_dir: config.cni_net_dir.clone(),
            }),
        );
        reconciler.register_metrics(&mut registry);
        sidecars.register_metrics(&mut registry);
        (reconciler, sidecars)
    });
    let cni_server = CniServer::bind(&config.cni_socket)?;
    let installer = Arc::new(Installer::new(InstallConfig {
        cni_bin_dir: config.cni_bin_dir.clone(),
        cni_net_dir: config.cni_net_dir.clone(),
        placement: config.cni_placement.clone(),
        plugin_binary: config.cni_plugin.clone(),
        plugin_name: PLUGIN_NAME.into(),
        plugin_config: plugin_config(&config),
        service_account: config.service_account.clone(),
    }));
    installer.register_metrics(&mut registry);
    let registry = Arc::new(Mutex::new(registry));

    let (ready_tx, ready) = tokio::sync::watch::channel(false);
    let (readiness_tx, readiness) = tokio::sync::watch::channel(Readiness::Starting);
    let mut install_status = installer.status();
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(zds_serve);
    tasks.spawn(cni_server.serve(cni_handler));
    tasks.spawn(enroller.clone().follow_acks());
    tasks.spawn(enroller.clone().sweep_orphans(config.orphan_sweep_interval));
    if let Some((reconciler, sidecars)) = reconciler {
        tasks.spawn(reconciler.run(first_pass_tx));
        tasks.spawn(sidecars.run());
    }
    // Stopped first at shutdown: only the stop's own condition is written from then on.
    let node_condition = (in_cluster.as_ref())
        .map(|cluster| tasks.spawn(cluster.node_condition.clone().follow(readiness)));
    let mut snapshots_due = first_pass.clone();
    tasks.spawn(async move {
        if snapshots_due.wait_for(|done| *done).await.is_ok() {
            snapshots.release_snapshots();
        }
    });
    if let Some(own_pod) = &config.policy.own.pod_name {
        let own_pod = PodName::new(&config.policy.own.namespace, own_pod);
        tasks.spawn(report_config_rewrites(
            reporter.clone(),
            own_pod,
            installer.status(),
        ));
    }
    let synced = policy.clone();
    tasks.spawn(async move {
        // Not ready before the policy source can answer for every pod.
        synced.synced().await;
        if first_pass.wait_for(|done| *done).await.is_err() {
            return;
        }
        loop {
            let now = Readiness::of(&install_status.borrow_and_update());
            ready_tx.send_replace(now.is_ready());
            readiness_tx.send_if_modified(|readiness| std::mem::replace(readiness, now) != now);
            if install_status.changed().await.is_err() {
                return;
            }
        }
    });
    let live: http::Liveness = {
        let datapath = datapath.clone();
        Arc::new(move || datapath.health())
    };
    {
        let (socket, pin_root, state_file) = (
            config.trace_socket.clone(),
            config.datapath.pin_root.clone(),
            config.state_file.clone(),
        );
        tasks.spawn(async move {
            if let Err(error) = trace::serve(socket, pin_root, state_file).await {
                warn!(error = format!("{error:#}"), "trace server stopped");
            }
        });
    }
    for server in [
        http::serve_health(config.health_addr, ready.clone(), live.clone()).boxed(),
        http::serve(config.metrics_addr, ready, live, registry).boxed(),
        http::serve_admin(config.admin_addr).boxed(),
    ] {
        tasks.spawn(async move {
            if let Err(error) = server.await {
                warn!(error = format!("{error:#}"), "http server stopped");
            }
        });
    }
    let (stop_install, install_stopped) = tokio::sync::oneshot::channel::<()>();
    let watcher = {
        let installer = installer.clone();
        tokio::spawn(async move {
            installer
                .watch(async {
                    let _ = install_stopped.await;
                })
                .await
        })
    };

    shutdown.await;
    if let Some(task) = node_condition {
        task.abort();
    }
    let _ = stop_install.send(());
    if let Err(error) = watcher.await? {
        warn!(error = format!("{error:#}"), "installer watch");
    }
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    let removing = config.uninstall_on_exit || !keep_node_on_exit(in_cluster.as_ref()).await;
    if let Some(cluster) = &in_cluster {
        // Said before weir is removed or handed over, so the node takes no new pods meanwhile.
        cluster.node_condition.write_stopped(removing).await;
    }
    if removing {
        let kept = match config.hand_back_to_istio_cni {
            Some(within) => {
                hand_back::run(&installer, &datapath, &config.cni_net_dir, within).await?
            }
            None => {
                installer.uninstall().context("removing the CNI plugin")?;
                Vec::new()
            }
        };
        if kept.is_empty() {
            datapath.uninstall().await?;
            info!("weir removed from this node");
        } else {
            datapath.shutdown().await?;
            info!(
                pods = kept.len(),
                "stopped; redirection stays in place for the pods not handed back"
            );
        }
    } else {
        if let Err(error) = enroller.save_state() {
            warn!("recording the enrolled pods: {error:#}");
        }
        datapath.shutdown().await?;
        info!("stopped; redirection and the plugin stay in place for the next agent");
    }
    Ok(())
}

/// What the agent follows the cluster with, where there is one.
struct InCluster {
    client: kube::Client,
    node_condition: NodeConditionWriter,
    node_name: String,
    reflectors: cluster::Reflectors,
    resync_interval: std::time::Duration,
    broken_pods: BrokenPods,
}

/// On SIGTERM: whether to leave weir in place for the next agent. Without a cluster nothing
/// says an upgrade is under way: `--uninstall-on-exit` decides.
async fn keep_node_on_exit(in_cluster: Option<&InCluster>) -> bool {
    match in_cluster {
        Some(cluster) => {
            shutdown::keep_node_on_exit(&cluster.client, &cluster.node_name, &cluster.reflectors)
                .await
        }
        None => true,
    }
}

/// Tells the agent's own pod each time another component rewrote the CNI config and weir put
/// its entry back (a Warning Event in a cluster, rate-limited as the others).
async fn report_config_rewrites(
    reporter: Arc<dyn Reporter>,
    own_pod: PodName,
    mut status: tokio::sync::watch::Receiver<InstallStatus>,
) {
    // From zero: a rewrite found by the first install (made while no agent ran) counts too.
    let mut reported = 0;
    loop {
        let (rewrites, file) = {
            let status = status.borrow_and_update();
            (status.config_rewrites, status.config_file.clone())
        };
        if rewrites > reported {
            reported = rewrites;
            let file = file.map_or_else(String::new, |file| file.display().to_string());
            reporter
                .warn(&own_pod, Warning::CniConfigRewritten { file })
                .await;
        }
        if status.changed().await.is_err() {
            return;
        }
    }
}

/// weir's entry in the node's conflist: where the agent is, and its ambient rule, which the
/// plugin applies to the API server's objects while the agent is away.
fn plugin_config(config: &AgentConfig) -> serde_json::Value {
    let policy = &config.policy;
    let mut entry = serde_json::json!({
        "agent_socket": config.cni_socket,
        "verdict_cache": config.verdict_cache,
        "exclude_namespaces": policy.exclude_namespaces,
        "enablement_selectors": policy.enablement,
        "system_namespace": policy.system_namespace,
        "pod_namespace": policy.own.namespace,
        "daemonset_name": policy.own.daemonset,
    });
    if let Some(log) = &config.cni_plugin_log {
        entry["log_file"] = serde_json::json!(log);
    }
    entry
}
