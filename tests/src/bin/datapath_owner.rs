//! A datapath owner in its own process, for tests that crash and restart it.
//!
//! `weir-datapath-owner PIN_ROOT NODE_NETNS` starts the datapath, prints `ready`, then serves
//! one command per stdin line: `enroll <Workload JSON>`, `unenroll <uid>`, `uninstall`. Each
//! answer is one line, `ok …` or `err …`. At end of input it stops and leaves the datapath in
//! place, as an agent restart does.
use std::io::{self, BufRead, Write};

use weir_agent::{
    datapath::{Datapath, DatapathConfig},
    workload::Workload,
};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let (Some(pin_root), Some(node_netns)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: weir-datapath-owner PIN_ROOT NODE_NETNS");
    };
    let datapath = Datapath::start(DatapathConfig {
        pin_root: pin_root.into(),
        cgroup: None,
        node_netns: Some(node_netns.into()),
        probe_bypass: true,
        bpf_log: false,
    })?;
    let mut out = io::stdout().lock();
    writeln!(out, "ready")?;
    for line in io::stdin().lock().lines() {
        let line = line?;
        let (command, argument) = line.split_once(' ').unwrap_or((&line, ""));
        let answer = match command {
            "enroll" => serde_json::from_str::<Workload>(argument)
                .map_err(anyhow::Error::from)
                .and_then(|pod| datapath.enroll(pod))
                .map(|_netns| String::new()),
            "unenroll" => datapath.unenroll(argument).map(|was| was.to_string()),
            "uninstall" => {
                datapath.uninstall()?;
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
    datapath.shutdown()
}
