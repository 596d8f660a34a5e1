//! The configuration reference (docs/configuration.md), generated from the command line's own
//! definition so the two cannot drift apart.
use clap::{Arg, ArgAction};

use super::{
    istio::{carried_into, Reading, ISTIO_SETTINGS},
    Cli,
};
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
    out += &istio_section();
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

/// How istio-cni's variables are read: those carried over are named beside weir's in the flag
/// tables; the others are listed here.
fn istio_section() -> String {
    let mut out = String::from(
        "\n## istio-cni's settings\n\n\
         An istio-cni node agent's environment carries over: where weir has the same setting, \
         istio-cni's variable is read as weir's (named beside it in the tables below, e.g. \
         `AMBIENT_DNS_CAPTURE` for `WEIR_DNS_CAPTURE`), and each one read is logged at start. \
         Where weir's variable is set too, or two of istio-cni's give the same setting, they \
         must agree: two values for one setting stop the agent with an error naming both. A \
         flag on the command line still wins over every variable. `REPAIR_ENABLED=false` \
         means `REPAIR_REPAIR_PODS=false` and `WEIR_REPAIR_BROKEN_PODS=none`; \
         `REPAIR_DELETE_PODS=true` and `REPAIR_LABEL_PODS=true` mean \
         `WEIR_REPAIR_BROKEN_PODS=delete` and `label`; `MONITORING_PORT=<port>` means \
         `WEIR_METRICS_ADDR=0.0.0.0:<port>`; `CNI_CONF_NAME` names the standalone config \
         (with `CHAINED_CNI_PLUGIN=false`) and is refused with a chained plugin, where \
         istio-cni appends to the file it names and weir to the file the runtime loads.\n\n\
         The others weir honours at one value only, which is what it always does, and refuses \
         any other at start with a message naming the variable; or has no use for, and \
         ignores with a warning:\n\n\
         | Variable | weir | Why |\n| --- | --- | --- |\n",
    );
    for setting in ISTIO_SETTINGS {
        let (honoured, why) = match setting.reading {
            Reading::Carried { .. } => continue,
            Reading::Only { value: "", why } => ("refused when set".to_owned(), why),
            Reading::Only { value, why } => (format!("refused unless `{value}`"), why),
            Reading::Unused(why) => ("ignored".to_owned(), why),
        };
        out += &format!(
            "| `{}` | {honoured} | {} |\n",
            setting.name,
            cell(&sentence(why))
        );
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
        let mut flag = match (arg.get_long(), arg.get_value_names()) {
            // A positional argument, by the name its usage shows.
            (None, _) => format!("`<{}>`", arg.get_id().as_str().to_uppercase()),
            (Some(long), Some([value, ..])) if arg.get_action().takes_values() => {
                format!("`--{long} <{value}>`")
            }
            (Some(long), _) => format!("`--{long}`"),
        };
        if let Some(short) = arg.get_short() {
            flag += &format!(" (`-{short}`)");
        }
        let env = arg.get_env().map_or_else(String::new, |env| {
            let env = env.to_string_lossy();
            let istio: Vec<String> = carried_into(&env)
                .iter()
                .map(|name| format!("`{name}`"))
                .collect();
            match istio.is_empty() {
                true => format!("`{env}`"),
                false => format!("`{env}`<br>istio-cni: {}", istio.join(", ")),
            }
        });
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
                description += &match cell(&meaning) {
                    meaning if meaning.is_empty() => format!("<br>`{}`", value.get_name()),
                    meaning => format!("<br>`{}`: {meaning}", value.get_name()),
                };
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
