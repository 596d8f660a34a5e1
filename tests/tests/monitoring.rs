//! deploy/monitoring's alert rules and Grafana dashboard, as Prometheus and the on-call get them:
//! promtool accepts the rules, every alert fires in the rules' unit tests
//! (deploy/monitoring/weir.rules.test.yaml) with a severity and a runbook that names a section of
//! the docs, and every expression of the rules and of the dashboard evaluates without error in a
//! real Prometheus scraping a real weir-agent, on metric names the agent serves.
//!
//! Needs Debian's `prometheus` package (`prometheus` and `promtool`; `cargo xtask test` installs
//! it): under `CI=true` a missing one fails the tests. The Prometheus test also needs privileges
//! (the agent loads its datapath) and the built `weir-agent` and `weir-cni`.
use std::collections::BTreeSet;
use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::os::{fd::AsFd, unix::process::CommandExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;
use weir_tests::{
    agent::{http_get, AgentBinary},
    chain::{CniChainNode, WAIT},
    privileged, required_program, wait_until, Metrics, NetNs, ZdsZtunnel,
};

/// How long Prometheus may take to start, scrape the agent three times and evaluate the rules.
const PROMETHEUS_TIMEOUT: Duration = Duration::from_secs(60);

fn monitoring_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring")
}

fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

fn rules_file() -> PathBuf {
    monitoring_dir().join("weir.rules.yaml")
}

fn yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn dashboard() -> Value {
    let path = monitoring_dir().join("weir-dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every rule of the rules file, alerting and recording.
fn rules() -> Vec<Value> {
    yaml(&rules_file())["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|group| group["rules"].as_array().unwrap().clone())
        .collect()
}

fn alerts() -> Vec<Value> {
    rules()
        .into_iter()
        .filter(|rule| rule["alert"].is_string())
        .collect()
}

fn program(name: &str) -> Option<PathBuf> {
    required_program(
        name,
        None,
        "install Debian's prometheus package (`cargo xtask test` does)",
    )
}

/// `program args…`, which must succeed; its output.
fn run(program: &Path, args: &[&Path]) -> String {
    let output = Command::new(program)
        .args(args)
        .current_dir(monitoring_dir())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{}: {text}", program.display());
    text
}

#[test]
fn promtool_accepts_the_rules() {
    let Some(promtool) = program("promtool") else {
        return;
    };
    let output = run(
        &promtool,
        &[Path::new("check"), Path::new("rules"), &rules_file()],
    );
    let count = rules().len();
    assert!(
        output.contains(&format!("SUCCESS: {count} rules found")),
        "{output}"
    );
}

/// The unit tests pass, and each alert is among the alerts they expect to fire, with a severity
/// the on-call routes by and the annotations Alertmanager's templates show.
#[test]
fn every_alert_fires_in_the_unit_tests_with_a_severity_and_a_runbook() {
    let Some(promtool) = program("promtool") else {
        return;
    };
    run(
        &promtool,
        &[
            Path::new("test"),
            Path::new("rules"),
            &monitoring_dir().join("weir.rules.test.yaml"),
        ],
    );
    let unit_tests = yaml(&monitoring_dir().join("weir.rules.test.yaml"));
    let shown_firing: BTreeSet<&str> = unit_tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|test| test["alert_rule_test"].as_array().unwrap())
        .filter(|case| case["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()))
        .map(|case| case["alertname"].as_str().unwrap())
        .collect();
    for alert in alerts() {
        let name = alert["alert"].as_str().unwrap();
        assert!(
            shown_firing.contains(name),
            "no unit test shows {name} firing"
        );
        let severity = alert["labels"]["severity"].as_str().unwrap_or_default();
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}: severity {severity:?}"
        );
        for annotation in ["summary", "description", "runbook_url"] {
            assert!(
                alert["annotations"][annotation].is_string(),
                "{name} has no {annotation}"
            );
        }
    }
}

/// GitHub's anchor of a Markdown heading: lower case, spaces to hyphens, punctuation other than
/// hyphens and underscores dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (not of `#` lines in its code blocks).
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut anchors = BTreeSet::new();
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            anchors.insert(anchor(line.trim_start_matches('#')));
        }
    }
    anchors
}

#[test]
fn every_runbook_url_names_a_section_of_the_docs() {
    for alert in alerts() {
        let name = alert["alert"].as_str().unwrap();
        let url = alert["annotations"]["runbook_url"].as_str().unwrap();
        let (file, section) = url
            .strip_prefix("docs/")
            .and_then(|rest| rest.split_once('#'))
            .unwrap_or_else(|| panic!("{name}: {url} is no docs/<file>#<section>"));
        let markdown = std::fs::read_to_string(docs_dir().join(file))
            .unwrap_or_else(|e| panic!("{name}: {url}: {e}"));
        assert!(
            anchors(&markdown).contains(section),
            "{name}: {file} has no section #{section}"
        );
    }
}

/// One copy of each file: deploy/monitoring links to the chart's, which the chart renders.
#[test]
fn deploy_monitoring_links_the_charts_files() {
    let chart_files = monitoring_dir().join("../chart/files");
    for name in ["weir.rules.yaml", "weir-dashboard.json"] {
        let link = monitoring_dir().join(name);
        assert!(link.is_symlink(), "{} is not a link", link.display());
        assert_eq!(
            link.canonicalize().unwrap(),
            chart_files.join(name).canonicalize().unwrap()
        );
    }
}

/// What Grafana sends for the dashboard's variables, on the one agent of the test.
fn substitute_variables(expr: &str, instance: &str) -> String {
    let expr = expr
        .replace("$__rate_interval", "1m")
        .replace("$node", instance);
    assert!(!expr.contains('$'), "a variable left in {expr}");
    expr
}

/// Every query of the dashboard: its panels' and its variables' (Grafana's
/// `label_values(metric, label)`, as the query that finds the same values).
fn dashboard_queries(instance: &str) -> Vec<String> {
    let dashboard = dashboard();
    let mut queries = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"].as_array().unwrap().iter().collect();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(substitute_variables(
                target["expr"].as_str().unwrap(),
                instance,
            ));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if variable["type"] != "query" {
            continue;
        }
        let query = variable["query"]["query"].as_str().unwrap();
        let (metric, label) = query
            .strip_prefix("label_values(")
            .and_then(|args| args.strip_suffix(')'))
            .and_then(|args| args.split_once(','))
            .unwrap_or_else(|| panic!("{query}: not label_values(metric, label)"));
        queries.push(format!("count by ({}) ({metric})", label.trim()));
    }
    queries
}

/// The metric names `expr` selects, told apart from its functions, keywords, label names and
/// values, and durations.
fn metric_names(expr: &str) -> BTreeSet<String> {
    /// Each followed by a list of label names, in brackets (`group_left` may have none).
    const GROUPINGS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    /// The aggregations, whose grouping may come before their brackets, and the other keywords.
    const KEYWORDS: [&str; 17] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // Skips from an opening bracket to past its closing one (label lists hold no brackets).
    let skip_to = |i: usize, close: char| {
        i + chars[i..]
            .iter()
            .position(|&c| c == close)
            .unwrap_or_else(|| {
                panic!("no {close} after {i} in {expr}");
            })
            + 1
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '{' {
            i = skip_to(i, '}');
        } else if c == '[' {
            i = skip_to(i, ']');
        } else if c == '"' {
            i = skip_to(i + 1, '"');
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace());
            if GROUPINGS.contains(&word.as_str()) {
                if next == Some(&'(') {
                    i = skip_to(i, ')');
                }
            } else if !KEYWORDS.contains(&word.as_str()) && next != Some(&'(') {
                names.insert(word);
            }
        } else if c.is_ascii_digit() {
            // A number (its exponent, if any, with it).
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The metric (family) `name` is a sample of, if it is one of `families`: a counter's `_total`,
/// a histogram's `_bucket`, `_count` and `_sum`.
fn family<'a>(name: &'a str, families: &BTreeSet<&str>) -> Option<&'a str> {
    ["", "_total", "_bucket", "_count", "_sum"]
        .into_iter()
        .filter_map(|suffix| name.strip_suffix(suffix))
        .find(|family| families.contains(family))
}

/// A Prometheus server in a network namespace, its storage in a temporary directory, stopped
/// (SIGTERM) when dropped.
struct Prometheus<'a> {
    netns: &'a NetNs,
    addr: SocketAddr,
    child: Child,
    dir: TempDir,
}

impl<'a> Prometheus<'a> {
    /// Starts `prometheus` in `netns`, scraping `target` every second as the job `weir`, with
    /// the rules file, and waits until it is ready.
    fn start(prometheus: &Path, netns: &'a NetNs, target: SocketAddr) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("weir-t-prometheus-")
            .tempdir()
            .unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 rule_files: [{rules:?}]\n\
                 scrape_configs:\n  \
                 - job_name: weir\n    \
                 static_configs: [{{targets: [\"{target}\"]}}]\n",
                rules = rules_file().canonicalize().unwrap(),
            ),
        )
        .unwrap();
        let addr = netns.run(|| {
            TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
        });
        let log = File::create(dir.path().join("log")).unwrap();
        let mut command = Command::new(prometheus);
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let netns_file = netns.open().unwrap();
        // SAFETY: setns is async-signal-safe, and the fd stays open until spawn returns.
        unsafe {
            command.pre_exec(move || weir_tests::netns::enter(netns_file.as_fd()));
        }
        let child = command.spawn().expect("starting prometheus");
        let mut server = Self {
            netns,
            addr,
            child,
            dir,
        };
        wait_until(PROMETHEUS_TIMEOUT, "prometheus ready", || {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("prometheus exited ({status}):\n{}", server.log());
            }
            server
                .get("/-/ready")
                .is_some_and(|(status, _)| status == 200)
        });
        server
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    fn get(&self, path: &str) -> Option<(u16, String)> {
        self.netns.run(|| http_get(self.addr, path)).ok()
    }

    /// An API answer's `data`, or its error.
    fn api(&self, path: &str) -> Result<Value, String> {
        let (_, body) = self
            .get(path)
            .unwrap_or_else(|| panic!("no answer to {path}:\n{}", self.log()));
        let answer: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
        match answer["status"].as_str() {
            Some("success") => Ok(answer["data"].clone()),
            _ => Err(format!("{}: {}", answer["errorType"], answer["error"])),
        }
    }

    /// An instant query's result: the vector's samples (a scalar or string result is one).
    fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let query: String = form_urlencoded::byte_serialize(expr.as_bytes()).collect();
        let data = self.api(&format!("/api/v1/query?query={query}"))?;
        Ok(match data["resultType"].as_str() {
            Some("vector") | Some("matrix") => data["result"].as_array().unwrap().clone(),
            _ => vec![data["result"].clone()],
        })
    }
}

impl Drop for Prometheus<'_> {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

/// The sample names and the metric (family) names of a /metrics text.
fn samples_and_families(text: &str) -> (BTreeSet<&str>, BTreeSet<&str>) {
    let mut samples = BTreeSet::new();
    let mut families = BTreeSet::new();
    for line in text.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            families.extend(declared.split_whitespace().next());
        } else if !line.starts_with('#') {
            samples.extend(
                line.split(['{', ' '])
                    .next()
                    .filter(|name| !name.is_empty()),
            );
        }
    }
    (samples, families)
}

/// Prometheus, scraping a real agent (the production binary, on a test node) and loading the rules
/// file: every rule evaluates without error, every expression of the rules and the dashboard
/// queries without error, every metric they name is served (or documented, for a labelled
/// family that has counted nothing yet), and every dashboard query on metrics that have samples
/// shows data.
#[test]
fn every_expression_evaluates_in_prometheus_scraping_a_real_agent() {
    let Some(prometheus_program) = program("prometheus") else {
        return;
    };
    let node = privileged!(CniChainNode::new());
    let agent = node.start_agent_process(AgentBinary::Run { env: &[] });
    // An ambient pod enrolled and acknowledged: the counters of the plugin's requests and of
    // ZDS, and the pod's own, have samples to show.
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).expect("ztunnel connects");
    let (_pod, _stand_in) = node.ambient_pod(&ztunnel, "app");
    let target = agent.config.metrics_addr;
    wait_until(WAIT, "the pod acknowledged", || {
        let metrics = node.netns().run(|| Metrics::scrape(target)).unwrap();
        metrics.value("weir_enrolled_pods", &[("status", "enabled")]) == Some(1.0)
    });
    let prometheus = Prometheus::start(&prometheus_program, node.netns(), target);

    let scraped = try_query_until_found(
        &prometheus,
        "three scrapes of the agent",
        r#"sum_over_time(up{job="weir"}[1m]) >= 3"#,
    );
    assert_eq!(scraped.len(), 1, "{scraped:?}");
    let rules = wait_until(PROMETHEUS_TIMEOUT, "every rule evaluated", || {
        let groups = prometheus.api("/api/v1/rules").unwrap()["groups"].clone();
        let rules: Vec<Value> = groups
            .as_array()?
            .iter()
            .flat_map(|group| group["rules"].as_array().unwrap().clone())
            .collect();
        rules
            .iter()
            .all(|rule| !rule["lastEvaluation"].as_str().unwrap().starts_with("0001"))
            .then_some(rules)
    });
    assert_eq!(rules.len(), self::rules().len(), "every rule loaded");
    for rule in &rules {
        assert_eq!(rule["health"], "ok", "{rule}");
    }

    let (_, metrics) = node
        .netns()
        .run(|| http_get(target, "/metrics"))
        .expect("the agent's /metrics");
    let (samples, families) = samples_and_families(&metrics);
    let instance = target.to_string();
    let dashboard_queries = dashboard_queries(&instance);
    let rule_exprs: Vec<String> = self::rules()
        .iter()
        .map(|rule| rule["expr"].as_str().unwrap().to_owned())
        .collect();
    let documented = documented_metrics();
    let known: BTreeSet<&str> = documented.iter().map(String::as_str).collect();
    let mut not_served = BTreeSet::new();
    for expr in dashboard_queries.iter().chain(&rule_exprs) {
        let result = prometheus
            .query(expr)
            .unwrap_or_else(|error| panic!("{expr}: {error}"));
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no metric found in {expr}");
        for name in names.iter().filter(|name| *name != "up") {
            // A family with labels has no lines before it counts something: such a metric
            // must be one of operations.md's.
            if family(name, &families).is_none() {
                assert!(
                    known.contains(name.as_str()) || family(name, &known).is_some(),
                    "{expr}: {name} is neither served by the agent nor documented"
                );
                not_served.insert(name.clone());
            }
        }
        let has_samples = names
            .iter()
            .all(|name| name == "up" || samples.contains(name.as_str()));
        if dashboard_queries.contains(expr) && has_samples {
            assert!(!result.is_empty(), "{expr} shows nothing");
        }
    }
    eprintln!("nothing counted yet, so not checked for data: {not_served:?}");
}

/// The metric names in the table of docs/operations.md's "Metrics" section.
fn documented_metrics() -> BTreeSet<String> {
    let operations = std::fs::read_to_string(docs_dir().join("operations.md")).unwrap();
    let section = operations
        .split_once("\n## Metrics\n")
        .and_then(|(_, rest)| rest.split("\n## ").next())
        .expect("a Metrics section in operations.md");
    section
        .lines()
        .filter_map(|line| line.strip_prefix("| `")?.split_once('`'))
        .map(|(name, _)| name.to_owned())
        .collect()
}

/// Waits until `expr` has a result, and returns it.
fn try_query_until_found(prometheus: &Prometheus, what: &str, expr: &str) -> Vec<Value> {
    let found = weir_tests::try_wait_until(PROMETHEUS_TIMEOUT, || {
        let result = prometheus.query(expr).unwrap();
        (!result.is_empty()).then_some(result)
    });
    found.unwrap_or_else(|| {
        let targets = prometheus.api("/api/v1/targets");
        panic!("no {what} within {PROMETHEUS_TIMEOUT:?}: targets {targets:?}")
    })
}

#[test]
fn metric_names_are_told_apart_from_functions_labels_and_keywords() {
    assert_eq!(
        metric_names(
            r#"histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{result="ok",x=~"b|c"}[10m]))) > 1e3
               and on (job) b_total / ignoring (x) group_left c unless max without (y) (d offset 5m)
               or count(count by (version) (e))"#
        ),
        ["a_bucket", "b_total", "c", "d", "e"]
            .map(String::from)
            .into()
    );
}
