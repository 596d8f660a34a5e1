//! A datapath owner in its own process, for tests that crash and restart it.
//!
//! `weir-datapath-owner NODE_NETNS` starts the datapath of the test node whose network namespace
//! is `/var/run/netns/NODE_NETNS`, prints `ready`, then serves one command per stdin line:
//! `enroll <Workload JSON>`, `unenroll <uid>`, `uninstall`. Each answer is one line, `ok …` or
//! `err …`. At end of input it stops and leaves the datapath in place, as an agent restart does.
use std::io::{self, BufRead, Write};

use weir_agent::{datapath::Datapath, workload::Workload};

fn main() -> anyhow::Result<()> {
    let Some(node_netns) = std::env::args().nth(1) else {
        anyhow::bail!("usage: weir-datapath-owner NODE_NETNS");
    };
    let datapath = Datapath::start(weir_tests::agent::datapath_config(&node_netns))?;
    // The test that runs this owner runs its ztunnel stand-ins, in the same cgroup.
    datapath.ztunnel_connected(std::process::id()).wait()?;
    let mut out = io::stdout().lock();
    writeln!(out, "ready")?;
    for line in io::stdin().lock().lines() {
        let line = line?;
        let (command, argument) = line.split_once(' ').unwrap_or((&line, ""));
        let answer = match command {
            "enroll" => serde_json::from_str::<Workload>(argument)
                .map_err(anyhow::Error::from)
                .and_then(|pod| datapath.enroll(pod).wait())
                .map(|_netns| String::new()),
            "unenroll" => datapath
                .unenroll(argument)
                .wait()
                .map(|was| was.to_string()),
            "uninstall" => {
                datapath.uninstall().wait()?;
                writeln!(out, "ok")?;
                return Ok(());
            }
            other => Err(anyhow::anyhow!("unknown command {other:?}")),
        };
        match answer {
            Ok(detail) => writeln!(out, "{}", format!("ok {detail}").trim_end())?,
            Err(error) => writeln!(out, "err {error:#}")?,
        }
    }
    datapath.shutdown().wait()
}
