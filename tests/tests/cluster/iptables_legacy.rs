//! A node whose istio-cni agent wrote its rules with iptables-legacy (a node whose iptables is
//! legacy), taken over.
use weir_tests::istio_iptables::Backend;

/// As `takeover::a_takeover_from_istio_cni_survives_a_restart_midway`, istio-cni's rules in the
/// pods and its probe SNAT on the node written with iptables-legacy: they leave the pods and the
/// node the same.
#[test]
fn a_node_whose_istio_cni_wrote_with_iptables_legacy_is_taken_over() {
    super::takeover::take_over_from_istio_cni(true, Backend::Legacy);
}
