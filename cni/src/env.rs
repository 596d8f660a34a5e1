//! The `CNI_*` environment the runtime sets for each call.
use crate::error::{code, CniError};
use crate::protocol::PodRef;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniEnv {
    pub command: Option<String>,
    pub container_id: Option<String>,
    pub netns: Option<String>,
    pub ifname: Option<String>,
    pub args: Option<String>,
}

impl CniEnv {
    /// Reads the process environment; a variable that is not valid UTF-8 counts as unset.
    /// `CNI_PATH` is not read: weir-cni delegates to no other plugin.
    pub fn from_process() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        Self {
            command: lookup("CNI_COMMAND"),
            container_id: lookup("CNI_CONTAINERID"),
            netns: lookup("CNI_NETNS"),
            ifname: lookup("CNI_IFNAME"),
            args: lookup("CNI_ARGS"),
        }
    }
}

/// A variable the command needs; the runtime sets unused ones to "" (`CNI_NETNS` on the second
/// DEL), so empty counts as missing.
pub fn require<'a>(value: &'a Option<String>, name: &str) -> Result<&'a str, CniError> {
    match value.as_deref() {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(CniError::new(
            code::INVALID_ENVIRONMENT,
            format!("{name} is not set"),
        )),
    }
}

/// Reads the pod from `CNI_ARGS` (`K=V;K=V`, in any order). Keys weir does not need, such as
/// `IgnoreUnknown` and `K8S_POD_INFRA_CONTAINER_ID` (the same as `CNI_CONTAINERID`), are skipped.
/// Missing keys stay empty: only ADD insists on a pod name.
pub fn parse_cni_args(raw: &str) -> Result<PodRef, CniError> {
    let mut pod = PodRef::default();
    for pair in raw.split(';').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').ok_or_else(|| {
            CniError::new(code::INVALID_ENVIRONMENT, "CNI_ARGS is malformed")
                .with_details(format!("{pair:?} is not KEY=VALUE"))
        })?;
        let field = match key {
            "K8S_POD_NAMESPACE" => &mut pod.namespace,
            "K8S_POD_NAME" => &mut pod.name,
            "K8S_POD_UID" => &mut pod.uid,
            _ => continue,
        };
        *field = value.to_owned();
    }
    Ok(pod)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_pod() -> PodRef {
        PodRef {
            namespace: "node1-ns".into(),
            name: "pod-2".into(),
            uid: "de60a85b-b095-45a4-a025-7153957e26cf".into(),
        }
    }

    #[test]
    fn parses_the_orders_containerd_uses() {
        // ADD and DEL of the same pod, verbatim from samples/containerd-1.6-cni-calls.txt.
        let add = "K8S_POD_NAMESPACE=node1-ns;K8S_POD_NAME=pod-2;K8S_POD_INFRA_CONTAINER_ID=4ea802200f955fb7cfeebbd932b27369f51eda79babb9e6fb4a4a881cc3ba353;K8S_POD_UID=de60a85b-b095-45a4-a025-7153957e26cf;IgnoreUnknown=1";
        let del = "K8S_POD_UID=de60a85b-b095-45a4-a025-7153957e26cf;IgnoreUnknown=1;K8S_POD_NAMESPACE=node1-ns;K8S_POD_NAME=pod-2;K8S_POD_INFRA_CONTAINER_ID=4ea802200f955fb7cfeebbd932b27369f51eda79babb9e6fb4a4a881cc3ba353";
        assert_eq!(parse_cni_args(add).unwrap(), sample_pod());
        assert_eq!(parse_cni_args(del).unwrap(), sample_pod());
    }

    #[test]
    fn tolerates_empty_segments_and_missing_keys() {
        let pod = parse_cni_args(";K8S_POD_NAME=a=b;;").unwrap();
        assert_eq!(pod.name, "a=b");
        assert!(pod.namespace.is_empty() && pod.uid.is_empty());
        assert_eq!(parse_cni_args("").unwrap(), PodRef::default());
    }

    #[test]
    fn rejects_a_pair_without_value() {
        let err = parse_cni_args("K8S_POD_NAME=a;garbage").unwrap_err();
        assert_eq!(err.code, code::INVALID_ENVIRONMENT);
        assert!(err.details.contains("garbage"));
    }

    #[test]
    fn empty_variables_count_as_missing() {
        let env = CniEnv::from_lookup(|name| (name == "CNI_NETNS").then(String::new));
        assert_eq!(require(&env.netns, "CNI_NETNS").unwrap_err().code, 4);
        assert!(require(&env.command, "CNI_COMMAND").is_err());
        assert_eq!(require(&Some("x".into()), "X").unwrap(), "x");
    }
}
