//! istio-cni's environment, read as weir's: an istio-cni operator's settings (its ConfigMap's and
//! DaemonSet's variables) carry over where weir has the same setting, and are refused where weir
//! cannot honour them, before clap reads the environment. weir's own variable, where both are
//! set, must agree with istio's: two values for one setting stop the agent, naming both.
use std::collections::BTreeMap;

use anyhow::{bail, Result};
use tracing::{info, warn};

/// How weir reads one of istio-cni's variables.
pub enum Reading {
    /// weir's setting of that environment variable, with the value `translate` makes of
    /// istio's: `None` when that value asks nothing of weir (`REPAIR_DELETE_PODS=false`).
    Carried {
        weir: &'static str,
        translate: fn(&str) -> Result<Option<String>, String>,
    },
    /// Honoured only at this value, which is what weir always does (`""`: unset or empty); any
    /// other is refused, with why.
    Only {
        value: &'static str,
        why: &'static str,
    },
    /// Nothing in weir for it, whatever its value: ignored, with a line saying why.
    Unused(&'static str),
}

/// One of istio-cni's environment variables.
pub struct IstioSetting {
    pub name: &'static str,
    pub reading: Reading,
}

const fn carried(name: &'static str, weir: &'static str) -> IstioSetting {
    translated(name, weir, as_is)
}

const fn translated(
    name: &'static str,
    weir: &'static str,
    translate: fn(&str) -> Result<Option<String>, String>,
) -> IstioSetting {
    IstioSetting {
        name,
        reading: Reading::Carried { weir, translate },
    }
}

const fn only(name: &'static str, value: &'static str, why: &'static str) -> IstioSetting {
    IstioSetting {
        name,
        reading: Reading::Only { value, why },
    }
}

const fn unused(name: &'static str, why: &'static str) -> IstioSetting {
    IstioSetting {
        name,
        reading: Reading::Unused(why),
    }
}

/// istio-cni's node agent's variables (its flags, upper-cased with `-` as `_`, and those of its
/// chart's DaemonSet), as weir reads them.
pub const ISTIO_SETTINGS: &[IstioSetting] = &[
    carried("MOUNTED_CNI_NET_DIR", "WEIR_CNI_NET_DIR"),
    unused(
        "CNI_NET_DIR",
        "the host's CNI net dir, which weir's container mounts at the same path: \
         --cni-net-dir (MOUNTED_CNI_NET_DIR) is both",
    ),
    carried("CHAINED_CNI_PLUGIN", "WEIR_CHAINED_CNI_PLUGIN"),
    // Chained, istio-cni appends to the file it names; weir appends to the file the runtime
    // loads, so the name is carried over only for a standalone config (see `resolve`).
    carried("CNI_CONF_NAME", "WEIR_STANDALONE_CNI_CONFIG_FILENAME"),
    translated("ISTIO_OWNED_CNI_CONFIG", "WEIR_OWNED_CNI_CONFIG", boolean),
    carried(
        "ISTIO_OWNED_CNI_CONFIG_FILENAME",
        "WEIR_OWNED_CNI_CONFIG_FILENAME",
    ),
    only(
        "CNI_NETWORK_CONFIG",
        "",
        "a template for istio-cni's plugin entry: weir writes weir-cni's own",
    ),
    only(
        "CNI_NETWORK_CONFIG_FILE",
        "",
        "a template for istio-cni's plugin entry: weir writes weir-cni's own",
    ),
    only(
        "AMBIENT_ENABLED",
        "true",
        "weir always redirects ambient pods (those AMBIENT_ENABLEMENT_SELECTOR selects); \
         a node without ambient needs no change: no pod is selected",
    ),
    carried(
        "AMBIENT_ENABLEMENT_SELECTOR",
        "WEIR_AMBIENT_ENABLEMENT_SELECTOR",
    ),
    translated("AMBIENT_DNS_CAPTURE", "WEIR_DNS_CAPTURE", boolean),
    only(
        "AMBIENT_IPV6",
        "true",
        "weir always redirects ambient pods' IPv6 as their IPv4",
    ),
    translated(
        "AMBIENT_DISABLE_SAFE_UPGRADE",
        "WEIR_UNINSTALL_ON_EXIT",
        boolean,
    ),
    unused(
        "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP",
        "iptables rules in pods: weir has none",
    ),
    unused(
        "NATIVE_NFTABLES",
        "weir uses eBPF, neither iptables nor nftables",
    ),
    carried("EXCLUDE_NAMESPACES", "WEIR_EXCLUDE_NAMESPACES"),
    carried("ZTUNNEL_UDS_ADDRESS", "WEIR_ZDS_SOCKET"),
    translated("MONITORING_PORT", "WEIR_METRICS_ADDR", metrics_port),
    unused(
        "CNI_AGENT_RUN_DIR",
        "istio-cni's socket directory: weir's sockets and files have flags of their own \
         (--cni-socket, --state-file, --verdict-cache, --trace-socket)",
    ),
    unused(
        "LOG_LEVEL",
        "istio-cni's plugin's fallback level: weir-cni's lines go to the agent, whose RUST_LOG \
         filters them",
    ),
    carried("NODE_NAME", "WEIR_NODE_NAME"),
    carried("REPAIR_NODE_NAME", "WEIR_NODE_NAME"),
    carried("POD_NAME", "WEIR_POD_NAME"),
    carried("POD_NAMESPACE", "WEIR_POD_NAMESPACE"),
    // Off, istio-cni's repair does nothing: neither in place nor to the pod.
    translated("REPAIR_ENABLED", "WEIR_REPAIR_BROKEN_PODS", |value| {
        Ok((!parse_bool(value)?).then(|| "none".to_owned()))
    }),
    translated("REPAIR_ENABLED", "REPAIR_REPAIR_PODS", |value| {
        Ok((!parse_bool(value)?).then(|| "false".to_owned()))
    }),
    translated("REPAIR_DELETE_PODS", "WEIR_REPAIR_BROKEN_PODS", |value| {
        Ok(parse_bool(value)?.then(|| "delete".to_owned()))
    }),
    translated("REPAIR_LABEL_PODS", "WEIR_REPAIR_BROKEN_PODS", |value| {
        Ok(parse_bool(value)?.then(|| "label".to_owned()))
    }),
    unused(
        "REPAIR_RUN_AS_DAEMON",
        "weir's repair always runs in the agent",
    ),
    only(
        "REPAIR_SIDECAR_ANNOTATION",
        "sidecar.istio.io/status",
        "weir knows sidecar pods by the injector's sidecar.istio.io/status",
    ),
    only(
        "REPAIR_INIT_CONTAINER_NAME",
        "istio-validation",
        "weir looks for the injector's istio-validation",
    ),
    only(
        "REPAIR_INIT_CONTAINER_EXIT_CODE",
        "126",
        "weir looks for istio-validation's exit code 126",
    ),
    only(
        "REPAIR_INIT_CONTAINER_TERMINATION_MESSAGE",
        "",
        "weir knows a broken pod by its init container's exit code alone",
    ),
    only(
        "REPAIR_BROKEN_POD_LABEL_KEY",
        "cni.istio.io/uninitialized",
        "weir labels broken pods cni.istio.io/uninitialized=true",
    ),
    only(
        "REPAIR_BROKEN_POD_LABEL_VALUE",
        "true",
        "weir labels broken pods cni.istio.io/uninitialized=true",
    ),
    only(
        "REPAIR_LABEL_SELECTORS",
        "",
        "weir's repair considers every pod on its node",
    ),
    only(
        "REPAIR_FIELD_SELECTORS",
        "",
        "weir's repair considers every pod on its node",
    ),
    only(
        "SKIP_TLS_VERIFY",
        "false",
        "weir-cni is given the agent's own credentials, verified",
    ),
];

fn as_is(value: &str) -> Result<Option<String>, String> {
    Ok(Some(value.to_owned()))
}

/// istio reads booleans with Go's strconv.ParseBool.
fn parse_bool(value: &str) -> Result<bool, String> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err("not a boolean (true or false)".into()),
    }
}

fn boolean(value: &str) -> Result<Option<String>, String> {
    Ok(Some(parse_bool(value)?.to_string()))
}

/// istio-cni serves its metrics on every address at this port.
fn metrics_port(value: &str) -> Result<Option<String>, String> {
    let port: u16 = value.parse().map_err(|_| "not a port number".to_owned())?;
    Ok(Some(format!("0.0.0.0:{port}")))
}

/// The istio-cni variables read as `weir`'s setting, for the configuration reference.
pub fn carried_into(weir: &str) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = ISTIO_SETTINGS
        .iter()
        .filter(|setting| matches!(setting.reading, Reading::Carried { weir: into, .. } if into == weir))
        .map(|setting| setting.name)
        .collect();
    names.dedup();
    names
}

/// What istio-cni's environment gives weir.
#[derive(Debug, Default, PartialEq)]
pub struct Resolved {
    /// weir's variables to set, each with the istio-cni variables it comes from.
    pub set: BTreeMap<&'static str, (String, Vec<String>)>,
    /// istio-cni's variables found that weir has no use for, each with why.
    pub unused: Vec<(&'static str, &'static str)>,
}

impl Resolved {
    /// One line per setting carried over or ignored: what the agent took from istio-cni's
    /// environment is in its log.
    pub fn log(&self) {
        for (weir, (value, from)) in &self.set {
            info!("{} read as {weir}={value}", from.join(", "));
        }
        for (name, why) in &self.unused {
            warn!("{name} is ignored: {why}");
        }
    }
}

/// What `env` (a process's environment) asks of weir through istio-cni's names; every setting
/// weir cannot honour, and every setting given two values, in one error.
pub fn resolve(env: &BTreeMap<String, String>) -> Result<Resolved> {
    let mut refusals = Vec::new();
    let mut resolved = Resolved::default();
    // weir's variable -> every (source, value) given for it, weir's own first.
    let mut given: BTreeMap<&'static str, Vec<(String, String)>> = BTreeMap::new();
    for setting in ISTIO_SETTINGS {
        let Some(value) = env.get(setting.name) else {
            continue;
        };
        match setting.reading {
            Reading::Carried { weir, translate } => match translate(value) {
                Ok(Some(translated)) => {
                    let sources = given.entry(weir).or_insert_with(|| {
                        env.get(weir)
                            .map(|own| vec![(weir.to_owned(), own.clone())])
                            .unwrap_or_default()
                    });
                    sources.push((format!("{}={value}", setting.name), translated));
                }
                Ok(None) => {}
                Err(error) => refusals.push(format!("{}={value:?}: {error}", setting.name)),
            },
            Reading::Only {
                value: honoured,
                why,
            } => {
                let same = match honoured {
                    "true" | "false" => parse_bool(value).ok() == honoured.parse().ok(),
                    _ => value == honoured,
                };
                if !same {
                    refusals.push(format!(
                        "{}={value:?} cannot be honoured: {why}; unset it",
                        setting.name
                    ));
                }
            }
            Reading::Unused(why) => resolved.unused.push((setting.name, why)),
        }
    }
    for (weir, sources) in given {
        let (first_source, first_value) = &sources[0];
        if let Some((other_source, other_value)) =
            sources.iter().find(|(_, value)| value != first_value)
        {
            refusals.push(format!(
                "{first_source} and {other_source} give {weir} two values \
                 ({first_value:?} and {other_value:?}): set one"
            ));
        } else if first_source != weir {
            let from = sources.iter().map(|(source, _)| source.clone()).collect();
            resolved.set.insert(weir, (first_value.clone(), from));
        }
    }
    let chained = resolved
        .set
        .get("WEIR_CHAINED_CNI_PLUGIN")
        .map(|(value, _)| value.as_str())
        .or(env.get("WEIR_CHAINED_CNI_PLUGIN").map(String::as_str))
        .is_none_or(|value| parse_bool(value) != Ok(false));
    if chained && env.contains_key("CNI_CONF_NAME") {
        refusals.push(
            "CNI_CONF_NAME cannot be honoured with a chained plugin: istio-cni appends to the \
             file it names, weir to the file the runtime loads; unset it (it names the \
             standalone config only with CHAINED_CNI_PLUGIN=false)"
                .to_owned(),
        );
    }
    if !refusals.is_empty() {
        bail!(
            "istio-cni's settings that weir refuses:\n  {}",
            refusals.join("\n  ")
        );
    }
    Ok(resolved)
}

/// Reads istio-cni's variables in this process's environment and sets weir's from them, for
/// clap to read: call it before the command line is parsed, while the process has one thread.
/// On an error nothing is set.
pub fn carry_over() -> Result<Resolved> {
    let env: BTreeMap<String, String> = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
        .collect();
    let resolved = resolve(&env)?;
    for (weir, (value, _)) in &resolved.set {
        std::env::set_var(weir, value);
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;
    use crate::cli::Cli;

    fn env(vars: &[(&str, &str)]) -> BTreeMap<String, String> {
        vars.iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect()
    }

    fn set(resolved: &Resolved) -> BTreeMap<&str, &str> {
        resolved
            .set
            .iter()
            .map(|(weir, (value, _))| (*weir, value.as_str()))
            .collect()
    }

    fn refusal(vars: &[(&str, &str)]) -> String {
        format!("{:#}", resolve(&env(vars)).expect_err("refused"))
    }

    #[test]
    fn every_carried_setting_is_a_flags_variable() {
        let mut command = Cli::command();
        command.build();
        let variables: Vec<String> = command
            .get_arguments()
            .chain(
                command
                    .get_subcommands()
                    .flat_map(|sub| sub.get_arguments()),
            )
            .filter_map(|arg| Some(arg.get_env()?.to_string_lossy().into_owned()))
            .collect();
        for setting in ISTIO_SETTINGS {
            if let Reading::Carried { weir, .. } = setting.reading {
                assert!(variables.iter().any(|variable| variable == weir), "{weir}");
            }
        }
    }

    #[test]
    fn istio_cni_s_configmap_carries_over() {
        let resolved = resolve(&env(&[
            ("AMBIENT_ENABLED", "true"),
            ("AMBIENT_DNS_CAPTURE", "False"),
            ("AMBIENT_IPV6", "true"),
            ("CHAINED_CNI_PLUGIN", "true"),
            ("EXCLUDE_NAMESPACES", "kube-system,monitoring"),
            ("REPAIR_ENABLED", "true"),
            ("REPAIR_LABEL_PODS", "false"),
            ("REPAIR_DELETE_PODS", "true"),
            ("REPAIR_REPAIR_PODS", "true"),
            ("REPAIR_INIT_CONTAINER_NAME", "istio-validation"),
            ("REPAIR_NODE_NAME", "node-a"),
            ("NODE_NAME", "node-a"),
            ("MONITORING_PORT", "9090"),
            ("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "true"),
        ]))
        .unwrap();
        assert_eq!(
            set(&resolved),
            BTreeMap::from([
                ("WEIR_DNS_CAPTURE", "false"),
                ("WEIR_CHAINED_CNI_PLUGIN", "true"),
                ("WEIR_EXCLUDE_NAMESPACES", "kube-system,monitoring"),
                ("WEIR_REPAIR_BROKEN_PODS", "delete"),
                ("WEIR_NODE_NAME", "node-a"),
                ("WEIR_METRICS_ADDR", "0.0.0.0:9090"),
            ])
        );
        assert_eq!(
            resolved.set["WEIR_NODE_NAME"].1,
            ["NODE_NAME=node-a", "REPAIR_NODE_NAME=node-a"]
        );
        assert_eq!(
            resolved
                .unused
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>(),
            ["AMBIENT_RECONCILE_POD_RULES_ON_STARTUP"]
        );
    }

    #[test]
    fn weir_s_own_variable_agreeing_is_left_as_it_is() {
        let resolved = resolve(&env(&[
            ("WEIR_ZDS_SOCKET", "/run/zt.sock"),
            ("ZTUNNEL_UDS_ADDRESS", "/run/zt.sock"),
        ]))
        .unwrap();
        assert_eq!(resolved, Resolved::default());
    }

    #[test]
    fn two_values_for_one_setting_are_refused_naming_both() {
        let error = refusal(&[
            ("WEIR_ZDS_SOCKET", "/run/weir.sock"),
            ("ZTUNNEL_UDS_ADDRESS", "/run/istio.sock"),
        ]);
        assert!(
            error.contains("WEIR_ZDS_SOCKET and ZTUNNEL_UDS_ADDRESS=/run/istio.sock"),
            "{error}"
        );
        let error = refusal(&[("NODE_NAME", "a"), ("REPAIR_NODE_NAME", "b")]);
        assert!(
            error.contains("NODE_NAME=a and REPAIR_NODE_NAME=b"),
            "{error}"
        );
        let error = refusal(&[
            ("REPAIR_DELETE_PODS", "true"),
            ("REPAIR_LABEL_PODS", "true"),
        ]);
        assert!(
            error.contains("WEIR_REPAIR_BROKEN_PODS two values"),
            "{error}"
        );
        // istio's chart sets REPAIR_REPAIR_PODS whether or not the repair is enabled.
        let error = refusal(&[("REPAIR_ENABLED", "false"), ("REPAIR_REPAIR_PODS", "true")]);
        assert!(
            error.contains("REPAIR_REPAIR_PODS and REPAIR_ENABLED=false"),
            "{error}"
        );
    }

    #[test]
    fn repair_disabled_turns_off_both_of_weir_s_repairs() {
        let resolved = resolve(&env(&[("REPAIR_ENABLED", "0")])).unwrap();
        assert_eq!(
            set(&resolved),
            BTreeMap::from([
                ("REPAIR_REPAIR_PODS", "false"),
                ("WEIR_REPAIR_BROKEN_PODS", "none")
            ])
        );
    }

    #[test]
    fn settings_weir_cannot_honour_are_refused_by_name_all_at_once() {
        let error = refusal(&[
            ("AMBIENT_ENABLED", "false"),
            ("REPAIR_INIT_CONTAINER_NAME", "validation"),
            ("AMBIENT_DNS_CAPTURE", "maybe"),
            ("MONITORING_PORT", "http"),
        ]);
        for name in [
            "AMBIENT_ENABLED=\"false\" cannot be honoured",
            "REPAIR_INIT_CONTAINER_NAME=\"validation\" cannot be honoured",
            "AMBIENT_DNS_CAPTURE=\"maybe\": not a boolean",
            "MONITORING_PORT=\"http\": not a port number",
        ] {
            assert!(error.contains(name), "{name} in {error}");
        }
        assert!(resolve(&env(&[("CNI_NETWORK_CONFIG", "")])).is_ok());
        assert!(refusal(&[("CNI_NETWORK_CONFIG", "{}")]).contains("CNI_NETWORK_CONFIG"));
    }

    #[test]
    fn cni_conf_name_names_only_a_standalone_config() {
        let error = refusal(&[("CNI_CONF_NAME", "10-calico.conflist")]);
        assert!(error.contains("CNI_CONF_NAME cannot be honoured with a chained plugin"));
        let resolved = resolve(&env(&[
            ("CNI_CONF_NAME", "istio-cni.conf"),
            ("CHAINED_CNI_PLUGIN", "false"),
        ]))
        .unwrap();
        assert_eq!(
            set(&resolved)["WEIR_STANDALONE_CNI_CONFIG_FILENAME"],
            "istio-cni.conf"
        );
        let standalone = env(&[
            ("CNI_CONF_NAME", "istio-cni.conf"),
            ("WEIR_CHAINED_CNI_PLUGIN", "false"),
        ]);
        assert!(resolve(&standalone).is_ok());
    }
}
