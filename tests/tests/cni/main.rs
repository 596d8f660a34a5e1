//! Pods enrolled the way kubelet's runtime enrolls them: the node's CNI config (bridge +
//! host-local, with weir-cni inserted by weir's own installer), the runtime's ADD/CHECK/DEL calls,
//! the real agent, and ztunnel (the stand-in) connected over ZDS.
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    time::Duration,
};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;
use weir_agent::{
    config::AgentConfig,
    install::ServiceAccount,
    policy::{
        local::ObjectMeta as PolicyMeta, BYPASS_INBOUND_ANNOTATION, DATAPLANE_MODE_LABEL,
        DNS_CAPTURE_ANNOTATION,
    },
};
use weir_common::{ABI_VERSION, DNS_PORT, INBOUND_PORT, MAX_PODS};
use weir_tests::privileged;
use weir_tests::{
    agent::{http_get, Agent},
    chain::{
        ambient_policy, assert_direct, assert_through_ztunnel, pods_command, wait_for_metric,
        weir_conflist, weir_only, CniChainNode as Node, MESH, WAIT,
    },
    cni::{Command, NetworkConfigList, RuntimeConf},
    raw,
    receive_batch::kernel_needs_the_handoff,
    tcp_request, udp_request,
    zds_client::{NetnsId, ZdsEvent, ZdsZtunnel},
    ApiServer, EchoServer, Metrics, Pod, PodSpec, ZtunnelStandIn,
};

mod agent_away;
mod calls;
mod errors;
mod node_setup;

/// CHECK, with the pod's ADD result as prevResult.
fn check(node: &Node, pod: &Pod) -> Result<serde_json::Value, weir_tests::cni::CniError> {
    weir_only(
        node,
        Command::Check,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
}

/// The code and message of the error result weir-cni printed.
fn cni_error(result: Result<serde_json::Value, weir_tests::cni::CniError>) -> (u64, String) {
    match result {
        Err(weir_tests::cni::CniError::Plugin(failure)) => (
            failure.code.expect("an error result has a code"),
            failure.msg,
        ),
        other => panic!("expected an error result, got {other:?}"),
    }
}

/// An ambient pod wired by the node's primary CNI only, for weir-cni's calls made by hand.
fn unenrolled_ambient_pod(node: &Node, name: &str) -> Pod {
    node.test_node()
        .add_pod_primary(PodSpec {
            namespace: MESH.into(),
            ..PodSpec::new(name)
        })
        .unwrap()
}
