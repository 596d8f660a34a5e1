//! `weir-agent bug-report` next to a running agent with an enrolled pod: the archive holds what
//! the agent holds, and no credential from the CNI net dir.
//!
//! Runs the built binary: `cargo build -p weir-agent` first. Needs privileges (it enrolls a pod
//! through the CNI chain).
use std::{collections::BTreeMap, fs::File, io::Read};

use flate2::read::GzDecoder;
use weir_tests::privileged;
use weir_tests::{
    agent::{agent_command, AgentBinary},
    chain::CniChainNode as Node,
    ZdsZtunnel,
};

const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.a-service-account-token";

#[test]
fn a_bug_report_holds_the_nodes_state_and_no_credential() {
    let node = privileged!(Node::new());
    let agent = node.start_agent_process(AgentBinary::Run {
        env: &[("RUST_LOG", "info")],
    });
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).expect("ztunnel connects");
    let (pod, _stand_in) = node.ambient_pod(&ztunnel, "app");
    let net_dir = &agent.config.cni_net_dir;
    // What istio-cni and weir write for their plugin in a pod: a kubeconfig with the token, and
    // a config file that carries one.
    std::fs::write(
        net_dir.join("ZZZ-istio-cni-kubeconfig"),
        format!("users:\n- name: istio-cni\n  user:\n    token: {TOKEN}\n"),
    )
    .unwrap();
    std::fs::write(
        net_dir.join("99-other.json"),
        format!(r#"{{"name": "other", "kubernetes": {{"token": "{TOKEN}"}}}}"#),
    )
    .unwrap();

    let archive = tempfile::tempdir().unwrap();
    let path = archive.path().join("report.tar.gz");
    // Where weir's pod runs it: on the node's network, beside the agent's loopback addresses.
    let output = node
        .netns()
        .run(|| {
            agent_command(&agent.config, "bug-report")
                .arg("--output")
                .arg(&path)
                .output()
        })
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let files = read_archive(&path);

    let file = |name: &str| {
        files
            .get(name)
            .unwrap_or_else(|| panic!("{name} in the report: {:?}", files.keys()))
    };
    assert!(file("version.txt").contains(env!("CARGO_PKG_VERSION")));
    assert!(
        file("pods.json").contains(pod.uid()),
        "{}",
        file("pods.json")
    );
    assert!(file("pods.txt").contains("app"));
    assert!(file("check.txt").contains('✓'), "{}", file("check.txt"));
    // The pod's entry in PODS, and its address in POD_IPS as the maps key it.
    let maps = file("bpf/maps.txt");
    assert!(maps.contains("PODS Hash:"), "{maps}");
    let pod_ip: String = pod
        .ipv4()
        .octets()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(maps.contains(&pod_ip), "{pod_ip} in {maps}");
    assert!(file("bpf/programs.txt").contains("weir_connect4"));
    assert!(file("bpf/pins.txt").contains("PODS"));
    let logs = file("logs.txt");
    assert!(
        logs.lines()
            .any(|line| line.contains("pod enrolled") && line.contains(pod.uid())),
        "{logs}"
    );
    let metrics = file("metrics.txt");
    assert!(
        metrics.contains("weir_pods{mode=\"ambient\",state=\"enrolled\"} 1"),
        "{metrics}"
    );
    assert!(file("cni/listing.txt").contains("ZZZ-istio-cni-kubeconfig"));
    assert!(file("cni/10-weir-test.conflist").contains("weir-cni"));
    assert!(!files.contains_key("cni/ZZZ-istio-cni-kubeconfig"));
    assert!(
        !files.contains_key("errors.txt"),
        "{:?}",
        files.get("errors.txt")
    );
    for (name, content) in &files {
        assert!(!content.contains(TOKEN), "{name} holds the token");
    }
}

/// Every file of the archive under `weir-bug-report/`, by its name there.
fn read_archive(path: &std::path::Path) -> BTreeMap<String, String> {
    let mut archive = tar::Archive::new(GzDecoder::new(File::open(path).unwrap()));
    archive
        .entries()
        .unwrap()
        .map(|entry| {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().to_string_lossy().into_owned();
            let mut content = String::new();
            entry.read_to_string(&mut content).unwrap();
            let name = name.strip_prefix("weir-bug-report/").unwrap().to_owned();
            (name, content)
        })
        .collect()
}
