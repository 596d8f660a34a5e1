//! What each CNI command does. See the crate docs for the policy.
use std::io::Read;
use std::path::Path;

use serde::Deserialize;

use crate::agent::{self, Failure};
use crate::apiserver::{self, Lookup};
use crate::config::{self, NetConf, PrevResult, LATEST_VERSION, SUPPORTED_VERSIONS};
use crate::env::{self, CniEnv};
use crate::error::{self, code, CniError};
use crate::log::Log;
use crate::protocol::{CachedVerdict, Command, PodRef, Request, Response, VerdictCache};

/// What to print on stdout and how to exit.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: String,
    pub exit_code: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CniCommand {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl CniCommand {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "STATUS" => Self::Status,
            "GC" => Self::Gc,
            "VERSION" => Self::Version,
            _ => return None,
        })
    }

    /// The first spec version that has the command.
    fn since(self) -> &'static str {
        match self {
            Self::Check => "0.4.0",
            Self::Status | Self::Gc => "1.1.0",
            Self::Add | Self::Del | Self::Version => "0.3.0",
        }
    }
}

/// Runs one plugin invocation. Never panics: every failure becomes a CNI error result.
pub fn run(env: &CniEnv, mut stdin: impl Read) -> Outcome {
    let mut log = Log::stderr();
    let mut input = Vec::new();
    let result = match stdin.read_to_end(&mut input) {
        Ok(_) => dispatch(env, &input, &mut log),
        Err(e) => {
            Err(CniError::new(code::IO_FAILURE, "cannot read stdin").with_details(e.to_string()))
        }
    };
    let outcome = match result {
        Ok(stdout) => Outcome {
            stdout,
            exit_code: 0,
        },
        Err(err) => {
            log.error(&err);
            // Errors answer in the version the runtime asked for, whatever else was wrong.
            let version = requested_version(&input).unwrap_or_else(|| LATEST_VERSION.into());
            Outcome {
                stdout: err.to_json(&version) + "\n",
                exit_code: 1,
            }
        }
    };
    log.finish();
    outcome
}

/// Returns what to print: a result, or nothing (empty) for commands that have none.
fn dispatch(env: &CniEnv, stdin: &[u8], log: &mut Log) -> Result<String, CniError> {
    let name = env::require(&env.command, "CNI_COMMAND")?;
    log.add_context(name);
    let command = CniCommand::parse(name).ok_or_else(|| {
        CniError::new(
            code::INVALID_ENVIRONMENT,
            format!("unknown CNI_COMMAND {name:?}"),
        )
        .with_details("weir-cni supports ADD, DEL, CHECK, STATUS, GC and VERSION")
    })?;
    if command == CniCommand::Version {
        return version_info(stdin);
    }
    let conf = NetConf::parse(stdin)?;
    log.configure(conf.log_level, conf.log_file.as_deref());
    if !config::version_at_least(&conf.cni_version, command.since()) {
        return Err(config::incompatible(format!(
            "{name} needs cniVersion {} or later, the config has {}",
            command.since(),
            conf.cni_version
        )));
    }
    match command {
        CniCommand::Add => add(&conf, env, log),
        CniCommand::Del => del(&conf, env, log).map(|()| String::new()),
        CniCommand::Check => check(&conf, env, log).map(|()| String::new()),
        CniCommand::Status => status(&conf, log).map(|()| String::new()),
        CniCommand::Gc => gc(&conf, log).map(|()| String::new()),
        CniCommand::Version => Ok(String::new()),
    }
}

#[derive(Deserialize)]
struct Versioned {
    #[serde(rename = "cniVersion")]
    cni_version: Option<String>,
}

fn requested_version(stdin: &[u8]) -> Option<String> {
    serde_json::from_slice::<Versioned>(stdin).ok()?.cni_version
}

/// VERSION's stdin is `{"cniVersion": ...}`; runtimes may also send nothing.
fn version_info(stdin: &[u8]) -> Result<String, CniError> {
    let requested = if stdin.trim_ascii().is_empty() {
        None
    } else {
        serde_json::from_slice::<Versioned>(stdin)
            .map_err(|e| error::from_decode("VERSION input", e))?
            .cni_version
    };
    let info = serde_json::json!({
        "cniVersion": requested.as_deref().unwrap_or(LATEST_VERSION),
        "supportedVersions": SUPPORTED_VERSIONS,
    });
    Ok(info.to_string() + "\n")
}

/// Without `prevResult` weir-cni runs as a network of its own (a Multus attachment, as
/// istio-cni with `chained: false`): the agent gets no addresses and reads them in the pod, and
/// the result is empty, as istio-cni's.
fn add(conf: &NetConf, env: &CniEnv, log: &mut Log) -> Result<String, CniError> {
    let prev = conf
        .prev_result
        .as_deref()
        .map(PrevResult::parse)
        .transpose()?;
    let request = request(Command::Add, conf, env, prev.as_ref(), log)?;
    // Converted before the agent is asked, so a result that cannot be printed enrolls nothing.
    let result = match &prev {
        Some(prev) => prev.in_version(&conf.cni_version)?,
        None => config::empty_result(&conf.cni_version),
    } + "\n";
    if request.pod.namespace.is_empty() || request.pod.name.is_empty() {
        // Not a Kubernetes pod (no K8S_POD_* in CNI_ARGS): never ambient, never blocked.
        log.info("not a Kubernetes pod: passed through");
        return Ok(result);
    }
    ask_agent(conf, &request, log)?;
    Ok(result)
}

fn check(conf: &NetConf, env: &CniEnv, log: &mut Log) -> Result<(), CniError> {
    let prev = conf
        .prev_result
        .as_deref()
        .map(PrevResult::parse)
        .transpose()?;
    let request = request(Command::Check, conf, env, prev.as_ref(), log)?;
    ask_agent(conf, &request, log)
}

/// DEL fails only on malformed input, never because of the agent: a failing DEL would keep the
/// runtime from tearing the pod down, and the agent removes pods on its own (pod watcher).
fn del(conf: &NetConf, env: &CniEnv, log: &mut Log) -> Result<(), CniError> {
    let request = request(Command::Del, conf, env, None, log)?;
    if conf.is_excluded(&request.pod.namespace) {
        log.debug("namespace excluded: agent not asked");
        return Ok(());
    }
    let socket = conf.agent_socket.display();
    match call_agent(conf, &request, log) {
        Ok(Response::Ok { .. }) => log.info("removed"),
        Ok(Response::Error { code, msg, details }) => log.warn(format!(
            "agent failed DEL (error {code}: {msg} {details}); teardown goes on"
        )),
        Err(Failure::Unreachable(why)) => log.warn(format!(
            "weir agent unreachable at {socket} ({why}); teardown goes on, the agent cleans up when back"
        )),
        Err(Failure::NoAnswer(why)) => log.warn(format!(
            "weir agent at {socket} did not answer ({why}); teardown goes on, the agent cleans up"
        )),
        Err(Failure::Invalid(why)) => log.warn(format!("{why}; teardown goes on")),
    }
    Ok(())
}

/// Always ready: a runtime that acts on STATUS stops every new pod on the node when it fails,
/// and weir being down must never stop pods that are not ambient (ambient ones fail their ADD).
fn status(conf: &NetConf, log: &mut Log) -> Result<(), CniError> {
    if let Err(why) = agent::probe(&conf.agent_socket, conf.timeout()) {
        log.warn(format!(
            "weir agent unreachable at {} ({why}): ambient pods will wait",
            conf.agent_socket.display()
        ));
    }
    Ok(())
}

/// GC (CNI 1.1, no `prevResult`, no container): the agent unenrolls every pod it enrolled
/// through an attachment the runtime no longer lists. The runtime only logs a failed GC, so an
/// unreachable agent is reported as one (try again later) and nothing is removed; the agent's
/// orphan sweep takes out what a missed GC leaves behind.
fn gc(conf: &NetConf, log: &mut Log) -> Result<(), CniError> {
    let valid_attachments = conf.valid_attachments.clone().ok_or_else(|| {
        CniError::new(code::INVALID_CONFIG, "GC without cni.dev/valid-attachments")
            .with_details("without the runtime's list no pod can be told stale; none was removed")
    })?;
    let request = Request {
        command: Command::Gc,
        container_id: String::new(),
        netns: String::new(),
        ifname: String::new(),
        pod: PodRef::default(),
        ips: Vec::new(),
        annotations: Default::default(),
        valid_attachments,
        plugin_log: None,
    };
    match call_agent(conf, &request, log) {
        Ok(Response::Ok { .. }) => {
            log.info("stale attachments collected");
            Ok(())
        }
        Ok(Response::Error { code, msg, details }) => Err(CniError { code, msg, details }),
        Err(Failure::Invalid(why)) => Err(CniError::new(code::PLUGIN_SPECIFIC, why)),
        Err(Failure::Unreachable(why) | Failure::NoAnswer(why)) => Err(CniError::new(
            code::TRY_AGAIN_LATER,
            format!(
                "weir agent unreachable at {}: stale pods not collected",
                conf.agent_socket.display()
            ),
        )
        .with_details(why)),
    }
}

/// Builds the agent request from the environment, checking what the spec requires, and names
/// the pod in the log from here on.
fn request(
    command: Command,
    conf: &NetConf,
    env: &CniEnv,
    prev: Option<&PrevResult>,
    log: &mut Log,
) -> Result<Request, CniError> {
    let container_id = env::require(&env.container_id, "CNI_CONTAINERID")?;
    let pod = env::parse_cni_args(env.args.as_deref().unwrap_or_default())?;
    log.add_context(&format!(
        "{}/{} container={}",
        pod.namespace,
        pod.name,
        container_id.get(..12).unwrap_or(container_id)
    ));
    let netns = match command {
        // The runtime's second DEL (RemovePodSandbox) has no netns left; GC and LOG name none.
        Command::Del | Command::Gc | Command::Log => env.netns.clone().unwrap_or_default(),
        Command::Add | Command::Check => env::require(&env.netns, "CNI_NETNS")?.to_owned(),
    };
    Ok(Request {
        command,
        container_id: container_id.to_owned(),
        netns,
        ifname: env::require(&env.ifname, "CNI_IFNAME")?.to_owned(),
        pod,
        ips: prev.map(PrevResult::ips).unwrap_or_default(),
        annotations: conf.runtime_config.pod_annotations.clone(),
        valid_attachments: Vec::new(),
        plugin_log: None,
    })
}

/// Asks the agent; once it has answered, the run's log lines go to it too.
fn call_agent(conf: &NetConf, request: &Request, log: &mut Log) -> Result<Response, Failure> {
    let answer = agent::call(&conf.agent_socket, request, conf.timeout());
    if answer.is_ok() {
        log.answered(&conf.agent_socket, request);
    }
    answer
}

/// ADD and CHECK: the agent's verdict. An agent that took the request and gave no answer may be
/// enrolling the pod: the pod waits (11). An agent that cannot be reached at all leaves the
/// decision to the API server, as istio-cni's plugin asks it, and to the verdict cache only when
/// the API server cannot tell either.
fn ask_agent(conf: &NetConf, request: &Request, log: &mut Log) -> Result<(), CniError> {
    if conf.is_excluded(&request.pod.namespace) {
        log.info("namespace excluded: agent not asked");
        return Ok(());
    }
    let socket = conf.agent_socket.display();
    let PodRef {
        namespace, name, ..
    } = &request.pod;
    match call_agent(conf, request, log) {
        Ok(Response::Ok { enrolled }) => {
            log.info(if enrolled { "enrolled" } else { "not ambient" });
            Ok(())
        }
        Ok(Response::Error { code, msg, details }) => Err(CniError { code, msg, details }),
        Err(Failure::Invalid(why)) => Err(CniError::new(code::PLUGIN_SPECIFIC, why)),
        Err(Failure::NoAnswer(why)) => Err(CniError::new(
            code::TRY_AGAIN_LATER,
            format!(
                "weir agent at {socket} did not answer: pod {namespace}/{name} waits until it does"
            ),
        )
        .with_details(why)),
        Err(Failure::Unreachable(why)) => decide_without_agent(conf, request, &why, log),
    }
}

/// The agent cannot be reached: the API server's objects decide with the agent's rule; when the
/// API server cannot tell (no kubeconfig, unreachable, refusing, or it does not have this very
/// pod), the verdict cache does.
fn decide_without_agent(
    conf: &NetConf,
    request: &Request,
    why: &str,
    log: &mut Log,
) -> Result<(), CniError> {
    let socket = conf.agent_socket.display();
    let PodRef {
        namespace, name, ..
    } = &request.pod;
    let api_verdict = match &conf.kubeconfig {
        None => Err("no kubeconfig in the plugin's config".to_owned()),
        Some(kubeconfig) => {
            match apiserver::lookup(kubeconfig, &request.pod, apiserver::DEADLINE) {
                Ok(Lookup::Found(facts)) => Ok(conf.rule(&conf.own_pods()).is_ambient(&facts)),
                Ok(Lookup::NotThisPod(reason)) => Err(reason),
                Err(error) => Err(format!("the API server could not tell: {error}")),
            }
        }
    };
    let waits = if request.command == Command::Check {
        "cannot be checked until it is back"
    } else {
        "waits until it is back"
    };
    match api_verdict {
        Ok(true) => Err(CniError::new(
            code::TRY_AGAIN_LATER,
            format!(
                "weir agent unreachable at {socket}: ambient pod {namespace}/{name} {waits} \
                 (ambient per the API server)"
            ),
        )
        .with_details(why)),
        Ok(false) => {
            log.warn(format!(
                "weir agent unreachable at {socket} ({why}); not ambient per the API server: \
                 starting without redirection"
            ));
            Ok(())
        }
        Err(api_error) => {
            let cache = agent::load_verdicts(&conf.verdict_cache);
            let why_both = format!("{why}; {api_error}");
            decide_offline(&conf.agent_socket, &why_both, cache, request)?;
            log.warn(format!(
                "weir agent unreachable at {socket} ({why}) and {api_error}; not ambient per \
                 the verdict cache: starting without redirection"
            ));
            Ok(())
        }
    }
}

/// Without the agent and the API server, only a pod the verdict cache knows to be non-ambient
/// may go ahead. An ambient pod, a pod the cache does not know (it may carry the ambient label
/// itself), or any pod when the cache cannot be read, fails with "try again later": it must not
/// run unredirected, and the runtime retries until the agent is back.
fn decide_offline(
    socket: &Path,
    why: &str,
    cache: Result<VerdictCache, String>,
    request: &Request,
) -> Result<(), CniError> {
    let PodRef {
        namespace, name, ..
    } = &request.pod;
    let unreachable = format!("weir agent unreachable at {}", socket.display());
    let consequence = if request.command == Command::Check {
        "cannot be checked"
    } else {
        "cannot start without redirection"
    };
    let cache = match cache {
        Ok(cache) => cache,
        Err(cache_error) => {
            return Err(CniError::new(
                code::TRY_AGAIN_LATER,
                format!(
                    "{unreachable} and its verdict cache is unreadable: pod {namespace}/{name} \
                     may be ambient and {consequence}"
                ),
            )
            .with_details(format!("agent: {why}; verdict cache: {cache_error}")))
        }
    };
    let msg = match cache.verdict(&request.pod) {
        CachedVerdict::NotAmbient => return Ok(()),
        CachedVerdict::Ambient => {
            format!("{unreachable}: ambient pod {namespace}/{name} {consequence}")
        }
        CachedVerdict::Unknown => format!(
            "{unreachable} and the API server cannot tell: pod {namespace}/{name} is unknown to \
             the verdict cache, may be ambient and {consequence}"
        ),
    };
    Err(CniError::new(code::TRY_AGAIN_LATER, msg).with_details(why))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add_request(namespace: &str, name: &str) -> Request {
        Request {
            command: Command::Add,
            container_id: "c".into(),
            netns: "/var/run/netns/x".into(),
            ifname: "eth0".into(),
            pod: PodRef {
                namespace: namespace.into(),
                name: name.into(),
                uid: String::new(),
            },
            ips: vec![],
            annotations: Default::default(),
            valid_attachments: vec![],
            plugin_log: None,
        }
    }

    fn decide(cache: Result<VerdictCache, String>, request: &Request) -> Result<(), CniError> {
        decide_offline(Path::new("/run/weir.sock"), "refused", cache, request)
    }

    #[test]
    fn offline_only_non_ambient_pods_start() {
        let cache = VerdictCache {
            ambient_namespaces: vec!["mesh".into()],
            ambient_pods: vec!["plain/labelled".into()],
            opted_out_pods: vec!["mesh/opted-out".into()],
            other_pods: vec!["plain/other".into()],
        };
        for (ns, name) in [("plain", "other"), ("mesh", "opted-out")] {
            assert_eq!(decide(Ok(cache.clone()), &add_request(ns, name)), Ok(()));
        }
        for (ns, name) in [("mesh", "app"), ("plain", "labelled")] {
            let err = decide(Ok(cache.clone()), &add_request(ns, name)).unwrap_err();
            assert_eq!(err.code, code::TRY_AGAIN_LATER);
            assert_eq!(
                err.msg,
                format!(
                    "weir agent unreachable at /run/weir.sock: ambient pod {ns}/{name} \
                     cannot start without redirection"
                )
            );
            assert_eq!(err.details, "refused");
        }
    }

    /// The message a pod unknown to the verdict cache fails with.
    fn unknown_pod_message(namespace: &str, name: &str) -> String {
        format!(
            "weir agent unreachable at /run/weir.sock and the API server cannot tell: pod \
             {namespace}/{name} is unknown to the verdict cache, may be ambient and cannot start \
             without redirection"
        )
    }

    #[test]
    fn offline_a_pod_the_cache_does_not_know_fails_closed() {
        // Not ambient by its namespace, yet it may carry the ambient label itself.
        let cache = VerdictCache {
            ambient_namespaces: vec!["mesh".into()],
            other_pods: vec!["plain/known".into()],
            ..VerdictCache::default()
        };
        let err = decide(Ok(cache), &add_request("plain", "stranger")).unwrap_err();
        assert_eq!(err.code, code::TRY_AGAIN_LATER);
        assert_eq!(err.msg, unknown_pod_message("plain", "stranger"));
        assert_eq!(err.details, "refused");
    }

    #[test]
    fn offline_a_pod_the_cache_knows_as_not_ambient_starts() {
        let cache = VerdictCache {
            other_pods: vec!["plain/known".into()],
            ..VerdictCache::default()
        };
        assert_eq!(decide(Ok(cache), &add_request("plain", "known")), Ok(()));
    }

    #[test]
    fn offline_a_cache_without_other_pods_knows_no_plain_pod() {
        let older: VerdictCache = serde_json::from_str(
            r#"{"ambient_namespaces": ["mesh"], "ambient_pods": [], "opted_out_pods": ["mesh/out"]}"#,
        )
        .unwrap();
        assert!(older.other_pods.is_empty());
        let err = decide(Ok(older.clone()), &add_request("plain", "p")).unwrap_err();
        assert_eq!(err.code, code::TRY_AGAIN_LATER);
        assert_eq!(err.msg, unknown_pod_message("plain", "p"));
        assert_eq!(decide(Ok(older), &add_request("mesh", "out")), Ok(()));
    }

    #[test]
    fn offline_excluded_namespaces_start_without_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("verdicts.json");
        std::fs::write(
            &cache,
            serde_json::to_vec(&VerdictCache::default()).unwrap(),
        )
        .unwrap();
        let conf = NetConf::parse(
            serde_json::json!({
                "cniVersion": "1.0.0",
                "agent_socket": dir.path().join("absent.sock"),
                "verdict_cache": cache,
                "exclude_namespaces": ["kube-system", "infra"],
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        let mut log = Log::stderr();
        for namespace in ["kube-system", "infra"] {
            assert_eq!(
                ask_agent(&conf, &add_request(namespace, "p"), &mut log),
                Ok(())
            );
        }
        let err = ask_agent(&conf, &add_request("plain", "p"), &mut log).unwrap_err();
        assert_eq!(err.code, code::TRY_AGAIN_LATER);
        assert!(
            err.msg.contains("unknown to the verdict cache"),
            "{}",
            err.msg
        );
    }

    #[test]
    fn offline_without_a_cache_fails_closed() {
        let err = decide(Err("no such file".into()), &add_request("plain", "p")).unwrap_err();
        assert_eq!(err.code, code::TRY_AGAIN_LATER);
        assert!(err.details.contains("no such file"));
    }

    fn run_with(command: &str, stdin: &str) -> Outcome {
        let env = CniEnv {
            command: Some(command.into()),
            ..CniEnv::default()
        };
        run(&env, stdin.as_bytes())
    }

    #[test]
    fn version_reports_the_requested_version() {
        let out = run_with("VERSION", r#"{"cniVersion":"0.4.0"}"#);
        let info: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(info["cniVersion"], "0.4.0");
        assert_eq!(info["supportedVersions"].as_array().unwrap().len(), 5);
        let info: serde_json::Value =
            serde_json::from_str(&run_with("VERSION", "").stdout).unwrap();
        assert_eq!(info["cniVersion"], LATEST_VERSION);
    }

    #[test]
    fn commands_newer_than_the_config_are_refused() {
        let out = run_with("GC", r#"{"cniVersion":"1.0.0"}"#);
        assert_eq!(out.exit_code, 1);
        let err: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(err["code"], code::INCOMPATIBLE_VERSION);
        assert_eq!(err["cniVersion"], "1.0.0");
        let without_list = run_with("GC", r#"{"cniVersion":"1.1.0"}"#);
        assert!(without_list.stdout.contains("\"code\":7"));
        let check = run_with("CHECK", r#"{"cniVersion":"0.3.1"}"#);
        assert!(check.stdout.contains("\"code\":1"));
    }

    #[test]
    fn unknown_and_missing_commands_are_environment_errors() {
        assert!(run_with("FROB", "{}").stdout.contains("\"code\":4"));
        let out = run(&CniEnv::default(), &b"{}"[..]);
        assert!(out.stdout.contains("\"code\":4") && out.stdout.contains("CNI_COMMAND"));
    }
}
