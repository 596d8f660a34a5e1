//! The configuration reference (docs/configuration.md), generated from the command line's own
//! definition so the two cannot drift apart.
use clap::{Arg, ArgAction};

use super::Cli;
use crate::logging::{BPF_LOG_FILTER, DEFAULT_FILTER};

/// docs/configuration.md: every subcommand and flag of [`Cli`], with its environment variable,
/// default and help, and the logging settings.
pub fn markdown() -> String {
    use clap::CommandFactory;
    let mut command = Cli::command();
    command.build();
    let mut out = format!(
        "# Configuration\n\n\
         <!-- Generated from weir-agent's flag definitions (agent/src/cli/) by \
         `weir_agent::cli::markdown()`. Do not edit: change the flags, then run \
         `WEIR_BLESS=1 cargo test -p weir-tests --test configuration`. -->\n\n\
         `weir-agent` takes every setting as a flag or from the flag's environment variable; a \
         flag given on the command line wins over its variable. Interval flags take a period \
         such as `500ms`, `60s` or `5m`; a bare number is seconds.\n\n\
         ## Logs\n\n\
         Log lines go to stderr.\n\n\
         - `RUST_LOG` sets which lines are written, as a \
         [tracing `EnvFilter`](https://docs.rs/tracing-subscriber/latest/tracing_subscriber/filter/struct.EnvFilter.html) \
         (default `{DEFAULT_FILTER}`); `--bpf-log` adds `{BPF_LOG_FILTER}`. \
         An invalid `RUST_LOG` is reported in a warning and the default used instead; \
         `/logging` on `--admin-addr` shows and changes the filter while the agent runs \
         ([operations.md](operations.md#logs)).\n\
         - `LOG_FORMAT` (or `--log-format`) sets their form: `plain` text, coloured only when \
         stderr is a terminal, or `json`, one object per line with istio's keys, `time`, \
         `level`, `scope` and `msg`, and the line's fields. A line about a pod carries the \
         pod's `namespace`, `name` and `uid`; an error carries its whole chain of causes \
         (`binding 0.0.0.0:8000: Address already in use (os error 98)`).\n\n\
         ## Per-pod settings\n\n\
         What is redirected in one pod, and how, is read from the pod itself rather than from \
         flags: an ambient pod's `ambient.istio.io/*` annotations \
         ([operations.md](operations.md#which-pods-are-enrolled)), and a sidecar pod's \
         `sidecar.istio.io/interceptionMode` and `traffic.sidecar.istio.io/*` annotations and \
         its `istio-proxy` container's uid, gid, `ISTIO_META_DNS_CAPTURE` and \
         `ISTIO_DUAL_STACK` ([operations.md](operations.md#sidecar-pods)).\n",
    );
    out += "\n## Global flags\n\nGiven before or after the subcommand.\n\n";
    out += &flag_table(command.get_arguments().filter(|arg| arg.is_global_set()));
    for subcommand in command.get_subcommands() {
        let name = subcommand.get_name();
        if name == "help" {
            continue;
        }
        out += &format!("\n## `weir-agent {name}`\n\n");
        if let Some(about) = subcommand
            .get_long_about()
            .or_else(|| subcommand.get_about())
        {
            out += &format!("{}\n\n", sentence(&about.to_string()));
        }
        let own = subcommand
            .get_arguments()
            .filter(|arg| !arg.is_global_set() && !is_builtin(arg));
        out += &flag_table(own);
        if let Some(after) = subcommand.get_after_long_help() {
            out += &format!("\n```text\n{after}\n```\n");
        }
    }
    out
}

/// `--help` and `--version`: clap's own.
fn is_builtin(arg: &Arg) -> bool {
    matches!(
        arg.get_action(),
        ArgAction::Help | ArgAction::HelpLong | ArgAction::Version
    )
}

/// One row per flag: flag and value, environment variable, default, help (with the values it
/// accepts, where they are a list).
fn flag_table<'a>(args: impl Iterator<Item = &'a Arg>) -> String {
    let mut table =
        String::from("| Flag | Environment | Default | Description |\n| --- | --- | --- | --- |\n");
    for arg in args {
        let flag = match (arg.get_long(), arg.get_value_names()) {
            // A positional argument, by the name its usage shows.
            (None, _) => format!("`<{}>`", arg.get_id().as_str().to_uppercase()),
            (Some(long), Some([value, ..])) if arg.get_action().takes_values() => {
                format!("`--{long} <{value}>`")
            }
            (Some(long), _) => format!("`--{long}`"),
        };
        let env = arg
            .get_env()
            .map_or_else(String::new, |env| format!("`{}`", env.to_string_lossy()));
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|value| value.to_string_lossy().into_owned())
            .collect();
        let default = match defaults.join(",") {
            joined if joined.is_empty() => String::new(),
            joined => format!("`{joined}`"),
        };
        let help = arg
            .get_long_help()
            .or_else(|| arg.get_help())
            .map_or_else(String::new, |help| sentence(&help.to_string()));
        let mut description = cell(&help);
        // A switch's values are true and false: nothing to list.
        if arg.get_action().takes_values() && !is_bool(arg) {
            for value in arg.get_possible_values() {
                let meaning = value
                    .get_help()
                    .map_or_else(String::new, |help| sentence(&help.to_string()));
                description += &format!("<br>`{}`: {}", value.get_name(), cell(&meaning));
            }
        }
        table += &format!("| {flag} | {env} | {default} | {description} |\n");
    }
    table
}

/// A flag whose value is true or false (`--dns-capture false`).
fn is_bool(arg: &Arg) -> bool {
    let values = arg.get_possible_values();
    let names: Vec<&str> = values.iter().map(|value| value.get_name()).collect();
    names == ["true", "false"]
}

/// Help text ended as a sentence: clap drops the full stop of a one-paragraph help.
fn sentence(text: &str) -> String {
    match text.trim_end() {
        text if text.is_empty() || text.ends_with(['.', '!', '?']) => text.to_owned(),
        text => format!("{text}."),
    }
}

/// Text fit for one table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}
