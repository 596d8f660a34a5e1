//! A CNI network configuration as libcni reads it, and weir's entry in it.
//!
//! Everything here works on parsed JSON values and touches only weir's own entry, so whatever
//! weir does not own keeps its meaning: unknown fields, the order of the other plugins,
//! `disableCheck` (a bool, or the string some tools write), `cniVersions`, and so on.
use std::ffi::OsStr;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{Map, Value};

/// The capability that makes the runtime pass every pod annotation in `runtimeConfig`, so the
/// plugin learns per-pod options without asking the API server.
pub const POD_ANNOTATIONS_CAPABILITY: &str = "io.kubernetes.cri.pod-annotations";

pub type Object = Map<String, Value>;

/// istio-cni's plugin, whose place in the chain weir takes: its entry goes in the same write that
/// puts weir's in, so no pod is ever set up by both or, between two writes, by neither.
pub const ISTIO_CNI_PLUGIN_TYPE: &str = "istio-cni";

/// How libcni reads a file, which it decides by the file's extension alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `.conflist`: `{"name", "cniVersion", "plugins": [...], ...}`.
    List,
    /// `.conf` or `.json`: a single plugin's configuration.
    Single,
}

impl Format {
    /// The format of a file in the CNI net dir, `None` when libcni ignores the file. The extension
    /// is taken as Go's `filepath.Ext` takes it (from the last dot, dot files included), so weir
    /// sees the same files libcni does.
    pub fn of(file_name: &OsStr) -> Option<Self> {
        let name = file_name.as_encoded_bytes();
        let extension = &name[name.iter().rposition(|&b| b == b'.')?..];
        match extension {
            b".conflist" => Some(Self::List),
            b".conf" | b".json" => Some(Self::Single),
            _ => None,
        }
    }
}

/// A network configuration that libcni would load.
#[derive(Clone, Debug, PartialEq)]
pub enum NetworkConfig {
    List(Object),
    Single(Object),
}

impl NetworkConfig {
    /// Parses a file's content, accepting what libcni accepts (`ConfListFromBytes` and
    /// `ConfFromBytes` plus the "has a type" check the runtimes add) and nothing else, so weir
    /// never edits a file the runtime would skip.
    pub fn parse(format: Format, bytes: &[u8]) -> Result<Self> {
        let Value::Object(object) = serde_json::from_slice(bytes).context("invalid JSON")? else {
            bail!("not a JSON object");
        };
        match format {
            Format::List => validate_list(&object).map(|()| Self::List(object)),
            Format::Single => validate_plugin(&object).map(|()| Self::Single(object)),
        }
    }

    /// Whether `entry` is already in place: the list's last plugin, the only one of its type,
    /// and no istio-cni plugin beside it.
    pub fn holds_last(&self, entry: &Object) -> bool {
        let Self::List(list) = self else {
            return false;
        };
        let plugins = plugins(list);
        let ours = plugins
            .iter()
            .filter(|plugin| plugin_type(plugin) == Some(entry_type(entry)))
            .count();
        ours == 1
            && !self.holds_type(ISTIO_CNI_PLUGIN_TYPE)
            && plugins.last().and_then(Value::as_object) == Some(entry)
    }

    /// Whether a plugin of `plugin_type` is in the configuration, wherever.
    pub fn holds_type(&self, plugin_type: &str) -> bool {
        match self {
            Self::List(list) => plugins(list)
                .iter()
                .any(|plugin| self::plugin_type(plugin) == Some(plugin_type)),
            Self::Single(plugin) => plugin.get("type").and_then(Value::as_str) == Some(plugin_type),
        }
    }

    /// The configuration as a list whose last plugin is `entry`, with any other plugin of
    /// `entry`'s type (stale, or at the wrong position) and istio-cni's plugin dropped. A lone plugin is wrapped the way
    /// libcni's `ConfListFromConf` wraps it in memory: the plugin unchanged, the list taking its
    /// `name` and `cniVersion`; so the runtime sees the same network name and IPAM state as before.
    pub fn with_last(self, entry: Object) -> Object {
        let mut list = match self {
            Self::List(list) => list,
            Self::Single(plugin) => wrap(plugin),
        };
        remove_plugins(&mut list, entry_type(&entry));
        remove_plugins(&mut list, ISTIO_CNI_PLUGIN_TYPE);
        plugins_mut(&mut list).push(Value::Object(entry));
        list
    }
}

/// Removes every plugin of type `plugin_type` from a list, keeping the others in order; returns
/// how many were removed.
pub fn remove_plugins(list: &mut Object, plugin_type: &str) -> usize {
    let plugins = plugins_mut(list);
    let before = plugins.len();
    plugins.retain(|plugin| self::plugin_type(plugin) != Some(plugin_type));
    before - plugins.len()
}

/// How many plugins a list has.
pub fn plugin_count(list: &Object) -> usize {
    plugins(list).len()
}

/// weir's entry: `extra` (the plugin's own settings) plus its `type`, a default `name`, and the
/// pod-annotations capability. `cniVersion` is dropped: in a list the list's version applies.
pub fn plugin_entry(plugin_type: &str, extra: &Value) -> Result<Object> {
    let mut entry = match extra {
        Value::Object(fields) => fields.clone(),
        Value::Null => Object::new(),
        other => bail!("the CNI plugin's config must be a JSON object, not {other}"),
    };
    entry.remove("cniVersion");
    entry
        .entry("name")
        .or_insert_with(|| Value::from(plugin_type));
    entry.insert("type".into(), Value::from(plugin_type));
    let capabilities = entry
        .entry("capabilities")
        .or_insert_with(|| Value::Object(Object::new()));
    let Value::Object(capabilities) = capabilities else {
        bail!("the CNI plugin's capabilities must be a JSON object");
    };
    capabilities.insert(POD_ANNOTATIONS_CAPABILITY.into(), Value::Bool(true));
    Ok(entry)
}

fn validate_list(list: &Object) -> Result<()> {
    ensure!(
        list.get("name").is_some_and(Value::is_string),
        "no \"name\" string"
    );
    ensure!(
        list.get("cniVersion").is_none_or(Value::is_string),
        "\"cniVersion\" is not a string"
    );
    let plugins = list
        .get("plugins")
        .and_then(Value::as_array)
        .context("no \"plugins\" array")?;
    ensure!(!plugins.is_empty(), "no plugins in the list");
    for (index, plugin) in plugins.iter().enumerate() {
        let plugin = plugin
            .as_object()
            .with_context(|| format!("plugin {index} is not an object"))?;
        validate_plugin(plugin).with_context(|| format!("plugin {index}"))?;
    }
    Ok(())
}

fn validate_plugin(plugin: &Object) -> Result<()> {
    ensure!(
        plugin
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty()),
        "no \"type\" (a .conf holding a list?)"
    );
    for field in ["name", "cniVersion"] {
        ensure!(
            plugin.get(field).is_none_or(Value::is_string),
            "\"{field}\" is not a string"
        );
    }
    Ok(())
}

fn wrap(plugin: Object) -> Object {
    let mut list = Object::new();
    // libcni always sets a name (empty when the plugin has none), and a list needs one to load.
    let name = plugin.get("name").cloned().unwrap_or_else(|| "".into());
    list.insert("name".into(), name);
    if let Some(version) = plugin.get("cniVersion") {
        list.insert("cniVersion".into(), version.clone());
    }
    list.insert("plugins".into(), Value::Array(vec![Value::Object(plugin)]));
    list
}

fn plugin_type(plugin: &Value) -> Option<&str> {
    plugin.get("type")?.as_str()
}

fn entry_type(entry: &Object) -> &str {
    entry
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

// Lists reaching these have been validated by `parse` (or built by `wrap`).
fn plugins(list: &Object) -> &[Value] {
    list.get("plugins")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn plugins_mut(list: &mut Object) -> &mut Vec<Value> {
    let plugins = list
        .entry("plugins")
        .or_insert_with(|| Value::Array(Vec::new()));
    if !plugins.is_array() {
        *plugins = Value::Array(Vec::new());
    }
    plugins.as_array_mut().expect("plugins is an array")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(value: Value) -> Object {
        value.as_object().unwrap().clone()
    }

    fn weir() -> Object {
        plugin_entry("weir-cni", &json!({"agent_socket": "/run/weir.sock"})).unwrap()
    }

    #[test]
    fn extension_decides_the_format_as_libcni_does() {
        assert_eq!(Format::of("10-a.conflist".as_ref()), Some(Format::List));
        assert_eq!(Format::of("10-a.conf".as_ref()), Some(Format::Single));
        assert_eq!(Format::of("10-a.json".as_ref()), Some(Format::Single));
        assert_eq!(Format::of(".conf".as_ref()), Some(Format::Single));
        assert_eq!(Format::of("10-a.conf.bak".as_ref()), None);
        assert_eq!(Format::of(".weir-x.tmp".as_ref()), None);
        assert_eq!(Format::of("conflist".as_ref()), None);
    }

    #[test]
    fn rejects_what_libcni_rejects() {
        let list = |v: Value| NetworkConfig::parse(Format::List, v.to_string().as_bytes());
        let single = |v: Value| NetworkConfig::parse(Format::Single, v.to_string().as_bytes());
        assert!(
            list(json!({"plugins": [{"type": "bridge"}]})).is_err(),
            "no name"
        );
        assert!(list(json!({"name": "n", "plugins": []})).is_err(), "empty");
        assert!(list(json!({"name": "n", "plugins": [{"x": 1}]})).is_err());
        assert!(list(json!({"name": "n", "cniVersion": 1, "plugins": [{"type": "b"}]})).is_err());
        assert!(single(json!({"name": "n", "plugins": [{"type": "b"}]})).is_err());
        assert!(NetworkConfig::parse(Format::List, b"{\"name\": ").is_err());
        assert!(list(json!({"name": "n", "plugins": [{"type": "b"}]})).is_ok());
        assert!(single(json!({"type": "bridge"})).is_ok());
    }

    #[test]
    fn entry_declares_pod_annotations_and_keeps_extra_fields() {
        let entry = plugin_entry(
            "weir-cni",
            &json!({"cniVersion": "0.3.1", "log_file": "/var/log/weir.log",
                    "capabilities": {"portMappings": true}}),
        )
        .unwrap();
        assert_eq!(
            Value::Object(entry),
            json!({"name": "weir-cni", "type": "weir-cni", "log_file": "/var/log/weir.log",
                   "capabilities": {"portMappings": true, "io.kubernetes.cri.pod-annotations": true}})
        );
        assert!(plugin_entry("weir-cni", &json!([1])).is_err());
    }

    #[test]
    fn with_last_appends_and_keeps_the_rest() {
        let original = json!({"cniVersion": "1.0.0", "name": "kindnet", "disableCheck": "true",
            "plugins": [{"type": "ptp", "ipam": {"type": "host-local"}},
                        {"type": "portmap", "capabilities": {"portMappings": true}}]});
        let config = NetworkConfig::List(object(original.clone()));
        assert!(!config.holds_last(&weir()));
        let list = config.with_last(weir());
        let mut expected = original;
        expected["plugins"]
            .as_array_mut()
            .unwrap()
            .push(Value::Object(weir()));
        assert_eq!(Value::Object(list.clone()), expected);
        assert!(NetworkConfig::List(list).holds_last(&weir()));
    }

    #[test]
    fn with_last_moves_a_misplaced_or_stale_entry() {
        let stale = json!({"type": "weir-cni", "agent_socket": "/old.sock"});
        let config = NetworkConfig::List(object(json!({"name": "n",
            "plugins": [{"type": "a"}, stale, {"type": "b"}, Value::Object(weir())]})));
        assert!(!config.holds_last(&weir()), "a duplicate is not in place");
        let list = config.with_last(weir());
        assert_eq!(
            list["plugins"],
            json!([{"type": "a"}, {"type": "b"}, Value::Object(weir())])
        );
    }

    #[test]
    fn with_last_takes_istio_cnis_place_in_the_same_write() {
        let istio =
            json!({"type": "istio-cni", "kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"});
        let config = NetworkConfig::List(object(json!({"name": "n",
            "plugins": [{"type": "ptp"}, Value::Object(weir()), istio]})));
        assert!(
            !config.holds_last(&weir()),
            "istio-cni is still in the chain"
        );
        let list = config.with_last(weir());
        assert_eq!(
            list["plugins"],
            json!([{"type": "ptp"}, Value::Object(weir())])
        );
        assert!(NetworkConfig::List(list).holds_last(&weir()));
    }

    #[test]
    fn wraps_a_lone_plugin_as_libcni_does() {
        let conf = json!({"cniVersion": "0.4.0", "name": "mynet", "type": "bridge",
                          "ipam": {"type": "host-local", "subnet": "10.1.0.0/16"}});
        let list = NetworkConfig::Single(object(conf.clone())).with_last(weir());
        assert_eq!(
            Value::Object(list),
            json!({"cniVersion": "0.4.0", "name": "mynet", "plugins": [conf, Value::Object(weir())]})
        );
        let nameless = NetworkConfig::Single(object(json!({"type": "bridge"}))).with_last(weir());
        assert_eq!(nameless["name"], json!(""));
    }

    #[test]
    fn remove_plugins_keeps_the_order() {
        let mut list = object(json!({"name": "n",
            "plugins": [{"type": "a"}, {"type": "weir-cni"}, {"type": "b"}, {"type": "weir-cni"}]}));
        assert_eq!(remove_plugins(&mut list, "weir-cni"), 2);
        assert_eq!(list["plugins"], json!([{"type": "a"}, {"type": "b"}]));
        assert_eq!(remove_plugins(&mut list, "weir-cni"), 0);
        assert_eq!(plugin_count(&list), 2);
    }
}
