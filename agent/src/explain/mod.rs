//! `weir-agent explain`: whether a pod is captured and why, and what one of its connections
//! would meet, read next to a running agent without disturbing it: the agent's state file and
//! pinned maps as `weir-agent pods` reads them, the policy file when given, and the very map
//! entries the programs look up ([`predict`]).
mod predict;

use std::{
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    path::Path,
};

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use ipnet::IpNet;
use serde::Serialize;
use weir_common::{
    list, PodConfig, POD_INBOUND_ALL_PORTS, POD_OUTBOUND_ALL_RANGES, POD_SIDECAR, POD_SIDECAR_IPV6,
    POD_TPROXY,
};

pub use predict::{Outbound, Prediction};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{Api, ResourceExt};

use crate::{
    cli::RunArgs,
    cluster,
    datapath::PinnedLookups,
    inspect::{self, PodRow},
    policy::{local::LocalPolicy, Decision, Labels, PodFacts, PolicyConfig},
    workload::{AllOr, InterceptionMode, Mode, PodName, PodOptions, Status},
};

#[derive(clap::Args)]
pub struct ExplainArgs {
    /// The pod: `namespace/name`, or its uid.
    pub pod: String,
    /// Predict an outbound TCP connection from the pod's app to this address and port.
    #[arg(long, value_name = "ADDR:PORT", conflicts_with = "from")]
    pub to: Option<SocketAddr>,
    /// With --to: a UDP datagram sent to it (sendto, as resolvers send DNS), not a TCP connection.
    #[arg(long, requires = "to")]
    pub udp: bool,
    /// Predict a new inbound TCP connection from this address to the pod's --port.
    #[arg(long, value_name = "ADDR", requires = "port")]
    pub from: Option<IpAddr>,
    /// With --from: the pod's port the connection is made to.
    #[arg(long, requires = "from")]
    pub port: Option<u16>,
    /// How the explanation is printed.
    #[arg(long, short = 'o', value_enum, default_value_t = ExplainOutput::Text)]
    pub output: ExplainOutput,
    /// `run`'s flags: --state-file, and --policy-file, or --kubeconfig or --node-name (the API
    /// server), with the enablement flags, to tell why the policy does or does not enroll the
    /// pod.
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExplainOutput {
    /// Lines for an operator.
    Text,
    /// One JSON object (fields below).
    Json,
}

/// The JSON output's fields, for `--help`.
pub const JSON_FIELDS: &str = "\
JSON output (--output json): one object with these fields:
  pod                the pod as asked
  namespace, name    the pod's (null: unknown)
  uid                metadata.uid (null: the pod is nowhere on this node)
  enrolled           the maps hold the pod: its traffic is redirected
  why                why it is or is not enrolled, as far as the state file and maps tell
  mode               \"ambient\" or \"sidecar\" (null: not enrolled)
  status             \"enabled\", \"pending\" or null, as `weir-agent pods` shows it
  netns_cookie       the maps' key (null: not in the maps)
  ips                addresses the maps index for the pod
  options            {\"inbound_bypass\", \"dns_capture\", \"reroute_interfaces\"} from the maps
                     and the state file (null: not enrolled)
  sidecar            a sidecar pod's capture from the maps: interception_mode, proxy_uid,
                     proxy_gid, ipv6_captured, include_inbound_ports (\"all\" or {\"only\": [..]}),
                     exclude_inbound_ports, include_outbound_ports, exclude_outbound_ports,
                     include_outbound_ranges, exclude_outbound_ranges, excluded_interface_routes
  policy             with --policy-file, --kubeconfig or --node-name: {\"source\", \"decision\"
                     (ambient, sidecar or none), \"reasons\"}
  connection         with --to or --from: {\"hook\", \"protocol\", \"source\", \"destination\",
                     \"verdict\" (as `weir-agent trace` records it; null: let through untouched,
                     unrecorded), \"target\", \"rule\", \"unless\"}";

/// What `explain` found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub pod: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub uid: Option<String>,
    pub enrolled: bool,
    pub why: Vec<String>,
    pub mode: Option<Mode>,
    pub status: Option<Status>,
    pub netns_cookie: Option<u64>,
    pub ips: Vec<IpAddr>,
    pub options: Option<PodOptions>,
    pub sidecar: Option<SidecarCapture>,
    pub policy: Option<PolicyVerdict>,
    pub connection: Option<Prediction>,
}

/// A sidecar pod's capture, as its map entries hold it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SidecarCapture {
    pub interception_mode: InterceptionMode,
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    pub ipv6_captured: bool,
    pub include_inbound_ports: AllOr<u16>,
    pub exclude_inbound_ports: Vec<u16>,
    pub include_outbound_ports: Vec<u16>,
    pub exclude_outbound_ports: Vec<u16>,
    pub include_outbound_ranges: AllOr<IpNet>,
    pub exclude_outbound_ranges: Vec<IpNet>,
    /// Destinations the pod routes out of an excluded interface (excludeInterfaces).
    pub excluded_interface_routes: Vec<IpNet>,
}

/// What the policy decides for the pod, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyVerdict {
    pub source: String,
    /// ambient, sidecar or none.
    pub decision: &'static str,
    pub reasons: Vec<String>,
}

/// Explains `args.pod` from the maps pinned under `pin_root` and the state file.
pub async fn explain(args: &ExplainArgs, pin_root: &Path) -> Result<Explanation> {
    let rows = inspect::pods(pin_root, &args.run.state.state_file)?;
    let row = find(&rows, &args.pod)?;
    let pod_name = match row {
        Some(PodRow {
            namespace: Some(namespace),
            name: Some(name),
            ..
        }) => Some(PodName::new(namespace, name)),
        _ => args
            .pod
            .split_once('/')
            .map(|(namespace, name)| PodName::new(namespace, name)),
    };
    // The maps' part is worth showing when the policy's source cannot be read.
    let (policy, policy_unread) = match &pod_name {
        Some(pod) => match policy_verdict(&args.run, pod).await {
            Ok(policy) => (policy, None),
            Err(error) => (
                None,
                Some(format!("the policy could not be read: {error:#}")),
            ),
        },
        None => (None, None),
    };
    let mut explanation = Explanation {
        pod: args.pod.clone(),
        namespace: pod_name.as_ref().map(|pod| pod.namespace.clone()),
        name: pod_name.as_ref().map(|pod| pod.name.clone()),
        uid: row.map(|row| row.uid.clone()),
        enrolled: false,
        why: policy_unread.into_iter().collect(),
        mode: None,
        status: None,
        netns_cookie: None,
        ips: Vec::new(),
        options: None,
        sidecar: None,
        policy,
        connection: None,
    };
    let Some(row) = row.filter(|row| row.in_maps) else {
        explanation.why.push(match row {
            Some(_) => "the state file records it as enrolled, but the maps do not hold it: \
                        nothing redirects it (an orphan record)"
                .into(),
            None => "neither the state file nor the maps know it: the agent has not enrolled \
                     it on this node (not ambient or a sidecar pod by the policy, not on this \
                     node, or its enrollment failed: see the agent's log and the pod's events)"
                .into(),
        });
        if args.to.is_some() || args.from.is_some() {
            explanation.why.push(
                "its connections are not redirected: the programs let them through unrecorded"
                    .into(),
            );
        }
        return Ok(explanation);
    };
    let netns_cookie = row
        .netns_cookie
        .context("an enrolled pod has a netns cookie")?;
    let maps = PinnedLookups::open(pin_root)?
        .with_context(|| format!("no weir maps pinned under {}", pin_root.display()))?;
    let config = maps
        .pod(netns_cookie)?
        .context("the pod left the maps while they were read")?;
    let pod = predict::Pod {
        netns_cookie,
        config: &config,
        maps: &maps,
    };
    explanation.enrolled = true;
    explanation.why.push(match row.mode {
        Mode::Ambient => "the maps hold it as an ambient pod: redirected to ztunnel".into(),
        Mode::Sidecar => {
            "the maps hold it as a sidecar pod: redirected to its own istio-proxy".into()
        }
    });
    if !row.in_state_file {
        explanation
            .why
            .push("the state file has no record of it: its name is unknown".into());
    }
    if row.mode == Mode::Ambient && row.status != Some(Status::Enabled) {
        explanation.why.push(
            "ztunnel has not acknowledged it (status pending): new inbound connections are \
             dropped until ztunnel listens in the pod"
                .into(),
        );
    }
    explanation.mode = Some(row.mode);
    explanation.status = row.status;
    explanation.netns_cookie = Some(netns_cookie);
    explanation.ips = row.ips.clone();
    explanation.options = Some(row.options.clone());
    if config.has(POD_SIDECAR) {
        explanation.sidecar = Some(sidecar_capture(&config, &maps, netns_cookie)?);
    }
    explanation.connection = match (args.to, args.from, args.port) {
        (Some(destination), _, _) => Some(pod.outbound(Outbound {
            destination,
            udp: args.udp,
        })?),
        (None, Some(source), Some(port)) => Some(pod.inbound(source, port)?),
        _ => None,
    };
    Ok(explanation)
}

/// The pod asked for: `namespace/name`, or a uid.
fn find<'a>(rows: &'a [PodRow], wanted: &str) -> Result<Option<&'a PodRow>> {
    if wanted.is_empty() {
        bail!("name a pod: `namespace/name` or its uid");
    }
    Ok(rows.iter().find(|row| match wanted.split_once('/') {
        Some((namespace, name)) => {
            row.namespace.as_deref() == Some(namespace) && row.name.as_deref() == Some(name)
        }
        None => row.uid == wanted,
    }))
}

fn sidecar_capture(
    config: &PodConfig,
    maps: &PinnedLookups,
    netns_cookie: u64,
) -> Result<SidecarCapture> {
    let ports = maps.ports_of(netns_cookie)?;
    let ranges = maps.ranges_of(netns_cookie)?;
    let ports_in = |wanted: u8| -> Vec<u16> {
        ports
            .iter()
            .filter(|(list, _)| *list == wanted)
            .map(|(_, port)| *port)
            .collect()
    };
    let ranges_in = |wanted: u8, value: Option<u8>| -> Vec<IpNet> {
        ranges
            .iter()
            .filter(|(list, _, v)| *list == wanted && value.is_none_or(|value| *v == value))
            .map(|(_, range, _)| *range)
            .collect()
    };
    let all_or = |all: bool, only| if all { AllOr::All } else { AllOr::Only(only) };
    Ok(SidecarCapture {
        interception_mode: if config.has(POD_TPROXY) {
            InterceptionMode::Tproxy
        } else {
            InterceptionMode::Redirect
        },
        proxy_uid: config.proxy_uid,
        proxy_gid: config.proxy_gid,
        ipv6_captured: config.has(POD_SIDECAR_IPV6),
        include_inbound_ports: all_or(
            config.has(POD_INBOUND_ALL_PORTS),
            ports_in(list::INBOUND_INCLUDE),
        ),
        exclude_inbound_ports: ports_in(list::INBOUND_EXCLUDE),
        include_outbound_ports: ports_in(list::OUTBOUND_INCLUDE),
        exclude_outbound_ports: ports_in(list::OUTBOUND_EXCLUDE),
        include_outbound_ranges: match config.has(POD_OUTBOUND_ALL_RANGES) {
            true => AllOr::All,
            false => AllOr::Only(ranges_in(list::OUTBOUND_INCLUDE, None)),
        },
        exclude_outbound_ranges: ranges_in(list::OUTBOUND_EXCLUDE, None),
        excluded_interface_routes: ranges_in(list::ROUTES, Some(list::ROUTE_EXCLUDED)),
    })
}

/// What the policy decides for the pod, and why: from the policy file's labels and annotations,
/// or the API server's (`--kubeconfig`, or `--node-name` in the cluster), with the node's
/// enablement settings; `None` without either source.
async fn policy_verdict(run: &RunArgs, pod: &PodName) -> Result<Option<PolicyVerdict>> {
    let (source, facts) = match (&run.policy_file, &run.kubeconfig, &run.node_name) {
        (Some(file), _, _) => (
            format!("policy file {}", file.display()),
            LocalPolicy::load(file)?.facts(pod, &Labels::new()),
        ),
        (None, None, None) => return Ok(None),
        (None, kubeconfig, _) => (
            "the API server".to_owned(),
            cluster_facts(kubeconfig.as_deref(), pod).await?,
        ),
    };
    Ok(Some(decide(&run.policy(), source, &facts)?))
}

/// The pod's and its namespace's labels and annotations, as the API server has them.
async fn cluster_facts(kubeconfig: Option<&Path>, pod: &PodName) -> Result<PodFacts> {
    let client = cluster::client(kubeconfig).await?;
    let object = Api::<Pod>::namespaced(client.clone(), &pod.namespace)
        .get_opt(&pod.name)
        .await
        .with_context(|| format!("reading pod {pod} from the API server"))?
        .with_context(|| format!("the API server has no pod {pod}"))?;
    let namespace = Api::<Namespace>::all(client)
        .get(&pod.namespace)
        .await
        .with_context(|| format!("reading namespace {} from the API server", pod.namespace))?;
    Ok(cluster::facts_of(&object, namespace.labels().clone()))
}

/// The rules' decision for a pod, with the rule that gave it.
fn decide(config: &PolicyConfig, source: String, facts: &PodFacts) -> Result<PolicyVerdict> {
    let rule = config.rule();
    let mut reasons = Vec::new();
    match rule.never_ambient(facts) {
        Some(never) => reasons.push(format!("not ambient: {}", never.describe())),
        None => match rule.matching_selector(facts) {
            Some(index) => reasons.push(format!(
                "ambient: enablement selector {} of {} matches: {}",
                index + 1,
                config.enablement.len(),
                serde_json::to_string(&config.enablement[index])?
            )),
            None => reasons.push(
                "not ambient: no enablement selector matches the pod's labels and its \
                 namespace's"
                    .into(),
            ),
        },
    }
    let decision = match config.decide_mode(facts) {
        Ok(Decision::Ambient(ambient)) => {
            for problem in ambient.problems {
                reasons.push(format!(
                    "annotation {}={:?} is not understood: {} is used",
                    problem.annotation, problem.value, problem.used
                ));
            }
            "ambient"
        }
        Ok(Decision::Sidecar(_)) => {
            reasons.push(
                "sidecar: its injected istio-proxy gets its traffic (istio-cni's sidecar rules)"
                    .into(),
            );
            "sidecar"
        }
        Ok(Decision::Neither) => {
            reasons.push(
                "no sidecar istio-cni redirects either (no istio-proxy container, istio-init \
                 present, a gateway, DISABLE_ENVOY, sidecar.istio.io/inject=false, or an \
                 excluded namespace)"
                    .into(),
            );
            "none"
        }
        Err(invalid) => {
            reasons.push(format!("sidecar refused: {invalid} (its CNI ADD fails)"));
            "none"
        }
    };
    Ok(PolicyVerdict {
        source,
        decision,
        reasons,
    })
}

/// The explanation as lines for an operator.
pub fn text(explanation: &Explanation) -> String {
    let mut out = String::new();
    let pod = match (&explanation.namespace, &explanation.name) {
        (Some(namespace), Some(name)) => format!("{namespace}/{name}"),
        _ => explanation.pod.clone(),
    };
    let captured = match explanation.mode {
        Some(mode) => format!("captured ({})", mode.as_str()),
        None => "not captured".into(),
    };
    let _ = writeln!(out, "{pod}: {captured}");
    for why in &explanation.why {
        let _ = writeln!(out, "  {why}");
    }
    let field = |out: &mut String, name: &str, value: String| {
        let _ = writeln!(out, "{name:<23} {value}");
    };
    if let Some(uid) = &explanation.uid {
        field(&mut out, "uid", uid.clone());
    }
    if let Some(cookie) = explanation.netns_cookie {
        field(&mut out, "netns cookie", cookie.to_string());
    }
    if let Some(status) = explanation.status {
        field(&mut out, "status", status.as_str().into());
    }
    if !explanation.ips.is_empty() {
        field(&mut out, "addresses", join(&explanation.ips));
    }
    if let Some(options) = &explanation.options {
        if explanation.sidecar.is_none() {
            field(&mut out, "inbound bypass", on_off(options.inbound_bypass));
        }
        field(&mut out, "DNS capture", on_off(options.dns_capture));
        if !options.reroute_interfaces.is_empty() {
            field(
                &mut out,
                "rerouted interfaces",
                options.reroute_interfaces.join(", "),
            );
        }
    }
    if let Some(sidecar) = &explanation.sidecar {
        field(
            &mut out,
            "interception mode",
            match sidecar.interception_mode {
                InterceptionMode::Redirect => "REDIRECT".into(),
                InterceptionMode::Tproxy => "TPROXY".into(),
            },
        );
        field(
            &mut out,
            "proxy uid/gid",
            format!("{}/{}", sidecar.proxy_uid, sidecar.proxy_gid),
        );
        field(&mut out, "IPv6 captured", on_off(sidecar.ipv6_captured));
        field(
            &mut out,
            "inbound ports",
            match &sidecar.include_inbound_ports {
                AllOr::All => format!("all but {}", list_or_none(&sidecar.exclude_inbound_ports)),
                AllOr::Only(ports) => format!("only {}", list_or_none(ports)),
            },
        );
        field(
            &mut out,
            "outbound ranges",
            match &sidecar.include_outbound_ranges {
                AllOr::All => "all".into(),
                AllOr::Only(ranges) => format!("only {}", list_or_none(ranges)),
            },
        );
        field(
            &mut out,
            "excluded ranges",
            list_or_none(&sidecar.exclude_outbound_ranges),
        );
        field(
            &mut out,
            "included outbound ports",
            list_or_none(&sidecar.include_outbound_ports),
        );
        field(
            &mut out,
            "excluded outbound ports",
            list_or_none(&sidecar.exclude_outbound_ports),
        );
        if !sidecar.excluded_interface_routes.is_empty() {
            field(
                &mut out,
                "routes out of excluded interfaces",
                join(&sidecar.excluded_interface_routes),
            );
        }
    }
    if let Some(policy) = &explanation.policy {
        let _ = writeln!(out, "{}: {}", policy.source, policy.decision);
        for reason in &policy.reasons {
            let _ = writeln!(out, "  {reason}");
        }
    }
    if let Some(connection) = &explanation.connection {
        let source = connection
            .source
            .map_or("-".into(), |source| source.to_string());
        let _ = write!(
            out,
            "{} {} {source} -> {}: {}",
            connection.hook,
            connection.protocol,
            connection.destination,
            connection.verdict.unwrap_or("untouched, not recorded"),
        );
        if let Some(target) = connection.target {
            let _ = write!(out, " -> {target}");
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "  rule: {}", connection.rule);
        if let Some(unless) = &connection.unless {
            let _ = writeln!(out, "  unless: {unless}");
        }
    }
    out
}

fn on_off(on: bool) -> String {
    if on { "on" } else { "off" }.into()
}

fn join<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn list_or_none<T: ToString>(items: &[T]) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        join(items)
    }
}

/// The explanation as one JSON object (fields: [`JSON_FIELDS`]).
pub fn json(explanation: &Explanation) -> Result<String> {
    Ok(serde_json::to_string_pretty(explanation)? + "\n")
}
