//! `kubectl weir`, the plugin, as an operator runs it: given a pod, it finds the weir pod on that
//! pod's node through the API server (the stand-in, through a kubeconfig, at the context chosen)
//! and runs weir-agent's command there with `kubectl exec`, whose output and exit status become
//! its own; a bug report is saved to a local file. kubectl is a stand-in on PATH: a script that
//! records its arguments and answers with the output and status a test gives it.
//!
//! The tests run the built binary (`cargo build -p kubectl-weir` first). No privileges needed.
use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::{json, Value};
use tempfile::TempDir;
use weir_tests::{agent::workspace_binary, ApiServer};

/// What the kubectl stand-in writes to stderr on every run.
const KUBECTL_STDERR: &str = "kubectl stand-in: done";

/// The labels of weir's pods and the name of their agent container, as deploy/weir.yaml's
/// DaemonSet gives them: the pods the plugin must find are the ones weir's manifest makes.
fn weir_pod_template() -> (Value, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/weir.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let daemonset = serde_norway::Deserializer::from_str(&text)
        .map(|document| Value::deserialize(document).unwrap())
        .find(|object| object["kind"] == "DaemonSet")
        .expect("deploy/weir.yaml has weir's DaemonSet");
    let template = &daemonset["spec"]["template"];
    let container = template["spec"]["containers"][0]["name"].as_str().unwrap();
    (template["metadata"]["labels"].clone(), container.to_owned())
}

/// A pod in `namespace` on `node` (unscheduled without one), with `labels`, running.
fn pod(namespace: &str, name: &str, node: Option<&str>, labels: &Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "app"}]},
        "status": {"phase": if node.is_some() { "Running" } else { "Pending" }},
    }))
    .unwrap()
}

/// Two clusters, each an API stand-in: `stand-in`, the kubeconfig's current context (namespace
/// `shop`), with weir on node-a and node-b, and `other`, with weir on node-a alone.
struct Setup {
    api: ApiServer,
    other: ApiServer,
    /// Holds the kubeconfig, kubectl's stand-in and what it records (`kubectl/`), and the
    /// directory the plugin runs in (`work/`).
    dir: TempDir,
    container: String,
    /// Serves the stand-ins; dropped after them.
    _runtime: tokio::runtime::Runtime,
}

impl Setup {
    fn new() -> Self {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let api = runtime.block_on(ApiServer::start()).unwrap();
        let other = runtime.block_on(ApiServer::start()).unwrap();
        let (weir, container) = weir_pod_template();
        let app = json!({"app": "shop"});

        // An upgrade's old pod, going away, listed first: the running one beside it is the one
        // to ask.
        let mut leaving = pod("istio-system", "weir-8k2xq", Some("node-a"), &weir);
        leaving.metadata.deletion_timestamp =
            serde_json::from_value(json!("2025-01-01T00:00:00Z")).unwrap();
        api.create(&leaving);
        api.create(&pod("istio-system", "weir-a", Some("node-a"), &weir));
        api.create(&pod("istio-system", "weir-b", Some("node-b"), &weir));
        // weir's labels in another namespace, where another install could run.
        api.create(&pod("weir-canary", "weir-canary-a", Some("node-a"), &weir));
        api.create(&pod("shop", "cart", Some("node-a"), &app));
        api.create(&pod("shop", "ledger", Some("node-b"), &app));
        api.create(&pod("shop", "waiting", None, &app));
        api.create(&pod("shop", "lonely", Some("node-c"), &app));
        other.create(&pod("istio-system", "weir-other-a", Some("node-a"), &weir));
        other.create(&pod("default", "cart", Some("node-a"), &app));

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("work")).unwrap();
        std::fs::write(
            dir.path().join("kubeconfig"),
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: stand-in\n\
                 clusters:\n\
                 - {{name: stand-in, cluster: {{server: \"{}\"}}}}\n\
                 - {{name: other, cluster: {{server: \"{}\"}}}}\n\
                 contexts:\n\
                 - {{name: stand-in, context: {{cluster: stand-in, user: nobody, namespace: shop}}}}\n\
                 - {{name: other, context: {{cluster: other, user: nobody}}}}\n\
                 users: [{{name: nobody, user: {{}}}}]\n",
                api.url(),
                other.url()
            ),
        )
        .unwrap();
        let setup = Self {
            api,
            other,
            dir,
            container,
            _runtime: runtime,
        };
        let kubectl = setup.kubectl_dir();
        std::fs::create_dir(&kubectl).unwrap();
        let script = kubectl.join("kubectl");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\n\
                 printf '%s\\n' \"$@\" > '{dir}/argv'\n\
                 printf '%s' \"$KUBECONFIG\" > '{dir}/KUBECONFIG'\n\
                 cat '{dir}/stdout'\n\
                 echo '{KUBECTL_STDERR}' >&2\n\
                 exit \"$(cat '{dir}/status')\"\n",
                dir = kubectl.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        setup.kubectl_answers(b"", 0);
        setup
    }

    fn kubectl_dir(&self) -> PathBuf {
        self.dir.path().join("kubectl")
    }

    fn work_dir(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// What kubectl's stand-in prints to stdout and exits with from now on.
    fn kubectl_answers(&self, stdout: &[u8], status: u8) {
        std::fs::write(self.kubectl_dir().join("stdout"), stdout).unwrap();
        std::fs::write(self.kubectl_dir().join("status"), status.to_string()).unwrap();
        // Each run is known by the arguments it records.
        let _ = std::fs::remove_file(self.kubectl_dir().join("argv"));
    }

    /// kubectl's arguments in its last run since [`Setup::kubectl_answers`]; none if it did not run.
    fn kubectl_argv(&self) -> Option<Vec<String>> {
        let argv = std::fs::read_to_string(self.kubectl_dir().join("argv")).ok()?;
        Some(argv.lines().map(str::to_owned).collect())
    }

    /// `kubectl-weir args…` in the work directory, with $KUBECONFIG naming the kubeconfig and
    /// kubectl's stand-in first on PATH, as a kubectl plugin runs.
    fn plugin(&self, args: &[&str]) -> Output {
        let path = std::env::join_paths(std::iter::once(self.kubectl_dir()).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ))
        .unwrap();
        Command::new(workspace_binary("kubectl-weir"))
            .args(args)
            .current_dir(self.work_dir())
            .env("PATH", path)
            .env("KUBECONFIG", self.kubeconfig())
            .env_remove("WEIR_NAMESPACE")
            .stdin(Stdio::null())
            .output()
            .expect("running kubectl-weir")
    }

    /// kubectl's arguments for running `weir-agent agent_args…` in `namespace/pod`.
    fn exec_argv(&self, namespace: &str, pod: &str, agent_args: &[&str]) -> Vec<String> {
        let exec = [
            "exec",
            "-n",
            namespace,
            pod,
            "-c",
            &self.container,
            "--",
            "weir-agent",
        ];
        exec.iter()
            .chain(agent_args)
            .map(|arg| arg.to_string())
            .collect()
    }
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The plugin failed with an error naming `expected`, and never ran kubectl.
fn assert_refused(setup: &Setup, output: &Output, expected: &[&str]) {
    let stderr = stderr(output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    for part in expected {
        assert!(stderr.contains(part), "{part:?} not in: {stderr}");
    }
    assert_eq!(setup.kubectl_argv(), None, "kubectl ran: {stderr}");
}

#[test]
fn each_command_runs_in_the_weir_pod_on_the_pods_node() {
    let setup = Setup::new();
    let table = b"POD  UID  MODE\nshop/cart  1234  ambient\n";
    setup.kubectl_answers(table, 0);

    // The pod in the context's namespace, on node-a, where weir-a runs (weir-8k2xq is leaving).
    let output = setup.plugin(&["pods", "cart", "-o", "wide"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        setup.kubectl_argv().unwrap(),
        setup.exec_argv("istio-system", "weir-a", &["pods", "--output=wide"])
    );
    assert_eq!(output.stdout, table, "kubectl's stdout is the plugin's");
    assert!(
        stderr(&output).contains(KUBECTL_STDERR),
        "{}",
        stderr(&output)
    );
    // kubectl reads the same kubeconfig, from the same environment.
    let seen = std::fs::read_to_string(setup.kubectl_dir().join("KUBECONFIG")).unwrap();
    assert_eq!(Path::new(&seen), setup.kubeconfig());

    // A pod on node-b; the arguments after `--` go to weir-agent's command as they are.
    setup.kubectl_answers(b"", 0);
    let output = setup.plugin(&["trace", "-n", "shop", "ledger", "--", "--verdict", "drop"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        setup.kubectl_argv().unwrap(),
        setup.exec_argv(
            "istio-system",
            "weir-b",
            &["trace", "--pod=shop/ledger", "--verdict", "drop"]
        )
    );

    // A node named instead of a pod: the whole node's decisions, or its check.
    setup.kubectl_answers(b"", 0);
    let output = setup.plugin(&["trace", "--node", "node-a"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        setup.kubectl_argv().unwrap(),
        setup.exec_argv("istio-system", "weir-a", &["trace"])
    );
    setup.kubectl_answers(b"", 0);
    let output = setup.plugin(&["check", "--node", "node-b"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        setup.kubectl_argv().unwrap(),
        setup.exec_argv("istio-system", "weir-b", &["check"])
    );

    setup.kubectl_answers(b"", 0);
    let output = setup.plugin(&["explain", "cart"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        setup.kubectl_argv().unwrap(),
        setup.exec_argv("istio-system", "weir-a", &["explain", "shop/cart"])
    );

    // weir installed in another namespace.
    setup.kubectl_answers(b"", 0);
    let output = setup.plugin(&["pods", "--weir-namespace", "weir-canary", "cart"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        setup.kubectl_argv().unwrap(),
        setup.exec_argv("weir-canary", "weir-canary-a", &["pods"])
    );
}

#[test]
fn the_context_and_kubeconfig_given_are_the_cluster_asked_and_passed_to_kubectl() {
    let setup = Setup::new();
    let output = setup.plugin(&["--context", "other", "pods", "cart"]);
    assert!(output.status.success(), "{}", stderr(&output));
    // `other`'s namespace is `default`, where its cart runs on node-a.
    let mut expected = vec!["--context".to_owned(), "other".to_owned()];
    expected.extend(setup.exec_argv("istio-system", "weir-other-a", &["pods"]));
    assert_eq!(setup.kubectl_argv().unwrap(), expected);
    assert!(setup.other.requests().iter().any(|r| r.verb == "get"));

    setup.kubectl_answers(b"", 0);
    let kubeconfig = setup.kubeconfig();
    let kubeconfig = kubeconfig.to_str().unwrap();
    let output = setup.plugin(&["check", "--kubeconfig", kubeconfig, "-n", "shop", "ledger"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let mut expected = vec!["--kubeconfig".to_owned(), kubeconfig.to_owned()];
    expected.extend(setup.exec_argv("istio-system", "weir-b", &["check"]));
    assert_eq!(setup.kubectl_argv().unwrap(), expected);
}

#[test]
fn the_commands_exit_status_is_the_plugins() {
    let setup = Setup::new();
    setup.kubectl_answers(b"\xe2\x9c\x97 cni: no primary CNI config\n", 1);
    let output = setup.plugin(&["check", "cart"]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert_eq!(output.stdout, "✗ cni: no primary CNI config\n".as_bytes());
    setup.kubectl_answers(b"", 3);
    let output = setup.plugin(&["pods", "cart"]);
    assert_eq!(output.status.code(), Some(3), "{}", stderr(&output));
    assert!(
        stderr(&output).contains(KUBECTL_STDERR),
        "{}",
        stderr(&output)
    );
}

#[test]
fn a_bug_report_is_saved_whole_to_a_local_file_and_never_over_another() {
    let setup = Setup::new();
    let archive: Vec<u8> = (0..=255).cycle().take(70_000).collect();
    setup.kubectl_answers(&archive, 0);
    let output = setup.plugin(&["bug-report", "cart"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        setup.kubectl_argv().unwrap(),
        setup.exec_argv("istio-system", "weir-a", &["bug-report", "--output=-"])
    );
    let saved = setup.work_dir().join("weir-bug-report-node-a.tar.gz");
    assert_eq!(std::fs::read(&saved).unwrap(), archive);
    assert!(
        output.stdout.is_empty(),
        "the archive went to the file alone"
    );
    assert!(
        stderr(&output).contains("weir-bug-report-node-a.tar.gz"),
        "{}",
        stderr(&output)
    );

    // A second report of the node is refused before kubectl runs: the first one stays.
    setup.kubectl_answers(b"another", 0);
    let output = setup.plugin(&["bug-report", "--node", "node-a"]);
    assert_refused(
        &setup,
        &output,
        &["weir-bug-report-node-a.tar.gz exists", "--output"],
    );
    assert_eq!(std::fs::read(&saved).unwrap(), archive);

    // A report that fails leaves no file, whole or partial, and its status.
    setup.kubectl_answers(b"half an archi", 2);
    let output = setup.plugin(&["bug-report", "ledger", "--output", "ledger.tar.gz"]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    let mut files: Vec<_> = std::fs::read_dir(setup.work_dir())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    files.sort();
    assert_eq!(files, ["weir-bug-report-node-a.tar.gz"]);
}

#[test]
fn a_pod_missing_unscheduled_or_on_a_node_without_weir_is_a_clear_error() {
    let setup = Setup::new();
    let output = setup.plugin(&["pods", "-n", "shop", "gone"]);
    assert_refused(&setup, &output, &["pod shop/gone not found"]);

    let output = setup.plugin(&["pods", "waiting"]);
    assert_refused(&setup, &output, &["pod shop/waiting is not scheduled yet"]);

    let output = setup.plugin(&["trace", "lonely"]);
    assert_refused(
        &setup,
        &output,
        &[
            "no weir pod on node node-c",
            "namespace istio-system",
            "app.kubernetes.io/name=weir,app.kubernetes.io/component=node-agent",
            "weir may not run on that node",
        ],
    );
    // The selector the plugin lists weir's pods with, on the node's pods alone.
    let list = setup
        .api
        .requests()
        .into_iter()
        .rfind(|request| request.verb == "list")
        .unwrap();
    assert_eq!(list.path, "/api/v1/namespaces/istio-system/pods");
    assert_eq!(list.param("fieldSelector").unwrap(), "spec.nodeName=node-c");

    let output = setup.plugin(&["check", "--node", "node-z"]);
    assert_refused(&setup, &output, &["no weir pod on node node-z"]);

    let output = setup.plugin(&["--context", "nowhere", "pods", "cart"]);
    assert_refused(&setup, &output, &["nowhere"]);
}

#[test]
fn the_completion_script_knows_the_commands() {
    let output = Command::new(workspace_binary("kubectl-weir"))
        .args(["completion", "bash"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let script = String::from_utf8(output.stdout).unwrap();
    for command in [
        "pods",
        "trace",
        "check",
        "bug-report",
        "explain",
        "--weir-namespace",
    ] {
        assert!(script.contains(command), "{command} not in:\n{script}");
    }
}
