//! istio-validation, istio's own check of the redirection, passes in weir's sidecar pods and
//! fails without weir.
use super::*;

#[test]
fn istio_validation_passes_in_a_sidecar_pod_and_fails_without_weir() {
    let Some((node, agent, pod)) = sidecar_node(sidecar_pod(&[], &[])) else {
        return;
    };
    let plain = node.pod("default", "plain").unwrap();
    assert_eq!(
        run_validation(&plain),
        126,
        "no redirection: validation fails"
    );
    assert_eq!(run_validation(&pod), 0, "weir's redirection validates");
    agent.stop().unwrap();
}

/// A pod whose first address is IPv6 is validated over IPv6: its proxy's `[::1]` to `[::6]:15002`
/// must hairpin to 15006 as istio's ip6tables rules send it, or the pod never starts.
#[test]
fn istio_validation_passes_in_sidecar_pods_whose_first_address_is_ipv6() {
    for families in [Families::Ipv6Only, Families::DualStackIpv6First] {
        let Some((_node, agent, pod)) = sidecar_node_in(families, sidecar_pod(&[], &[])) else {
            return;
        };
        assert!(pod.ips()[0].is_ipv6(), "{families:?}: {pod:?}");
        assert_eq!(run_validation(&pod), 0, "{families:?}");
        agent.stop().unwrap();
    }
}
