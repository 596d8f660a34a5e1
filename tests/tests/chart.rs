//! deploy/chart, rendered by helm as `helm install` renders it: with its defaults it is
//! deploy/weir.yaml, object for object; each platform profile and each value an operator sets
//! reaches the agent as a setting it parses, with the node paths mounted where the agent looks.
//!
//! Needs helm: `WEIR_HELM` (`cargo xtask test` fetches it and passes it on), else `helm` on PATH.
//! Under `CI=true` a missing one fails the tests.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{CommandFactory, Parser};
use serde::Deserialize;
use serde_json::{json, Value};
use weir_agent::{cli::Cli, install::Placement};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn helm() -> Option<PathBuf> {
    weir_tests::required_program(
        "helm",
        Some("WEIR_HELM"),
        "set WEIR_HELM or put helm on PATH (`cargo xtask test` fetches it)",
    )
}

/// `helm template weir deploy/chart --namespace istio-system` with `args` (`-f`, `--set`): the
/// objects by `(kind, name)`, or helm's error.
fn render(helm: &Path, args: &[&str]) -> Result<BTreeMap<(String, String), Value>, String> {
    let out = Command::new(helm)
        .args(["template", "weir"])
        .arg(deploy_dir().join("chart"))
        .args(["--namespace", "istio-system"])
        .args(args)
        .current_dir(deploy_dir())
        .output()
        .expect("helm runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(objects(&String::from_utf8(out.stdout).unwrap()))
}

fn objects(yaml: &str) -> BTreeMap<(String, String), Value> {
    serde_norway::Deserializer::from_str(yaml)
        .map(|document| Value::deserialize(document).unwrap())
        .filter(|object| !object.is_null())
        .map(|object| {
            let key = (
                object["kind"].as_str().unwrap().to_owned(),
                object["metadata"]["name"].as_str().unwrap().to_owned(),
            );
            (key, object)
        })
        .collect()
}

fn daemonset(objects: &BTreeMap<(String, String), Value>) -> &Value {
    &objects[&("DaemonSet".into(), "weir".into())]
}

fn container(objects: &BTreeMap<(String, String), Value>) -> &Value {
    &daemonset(objects)["spec"]["template"]["spec"]["containers"][0]
}

/// The container's env with plain values (not the Downward API's).
fn env(objects: &BTreeMap<(String, String), Value>) -> BTreeMap<String, String> {
    container(objects)["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|env| Some((env["name"].as_str()?.into(), env["value"].as_str()?.into())))
        .collect()
}

/// `weir-agent run` as this env configures it: every variable but RUST_LOG is one of its flags', and every
/// value parses. The flags are given on the command line (the env of this test process is not
/// the container's).
fn parse_as_agent(env: &BTreeMap<String, String>) -> Cli {
    let command = Cli::command();
    let run = command.find_subcommand("run").unwrap();
    let flags: BTreeMap<String, (String, bool)> = command
        .get_arguments()
        .chain(run.get_arguments())
        .filter_map(|arg| {
            let env = arg.get_env()?.to_str()?.to_owned();
            let takes_value = arg.get_action().takes_values();
            Some((env, (arg.get_long()?.to_owned(), takes_value)))
        })
        .collect();
    let mut args = vec!["weir-agent".to_owned(), "run".to_owned()];
    // RUST_LOG is the log filter's, read before the flags.
    for (name, value) in env.iter().filter(|(name, _)| *name != "RUST_LOG") {
        let (long, takes_value) = flags
            .get(name)
            .unwrap_or_else(|| panic!("{name} is no flag's env of weir-agent run"));
        if *takes_value {
            args.push(format!("--{long}={value}"));
        } else if value == "true" {
            // A switch: clap reads its env as set unless it is false-like.
            args.push(format!("--{long}"));
        } else {
            assert_eq!(value, "false", "{name}: a switch is true or false");
        }
    }
    Cli::try_parse_from(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// The host path of the volume mounted at `mount_path`, which must be mounted at its own path.
fn host_path_mounted_at(objects: &BTreeMap<(String, String), Value>, mount_path: &str) -> String {
    let pod = &daemonset(objects)["spec"]["template"]["spec"];
    let mount = container(objects)["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|mount| mount["mountPath"] == mount_path)
        .unwrap_or_else(|| panic!("nothing mounted at {mount_path}"));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|volume| volume["name"] == mount["name"])
        .unwrap();
    volume["hostPath"]["path"].as_str().unwrap().to_owned()
}

#[test]
fn the_defaults_render_deploy_weir_yaml() {
    let Some(helm) = helm() else { return };
    let rendered = render(&helm, &[]).unwrap();
    let manifest = objects(&std::fs::read_to_string(deploy_dir().join("weir.yaml")).unwrap());
    assert_eq!(
        rendered.keys().collect::<Vec<_>>(),
        manifest.keys().collect::<Vec<_>>(),
        "the same objects"
    );
    for (key, object) in &manifest {
        assert_eq!(&rendered[key], object, "{key:?}");
    }
    let chart: Value = serde_norway::from_str(
        &std::fs::read_to_string(deploy_dir().join("chart/Chart.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    parse_as_agent(&env(&rendered));
}

/// Each profile: the paths it names are the ones the agent is told and the ones mounted, at the
/// same path; plus what the platform needs besides.
#[test]
fn every_platform_profile_mounts_and_configures_its_cni_paths() {
    let Some(helm) = helm() else { return };
    for (profile, bin_dir, conf_dir) in [
        ("gke", "/home/kubernetes/bin", "/etc/cni/net.d"),
        (
            "k3s",
            "/var/lib/rancher/k3s/data/current/bin",
            "/var/lib/rancher/k3s/agent/etc/cni/net.d",
        ),
        ("rke2", "/opt/cni/bin", "/etc/cni/net.d"),
        ("eks", "/opt/cni/bin", "/etc/cni/net.d"),
        ("openshift", "/var/lib/cni/bin", "/etc/cni/multus/net.d"),
    ] {
        let file = format!("chart/profiles/{profile}.yaml");
        let objects = render(&helm, &["-f", &file]).unwrap();
        let cli = parse_as_agent(&env(&objects));
        let weir_agent::cli::Command::Run(run) = cli.command else {
            unreachable!()
        };
        assert_eq!(run.cni_dirs.cni_bin_dir, Path::new(bin_dir), "{profile}");
        assert_eq!(run.cni_dirs.cni_net_dir, Path::new(conf_dir), "{profile}");
        let placement = run.cni_dirs.placement().unwrap();
        if profile == "openshift" {
            assert_eq!(placement.placement, Placement::Standalone);
            assert_eq!(placement.standalone_file, "istio-cni.conf");
        } else {
            assert_eq!(placement.placement, Placement::Chained, "{profile}");
        }
        assert_eq!(
            host_path_mounted_at(&objects, bin_dir),
            bin_dir,
            "{profile}"
        );
        assert_eq!(
            host_path_mounted_at(&objects, conf_dir),
            conf_dir,
            "{profile}"
        );
        let pod = &daemonset(&objects)["spec"]["template"]["spec"];
        assert_eq!(
            pod["nodeSelector"],
            json!({"kubernetes.io/os": "linux"}),
            "{profile}"
        );

        let quota = objects.get(&("ResourceQuota".into(), "weir-resource-quota".into()));
        assert_eq!(quota.is_some(), profile == "gke", "{profile}");
        if let Some(quota) = quota {
            assert_eq!(
                quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"],
                json!(["system-node-critical"])
            );
            assert_eq!(pod["priorityClassName"], "system-node-critical");
        }
        let scc = objects.get(&("RoleBinding".into(), "weir-privileged-scc".into()));
        assert_eq!(scc.is_some(), profile == "openshift", "{profile}");
        if let Some(scc) = scc {
            assert_eq!(scc["roleRef"]["name"], "system:openshift:scc:privileged");
            assert_eq!(scc["subjects"][0]["name"], pod["serviceAccountName"]);
            assert_eq!(
                container(&objects)["securityContext"]["seLinuxOptions"],
                json!({"type": "spc_t"})
            );
        }
    }
}

/// istio-cni's values, set as an operator sets them, reach the agent with the same meaning.
#[test]
fn istio_cni_values_configure_the_agent() {
    let Some(helm) = helm() else { return };
    let objects = render(
        &helm,
        &[
            "--set",
            "istioOwnedCNIConfig=true,istioOwnedCNIConfigFileName=01-weir.conflist",
            "--set",
            "excludeNamespaces={kube-system,monitoring},ambient.dnsCapture=false",
            "--set",
            "repair.labelPods=true,repair.repairPods=false,logging.level=debug",
            "--set-json",
            r#"ambient.enablementSelectors=[{"podSelector":{"matchLabels":{"mesh":"yes"}}}]"#,
            "--set",
            "env.WEIR_RESYNC_INTERVAL=5m,global.hub=registry.example.com/istio,global.tag=1.2.3",
            "--set",
            "global.imagePullPolicy=IfNotPresent,global.imagePullSecrets={pull-secret}",
            "--set",
            "cniNetnsDir=/var/run/docker/netns,podLabels.team=mesh,terminationGracePeriodSeconds=5",
            "--set",
            "seccompProfile.type=RuntimeDefault,priorityClassName=mesh-critical",
        ],
    )
    .unwrap();
    let env = env(&objects);
    let weir_agent::cli::Command::Run(run) = parse_as_agent(&env).command else {
        unreachable!()
    };
    assert!(run.cni_dirs.owned_cni_config);
    assert_eq!(run.cni_dirs.owned_cni_config_filename, "01-weir.conflist");
    assert_eq!(run.exclude_namespaces, ["kube-system", "monitoring"]);
    assert!(!run.dns_capture);
    assert!(!run.repair_pods);
    assert_eq!(env["WEIR_REPAIR_BROKEN_PODS"], "label");
    assert_eq!(env["RUST_LOG"], "debug");
    assert_eq!(run.ambient_enablement_selector.map(|s| s.len()), Some(1));
    assert_eq!(run.resync_interval, std::time::Duration::from_secs(300));
    let container = container(&objects);
    assert_eq!(
        container["image"],
        "registry.example.com/istio/weir-agent:1.2.3"
    );
    assert_eq!(container["imagePullPolicy"], "IfNotPresent");
    assert_eq!(
        container["securityContext"]["seccompProfile"],
        json!({"type": "RuntimeDefault"})
    );
    assert_eq!(
        host_path_mounted_at(&objects, "/var/run/docker/netns"),
        "/var/run/docker/netns"
    );
    let template = &daemonset(&objects)["spec"]["template"];
    assert_eq!(template["metadata"]["labels"]["team"], "mesh");
    let pod = &template["spec"];
    assert_eq!(pod["imagePullSecrets"], json!([{"name": "pull-secret"}]));
    assert_eq!(pod["terminationGracePeriodSeconds"], 5);
    assert_eq!(pod["priorityClassName"], "mesh-critical");
}

/// weir's own image values win over istio's global ones; an empty pull policy is Kubernetes'.
#[test]
fn weir_s_image_values_win_over_istio_s_global_ones() {
    let Some(helm) = helm() else { return };
    let objects = render(
        &helm,
        &[
            "--set",
            "hub=weir.example.com,tag=0.9.0,pullPolicy=Always",
            "--set",
            "global.hub=istio.example.com,global.tag=1.26.0,global.imagePullPolicy=Never",
        ],
    )
    .unwrap();
    assert_eq!(
        container(&objects)["image"],
        "weir.example.com/weir-agent:0.9.0"
    );
    assert_eq!(container(&objects)["imagePullPolicy"], "Always");
    let objects = render(&helm, &["--set", "global.imagePullPolicy="]).unwrap();
    assert!(container(&objects).get("imagePullPolicy").is_none());
}

/// `helm lint` with these arguments: helm's output, and whether it passed.
fn lint(helm: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(helm)
        .arg("lint")
        .arg(deploy_dir().join("chart"))
        .args(args)
        .current_dir(deploy_dir())
        .output()
        .expect("helm runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// values.schema.json: the defaults, every profile and an istio-cni values file pass; a key the
/// chart does not know, at any level, is refused naming it, as is an istio-cni value weir
/// cannot honour.
#[test]
fn the_values_schema_refuses_unknown_keys_by_name() {
    let Some(helm) = helm() else { return };
    let (passed, out) = lint(&helm, &[]);
    assert!(passed, "{out}");
    for profile in std::fs::read_dir(deploy_dir().join("chart/profiles")).unwrap() {
        let profile = profile.unwrap().path();
        let (passed, out) = lint(&helm, &["-f", profile.to_str().unwrap()]);
        assert!(passed, "{}: {out}", profile.display());
    }
    let istio_values = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(istio_values.path(), ISTIO_CNI_VALUES).unwrap();
    let objects = render(&helm, &["-f", istio_values.path().to_str().unwrap()]).unwrap();
    assert_eq!(
        container(&objects)["image"],
        "registry.example.com/istio/weir-agent:1.26.0"
    );

    for (set, named) in [
        ("hubb=registry.example.com", "hubb"),
        ("ambient.dnsCaptur=false", "dnsCaptur"),
        ("monitoring.podMonitor.labelz.a=b", "labelz"),
        ("global.proxy.image=proxyv2", "proxy"),
        ("ambient.enabled=false", "enabled"),
        ("repair.initContainerName=validation", "initContainerName"),
    ] {
        let error = render(&helm, &["--set", set]).expect_err(set);
        assert!(error.contains(named), "{set}: {error}");
        let (passed, out) = lint(&helm, &["--set", set]);
        assert!(!passed && out.contains(named), "{set}: {out}");
    }
}

/// An istio-cni values file as an ambient operator writes it.
const ISTIO_CNI_VALUES: &str = "
global:
  hub: registry.example.com/istio
  tag: 1.26.0
  imagePullPolicy: IfNotPresent
  imagePullSecrets: [pull-secret]
cniBinDir: /opt/cni/bin
cniConfDir: /etc/cni/net.d
cniNetnsDir: /var/run/netns
excludeNamespaces: [kube-system]
podAnnotations: {}
seccompProfile: {}
ambient:
  enabled: true
  ipv6: true
  dnsCapture: true
  reconcileIptablesOnStartup: false
  shareHostNetworkNamespace: false
repair:
  enabled: true
  repairPods: true
  deletePods: false
  labelPods: false
  initContainerName: istio-validation
  brokenPodLabelKey: cni.istio.io/uninitialized
  brokenPodLabelValue: \"true\"
resources:
  requests: {cpu: 100m, memory: 100Mi}
";

/// Pod deletion is granted exactly when it is configured, and as deploy/repair-delete grants it;
/// values weir cannot honour are refused with a message, not ignored.
#[test]
fn pod_deletion_is_granted_as_configured_and_values_weir_cannot_honour_are_refused() {
    let Some(helm) = helm() else { return };
    let pods_verbs = |objects: &BTreeMap<(String, String), Value>| {
        objects[&("ClusterRole".into(), "weir".into())]["rules"][0]["verbs"].clone()
    };
    let default = render(&helm, &[]).unwrap();
    assert_eq!(pods_verbs(&default), json!(["get", "list", "watch"]));

    let deleting = render(&helm, &["--set", "repair.deletePods=true"]).unwrap();
    assert_eq!(env(&deleting)["WEIR_REPAIR_BROKEN_PODS"], "delete");
    assert_eq!(
        pods_verbs(&deleting),
        json!(["get", "list", "watch", "delete"])
    );
    let grant =
        objects(&std::fs::read_to_string(deploy_dir().join("repair-delete/rbac.yaml")).unwrap());
    let grant = &grant[&("ClusterRole".into(), "weir-repair-delete".into())]["rules"];
    assert_eq!(
        grant,
        &json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]}])
    );

    let disabled = render(
        &helm,
        &["--set", "repair.enabled=false,repair.deletePods=true"],
    )
    .unwrap();
    assert_eq!(env(&disabled)["WEIR_REPAIR_BROKEN_PODS"], "none");
    assert_eq!(env(&disabled)["REPAIR_REPAIR_PODS"], "false");
    assert_eq!(pods_verbs(&disabled), json!(["get", "list", "watch"]));

    let error = render(
        &helm,
        &["--set", "repair.deletePods=true,repair.labelPods=true"],
    )
    .expect_err("both actions at once");
    assert!(error.contains("set at most one"), "{error}");
    let error = render(&helm, &["--set", "chained=false,istioOwnedCNIConfig=true"])
        .expect_err("a standalone plugin in a chain of its own");
    assert!(error.contains("an owned config is a chain"), "{error}");
    let error = render(&helm, &["--set", "cniConfFileName=10-calico.conflist"])
        .expect_err("chaining into a chosen file");
    assert!(error.contains("names the standalone config"), "{error}");
}

/// The kinds the monitoring switches add; with their defaults the chart renders none of them (and
/// is deploy/weir.yaml, as `the_defaults_render_deploy_weir_yaml` checks).
const MONITORING_KINDS: [&str; 5] = [
    "PrometheusRule",
    "ServiceMonitor",
    "PodMonitor",
    "Service",
    "ConfigMap",
];

fn monitoring_objects(objects: &BTreeMap<(String, String), Value>) -> Vec<&(String, String)> {
    objects
        .keys()
        .filter(|(kind, _)| MONITORING_KINDS.contains(&kind.as_str()))
        .collect()
}

/// Whether `selector` (matchLabels) selects the DaemonSet's pods.
fn selects_the_agents_pods(objects: &BTreeMap<(String, String), Value>, selector: &Value) -> bool {
    let pod_labels = &daemonset(objects)["spec"]["template"]["metadata"]["labels"];
    let selector = selector.as_object().unwrap();
    !selector.is_empty()
        && selector
            .iter()
            .all(|(name, value)| &pod_labels[name] == value)
}

/// The agent container's port named `name`.
fn container_port(objects: &BTreeMap<(String, String), Value>, name: &str) -> u64 {
    container(objects)["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|port| port["name"] == name)
        .unwrap_or_else(|| panic!("no container port named {name}"))["containerPort"]
        .as_u64()
        .unwrap()
}

fn monitoring_file(name: &str) -> String {
    std::fs::read_to_string(deploy_dir().join("monitoring").join(name)).unwrap()
}

/// The scrape's relabelings: the job the rules and the dashboard select, and the node's name.
fn assert_relabels_job_and_node(endpoint: &Value) {
    assert_eq!(
        endpoint["relabelings"],
        json!([
            {"targetLabel": "job", "replacement": "weir"},
            {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"},
        ])
    );
}

/// Each monitoring switch renders its objects, which carry deploy/monitoring's rules and dashboard
/// as they are and scrape the agents' metrics port; off, they render nothing.
#[test]
fn monitoring_switches_render_the_rules_the_monitors_and_the_dashboard() {
    let Some(helm) = helm() else { return };
    assert_eq!(
        monitoring_objects(&render(&helm, &[]).unwrap()),
        Vec::<&(String, String)>::new()
    );

    let objects = render(
        &helm,
        &[
            "--set",
            "monitoring.prometheusRule.enabled=true,monitoring.prometheusRule.labels.release=kps",
            "--set",
            "monitoring.serviceMonitor.enabled=true,monitoring.serviceMonitor.interval=15s",
            "--set",
            "monitoring.dashboard.enabled=true,monitoring.dashboard.namespace=monitoring",
        ],
    )
    .unwrap();
    let rule = &objects[&("PrometheusRule".into(), "weir".into())];
    assert_eq!(rule["metadata"]["labels"]["release"], "kps");
    let rules: Value = serde_norway::from_str(&monitoring_file("weir.rules.yaml")).unwrap();
    assert_eq!(rule["spec"], rules, "the rules file, as it is");

    let service = &objects[&("Service".into(), "weir-metrics".into())];
    assert!(selects_the_agents_pods(
        &objects,
        &service["spec"]["selector"]
    ));
    let port = &service["spec"]["ports"][0];
    assert_eq!(port["targetPort"], "metrics");
    assert_eq!(
        port["port"].as_u64(),
        Some(container_port(&objects, "metrics"))
    );
    assert_eq!(container_port(&objects, "metrics"), 15014);
    let monitor = &objects[&("ServiceMonitor".into(), "weir".into())]["spec"];
    let service_labels = service["metadata"]["labels"].as_object().unwrap();
    for (name, value) in monitor["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(service_labels.get(name), Some(value), "{name}");
    }
    assert_eq!(
        monitor["namespaceSelector"],
        json!({"matchNames": ["istio-system"]})
    );
    let endpoint = &monitor["endpoints"][0];
    assert_eq!(
        (&endpoint["port"], &endpoint["path"]),
        (&json!("metrics"), &json!("/metrics"))
    );
    assert_eq!(endpoint["interval"], "15s");
    assert_relabels_job_and_node(endpoint);

    let dashboard = &objects[&("ConfigMap".into(), "weir-dashboard".into())];
    assert_eq!(dashboard["metadata"]["namespace"], "monitoring");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value =
        serde_json::from_str(dashboard["data"]["weir-dashboard.json"].as_str().unwrap()).unwrap();
    let file: Value = serde_json::from_str(&monitoring_file("weir-dashboard.json")).unwrap();
    assert_eq!(json, file, "the dashboard file, as it is");
    assert!(!objects.contains_key(&("PodMonitor".into(), "weir".into())));

    let objects = render(&helm, &["--set", "monitoring.podMonitor.enabled=true"]).unwrap();
    assert_eq!(
        monitoring_objects(&objects),
        [&("PodMonitor".to_owned(), "weir".to_owned())]
    );
    let monitor = &objects[&("PodMonitor".into(), "weir".into())]["spec"];
    assert!(selects_the_agents_pods(
        &objects,
        &monitor["selector"]["matchLabels"]
    ));
    let endpoint = &monitor["podMetricsEndpoints"][0];
    assert_eq!(
        (&endpoint["port"], &endpoint["path"]),
        (&json!("metrics"), &json!("/metrics"))
    );
    assert_relabels_job_and_node(endpoint);

    let error = render(
        &helm,
        &[
            "--set",
            "monitoring.podMonitor.enabled=true,monitoring.serviceMonitor.enabled=true",
        ],
    )
    .expect_err("both monitors at once");
    assert!(error.contains("enable at most one"), "{error}");
}
