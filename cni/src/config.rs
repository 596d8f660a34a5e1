//! The network configuration the runtime passes on stdin, and the previous plugin's result in it.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::ambient::{self, EnablementSelector, OwnPods, Rule};
use crate::error::{self, code, CniError};
use crate::log::LogLevel;
use crate::protocol::{Attachment, PodIp, DEFAULT_AGENT_SOCKET, DEFAULT_VERDICT_CACHE};

/// Oldest first: the order is what [`version_at_least`] compares.
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
pub const LATEST_VERSION: &str = "1.1.0";

/// Whether `version` is supported and no older than `min`.
pub fn version_at_least(version: &str, min: &str) -> bool {
    let rank = |v: &str| SUPPORTED_VERSIONS.iter().position(|s| *s == v);
    matches!((rank(version), rank(min)), (Some(v), Some(m)) if v >= m)
}

/// weir-cni's entry in the conflist, as the runtime hands it over. Unknown fields (`name`,
/// `type`, `capabilities`, other plugins' options) are ignored.
#[derive(Debug, Deserialize)]
pub struct NetConf {
    #[serde(rename = "cniVersion", default)]
    pub cni_version: String,
    #[serde(default = "default_agent_socket")]
    pub agent_socket: PathBuf,
    #[serde(default = "default_verdict_cache")]
    pub verdict_cache: PathBuf,
    #[serde(default = "default_exclude_namespaces")]
    pub exclude_namespaces: Vec<String>,
    #[serde(default = "default_timeout_seconds")]
    pub timeout_seconds: u64,
    /// The kubeconfig the plugin reads the API server with when the agent cannot be reached.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// The agent's ambient rule, for deciding from the API server's objects: its enablement
    /// selectors, the Istio system namespace (ztunnel's pods), weir's namespace and DaemonSet.
    #[serde(default = "ambient::default_selectors")]
    pub enablement_selectors: Vec<EnablementSelector>,
    #[serde(default = "default_istio_namespace")]
    pub system_namespace: String,
    #[serde(default = "default_istio_namespace")]
    pub pod_namespace: String,
    #[serde(default = "default_daemonset_name")]
    pub daemonset_name: String,
    #[serde(default)]
    pub log_file: Option<PathBuf>,
    #[serde(default)]
    pub log_level: LogLevel,
    /// Kept as raw text so ADD can hand it back exactly as received.
    #[serde(rename = "prevResult", default)]
    pub prev_result: Option<Box<RawValue>>,
    #[serde(rename = "runtimeConfig", default)]
    pub runtime_config: RuntimeConfig,
    /// GC only: the attachments the runtime still has on this network.
    #[serde(rename = "cni.dev/valid-attachments", default)]
    pub valid_attachments: Option<Vec<Attachment>>,
}

/// What the runtime fills in for the capabilities the plugin declares.
#[derive(Debug, Default, Deserialize)]
pub struct RuntimeConfig {
    #[serde(rename = "io.kubernetes.cri.pod-annotations", default)]
    pub pod_annotations: BTreeMap<String, String>,
}

fn default_agent_socket() -> PathBuf {
    DEFAULT_AGENT_SOCKET.into()
}
fn default_verdict_cache() -> PathBuf {
    DEFAULT_VERDICT_CACHE.into()
}
fn default_exclude_namespaces() -> Vec<String> {
    vec!["kube-system".into()]
}
fn default_timeout_seconds() -> u64 {
    5
}
fn default_istio_namespace() -> String {
    "istio-system".into()
}
fn default_daemonset_name() -> String {
    "weir".into()
}

impl NetConf {
    pub fn parse(stdin: &[u8]) -> Result<Self, CniError> {
        let conf: Self =
            serde_json::from_slice(stdin).map_err(|e| error::from_decode("network config", e))?;
        if conf.cni_version.is_empty() {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                "network config has no cniVersion",
            ));
        }
        if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
            return Err(incompatible(format!(
                "cniVersion {} is not supported",
                conf.cni_version
            )));
        }
        if conf.timeout_seconds == 0 {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                "timeout_seconds must be at least 1",
            ));
        }
        ambient::validate_selectors(&conf.enablement_selectors).map_err(|why| {
            CniError::new(code::INVALID_CONFIG, "invalid enablement_selectors").with_details(why)
        })?;
        Ok(conf)
    }

    /// weir's own pods, as the agent is told them (its own pod runs on the host network and
    /// never reaches the plugin).
    pub fn own_pods(&self) -> OwnPods {
        OwnPods {
            namespace: self.pod_namespace.clone(),
            daemonset: self.daemonset_name.clone(),
            pod_name: None,
        }
    }

    /// The agent's ambient rule with this config's settings.
    pub fn rule<'a>(&'a self, own: &'a OwnPods) -> Rule<'a> {
        Rule {
            exclude_namespaces: &self.exclude_namespaces,
            system_namespace: &self.system_namespace,
            enablement: &self.enablement_selectors,
            own,
        }
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_seconds)
    }

    pub fn is_excluded(&self, namespace: &str) -> bool {
        self.exclude_namespaces.iter().any(|ns| ns == namespace)
    }
}

pub fn incompatible(msg: String) -> CniError {
    CniError::new(code::INCOMPATIBLE_VERSION, msg).with_details(format!(
        "weir-cni supports CNI versions {}",
        SUPPORTED_VERSIONS.join(", ")
    ))
}

/// The previous plugin's result: the raw text plus the few fields weir reads.
pub struct PrevResult<'a> {
    raw: &'a RawValue,
    view: ResultView,
}

#[derive(Deserialize)]
struct ResultView {
    #[serde(rename = "cniVersion", default)]
    cni_version: String,
    #[serde(default)]
    interfaces: Vec<InterfaceView>,
    #[serde(default)]
    ips: Vec<IpView>,
}

#[derive(Deserialize)]
struct InterfaceView {
    name: String,
}

#[derive(Deserialize)]
struct IpView {
    address: String,
    #[serde(default)]
    gateway: Option<String>,
    /// Index into `interfaces`.
    #[serde(default)]
    interface: Option<usize>,
}

impl<'a> PrevResult<'a> {
    pub fn parse(raw: &'a RawValue) -> Result<Self, CniError> {
        let view = serde_json::from_str(raw.get()).map_err(|e| {
            CniError::new(code::INVALID_CONFIG, "prevResult is not a CNI result")
                .with_details(e.to_string())
        })?;
        Ok(Self { raw, view })
    }

    /// The addresses, with the interface index resolved to its name (an index that points
    /// nowhere leaves the interface unnamed rather than failing the pod).
    pub fn ips(&self) -> Vec<PodIp> {
        self.view
            .ips
            .iter()
            .map(|ip| PodIp {
                address: ip.address.clone(),
                gateway: ip.gateway.clone(),
                interface: ip
                    .interface
                    .and_then(|index| self.view.interfaces.get(index))
                    .map(|interface| interface.name.clone()),
            })
            .collect()
    }

    /// The result to print for ADD. The runtime already converts prevResult to the config's
    /// version, so this is normally the input verbatim; it is converted only when the versions
    /// differ.
    pub fn in_version(&self, version: &str) -> Result<String, CniError> {
        let from = self.view.cni_version.as_str();
        if from.is_empty() || from == version {
            return Ok(self.raw.get().to_owned());
        }
        if !SUPPORTED_VERSIONS.contains(&from) {
            return Err(incompatible(format!(
                "cannot convert prevResult from version {from} to {version}"
            )));
        }
        let mut result: Value = serde_json::from_str(self.raw.get())
            .map_err(|e| CniError::new(code::DECODE_FAILURE, e.to_string()))?;
        if let Some(result) = result.as_object_mut() {
            result.insert("cniVersion".into(), version.into());
            let ips = result.get_mut("ips").and_then(Value::as_array_mut);
            for ip in ips.into_iter().flatten().filter_map(Value::as_object_mut) {
                set_ip_family(ip, version);
            }
        }
        Ok(result.to_string())
    }
}

/// The result of an ADD that sets up nothing (weir-cni as a network of its own): every field but
/// `cniVersion` is optional in each supported version.
pub fn empty_result(version: &str) -> String {
    serde_json::json!({ "cniVersion": version }).to_string()
}

/// The supported versions share one result shape except for the per-address `version` ("4" or
/// "6"), which 0.3.x and 0.4.0 require and 1.0.0 dropped.
fn set_ip_family(ip: &mut serde_json::Map<String, Value>, version: &str) {
    if version_at_least(version, "1.0.0") {
        ip.remove("version");
    } else if !ip.contains_key("version") {
        let is_v6 = ip
            .get("address")
            .and_then(Value::as_str)
            .is_some_and(|address| address.contains(':'));
        ip.insert("version".into(), if is_v6 { "6" } else { "4" }.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn raw(value: Value) -> Box<RawValue> {
        RawValue::from_string(value.to_string()).unwrap()
    }

    fn dual_stack_result(version: &str) -> Value {
        json!({
            "cniVersion": version,
            "interfaces": [
                {"name": "cni0", "mac": "b2:9b:e0:5e:02:eb"},
                {"name": "veth1", "mac": "4a:dc:57:2e:28:5b"},
                {"name": "eth0", "sandbox": "/var/run/netns/cni-x"}
            ],
            "ips": [
                {"address": "10.99.0.3/24", "gateway": "10.99.0.1", "interface": 2},
                {"address": "fd00::3/64", "interface": 2},
                {"address": "192.0.2.9/32", "interface": 7},
                {"address": "192.0.2.10/32"}
            ]
        })
    }

    #[test]
    fn defaults_apply_to_a_minimal_config() {
        let conf =
            NetConf::parse(br#"{"cniVersion":"1.0.0","name":"n","type":"weir-cni"}"#).unwrap();
        assert_eq!(conf.agent_socket, PathBuf::from(DEFAULT_AGENT_SOCKET));
        assert_eq!(conf.verdict_cache, PathBuf::from(DEFAULT_VERDICT_CACHE));
        assert_eq!(conf.exclude_namespaces, ["kube-system"]);
        assert_eq!(conf.timeout(), Duration::from_secs(5));
        assert_eq!(conf.log_file, None);
        assert_eq!(conf.log_level, LogLevel::Info);
        assert!(conf.prev_result.is_none());
        assert!(conf.runtime_config.pod_annotations.is_empty());
        assert!(conf.is_excluded("kube-system") && !conf.is_excluded("default"));
        assert_eq!(conf.kubeconfig, None);
        assert_eq!(conf.enablement_selectors, ambient::default_selectors());
        assert_eq!(conf.own_pods().namespace, "istio-system");
        assert_eq!(conf.own_pods().daemonset, "weir");
        assert_eq!(conf.system_namespace, "istio-system");
    }

    #[test]
    fn rejects_bad_configs_with_the_spec_codes() {
        let code_of = |stdin: &str| NetConf::parse(stdin.as_bytes()).unwrap_err().code;
        assert_eq!(code_of(r#"{"cniVersion":"1.0.0""#), code::DECODE_FAILURE);
        assert_eq!(code_of(r#"{"name":"n"}"#), code::INVALID_CONFIG);
        assert_eq!(
            code_of(r#"{"cniVersion":"0.2.0"}"#),
            code::INCOMPATIBLE_VERSION
        );
        let bad_type = r#"{"cniVersion":"1.0.0","timeout_seconds":"5"}"#;
        assert_eq!(code_of(bad_type), code::INVALID_CONFIG);
        let zero = r#"{"cniVersion":"1.0.0","timeout_seconds":0}"#;
        assert_eq!(code_of(zero), code::INVALID_CONFIG);
        let level = r#"{"cniVersion":"1.0.0","log_level":"loud"}"#;
        assert_eq!(code_of(level), code::INVALID_CONFIG);
        let selector = r#"{"cniVersion":"1.0.0","enablement_selectors":
            [{"podSelector":{"matchExpressions":[{"key":"k","operator":"Near"}]}}]}"#;
        assert_eq!(code_of(selector), code::INVALID_CONFIG);
    }

    #[test]
    fn ips_resolve_interface_indexes() {
        let raw = raw(dual_stack_result("1.0.0"));
        let ips = PrevResult::parse(&raw).unwrap().ips();
        let ip = |address: &str, gateway: Option<&str>, interface: Option<&str>| PodIp {
            address: address.into(),
            gateway: gateway.map(Into::into),
            interface: interface.map(Into::into),
        };
        assert_eq!(
            ips,
            [
                ip("10.99.0.3/24", Some("10.99.0.1"), Some("eth0")),
                ip("fd00::3/64", None, Some("eth0")),
                ip("192.0.2.9/32", None, None),
                ip("192.0.2.10/32", None, None),
            ]
        );
    }

    #[test]
    fn same_version_result_is_verbatim() {
        // Odd spacing and key order must survive untouched.
        let text = r#"{ "ips":[{"address":"10.0.0.2/24"}],  "cniVersion":"1.0.0", "x":1 }"#;
        let raw = RawValue::from_string(text.into()).unwrap();
        assert_eq!(
            PrevResult::parse(&raw)
                .unwrap()
                .in_version("1.0.0")
                .unwrap(),
            text
        );
    }

    #[test]
    fn converts_between_result_shapes() {
        let raw_v1 = raw(dual_stack_result("1.0.0"));
        let legacy: Value = serde_json::from_str(
            &PrevResult::parse(&raw_v1)
                .unwrap()
                .in_version("0.4.0")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(legacy["cniVersion"], "0.4.0");
        let families: Vec<&str> = legacy["ips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ip| ip["version"].as_str().unwrap())
            .collect();
        assert_eq!(families, ["4", "6", "4", "4"]);

        let raw_legacy = raw(legacy);
        let back: Value = serde_json::from_str(
            &PrevResult::parse(&raw_legacy)
                .unwrap()
                .in_version("1.0.0")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(back, dual_stack_result("1.0.0"));
    }

    #[test]
    fn refuses_unknown_result_versions() {
        let raw = raw(json!({"cniVersion": "0.2.0", "ip4": {"ip": "10.0.0.2/24"}}));
        let err = PrevResult::parse(&raw)
            .unwrap()
            .in_version("1.0.0")
            .unwrap_err();
        assert_eq!(err.code, code::INCOMPATIBLE_VERSION);
    }

    #[test]
    fn the_empty_result_is_in_the_configs_version() {
        for version in SUPPORTED_VERSIONS {
            let result: Value = serde_json::from_str(&empty_result(version)).unwrap();
            assert_eq!(result, json!({ "cniVersion": version }));
        }
    }

    #[test]
    fn version_order() {
        assert!(version_at_least("1.1.0", "1.1.0"));
        assert!(version_at_least("1.0.0", "0.4.0"));
        assert!(!version_at_least("0.3.1", "0.4.0"));
        assert!(!version_at_least("9.9.9", "0.3.0"));
    }
}
