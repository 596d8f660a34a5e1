//! Missed events never leak state: pods whose removal the agent was never told about, through
//! the runtime's CNI GC or a DEL that never came, are unenrolled, and a pod an agent start cannot
//! recover costs only itself. Through the real chain and the real agent, as tests/tests/cni/.
use std::{collections::BTreeSet, path::Path, process::Command as Process, time::Duration};

use weir_agent::{config::AgentConfig, datapath::pinned_pods, state};
use weir_tests::privileged;
use weir_tests::{
    agent::Agent,
    cgroup::{CgroupDriver, PodProcess},
    chain::{assert_direct, assert_through_ztunnel, gc, wait_for_metric, CniChainNode, WAIT},
    cni::CniError,
    Pod, ZdsEvent, ZdsZtunnel,
};

/// Uids of the pods in the pinned maps at `pin_root`.
fn uids_in_maps(pin_root: &Path) -> BTreeSet<String> {
    pinned_pods(pin_root)
        .unwrap()
        .unwrap_or_default()
        .into_iter()
        .map(|pod| pod.uid)
        .collect()
}

/// Uids recorded in the agent's state file.
fn uids_recorded(config: &AgentConfig) -> BTreeSet<String> {
    state::read(&config.state_file)
        .unwrap()
        .into_keys()
        .collect()
}

/// The agent removed `removed` (ztunnel told, map entries and state record gone) and still holds
/// `kept` (in the maps and the state file, never dropped from ztunnel).
fn assert_removed_and_kept(agent: &Agent, ztunnel: &ZdsZtunnel, removed: &Pod, kept: &Pod) {
    assert!(
        ztunnel.wait_for_del(removed.uid(), WAIT),
        "ztunnel told to drop {}",
        removed.name()
    );
    let in_maps = uids_in_maps(&agent.config.datapath.pin_root);
    assert!(!in_maps.contains(removed.uid()), "{in_maps:?}");
    assert!(in_maps.contains(kept.uid()), "{in_maps:?}");
    let recorded = uids_recorded(&agent.config);
    assert!(!recorded.contains(removed.uid()) && recorded.contains(kept.uid()));
    assert!(!ztunnel.events().contains(&ZdsEvent::Del {
        uid: kept.uid().to_owned()
    }));
}

/// Detaches the pod's netns from its path, as `ip netns delete` (and a runtime removing the
/// sandbox) does.
fn unmount_netns(pod: &Pod) {
    let status = Process::new("umount")
        .arg("--lazy")
        .arg(pod.netns_path())
        .status()
        .unwrap();
    assert!(status.success(), "umount {}", pod.netns_path().display());
}

/// A process in a mount namespace of its own that bind-mounts a pod's netns there, and stays in
/// the node's netns: only that mount holds the pod's.
struct PinElsewhere {
    process: std::process::Child,
    _mount_point: tempfile::TempPath,
}

impl PinElsewhere {
    fn start(pod: &Pod) -> Self {
        let target = tempfile::NamedTempFile::new().unwrap().into_temp_path();
        let script = format!(
            "mount --bind {} {} && echo pinned && exec sleep 600",
            pod.netns_path().display(),
            target.display()
        );
        let mut child = Process::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let stdout = child.stdout.take().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
        assert_eq!(line.trim(), "pinned", "the pin in another mount namespace");
        Self {
            process: child,
            _mount_point: target,
        }
    }
}

impl Drop for PinElsewhere {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

#[test]
fn gc_unenrolls_the_pods_whose_attachment_the_runtime_no_longer_lists() {
    let node = privileged!(CniChainNode::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, kept, kept_ztunnel) = node.server_and_ambient_pod(&ztunnel, "kept");
    let (stale, _) = node.ambient_pod(&ztunnel, "stale");
    let (unlisted, unlisted_ztunnel) = node.ambient_pod(&ztunnel, "unlisted");
    let pin_root = agent.config.datapath.pin_root.clone();

    // The runtime still has `server` (not ambient) and `kept`; `stale`'s sandbox is gone, its
    // netns with it. `unlisted` is missing from the list too, but its netns is still there: a
    // runtime's list that lags or errs must not take a live pod's capture away.
    unmount_netns(&stale);
    gc(&node, &[&server, &kept]).expect("GC succeeds");
    assert_removed_and_kept(&agent, &ztunnel, &stale, &kept);
    assert!(uids_in_maps(&pin_root).contains(unlisted.uid()));
    assert_through_ztunnel(&unlisted, &unlisted_ztunnel, &server, &echo, "unlisted");

    // The listed pod still goes through ztunnel; the collected one talks directly again.
    assert_through_ztunnel(&kept, &kept_ztunnel, &server, &echo, "kept");
    assert_direct(&stale, &server, &echo, "direct");

    // The agent is down: the runtime gets a spec error to log, and nothing is removed.
    let config = agent.config.clone();
    agent.stop().unwrap();
    match gc(&node, &[]) {
        Err(CniError::Plugin(failure)) => {
            assert_eq!(failure.code, Some(11), "try again later: {failure}");
            assert!(failure.msg.contains("unreachable"), "{failure}");
        }
        other => panic!("expected a CNI error, got {other:?}"),
    }
    assert!(uids_in_maps(&pin_root).contains(kept.uid()));
    assert!(uids_recorded(&config).contains(kept.uid()));
}

#[test]
fn the_sweep_unenrolls_a_pod_whose_del_never_came_and_keeps_one_still_held() {
    let node = privileged!(CniChainNode::new());
    let agent = Agent::start(AgentConfig {
        orphan_sweep_interval: Duration::from_millis(200),
        ..node.files.agent_config(node.netns()).unwrap()
    })
    .expect("agent ready");
    let ztunnel = ZdsZtunnel::connect(&agent.config.zds_socket).expect("ztunnel connects");
    let (server, echo, held, held_ztunnel) = node.server_and_ambient_pod(&ztunnel, "held");
    let (pinned, pinned_ztunnel) = node.ambient_pod(&ztunnel, "pinned");
    // `pinned` keeps a mount in another mount namespace, as a runtime with a mount namespace of
    // its own pins it; `released` comes after, so that namespace has no copy of its mount.
    let _pin = PinElsewhere::start(&pinned);
    let (released, _) = node.ambient_pod(&ztunnel, "released");

    // All lose the runtime's bind mount without a DEL; `held` keeps a process. `released` goes
    // last, so the sweep that finds it gone has seen the others unmounted.
    let _process = PodProcess::start(held.netns(), held.uid(), CgroupDriver::Cgroupfs).unwrap();
    for pod in [&held, &pinned, &released] {
        unmount_netns(pod);
    }

    // The sweep removed the released pod, and counted it once that was done.
    wait_for_metric(&agent, "weir_orphans_removed_total", &[], 1.0);
    assert_removed_and_kept(&agent, &ztunnel, &released, &held);
    assert!(uids_in_maps(&agent.config.datapath.pin_root).contains(pinned.uid()));

    // The held and pinned pods are still redirected.
    assert_through_ztunnel(&held, &held_ztunnel, &server, &echo, "held");
    assert_through_ztunnel(&pinned, &pinned_ztunnel, &server, &echo, "pinned");
    agent.stop().unwrap();
}

#[test]
fn a_pod_a_restart_cannot_recover_costs_only_itself() {
    let node = privileged!(CniChainNode::new());
    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    let (server, echo, good, _) = node.server_and_ambient_pod(&ztunnel, "good");
    let (broken, _) = node.ambient_pod(&ztunnel, "broken");
    agent.stop().unwrap();
    assert!(ztunnel.wait_for_close(WAIT));
    drop(ztunnel);

    // The broken pod's record is garbage (a partial write, a bug in an older agent).
    let state_file = node.files.agent_config(node.netns()).unwrap().state_file;
    let mut records: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_file).unwrap()).unwrap();
    records[broken.uid()]["ips"] = "garbage".into();
    std::fs::write(&state_file, records.to_string()).unwrap();

    let (agent, ztunnel) = node.start_agent_and_ztunnel();
    wait_for_metric(&agent, "weir_recovery_failures_total", &[], 1.0);
    assert!(ztunnel.wait_for_snapshot(WAIT));
    let events = ztunnel.events();
    let named = events.iter().any(|event| match event {
        ZdsEvent::Add { uid, info, .. } => {
            uid == good.uid() && info.as_ref().is_some_and(|info| info.name == "good")
        }
        _ => false,
    });
    assert!(named, "the good pod is recovered with its name: {events:?}");
    // The broken pod stays redirected and named to ztunnel, for a DEL, GC or the sweep.
    assert!(events.iter().any(|e| e.uid() == Some(broken.uid())));
    assert!(uids_in_maps(&agent.config.datapath.pin_root).contains(broken.uid()));

    let stand_in = ztunnel.wait_for_pod(good.uid(), WAIT).unwrap();
    assert_through_ztunnel(&good, &stand_in, &server, &echo, "after restart");
    agent.stop().unwrap();
}
