//! The agent's log lines, on stderr: plain text for a person, or one JSON object per line for a
//! cluster's log pipeline (`--log-format`, `LOG_FORMAT`), with istio's keys (`time`, `level`,
//! `scope`, `msg`). `RUST_LOG` sets the filter at start and `/logging` on the admin address
//! changes it while the agent runs ([`log_filter`]). Every line about a pod carries its
//! `namespace`, `name` and `uid`: the pod's steps run inside [`pod_span`], whose fields the JSON
//! lines hold at their top level (and the plain lines in the span's prefix).
use std::{
    collections::VecDeque,
    fmt,
    io::{self, IsTerminal, Write},
    sync::{Mutex, OnceLock},
};

use anyhow::Result;
use serde_json::{Map, Value};
use tracing::{field::Field, Event, Span, Subscriber};
use tracing_subscriber::{
    field::{RecordFields, Visit},
    filter::{Directive, LevelFilter},
    fmt::{
        format::Writer,
        time::{FormatTime, SystemTime},
        FmtContext, FormatEvent, FormatFields, FormattedFields, MakeWriter,
    },
    layer::SubscriberExt,
    registry::LookupSpan,
    reload,
    util::SubscriberInitExt,
    EnvFilter, Layer, Registry,
};

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Text, one line per event; coloured only on a terminal.
    #[default]
    Plain,
    /// One JSON object per line.
    Json,
}

/// Which lines are written when `RUST_LOG` is unset or invalid. aya warns about the
/// socket-storage map it has no type for, although it is allowed.
pub const DEFAULT_FILTER: &str = "info,aya::bpf=error";

/// What `--bpf-log` adds to the filter: the eBPF programs' records, at debug level.
pub const BPF_LOG_FILTER: &str = "weir_ebpf=debug";

/// Lines kept for [`recent_lines`]: about the last minutes of a busy node.
const RECENT_LINES: usize = 5_000;

static RECENT: OnceLock<Mutex<VecDeque<String>>> = OnceLock::new();

/// The last lines this process wrote (at most [`RECENT_LINES`]), oldest first, as written: what
/// `/logs` on the admin address serves, for `weir-agent bug-report`, which runs in the agent's
/// container where `kubectl logs` cannot be read. Empty before [`init`].
pub fn recent_lines() -> Vec<String> {
    RECENT.get().map_or_else(Vec::new, |recent| {
        recent.lock().unwrap().iter().cloned().collect()
    })
}

/// stderr, with each line also kept in [`RECENT`].
#[derive(Clone, Copy)]
struct StderrAndRecent;

impl<'writer> MakeWriter<'writer> for StderrAndRecent {
    type Writer = StderrAndRecent;

    fn make_writer(&'writer self) -> Self::Writer {
        *self
    }
}

impl Write for StderrAndRecent {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // The formatter writes one whole event per call.
        let written = io::stderr().write(buf)?;
        let recent = RECENT.get_or_init(|| Mutex::new(VecDeque::with_capacity(RECENT_LINES)));
        let mut recent = recent.lock().unwrap();
        for line in String::from_utf8_lossy(&buf[..written]).lines() {
            if recent.len() == RECENT_LINES {
                recent.pop_front();
            }
            recent.push_back(line.to_owned());
        }
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

/// The filter in force, and the means to change it while the process runs.
#[derive(Clone)]
pub struct LogFilter {
    handle: reload::Handle<EnvFilter, Registry>,
    /// `--bpf-log`: [`BPF_LOG_FILTER`] stays in every filter set.
    bpf_log: bool,
}

impl LogFilter {
    /// The filter in force, as `RUST_LOG` would spell it.
    pub fn current(&self) -> String {
        self.handle
            .with_current(ToString::to_string)
            .unwrap_or_default()
    }

    /// Puts `text` (`RUST_LOG`'s syntax) in force and returns the filter now in force; an
    /// invalid `text` changes nothing.
    pub fn set(&self, text: &str) -> Result<String, InvalidFilter> {
        let filter = with_bpf_log(parse_filter(text)?, self.bpf_log);
        let max_level = filter.max_level_hint().unwrap_or(LevelFilter::TRACE);
        self.handle
            .reload(filter)
            .map_err(|error| InvalidFilter(vec![(text.to_owned(), error.to_string())]))?;
        // Records of the `log` crate (aya's) are dropped before they become events when their
        // level is over the one the bridge was set up with.
        log::set_max_level(as_log_level(max_level));
        Ok(self.current())
    }
}

/// The process's filter, once [`init`] has installed the logger.
pub fn log_filter() -> Option<&'static LogFilter> {
    LOG_FILTER.get()
}

static LOG_FILTER: OnceLock<LogFilter> = OnceLock::new();

/// Directives of a filter that do not parse, each with why.
#[derive(Debug, PartialEq, Eq)]
pub struct InvalidFilter(Vec<(String, String)>);

impl fmt::Display for InvalidFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, (directive, why)) in self.0.iter().enumerate() {
            let separator = if index == 0 { "" } else { "; " };
            write!(f, "{separator}invalid directive {directive:?}: {why}")?;
        }
        Ok(())
    }
}

/// `text` as a filter (`RUST_LOG`'s syntax: comma-separated directives), or every directive
/// that does not parse: an [`EnvFilter`] would leave them out without a word.
fn parse_filter(text: &str) -> Result<EnvFilter, InvalidFilter> {
    if text.trim().is_empty() {
        return Err(InvalidFilter(vec![(
            text.to_owned(),
            "empty: give a level such as `info`, or directives such as \
             `info,weir_agent::datapath=debug`"
                .to_owned(),
        )]));
    }
    let invalid: Vec<(String, String)> = text
        .split(',')
        .map(str::trim)
        .filter(|directive| !directive.is_empty())
        .filter_map(|directive| {
            let error = directive.parse::<Directive>().err()?;
            Some((directive.to_owned(), error.to_string()))
        })
        .collect();
    if !invalid.is_empty() {
        return Err(InvalidFilter(invalid));
    }
    EnvFilter::builder()
        .parse(text)
        .map_err(|error| InvalidFilter(vec![(text.to_owned(), error.to_string())]))
}

/// The filter to start with: `RUST_LOG`'s (unset or empty: [`DEFAULT_FILTER`]), or, when it
/// does not parse, [`DEFAULT_FILTER`] and why `RUST_LOG` was not used: a typo in a log setting
/// must not take the node's CNI down.
fn startup_filter(rust_log: Option<&std::ffi::OsStr>) -> (EnvFilter, Option<String>) {
    let default = || EnvFilter::new(DEFAULT_FILTER);
    let Some(value) = rust_log.filter(|value| !value.is_empty()) else {
        return (default(), None);
    };
    let parsed = match value.to_str() {
        Some(text) => parse_filter(text).map_err(|invalid| invalid.to_string()),
        None => Err("not UTF-8".to_owned()),
    };
    match parsed {
        Ok(filter) => (filter, None),
        Err(why) => (default(), Some(why)),
    }
}

fn with_bpf_log(filter: EnvFilter, bpf_log: bool) -> EnvFilter {
    if bpf_log {
        filter.add_directive(BPF_LOG_FILTER.parse().expect("a valid directive"))
    } else {
        filter
    }
}

fn as_log_level(level: LevelFilter) -> log::LevelFilter {
    match level {
        LevelFilter::OFF => log::LevelFilter::Off,
        LevelFilter::ERROR => log::LevelFilter::Error,
        LevelFilter::WARN => log::LevelFilter::Warn,
        LevelFilter::INFO => log::LevelFilter::Info,
        LevelFilter::DEBUG => log::LevelFilter::Debug,
        LevelFilter::TRACE => log::LevelFilter::Trace,
    }
}

/// Sends this process's log lines to stderr in `format`, filtered by `RUST_LOG` (or
/// [`DEFAULT_FILTER`], with a warning that names what is wrong with an invalid `RUST_LOG`).
/// `bpf_log` lets the eBPF programs' records through (debug level, target `weir_ebpf`). Records
/// of the `log` crate (aya-log's) become events too.
pub fn init(format: LogFormat, bpf_log: bool) -> Result<()> {
    let rust_log = std::env::var_os("RUST_LOG");
    let (filter, rust_log_invalid) = startup_filter(rust_log.as_deref());
    // Colour only for a person at a terminal: `kubectl logs` and log files get plain text.
    let ansi = std::io::stderr().is_terminal();
    let (subscriber, handle) =
        subscriber(format, with_bpf_log(filter, bpf_log), StderrAndRecent, ansi);
    subscriber.try_init()?;
    let filter = LOG_FILTER.get_or_init(|| LogFilter { handle, bpf_log });
    if let Some(why) = rust_log_invalid {
        tracing::warn!(
            rust_log = %rust_log.unwrap_or_default().to_string_lossy(),
            filter = filter.current(),
            "RUST_LOG is not a valid filter ({why}): logging with the default filter instead"
        );
    }
    Ok(())
}

/// The subscriber [`init`] installs, writing to `writer` (ANSI colour in plain text if `ansi`),
/// and the handle that changes its filter.
pub fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> (
    Box<dyn Subscriber + Send + Sync>,
    reload::Handle<EnvFilter, Registry>,
)
where
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    let (filter, handle) = reload::Layer::new(filter);
    let lines = tracing_subscriber::fmt::layer().with_writer(writer);
    let lines = match format {
        LogFormat::Plain => lines.with_ansi(ansi).boxed(),
        LogFormat::Json => lines
            .with_ansi(false)
            .fmt_fields(JsonFields)
            .event_format(FlatJson)
            .boxed(),
    };
    (
        Box::new(Registry::default().with(filter).with(lines)),
        handle,
    )
}

/// The span a step for one pod runs in: every line logged inside it carries the pod's
/// `namespace`, `name` and `uid` (those not known, empty, are left out). At error level, so that
/// it is kept by any filter that keeps the lines inside it.
pub fn pod_span(namespace: &str, name: &str, uid: &str) -> Span {
    let span = tracing::error_span!(
        "pod",
        namespace = tracing::field::Empty,
        name = tracing::field::Empty,
        uid = tracing::field::Empty
    );
    for (field, value) in [("namespace", namespace), ("name", name), ("uid", uid)] {
        if !value.is_empty() {
            span.record(field, value);
        }
    }
    span
}

/// An error and every cause under it, `outer: inner: root`, as anyhow's `{:#}` writes one: for
/// the error types that keep their cause out of their message (aya's `SyscallError` says only
/// "`bpf_map_update_elem` failed", its errno is its source).
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        text += ": ";
        text += &inner.to_string();
        cause = inner.source();
    }
    text
}

/// One line, with istio's keys: `time` (RFC 3339, UTC, microseconds), `level` (`error`, `warn`,
/// `info`, `debug`, `trace`), `scope` (see [`scope`]), `msg`, then the fields of the spans the
/// event is in (outermost first) and of the event itself, all at the top level; an event's field
/// wins over a span's of the same name, and those four over both.
struct FlatJson;

impl<S> FormatEvent<S, JsonFields> for FlatJson
where
    S: Subscriber + for<'lookup> LookupSpan<'lookup>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut fields = Map::new();
        for span in ctx
            .event_scope()
            .into_iter()
            .flat_map(|scope| scope.from_root())
        {
            let extensions = span.extensions();
            let recorded = extensions
                .get::<FormattedFields<JsonFields>>()
                .and_then(|recorded| {
                    serde_json::from_str::<Map<String, Value>>(&recorded.fields).ok()
                });
            fields.extend(recorded.unwrap_or_default());
        }
        event.record(&mut JsonVisitor(&mut fields));

        let mut time = String::new();
        SystemTime.format_time(&mut Writer::new(&mut time))?;
        // A `log` record's target is its own, not the bridge's.
        let target = match fields.remove("log.target") {
            Some(Value::String(target)) => target,
            _ => event.metadata().target().to_owned(),
        };
        fields.retain(|name, _| !name.starts_with("log."));
        let msg = fields.remove("message").unwrap_or_default();
        for key in ["time", "level", "scope", "msg"] {
            fields.remove(key);
        }
        let level = event.metadata().level().as_str().to_ascii_lowercase();
        let mut line = vec![
            ("time".to_owned(), Value::from(time)),
            ("level".to_owned(), level.into()),
            ("scope".to_owned(), scope(&target).into()),
            ("msg".to_owned(), msg),
        ];
        line.extend(fields);
        // Written pair by pair: these four first, where a person reading the line looks.
        writer.write_char('{')?;
        for (index, (name, value)) in line.iter().enumerate() {
            let comma = if index == 0 { "" } else { "," };
            write!(writer, "{comma}{}:{value}", Value::from(name.as_str()))?;
        }
        writer.write_str("}\n")
    }
}

/// A line's scope, istio's short name for the part of the program it comes from, from its
/// target: the agent's module (`weir_agent::datapath::owner` is `datapath`, `weir_agent::zds`
/// is `zds`; the agent's top level is `default`), weir's other crates by their name without
/// `weir_` (the plugin's lines, `weir_cni`, are `cni`; the eBPF programs', `weir_ebpf`, are
/// `ebpf`), and other crates by their name (`kube_runtime::watcher` is `kube_runtime`).
pub fn scope(target: &str) -> &str {
    let mut path = target.split("::");
    let krate = path.next().unwrap_or_default();
    match (krate, path.next()) {
        ("weir_agent", Some(module)) => module,
        ("weir_agent", None) => "default",
        (krate, _) => krate.strip_prefix("weir_").unwrap_or(krate),
    }
}

/// Span fields recorded as one JSON object, for [`FlatJson`] to merge into each line.
struct JsonFields;

impl<'writer> FormatFields<'writer> for JsonFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        let mut map = Map::new();
        fields.record(&mut JsonVisitor(&mut map));
        write!(writer, "{}", Value::Object(map))
    }

    /// Values recorded after the span was created join the object.
    fn add_fields(
        &self,
        current: &'writer mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let mut map: Map<String, Value> = serde_json::from_str(&current.fields).unwrap_or_default();
        fields.record(&mut JsonVisitor(&mut map));
        current.fields = Value::Object(map).to_string();
        Ok(())
    }
}

/// Fields as JSON values: numbers and booleans as such, everything else as its text.
struct JsonVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for JsonVisitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// The lines `log` writes through a subscriber in `format`, filtered as by RUST_LOG=`filter`.
    fn lines(format: LogFormat, filter: &str, log: impl FnOnce()) -> String {
        let captured = Arc::new(Mutex::new(Vec::new()));
        let writer = captured.clone();
        let make_writer = move || Captured(writer.clone());
        let (subscriber, _) = subscriber(format, EnvFilter::new(filter), make_writer, false);
        tracing::subscriber::with_default(subscriber, log);
        let bytes = captured.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// With only warnings on (as the tests run the agent), a warning about a pod still names it.
    #[test]
    fn a_pods_fields_are_top_level_json_fields_whatever_the_level() {
        let text = lines(LogFormat::Json, "warn", || {
            let _pod = pod_span("mesh", "client", "0c3e1f2a").entered();
            tracing::info!("left out");
            tracing::warn!(attempt = 2, "ztunnel did not accept the pod");
        });
        let [line] = &text.lines().collect::<Vec<_>>()[..] else {
            panic!("one line expected:\n{text}")
        };
        let line: Value = serde_json::from_str(line).unwrap();
        assert_eq!(line["level"], "warn");
        assert_eq!(line["scope"], "logging");
        assert_eq!(line["msg"], "ztunnel did not accept the pod");
        assert_eq!(line["namespace"], "mesh");
        assert_eq!(line["name"], "client");
        assert_eq!(line["uid"], "0c3e1f2a");
        assert_eq!(line["attempt"], 2, "an event's number stays a number");
        let time = line["time"].as_str().unwrap();
        // RFC 3339 in UTC with microseconds, as istio's: 2024-11-30T04:19:06.476123Z.
        assert_eq!(time.len(), "2024-11-30T04:19:06.476123Z".len(), "{time}");
        assert!(time.ends_with('Z') && time.as_bytes()[19] == b'.', "{time}");
        let first_keys = ["\"time\":", "\"level\":", "\"scope\":", "\"msg\":"];
        let at: Vec<Option<usize>> = first_keys.iter().map(|key| text.find(key)).collect();
        assert!(
            at[0] == Some(1) && at.windows(2).all(|pair| pair[0] < pair[1]),
            "{text}"
        );
    }

    #[test]
    fn scopes_are_short_names_of_the_targets() {
        for (target, scope_name) in [
            ("weir_agent::datapath::owner", "datapath"),
            ("weir_agent::zds", "zds"),
            ("weir_agent", "default"),
            ("weir_cni", "cni"),
            ("weir_ebpf", "ebpf"),
            ("kube_runtime::watcher", "kube_runtime"),
        ] {
            assert_eq!(scope(target), scope_name, "{target}");
        }
    }

    #[test]
    fn an_events_fields_named_as_the_keys_do_not_repeat_them() {
        let text = lines(LogFormat::Json, "info", || {
            tracing::info!(level = 3, scope = "x", "a line");
        });
        let line = text.trim_end();
        assert_eq!(line.matches("\"level\"").count(), 1, "{line}");
        let line: Value = serde_json::from_str(line).unwrap();
        assert_eq!(line["level"], "info");
        assert_eq!(line["scope"], "logging");
    }

    #[test]
    fn an_invalid_filter_names_each_bad_directive() {
        let invalid = parse_filter("info,weir_agent=verbose,zds=debug,=x").unwrap_err();
        let text = invalid.to_string();
        assert!(text.contains("\"weir_agent=verbose\""), "{text}");
        assert!(!text.contains("zds=debug"), "{text}");
        assert!(parse_filter("").is_err());
        assert!(parse_filter("info,weir_agent::datapath=debug").is_ok());
    }

    #[test]
    fn rust_log_unset_or_invalid_starts_with_the_default_filter() {
        let start = |value: Option<&str>| {
            let (filter, why) = startup_filter(value.map(std::ffi::OsStr::new));
            (filter.to_string(), why)
        };
        let default = EnvFilter::new(DEFAULT_FILTER).to_string();
        assert_eq!(start(None), (default.clone(), None));
        assert_eq!(start(Some("")), (default.clone(), None));
        assert_eq!(start(Some("debug")), ("debug".to_owned(), None));
        let (filter, why) = start(Some("debug,weir_agent=lots"));
        assert_eq!(filter, default);
        assert!(why.unwrap().contains("\"weir_agent=lots\""));
    }

    #[test]
    fn a_set_filter_is_in_force_and_an_invalid_one_changes_nothing() {
        let captured = Arc::new(Mutex::new(Vec::new()));
        let writer = captured.clone();
        let make_writer = move || Captured(writer.clone());
        let (subscriber, handle) =
            subscriber(LogFormat::Json, EnvFilter::new("info"), make_writer, false);
        let filter = LogFilter {
            handle,
            bpf_log: true,
        };
        tracing::subscriber::with_default(subscriber, || {
            tracing::debug!("before");
            assert_eq!(filter.set("debug").unwrap(), "weir_ebpf=debug,debug");
            tracing::debug!("after");
            assert!(filter.set("debug,zds=loud").is_err());
            assert_eq!(filter.current(), "weir_ebpf=debug,debug");
        });
        let text = String::from_utf8(captured.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("before") && text.contains("after"), "{text}");
    }

    #[test]
    fn a_pods_fields_are_in_the_plain_lines_prefix_and_unknown_ones_left_out() {
        let text = lines(LogFormat::Plain, "info", || {
            let _pod = pod_span("", "", "0c3e1f2a").entered();
            tracing::info!("recovered an enrolled pod");
        });
        assert!(text.contains("pod{uid=\"0c3e1f2a\"}"), "{text}");
        let text = lines(LogFormat::Json, "info", || {
            let _pod = pod_span("", "", "0c3e1f2a").entered();
            tracing::info!("recovered an enrolled pod");
        });
        let line: Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(line["uid"], "0c3e1f2a");
        assert_eq!(line.get("name"), None, "{line}");
    }

    #[test]
    fn an_events_field_wins_over_its_spans() {
        let text = lines(LogFormat::Json, "info", || {
            let _pod = pod_span("mesh", "client", "0c3e1f2a").entered();
            tracing::info!(uid = "other", "a line about another pod");
        });
        let line: Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(line["uid"], "other");
        assert_eq!(line["name"], "client");
    }

    #[test]
    fn a_chain_names_every_cause() {
        let errno = std::io::Error::from_raw_os_error(libc::EADDRINUSE);
        let error = anyhow::Error::new(errno).context("binding 0.0.0.0:8000");
        let chained = chain(error.as_ref());
        assert!(
            chained.starts_with("binding 0.0.0.0:8000: Address already in use"),
            "{chained}"
        );
        assert_eq!(chained, format!("{error:#}"));
    }
}
