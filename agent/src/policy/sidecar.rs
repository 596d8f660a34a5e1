//! Which pods get sidecar redirection, and how: istio-cni's sidecar path (`CmdAdd` in
//! `plugin.go`, `NewRedirect` in `sidecar_redirect.go`) over a pod's annotations and its
//! `istio-proxy` container.
//!
//! A pod is redirected when it has an `istio-proxy` container of the `sidecar` kind, no
//! `istio-init` container, Envoy not disabled, injection not turned off, and the injector's
//! status annotation. Its annotations then say how, each with istio's default when absent; a
//! present annotation is used as written, even empty, and an invalid one fails the pod's CNI ADD
//! as istio's does rather than falling back to a guess. So does one istio would take that would
//! take the pod's inbound capture away: its primary interface named as rerouted.
use std::net::IpAddr;

use ipnet::IpNet;
use weir_cni::ambient::ContainerFacts;

use super::{
    Labels, PodFacts, PRIMARY_INTERFACE, REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
    SIDECAR_STATUS_ANNOTATION,
};
use crate::workload::{AllOr, InterceptionMode, SidecarRedirect};

/// The injected proxy; its args, env and securityContext are read.
pub const PROXY_CONTAINER: &str = "istio-proxy";
/// The injector's container when CNI is not used: such a pod redirects itself.
pub const INIT_CONTAINER: &str = "istio-init";
/// Looked up as a label first, then as an annotation.
pub const INJECT_KEY: &str = "sidecar.istio.io/inject";
pub const INTERCEPTION_MODE_ANNOTATION: &str = "sidecar.istio.io/interceptionMode";
pub const INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION: &str =
    "traffic.sidecar.istio.io/includeOutboundIPRanges";
pub const EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION: &str =
    "traffic.sidecar.istio.io/excludeOutboundIPRanges";
pub const INCLUDE_INBOUND_PORTS_ANNOTATION: &str = "traffic.sidecar.istio.io/includeInboundPorts";
pub const EXCLUDE_INBOUND_PORTS_ANNOTATION: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
pub const INCLUDE_OUTBOUND_PORTS_ANNOTATION: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
pub const EXCLUDE_OUTBOUND_PORTS_ANNOTATION: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
pub const EXCLUDE_INTERFACES_ANNOTATION: &str = "traffic.sidecar.istio.io/excludeInterfaces";
/// The deprecated name of `istio.io/reroute-virtual-interfaces`, read only when that is absent.
pub const KUBEVIRT_INTERFACES_ANNOTATION: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";

/// The proxy's status, health and metrics ports: never captured inbound, whatever the pod says,
/// or its probes and scrapes would loop through the proxy.
const ALWAYS_EXCLUDED_INBOUND_PORTS: [u16; 3] = [15020, 15021, 15090];
/// The identity the injector gives the proxy; also what istio-cni assumes for a uid or gid of 0,
/// since exempting root would exempt every root process of the pod.
const DEFAULT_PROXY_ID: u32 = 1337;

/// An annotation istio-cni would refuse: the pod's CNI ADD fails with it, as istio's does.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation}={value:?} is invalid: {reason}")]
pub struct InvalidAnnotation {
    pub annotation: &'static str,
    pub value: String,
    pub reason: String,
}

fn invalid(annotation: &'static str, value: &str, reason: impl Into<String>) -> InvalidAnnotation {
    InvalidAnnotation {
        annotation,
        value: value.to_owned(),
        reason: reason.into(),
    }
}

/// The sidecar decision for a pod that is not ambient: `Ok(None)` when istio-cni leaves it
/// alone, `Ok(Some)` with its redirection, `Err` when an annotation is invalid.
pub fn decide(pod: &PodFacts) -> Result<Option<SidecarRedirect>, InvalidAnnotation> {
    match redirected_proxy(pod) {
        Some(proxy) => redirect(&pod.annotations, proxy).map(Some),
        None => Ok(None),
    }
}

/// The pod's `istio-proxy` when istio-cni would redirect the pod to it; the checks run in the
/// plugin's order.
fn redirected_proxy(pod: &PodFacts) -> Option<&ContainerFacts> {
    // The runtime never calls CNI for these, so istio-cni never sees them: even an invalid
    // annotation on one is nobody's error.
    if pod.host_network {
        return None;
    }
    if pod.containers.iter().any(|c| c.name == INIT_CONTAINER) {
        return None;
    }
    let proxy = pod.containers.iter().find(|c| c.name == PROXY_CONTAINER);
    if proxy
        .and_then(|p| env(p, "DISABLE_ENVOY"))
        .and_then(parse_bool)
        == Some(true)
    {
        return None;
    }
    let proxy = proxy?;
    let proxy_type = match proxy.args.as_slice() {
        [command, kind, ..] if command == "proxy" => kind.as_str(),
        _ => "",
    };
    // A gateway (`router`) runs the same container but captures nothing.
    if !proxy_type.is_empty() && proxy_type != "sidecar" {
        return None;
    }
    let inject = pod
        .labels
        .get(INJECT_KEY)
        .or_else(|| pod.annotations.get(INJECT_KEY));
    if inject.and_then(|v| parse_bool(v)) == Some(false) {
        return None;
    }
    // Only presence counts: the injector's JSON is never read.
    if !pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
        return None;
    }
    Some(proxy)
}

/// istio-cni's `NewRedirect`: the annotations are read in its order, so a pod with several
/// invalid ones is refused for the same one first.
fn redirect(
    annotations: &Labels,
    proxy: &ContainerFacts,
) -> Result<SidecarRedirect, InvalidAnnotation> {
    let get = |key: &str| annotations.get(key).map(String::as_str);

    let mode = match get(INTERCEPTION_MODE_ANNOTATION).unwrap_or("REDIRECT") {
        "REDIRECT" => InterceptionMode::Redirect,
        "TPROXY" => InterceptionMode::Tproxy,
        other => {
            let reason = "istio-cni redirects only REDIRECT or TPROXY (case-sensitive), not NONE";
            return Err(invalid(INTERCEPTION_MODE_ANNOTATION, other, reason));
        }
    };
    let include_outbound_ranges = match get(INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION) {
        None | Some("*") => AllOr::All,
        Some(value) => AllOr::Only(cidrs(INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION, value)?),
    };
    let exclude_outbound_ranges = cidrs(
        EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION,
        get(EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION).unwrap_or(""),
    )?;
    let exclude_inbound = PortList::read(annotations, EXCLUDE_INBOUND_PORTS_ANNOTATION, "15020")?;
    let include_inbound = PortList::read(annotations, INCLUDE_INBOUND_PORTS_ANNOTATION, "*")?;
    let exclude_outbound = PortList::read(annotations, EXCLUDE_OUTBOUND_PORTS_ANNOTATION, "15020")?;
    let include_outbound = PortList::read(annotations, INCLUDE_OUTBOUND_PORTS_ANNOTATION, "")?;

    let exclude_interfaces = interfaces(
        EXCLUDE_INTERFACES_ANNOTATION,
        get(EXCLUDE_INTERFACES_ANNOTATION).unwrap_or(""),
    )?;
    let reroute_annotation = match get(REROUTE_VIRTUAL_INTERFACES_ANNOTATION) {
        Some(value) => (REROUTE_VIRTUAL_INTERFACES_ANNOTATION, value),
        None => (
            KUBEVIRT_INTERFACES_ANNOTATION,
            get(KUBEVIRT_INTERFACES_ANNOTATION).unwrap_or(""),
        ),
    };
    let reroute_interfaces = interfaces(reroute_annotation.0, reroute_annotation.1)?;

    // istio-cni validates `*` on these, then its ADD fails when iptables refuses `*` as a port:
    // refused only now, after every annotation was read, a pod fails for istio's first reason.
    let mut exclude_inbound_ports = exclude_inbound.without_wildcard()?;
    exclude_inbound_ports.extend(ALWAYS_EXCLUDED_INBOUND_PORTS);
    let exclude_inbound_ports = first_seen(exclude_inbound_ports);
    let exclude_outbound_ports = exclude_outbound.without_wildcard()?;
    let include_outbound_ports = include_outbound.without_wildcard()?;
    let proxy_uid = proxy_id(proxy.run_as_user, "istio-proxy securityContext.runAsUser")?;
    let proxy_gid = proxy_id(proxy.run_as_group, "istio-proxy securityContext.runAsGroup")?;
    // istio would take every inbound connection to the outbound listener, around the inbound
    // capture (and the inbound policy) of the proxy: refused, after istio's own reasons.
    if reroute_interfaces
        .iter()
        .any(|name| name == PRIMARY_INTERFACE)
    {
        let (annotation, value) = reroute_annotation;
        let reason = format!(
            "{PRIMARY_INTERFACE} is the pod's network: rerouting it would take the pod's \
             inbound connections to the proxy's outbound listener, around its inbound capture"
        );
        return Err(invalid(annotation, value, reason));
    }

    // Only a literal `value` is read; one from `valueFrom` counts as "", which is not a bool.
    let flag = |name| env(proxy, name).and_then(parse_bool).unwrap_or(false);
    Ok(SidecarRedirect {
        mode,
        proxy_uid,
        proxy_gid,
        include_outbound_ranges,
        exclude_outbound_ranges,
        include_inbound_ports: include_inbound.ports,
        exclude_inbound_ports,
        include_outbound_ports,
        exclude_outbound_ports,
        exclude_interfaces,
        reroute_interfaces,
        dns_capture: flag("ISTIO_META_DNS_CAPTURE"),
        dual_stack: flag("ISTIO_DUAL_STACK"),
    })
}

/// The proxy's uid or gid; unset and 0 both mean the injector's default.
fn proxy_id(id: Option<i64>, field: &'static str) -> Result<u32, InvalidAnnotation> {
    match id {
        None | Some(0) => Ok(DEFAULT_PROXY_ID),
        // The API server refuses these; only a hand-written policy file can carry one, and
        // istio's rules would fail on it too.
        Some(id) => u32::try_from(id)
            .map_err(|_| invalid(field, &id.to_string(), "not a Linux user or group id")),
    }
}

/// A container's env value as istio-cni keeps it: the last entry of a name wins, and one from
/// `valueFrom` is empty.
fn env<'a>(container: &'a ContainerFacts, name: &str) -> Option<&'a str> {
    container
        .env
        .iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, value)| value.as_deref().unwrap_or(""))
}

/// Go's `strconv.ParseBool`, which istio-cni uses for every flag it reads.
fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// A comma-separated CIDR list as Go's `netip.ParsePrefix` reads each item: no blanks around
/// them, no empty item; "" is the empty list.
fn cidrs(annotation: &'static str, value: &str) -> Result<Vec<IpNet>, InvalidAnnotation> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|item| {
            prefix(item).map_err(|why| {
                let reason = format!("{item:?} is not a CIDR (address/length, no spaces): {why}");
                invalid(annotation, value, reason)
            })
        })
        .collect()
}

/// One CIDR, strictly: a sign or a leading zero in the length is refused, as Go refuses them.
/// Host bits are cleared, as the rules apply the prefix.
fn prefix(text: &str) -> Result<IpNet, String> {
    let (address, length) = text
        .split_once('/')
        .ok_or_else(|| "no /length".to_owned())?;
    let address: IpAddr = address
        .parse()
        .map_err(|_| format!("{address:?} is not an IP address"))?;
    let decimal = !length.is_empty()
        && length.bytes().all(|b| b.is_ascii_digit())
        && (length == "0" || !length.starts_with('0'));
    let length: u8 = match length.parse() {
        Ok(length) if decimal => length,
        _ => return Err(format!("{length:?} is not a prefix length")),
    };
    IpNet::new(address, length)
        .map(|net| net.trunc())
        .map_err(|_| format!("/{length} is too long for {address}"))
}

/// A port-list annotation, or its default, as istio-cni validates it; `*` passes here and is
/// refused later where istio could not apply it.
struct PortList<'a> {
    annotation: &'static str,
    value: &'a str,
    ports: AllOr<u16>,
}

impl<'a> PortList<'a> {
    fn read(
        annotations: &'a Labels,
        annotation: &'static str,
        default: &'a str,
    ) -> Result<Self, InvalidAnnotation> {
        let value = annotations.get(annotation).map_or(default, String::as_str);
        let ports = if value == "*" {
            AllOr::All
        } else {
            AllOr::Only(ports(annotation, value)?)
        };
        Ok(Self {
            annotation,
            value,
            ports,
        })
    }

    fn without_wildcard(self) -> Result<Vec<u16>, InvalidAnnotation> {
        match self.ports {
            AllOr::Only(ports) => Ok(ports),
            AllOr::All => Err(invalid(
                self.annotation,
                self.value,
                "istio-cni accepts `*` here but its rules could not apply it (the pod's CNI ADD \
                 fails in iptables); only includeInboundPorts means every port by `*`",
            )),
        }
    }
}

/// istio's `parsePorts`: blanks around the list and around each item are ignored, an empty list
/// is no port, and every item is a decimal 0..=65535.
fn ports(annotation: &'static str, value: &str) -> Result<Vec<u16>, InvalidAnnotation> {
    let list = value.trim();
    if list.is_empty() {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(|item| {
            let item = item.trim();
            let digits = !item.is_empty() && item.bytes().all(|b| b.is_ascii_digit());
            match item.parse::<u16>() {
                Ok(port) if digits => Ok(port),
                _ => Err(invalid(
                    annotation,
                    value,
                    format!("{item:?} is not a port (a decimal number from 0 to 65535)"),
                )),
            }
        })
        .collect()
}

/// The longest name Linux gives an interface (IFNAMSIZ less its NUL).
const MAX_INTERFACE_NAME: usize = 15;

/// istio's `ValidateInterfaceNames`: "" is no interface; otherwise every comma-separated item,
/// trimmed, is a name of at most 15 characters, a letter then letters, digits, `_`, `.` or `-`.
fn interfaces(annotation: &'static str, value: &str) -> Result<Vec<String>, InvalidAnnotation> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|name| {
            let name = name.trim();
            let fail = |why: String| Err(invalid(annotation, value, why));
            if name.is_empty() {
                return fail("an interface name is empty".into());
            }
            if name.len() > MAX_INTERFACE_NAME {
                return fail(format!(
                    "interface name {name:?} is longer than {MAX_INTERFACE_NAME} characters"
                ));
            }
            let mut chars = name.chars();
            let starts_with_letter = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
            let rest_allowed =
                chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
            if !(starts_with_letter && rest_allowed) {
                return fail(format!(
                    "interface name {name:?} must be a letter followed by letters, digits, \
                     '_', '.' or '-'"
                ));
            }
            Ok(name.to_owned())
        })
        .collect()
}

/// The ports without repeats, each where it first appeared.
fn first_seen(ports: Vec<u16>) -> Vec<u16> {
    let mut kept = Vec::with_capacity(ports.len());
    for port in ports {
        if !kept.contains(&port) {
            kept.push(port);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_labels as labels;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn container(name: &str) -> ContainerFacts {
        ContainerFacts {
            name: name.into(),
            ..ContainerFacts::default()
        }
    }

    fn net(cidr: &str) -> IpNet {
        cidr.parse().unwrap()
    }

    /// istio-proxy as the injector writes it.
    fn proxy() -> ContainerFacts {
        ContainerFacts {
            name: PROXY_CONTAINER.into(),
            args: strings(&[
                "proxy",
                "sidecar",
                "--domain",
                "$(POD_NAMESPACE).svc.cluster.local",
                "--proxyLogLevel=warning",
                "--log_output_level=default:info",
            ]),
            env: vec![
                ("PILOT_CERT_PROVIDER".into(), Some("istiod".into())),
                ("POD_NAME".into(), None),
                ("ISTIO_META_CLUSTER_ID".into(), Some("Kubernetes".into())),
            ],
            run_as_user: Some(1337),
            run_as_group: Some(1337),
        }
    }

    /// A pod as istio's injector writes it when CNI is enabled: `istio-validation` in place of
    /// `istio-init`, and the traffic annotations.
    fn injected() -> PodFacts {
        let validation = ContainerFacts {
            name: "istio-validation".into(),
            args: strings(&[
                "istio-iptables",
                "-p",
                "15001",
                "-z",
                "15006",
                "-u",
                "1337",
                "-m",
                "REDIRECT",
                "-i",
                "*",
                "-x",
                "",
                "-b",
                "*",
                "-d",
                "15090,15021,15020",
                "--log_output_level=default:info",
                "--run-validation",
                "--skip-rule-apply",
            ]),
            run_as_user: Some(1337),
            run_as_group: Some(1337),
            ..ContainerFacts::default()
        };
        PodFacts {
            namespace: "shop".into(),
            name: "api-7d9c".into(),
            labels: labels(&[
                ("app", "api"),
                ("security.istio.io/tlsMode", "istio"),
                ("service.istio.io/canonical-name", "api"),
            ]),
            annotations: labels(&[
                (INTERCEPTION_MODE_ANNOTATION, "REDIRECT"),
                (INCLUDE_INBOUND_PORTS_ANNOTATION, "*"),
                (EXCLUDE_INBOUND_PORTS_ANNOTATION, "15020"),
                (INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION, "*"),
                ("istio.io/rev", "default"),
                ("kubectl.kubernetes.io/default-container", "api"),
                (
                    SIDECAR_STATUS_ANNOTATION,
                    r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}"#,
                ),
            ]),
            containers: vec![validation, container("api"), proxy()],
            service_account: Some("api".into()),
            ..PodFacts::default()
        }
    }

    fn with_annotations(pairs: &[(&str, &str)]) -> PodFacts {
        let mut pod = injected();
        pod.annotations.extend(labels(pairs));
        pod
    }

    fn redirect_of(pod: &PodFacts) -> SidecarRedirect {
        decide(pod).unwrap().expect("redirected")
    }

    fn annotated(pairs: &[(&str, &str)]) -> SidecarRedirect {
        redirect_of(&with_annotations(pairs))
    }

    fn refused(pairs: &[(&str, &str)]) -> InvalidAnnotation {
        decide(&with_annotations(pairs)).expect_err("refused")
    }

    fn with_proxy(change: impl FnOnce(&mut ContainerFacts)) -> PodFacts {
        let mut pod = injected();
        change(
            pod.containers
                .iter_mut()
                .find(|c| c.name == PROXY_CONTAINER)
                .unwrap(),
        );
        pod
    }

    fn with_proxy_env(name: &str, value: Option<&str>) -> PodFacts {
        with_proxy(|p| p.env.push((name.into(), value.map(Into::into))))
    }

    #[test]
    fn an_injected_pod_with_cni_enabled_is_redirected_with_istios_defaults() {
        assert_eq!(decide(&injected()), Ok(Some(SidecarRedirect::default())));
    }

    #[test]
    fn absent_annotations_take_istios_defaults() {
        let mut pod = injected();
        pod.annotations
            .retain(|key, _| key == SIDECAR_STATUS_ANNOTATION);
        assert_eq!(redirect_of(&pod), SidecarRedirect::default());
    }

    #[test]
    fn host_network_pods_are_never_redirected() {
        let mut pod = with_annotations(&[(INTERCEPTION_MODE_ANNOTATION, "NONE")]);
        pod.host_network = true;
        assert_eq!(decide(&pod), Ok(None));
    }

    #[test]
    fn a_pod_with_istio_init_redirects_itself() {
        let mut pod = injected();
        pod.containers.insert(0, container(INIT_CONTAINER));
        assert_eq!(decide(&pod), Ok(None));
        let mut pod = injected();
        pod.containers.push(container(INIT_CONTAINER));
        assert_eq!(decide(&pod), Ok(None));
    }

    #[test]
    fn disable_envoy_skips_when_it_parses_as_true() {
        for value in ["true", "1", "t", "T", "TRUE", "True"] {
            let pod = with_proxy_env("DISABLE_ENVOY", Some(value));
            assert_eq!(decide(&pod), Ok(None), "{value}");
        }
        for value in [Some("false"), Some("0"), Some("yes"), Some(""), None] {
            let pod = with_proxy_env("DISABLE_ENVOY", value);
            assert!(decide(&pod).unwrap().is_some(), "{value:?}");
        }
        let mut pod = injected();
        pod.containers[1]
            .env
            .push(("DISABLE_ENVOY".into(), Some("true".into())));
        assert!(
            decide(&pod).unwrap().is_some(),
            "only istio-proxy's env counts"
        );
    }

    #[test]
    fn a_pod_without_istio_proxy_is_left_alone() {
        let mut pod = injected();
        pod.containers.retain(|c| c.name != PROXY_CONTAINER);
        assert_eq!(decide(&pod), Ok(None));
    }

    #[test]
    fn a_native_sidecar_proxy_counts_too() {
        let mut pod = injected();
        let proxy = pod.containers.pop().unwrap();
        pod.containers.insert(1, proxy);
        assert_eq!(decide(&pod), Ok(Some(SidecarRedirect::default())));
    }

    #[test]
    fn only_a_sidecar_proxy_type_is_redirected() {
        let redirected = |args: &[&str]| {
            let pod = with_proxy(|p| p.args = strings(args));
            decide(&pod).unwrap().is_some()
        };
        assert!(redirected(&["proxy", "sidecar"]));
        assert!(!redirected(&["proxy", "router", "--domain", "x"]));
        assert!(!redirected(&["proxy", "Sidecar"]));
        // No type at all does not exclude.
        assert!(redirected(&[]));
        assert!(redirected(&["proxy"]));
        assert!(redirected(&["proxy", ""]));
        assert!(redirected(&["agent", "router"]));
    }

    #[test]
    fn inject_false_skips_from_the_label_first_then_the_annotation() {
        let decided = |label: Option<&str>, annotation: Option<&str>| {
            let mut pod = injected();
            if let Some(value) = label {
                pod.labels.insert(INJECT_KEY.into(), value.into());
            }
            if let Some(value) = annotation {
                pod.annotations.insert(INJECT_KEY.into(), value.into());
            }
            decide(&pod).unwrap().is_some()
        };
        for value in ["false", "False", "FALSE", "f", "F", "0"] {
            assert!(!decided(Some(value), None), "label {value}");
            assert!(!decided(None, Some(value)), "annotation {value}");
        }
        assert!(decided(Some("true"), None));
        assert!(decided(None, Some("no")), "an unparsable value is ignored");
        assert!(decided(Some("true"), Some("false")), "the label wins");
        assert!(
            decided(Some("nope"), Some("false")),
            "a present label wins even when it does not parse"
        );
        assert!(!decided(Some("false"), Some("true")));
    }

    #[test]
    fn the_status_annotation_must_be_present_whatever_its_value() {
        let mut pod = injected();
        pod.annotations.remove(SIDECAR_STATUS_ANNOTATION);
        assert_eq!(decide(&pod), Ok(None));
        pod.annotations
            .insert(SIDECAR_STATUS_ANNOTATION.into(), String::new());
        assert!(decide(&pod).unwrap().is_some());
    }

    #[test]
    fn a_pod_left_alone_is_never_refused_for_its_annotations() {
        let mut pod = with_annotations(&[(INTERCEPTION_MODE_ANNOTATION, "NONE")]);
        pod.annotations.remove(SIDECAR_STATUS_ANNOTATION);
        assert_eq!(decide(&pod), Ok(None));
    }

    #[test]
    fn interception_mode_is_redirect_or_tproxy_exactly() {
        assert_eq!(
            annotated(&[(INTERCEPTION_MODE_ANNOTATION, "TPROXY")]).mode,
            InterceptionMode::Tproxy
        );
        for value in ["NONE", "redirect", "Tproxy", "", " REDIRECT"] {
            let error = refused(&[(INTERCEPTION_MODE_ANNOTATION, value)]);
            assert_eq!(error.annotation, INTERCEPTION_MODE_ANNOTATION, "{value}");
            assert_eq!(error.value, value);
        }
    }

    #[test]
    fn empty_values_mean_what_they_mean_to_istio() {
        let empty = |key| annotated(&[(key, "")]);
        assert_eq!(
            empty(INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION).include_outbound_ranges,
            AllOr::Only(Vec::new()),
            "no IP-based outbound capture"
        );
        assert_eq!(
            empty(INCLUDE_INBOUND_PORTS_ANNOTATION).include_inbound_ports,
            AllOr::Only(Vec::new()),
            "no inbound capture"
        );
        assert_eq!(
            empty(EXCLUDE_OUTBOUND_PORTS_ANNOTATION).exclude_outbound_ports,
            Vec::<u16>::new(),
            "present but empty drops the 15020 default"
        );
        assert_eq!(
            empty(EXCLUDE_INBOUND_PORTS_ANNOTATION).exclude_inbound_ports,
            [15020, 15021, 15090]
        );
        for key in [
            EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION,
            INCLUDE_OUTBOUND_PORTS_ANNOTATION,
            EXCLUDE_INTERFACES_ANNOTATION,
            REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
            KUBEVIRT_INTERFACES_ANNOTATION,
        ] {
            assert_eq!(empty(key), SidecarRedirect::default(), "{key}");
        }
        let blank = annotated(&[
            (INCLUDE_INBOUND_PORTS_ANNOTATION, "  "),
            (INCLUDE_OUTBOUND_PORTS_ANNOTATION, " "),
        ]);
        assert_eq!(blank.include_inbound_ports, AllOr::Only(Vec::new()));
        assert!(blank.include_outbound_ports.is_empty());
    }

    #[test]
    fn the_proxys_inbound_ports_are_always_excluded_once() {
        let exclude =
            |value| annotated(&[(EXCLUDE_INBOUND_PORTS_ANNOTATION, value)]).exclude_inbound_ports;
        assert_eq!(exclude("3306"), [3306, 15020, 15021, 15090]);
        assert_eq!(exclude("15020"), [15020, 15021, 15090]);
        assert_eq!(
            exclude("15090, 3306,3306 ,15021"),
            [15090, 3306, 15021, 15020]
        );
        assert_eq!(exclude("8080,15020"), [8080, 15020, 15021, 15090]);
    }

    #[test]
    fn a_present_outbound_exclusion_replaces_the_default() {
        let redirect = annotated(&[(EXCLUDE_OUTBOUND_PORTS_ANNOTATION, "53, 8125")]);
        assert_eq!(redirect.exclude_outbound_ports, [53, 8125]);
    }

    #[test]
    fn port_lists_are_trimmed_decimal_ports() {
        let redirect = annotated(&[
            (INCLUDE_INBOUND_PORTS_ANNOTATION, "80, 8080 ,443"),
            (INCLUDE_OUTBOUND_PORTS_ANNOTATION, "0,65535,080"),
        ]);
        assert_eq!(
            redirect.include_inbound_ports,
            AllOr::Only(vec![80, 8080, 443])
        );
        assert_eq!(redirect.include_outbound_ports, [0, 65535, 80]);
        for key in [
            INCLUDE_INBOUND_PORTS_ANNOTATION,
            EXCLUDE_INBOUND_PORTS_ANNOTATION,
            INCLUDE_OUTBOUND_PORTS_ANNOTATION,
            EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
        ] {
            for value in [
                "65536", "-1", "+80", "80,,81", "80,", ",", "http", "0x50", " * ", "*,80", "8 0",
            ] {
                let error = refused(&[(key, value)]);
                assert_eq!((error.annotation, error.value.as_str()), (key, value));
                assert!(error.reason.contains("is not a port"), "{error}");
            }
        }
    }

    #[test]
    fn a_port_wildcard_means_every_port_only_for_inbound_inclusion() {
        assert_eq!(
            annotated(&[(INCLUDE_INBOUND_PORTS_ANNOTATION, "*")]).include_inbound_ports,
            AllOr::All
        );
        for key in [
            EXCLUDE_INBOUND_PORTS_ANNOTATION,
            INCLUDE_OUTBOUND_PORTS_ANNOTATION,
            EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
        ] {
            let error = refused(&[(key, "*")]);
            assert_eq!((error.annotation, error.value.as_str()), (key, "*"));
            assert!(error.reason.contains("could not apply"), "{error}");
        }
    }

    #[test]
    fn cidr_lists_are_prefixes_without_spaces() {
        let redirect = annotated(&[
            (
                INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION,
                "10.0.0.0/8,fd00::/8,10.1.2.3/16",
            ),
            (
                EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION,
                "169.254.169.254/32,::ffff:0:0/96",
            ),
        ]);
        assert_eq!(
            redirect.include_outbound_ranges,
            AllOr::Only(vec![net("10.0.0.0/8"), net("fd00::/8"), net("10.1.0.0/16")])
        );
        assert_eq!(
            redirect.exclude_outbound_ranges,
            [net("169.254.169.254/32"), net("::ffff:0:0/96")]
        );
        for key in [
            INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION,
            EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION,
        ] {
            for value in [
                "10.0.0.0/8, 10.1.0.0/16",
                " 10.0.0.0/8",
                "10.0.0.0",
                "10.0.0.0/",
                "10.0.0.0/33",
                "fd00::/129",
                "10.0.0.0/08",
                "10.0.0.0/+8",
                "010.0.0.0/8",
                "fe80::1%eth0/64",
                "10.0.0.0/8,",
                "*,10.0.0.0/8",
                " ",
            ] {
                let error = refused(&[(key, value)]);
                assert_eq!((error.annotation, error.value.as_str()), (key, value));
                assert!(error.reason.contains("is not a CIDR"), "{error}");
            }
        }
        let error = refused(&[(EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION, "*")]);
        assert_eq!(error.annotation, EXCLUDE_OUTBOUND_IP_RANGES_ANNOTATION);
    }

    #[test]
    fn interface_lists_are_trimmed_valid_names() {
        let redirect = annotated(&[
            (
                EXCLUDE_INTERFACES_ANNOTATION,
                " eth1 , net-2.a_b,fifteen-chars-x",
            ),
            (REROUTE_VIRTUAL_INTERFACES_ANNOTATION, "tap0"),
        ]);
        assert_eq!(
            redirect.exclude_interfaces,
            ["eth1", "net-2.a_b", "fifteen-chars-x"]
        );
        assert_eq!(redirect.reroute_interfaces, ["tap0"]);
        for key in [
            EXCLUDE_INTERFACES_ANNOTATION,
            REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
            KUBEVIRT_INTERFACES_ANNOTATION,
        ] {
            for value in [
                "eth1,",
                ",",
                " ",
                "eth1,,eth2",
                "1eth",
                "_tap",
                "sixteen-chars-xx",
                "tap 0",
                "eth0:1",
                "net/1",
            ] {
                let error = refused(&[(key, value)]);
                assert_eq!((error.annotation, error.value.as_str()), (key, value));
            }
        }
    }

    #[test]
    fn reroute_virtual_interfaces_win_over_the_kubevirt_annotation() {
        let reroute = |pairs: &[(&str, &str)]| annotated(pairs).reroute_interfaces;
        assert_eq!(
            reroute(&[(KUBEVIRT_INTERFACES_ANNOTATION, "net1,net2")]),
            ["net1", "net2"]
        );
        assert_eq!(
            reroute(&[
                (KUBEVIRT_INTERFACES_ANNOTATION, "net1"),
                (REROUTE_VIRTUAL_INTERFACES_ANNOTATION, "tap0"),
            ]),
            ["tap0"]
        );
        assert!(
            reroute(&[
                (KUBEVIRT_INTERFACES_ANNOTATION, "net1"),
                (REROUTE_VIRTUAL_INTERFACES_ANNOTATION, ""),
            ])
            .is_empty(),
            "present, even empty, the newer annotation wins"
        );
        assert_eq!(
            reroute(&[
                (KUBEVIRT_INTERFACES_ANNOTATION, "not valid!"),
                (REROUTE_VIRTUAL_INTERFACES_ANNOTATION, "tap0"),
            ]),
            ["tap0"],
            "the older annotation is not even read"
        );
    }

    #[test]
    fn the_primary_interface_is_never_rerouted() {
        for key in [
            REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
            KUBEVIRT_INTERFACES_ANNOTATION,
        ] {
            let error = refused(&[(key, "tap0, eth0")]);
            assert_eq!(
                (error.annotation, error.value.as_str()),
                (key, "tap0, eth0")
            );
        }
    }

    #[test]
    fn lo_is_never_rerouted() {
        let redirect = annotated(&[(REROUTE_VIRTUAL_INTERFACES_ANNOTATION, "tap0,lo")]);
        assert_eq!(redirect.options().reroute_interfaces, ["tap0"]);
    }

    #[test]
    fn proxy_ids_come_from_its_security_context_with_0_meaning_1337() {
        let ids = |uid: Option<i64>, gid: Option<i64>| {
            let redirect = redirect_of(&with_proxy(|p| {
                p.run_as_user = uid;
                p.run_as_group = gid;
            }));
            (redirect.proxy_uid, redirect.proxy_gid)
        };
        assert_eq!(ids(None, None), (1337, 1337));
        assert_eq!(ids(Some(0), Some(0)), (1337, 1337));
        // TPROXY: the injector runs the proxy as root, group 1337.
        assert_eq!(ids(Some(0), Some(1337)), (1337, 1337));
        assert_eq!(ids(Some(1000770000), None), (1000770000, 1337));
        assert_eq!(ids(Some(0), Some(5)), (1337, 5));
        assert_eq!(ids(Some(2000), Some(3000)), (2000, 3000));

        let error = decide(&with_proxy(|p| p.run_as_user = Some(-1))).unwrap_err();
        assert_eq!(error.annotation, "istio-proxy securityContext.runAsUser");
        let error = decide(&with_proxy(|p| p.run_as_group = Some(1 << 32))).unwrap_err();
        assert_eq!(error.annotation, "istio-proxy securityContext.runAsGroup");
    }

    #[test]
    fn pod_level_ids_and_other_containers_do_not_count() {
        let mut pod = injected();
        pod.containers[1].run_as_user = Some(4000);
        pod.containers[0].run_as_group = Some(4000);
        let redirect = redirect_of(&pod);
        assert_eq!((redirect.proxy_uid, redirect.proxy_gid), (1337, 1337));
    }

    #[test]
    fn dns_capture_and_dual_stack_come_from_the_proxys_env() {
        for (value, expected) in [
            (Some("true"), true),
            (Some("1"), true),
            (Some("T"), true),
            (Some("false"), false),
            (Some("yes"), false),
            (Some(""), false),
            (None, false),
        ] {
            let pod = with_proxy_env("ISTIO_META_DNS_CAPTURE", value);
            assert_eq!(redirect_of(&pod).dns_capture, expected, "{value:?}");
            let pod = with_proxy_env("ISTIO_DUAL_STACK", value);
            assert_eq!(redirect_of(&pod).dual_stack, expected, "{value:?}");
        }
        let pod = with_proxy(|p| {
            p.env
                .push(("ISTIO_META_DNS_CAPTURE".into(), Some("true".into())));
            p.env
                .push(("ISTIO_META_DNS_CAPTURE".into(), Some("false".into())));
        });
        assert!(!redirect_of(&pod).dns_capture, "the last entry wins");
        let mut pod = injected();
        pod.containers[1]
            .env
            .push(("ISTIO_DUAL_STACK".into(), Some("true".into())));
        assert!(!redirect_of(&pod).dual_stack);
    }

    #[test]
    fn an_error_names_the_annotation_its_value_and_why() {
        let error = refused(&[(INCLUDE_INBOUND_PORTS_ANNOTATION, "80,http")]);
        assert_eq!(
            error.to_string(),
            "annotation traffic.sidecar.istio.io/includeInboundPorts=\"80,http\" is invalid: \
             \"http\" is not a port (a decimal number from 0 to 65535)"
        );
    }

    #[test]
    fn several_invalid_annotations_are_refused_in_istios_order() {
        let error = refused(&[
            (EXCLUDE_INTERFACES_ANNOTATION, "1eth"),
            (INCLUDE_OUTBOUND_IP_RANGES_ANNOTATION, "x"),
            (INTERCEPTION_MODE_ANNOTATION, "NONE"),
        ]);
        assert_eq!(error.annotation, INTERCEPTION_MODE_ANNOTATION);
        // istio accepts the wildcard and fails later, so the bad interface is what it reports.
        let error = refused(&[
            (EXCLUDE_INBOUND_PORTS_ANNOTATION, "*"),
            (EXCLUDE_INTERFACES_ANNOTATION, "1eth"),
        ]);
        assert_eq!(error.annotation, EXCLUDE_INTERFACES_ANNOTATION);
    }
}
