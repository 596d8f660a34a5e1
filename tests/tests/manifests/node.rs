//! The DaemonSet as a node runs it: probes and ports at the agent's addresses, host paths
//! mounted where the agent looks, scheduling before other pods, one node at a time.
use super::*;

#[test]
fn probes_and_ports_are_the_agents_health_and_metrics_addresses() {
    let all = manifests();
    let (ds, pod, container) = daemonset(&all);
    let ports: BTreeMap<&str, i32> = container
        .ports
        .iter()
        .flatten()
        .map(|port| (port.name.as_deref().unwrap_or(""), port.container_port))
        .collect();
    let health = port_of(expected::HEALTH_ADDR);
    let metrics = port_of(expected::METRICS_ADDR);
    assert_eq!(
        ports,
        BTreeMap::from([("health", health), ("metrics", metrics)])
    );
    assert_eq!(pod.host_network, Some(true), "the ports are the node's");

    let http_get = |probe: &Option<Probe>, which: &str| {
        let action = probe
            .as_ref()
            .and_then(|probe| probe.http_get.as_ref())
            .unwrap_or_else(|| panic!("no {which} httpGet probe"));
        let port = match &action.port {
            IntOrString::Int(port) => *port,
            IntOrString::String(name) => ports[name.as_str()],
        };
        (action.path.clone().unwrap_or_default(), port)
    };
    assert_eq!(
        http_get(&container.liveness_probe, "liveness"),
        (expected::LIVENESS_PATH.to_owned(), health)
    );
    assert_eq!(
        http_get(&container.readiness_probe, "readiness"),
        (expected::READINESS_PATH.to_owned(), health)
    );

    let annotations = ds
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|meta| meta.annotations.clone())
        .unwrap_or_default();
    let annotation = |key: &str| annotations.get(key).map(String::as_str);
    assert_eq!(annotation("prometheus.io/scrape"), Some("true"));
    assert_eq!(
        annotation("prometheus.io/port"),
        Some(metrics.to_string().as_str())
    );
    assert_eq!(
        annotation("prometheus.io/path"),
        Some(expected::METRICS_PATH)
    );
}

/// The probes' paths, asked of the agent's own HTTP server (agent/src/http.rs): /healthz answers
/// at once, /readyz only once the node is installed, /metrics is Prometheus text.
#[tokio::test]
async fn the_probe_paths_answer_on_the_agents_http_server() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let path = |probe: &Option<Probe>| {
        probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|get| get.path.clone())
            .unwrap()
    };
    let (liveness, readiness) = (
        path(&container.liveness_probe),
        path(&container.readiness_probe),
    );

    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (ready_tx, ready) = tokio::sync::watch::channel(false);
    let registry = Arc::new(Mutex::new(prometheus_client::registry::Registry::default()));
    let live = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let liveness_check: weir_agent::http::Liveness = {
        let live = live.clone();
        Arc::new(
            move || match live.load(std::sync::atomic::Ordering::Relaxed) {
                true => Ok(()),
                false => Err("the datapath thread has stopped".into()),
            },
        )
    };
    let server = tokio::spawn(weir_agent::http::serve(
        addr,
        ready,
        liveness_check,
        registry,
    ));

    assert_eq!(get(addr, &liveness).await, 200, "{liveness}");
    live.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        get(addr, &liveness).await,
        503,
        "{liveness} once a part died"
    );
    live.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(addr, &readiness).await, 503, "{readiness} before ready");
    ready_tx.send_replace(true);
    assert_eq!(get(addr, &readiness).await, 200, "{readiness} when ready");
    assert_eq!(get(addr, expected::METRICS_PATH).await, 200);
    assert_eq!(get(addr, "/nothing-here").await, 404);
    server.abort();
}

/// The status code of `GET path` (HTTP/1.1, retried while the server is not yet listening).
async fn get(addr: std::net::SocketAddr, path: &str) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut stream = loop {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("connecting to {addr}: {e}"),
        }
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .expect("response in time")
        .unwrap();
    response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"))
}

#[test]
fn every_host_path_the_agent_uses_is_mounted_from_the_same_host_path() {
    let all = manifests();
    let (_, pod, container) = daemonset(&all);
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    // Each mount names a volume, each volume is mounted.
    let mounted: BTreeSet<&str> = mounts.iter().map(|m| m.name.as_str()).collect();
    let declared: BTreeSet<&str> = volumes.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(mounted, declared, "volumes and volumeMounts");

    // The mount that holds `path` (the deepest one), and its hostPath.
    let mount_of = |path: &str| -> (&VolumeMount, &HostPathVolumeSource) {
        let mount = mounts
            .iter()
            .filter(|m| Path::new(path).starts_with(&m.mount_path))
            .max_by_key(|m| m.mount_path.len())
            .unwrap_or_else(|| panic!("nothing is mounted at {path} or above it"));
        let host = volumes
            .iter()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.host_path.as_ref())
            .unwrap_or_else(|| panic!("{} ({path}) is not a hostPath", mount.name));
        (mount, host)
    };
    let same_path = |path: &str, dir: &str| {
        let (mount, host) = mount_of(path);
        assert_eq!(mount.mount_path, dir, "{path} is under the mount of {dir}");
        assert_eq!(host.path, dir, "{dir} comes from the same host path");
        mount
    };

    for (long, env, default, dir) in expected::HOST_PATH_FLAGS {
        same_path(default, dir);
        assert!(
            env_value(container, env).is_none_or(|var| var.value.as_deref() == Some(*default)),
            "the DaemonSet keeps {long}'s default: {env}, when set, must name it"
        );
    }
    let privileged = container
        .security_context
        .as_ref()
        .and_then(|sc| sc.privileged)
        == Some(true);
    let bpffs = same_path(expected::BPFFS, expected::BPFFS);
    assert_eq!(
        bpffs.mount_propagation.as_deref(),
        Some("Bidirectional"),
        "a bpffs the agent mounts must be the host's"
    );
    assert!(
        privileged,
        "Bidirectional propagation needs a privileged container"
    );
    let netns = same_path(expected::NETNS, expected::NETNS);
    assert!(
        matches!(
            netns.mount_propagation.as_deref(),
            Some("HostToContainer" | "Bidirectional")
        ),
        "netns mounts made after the agent starts must reach it"
    );
    same_path(expected::CGROUP, expected::CGROUP);
    assert!(
        !mounts.iter().any(|m| m.mount_path == expected::PROC),
        "the runtime refuses a mount over /proc"
    );
    assert_eq!(
        pod.host_pid,
        Some(true),
        "{}/<pid>/ns/net of the node's processes needs the host PID namespace",
        expected::PROC
    );
}

/// istiod removes a node's `cni.istio.io/not-ready` taint when a pod labelled
/// `k8s-app=istio-cni-node` in its own namespace is ready there: weir's pods carry the label, in
/// istiod's namespace, and are ready only when the agent's `/readyz` says it serves the node.
#[test]
fn istiod_lifts_the_not_ready_taint_once_weir_is_ready_on_the_node() {
    let all = manifests();
    let (ds, _pod, container) = daemonset(&all);
    assert_eq!(ds.metadata.namespace.as_deref(), Some("istio-system"));
    let labels = ds
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|meta| meta.labels.clone())
        .unwrap_or_default();
    assert_eq!(
        labels.get("k8s-app").map(String::as_str),
        Some("istio-cni-node")
    );
    let readiness = container
        .readiness_probe
        .as_ref()
        .and_then(|probe| probe.http_get.as_ref())
        .expect("a readiness probe over HTTP");
    assert_eq!(readiness.path.as_deref(), Some("/readyz"));
}

#[test]
fn the_daemonset_runs_on_every_node_before_other_pods_and_upgrades_one_node_at_a_time() {
    let all = manifests();
    let (ds, pod, container) = daemonset(&all);
    let spec = &ds.spec;
    let selector = spec.selector.match_labels.clone().unwrap_or_default();
    let labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|meta| meta.labels.clone())
        .unwrap_or_default();
    assert!(!selector.is_empty());
    for (key, value) in &selector {
        assert_eq!(
            labels.get(key),
            Some(value),
            "template carries selector {key}"
        );
    }

    let tolerations = pod.tolerations.as_deref().unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "tolerates every taint: {tolerations:?}"
    );
    assert_eq!(
        pod.node_selector,
        Some([("kubernetes.io/os".to_owned(), "linux".to_owned())].into()),
        "every Linux node, and only those"
    );
    assert_eq!(pod.affinity, None, "no node is left out");
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert!(pod.termination_grace_period_seconds.is_some_and(|s| s > 0));

    let strategy = spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().unwrap();
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(1)));
    assert_eq!(rolling.max_surge, None, "one agent per node at a time");

    // The image `cargo xtask image` builds, and its entrypoint.
    let image = concat!("localhost/weir-agent:", env!("CARGO_PKG_VERSION"));
    assert_eq!(container.image.as_deref(), Some(image));
    assert_eq!(container.command, None, "the image's ENTRYPOINT runs");
    let resources = container.resources.as_ref().unwrap();
    let requests = resources.requests.clone().unwrap_or_default();
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"));
    let limits = resources.limits.clone().unwrap_or_default();
    assert!(limits.contains_key("memory"), "a memory limit");
    assert!(
        !limits.contains_key("cpu"),
        "no CPU limit: pod starts come in bursts"
    );
}
