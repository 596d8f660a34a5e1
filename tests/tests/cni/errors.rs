//! What the runtime is told when a call cannot be served: the CNI spec's error codes, for good
//! or to try again later.
use super::*;

#[test]
fn malformed_and_oversized_requests_get_errors() {
    let node = privileged!(Node::new());
    let agent = node.start_agent();
    let ask = |payload: &[u8]| -> serde_json::Value {
        let mut stream = UnixStream::connect(&agent.config.cni_socket).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let _ = stream.write_all(payload);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let garbage = ask(b"{not json\n");
    assert_eq!(garbage["result"], "error");
    assert_eq!(garbage["code"], 6);
    let oversized = ask(&vec![b'x'; 200 * 1024]);
    assert_eq!(oversized["result"], "error");
    // The agent still serves pods afterwards.
    let _ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).unwrap();
    node.pod(MESH, "after").expect("still serving");
    agent.stop().unwrap();
}

/// An ambient pod's request that lacks what its enrollment needs gets the spec's code for what
/// is wrong and a message naming it, never "try again later": the runtime would send the same
/// request again and again. (weir-cni answers what it can check alone the same way, without
/// asking the agent: `cni/tests/plugin.rs`.) The runtime's DELs after the failed ADD succeed.
#[test]
fn malformed_requests_get_the_specs_code_for_what_is_wrong() {
    let node = privileged!(Node::new());
    let agent = node.start_agent();
    let pod = unenrolled_ambient_pod(&node, "app");
    let (runtime, prev) = (pod.runtime_conf(), pod.prev_result());
    let without_netns = RuntimeConf {
        netns: None,
        ..runtime.clone()
    };
    let without_uid = RuntimeConf {
        args: runtime
            .args
            .iter()
            .filter(|(key, _)| key != "K8S_POD_UID")
            .cloned()
            .collect(),
        ..runtime.clone()
    };
    let mut without_addresses = prev.clone();
    without_addresses["ips"] = json!([]);
    // Without them in prevResult the agent looks on eth0, where only link-local ones are left.
    let flush = [
        "-n",
        pod.netns().name(),
        "addr",
        "flush",
        "dev",
        "eth0",
        "scope",
        "global",
    ];
    weir_tests::netns::ip(&flush).unwrap();
    let mut bad_address = prev.clone();
    bad_address["ips"][0]["address"] = "10.244.0.300/24".into();
    let add = |runtime: &RuntimeConf, prev: &serde_json::Value| {
        weir_only(&node, Command::Add, runtime, Some(prev))
    };
    for (result, code, msg) in [
        (
            add(&without_uid, prev),
            4,
            "CNI_ARGS has no K8S_POD_UID: ambient pod mesh/app cannot be enrolled",
        ),
        (
            add(runtime, &without_addresses),
            7,
            "neither prevResult nor the pod's eth0 has an IP address: ambient pod mesh/app \
             cannot be enrolled",
        ),
        (
            add(runtime, &bad_address),
            7,
            "prevResult address \"10.244.0.300/24\" is not an IP address: ambient pod mesh/app \
             cannot be enrolled",
        ),
    ] {
        let (got_code, got_msg) = cni_error(result);
        assert_eq!((got_code, got_msg.as_str()), (code, msg));
    }
    weir_only(&node, Command::Del, runtime, Some(prev)).expect("StopPodSandbox's DEL");
    weir_only(&node, Command::Del, &without_netns, None).expect("RemovePodSandbox's DEL");
    agent.stop().unwrap();
}

/// An enrollment that can never succeed fails for good (a well-known code where the spec has
/// one, else 999) and says why: `CNI_NETNS` names nothing (the sandbox's namespace is gone),
/// a file left behind once the namespace was unmounted, or the node's own namespace. Asked again,
/// the answer is the same; the pod's DELs succeed, and its real namespace enrolls afterwards.
#[test]
fn an_enrollment_that_can_never_succeed_fails_for_good() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let pod = unenrolled_ambient_pod(&node, "app");
    let gone = node.files.run_dir().join("cni-gone");
    let unmounted = tempfile::NamedTempFile::new_in(node.files.run_dir()).unwrap();
    let node_netns = node.netns().path().to_owned();
    for (netns, code, msg) in [
        (&gone, 4, "does not exist"),
        (
            &unmounted.path().to_owned(),
            4,
            "is not a network namespace",
        ),
        (
            &node_netns,
            999,
            "refusing to redirect the node's own network namespace as pod",
        ),
    ] {
        let runtime = RuntimeConf {
            netns: Some(netns.clone()),
            ..pod.runtime_conf().clone()
        };
        for _ in 0..2 {
            let (got_code, got_msg) = cni_error(weir_only(
                &node,
                Command::Add,
                &runtime,
                Some(pod.prev_result()),
            ));
            assert_eq!(got_code, code, "{got_msg}");
            assert!(got_msg.starts_with("CNI_NETNS: "), "{got_msg}");
            assert!(got_msg.contains(msg), "{got_msg}");
            assert!(
                got_msg.ends_with("ambient pod mesh/app cannot be enrolled"),
                "{got_msg}"
            );
        }
        weir_only(&node, Command::Del, &runtime, Some(pod.prev_result())).unwrap();
    }
    assert!(ztunnel.pod(pod.uid()).is_none());
    weir_only(
        &node,
        Command::Add,
        pod.runtime_conf(),
        Some(pod.prev_result()),
    )
    .expect("the pod's own netns enrolls");
    assert!(ztunnel.wait_for_pod(pod.uid(), WAIT).is_some());
    agent.stop().unwrap();
}

/// What clears up without a new request is "try again later" (11), with its cause, and the
/// runtime's retry then succeeds: here the agent cannot read its policy for a moment (an
/// editor writing the file in place).
#[test]
fn a_failure_that_clears_up_is_try_again_later() {
    let node = privileged!(Node::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let pod = unenrolled_ambient_pod(&node, "app");
    std::fs::write(node.files.policy_file(), "{\"namespaces\": {").unwrap();
    let add = || {
        weir_only(
            &node,
            Command::Add,
            pod.runtime_conf(),
            Some(pod.prev_result()),
        )
    };
    let (code, msg) = cni_error(add());
    assert_eq!(code, 11, "{msg}");
    assert!(
        msg.starts_with("cannot decide whether pod mesh/app is ambient: EOF while parsing"),
        "{msg}"
    );
    node.files.write_policy(&ambient_policy()).unwrap();
    add().expect("the runtime's retry");
    assert!(ztunnel.wait_for_pod(pod.uid(), WAIT).is_some());
    agent.stop().unwrap();
}
