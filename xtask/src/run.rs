//! `cargo xtask run`: weir-agent as a local node agent on this machine, for developing against a
//! real kernel without a cluster. Its CNI directories, sockets and policy file live in a
//! directory of your choice; the datapath attaches to this machine's root cgroup (it acts only
//! on pods the policy makes ambient) and is removed again when the agent is stopped: Ctrl-C, or
//! SIGTERM or SIGHUP to xtask, which passes them on.

use std::path::Path;

use anyhow::{Context, Result};

use crate::{demo, step, system};

pub fn run(dir: &Path, agent_args: &[String]) -> Result<()> {
    demo::build_binaries()?;
    for sub in ["net.d", "bin", "run"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    let dir = dir.canonicalize()?;
    let policy = dir.join("policy.json");
    if !policy.exists() {
        std::fs::write(&policy, "{\"namespaces\": {}, \"pods\": {}}\n")
            .with_context(|| format!("writing {}", policy.display()))?;
    }
    step(&format!(
        "running weir-agent; node files in {} (put your primary CNI's conflist in net.d/, \
         edit policy.json to make namespaces ambient; Ctrl-C stops and uninstalls)",
        dir.display()
    ));
    let agent = crate::target_dir()?.join("debug/weir-agent");
    let path = |name: &str| dir.join(name).into_os_string();
    let mut command = system::as_root(agent);
    command
        .args([
            "--pin-root",
            "/sys/fs/bpf/weir-dev",
            "run",
            "--uninstall-on-exit",
        ])
        .arg("--policy-file")
        .arg(path("policy.json"))
        .arg("--cni-bin-dir")
        .arg(path("bin"))
        .arg("--cni-net-dir")
        .arg(path("net.d"))
        .arg("--cni-socket")
        .arg(path("run/cni.sock"))
        .arg("--verdict-cache")
        .arg(path("run/verdicts.json"))
        .arg("--state-file")
        .arg(path("run/pods.json"))
        .arg("--zds-socket")
        .arg(path("run/ztunnel.sock"))
        .arg("--cni-plugin-log")
        .arg(path("run/weir-cni.log"))
        .args([
            "--health-addr",
            "127.0.0.1:8000",
            "--metrics-addr",
            "127.0.0.1:15014",
        ])
        .args(agent_args);
    system::run_supervised(&mut command)
}
