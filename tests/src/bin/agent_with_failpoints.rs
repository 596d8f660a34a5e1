//! weir-agent with its fault-injection points reachable, for tests that kill it midway.
//!
//! `weir-agent-with-failpoints NODE_NETNS NODE_FILES_DIR HEALTH_ADDR METRICS_ADDR ADMIN_ADDR
//! [PAUSE_AT]`
//! runs the agent as `weir_tests::agent::NodeFiles::agent_config` configures it for that node.
//! With `PAUSE_AT` (a `fail::fail_point!` name in the agent, e.g. `enroll-acked`), the first
//! thread to reach that point prints `paused at PAUSE_AT` and stops there for good, so the test
//! knows where the agent is when it kills it. `FAILPOINTS` (the `fail` crate's syntax) sets
//! other actions. The production binary never configures the points: they are reachable from
//! this binary only.
use std::io::Write;

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (node_netns, files_dir, health, metrics, admin, pause_at) = match &args[..] {
        [node_netns, files_dir, health, metrics, admin, rest @ ..] if rest.len() <= 1 => {
            (node_netns, files_dir, health, metrics, admin, rest.first())
        }
        _ => anyhow::bail!(
            "usage: weir-agent-with-failpoints NODE_NETNS NODE_FILES_DIR HEALTH_ADDR \
             METRICS_ADDR ADMIN_ADDR [PAUSE_AT]"
        ),
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let _failpoints = fail::FailScenario::setup();
    if let Some(point) = pause_at.cloned() {
        let announced = format!("paused at {point}");
        fail::cfg_callback(point, move || {
            let mut stdout = std::io::stdout().lock();
            let _ = writeln!(stdout, "{announced}").and_then(|()| stdout.flush());
            loop {
                std::thread::park();
            }
        })
        .map_err(anyhow::Error::msg)?;
    }
    let config = weir_tests::agent::agent_config_at(
        files_dir.as_ref(),
        node_netns,
        health.parse().context("HEALTH_ADDR")?,
        metrics.parse().context("METRICS_ADDR")?,
        admin.parse().context("ADMIN_ADDR")?,
    );
    tokio::runtime::Runtime::new()?.block_on(weir_agent::app::run(config, std::future::pending()))
}
