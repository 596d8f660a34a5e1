//! The agent's log lines, on stderr: plain text for a person, or one JSON object per line for a
//! cluster's log pipeline (`--log-format`, `LOG_FORMAT`), the level set by `RUST_LOG`. Every line
//! about a pod carries its `namespace`, `name` and `uid`: the pod's steps run inside
//! [`pod_span`], whose fields the JSON lines hold at their top level (and the plain lines in the
//! span's prefix).
use std::{fmt, io::IsTerminal};

use anyhow::Result;
use serde_json::{Map, Value};
use tracing::{field::Field, Event, Span, Subscriber};
use tracing_subscriber::{
    field::{RecordFields, Visit},
    fmt::{
        format::Writer,
        time::{FormatTime, SystemTime},
        FmtContext, FormatEvent, FormatFields, FormattedFields, MakeWriter,
    },
    registry::LookupSpan,
    util::SubscriberInitExt,
    EnvFilter,
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

/// Which lines are written when `RUST_LOG` is unset. aya warns about the socket-storage map it
/// has no type for, although it is allowed.
pub const DEFAULT_FILTER: &str = "info,aya::bpf=error";

/// What `--bpf-log` adds to the filter: the eBPF programs' records, at debug level.
pub const BPF_LOG_FILTER: &str = "weir_ebpf=debug";

/// Sends this process's log lines to stderr in `format`, filtered by `RUST_LOG` (or
/// [`DEFAULT_FILTER`]). `bpf_log` lets the eBPF programs' records through (debug level, target
/// `weir_ebpf`). Records of the `log` crate (aya-log's) become events too.
pub fn init(format: LogFormat, bpf_log: bool) -> Result<()> {
    let mut filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    if bpf_log {
        filter = filter.add_directive(BPF_LOG_FILTER.parse()?);
    }
    // Colour only for a person at a terminal: `kubectl logs` and log files get plain text.
    let ansi = std::io::stderr().is_terminal();
    subscriber(format, filter, std::io::stderr, ansi).try_init()?;
    Ok(())
}

/// The subscriber [`init`] installs, writing to `writer` (ANSI colour in plain text if `ansi`).
pub fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Plain => Box::new(builder.with_ansi(ansi).finish()),
        LogFormat::Json => Box::new(
            builder
                .with_ansi(false)
                .fmt_fields(JsonFields)
                .event_format(FlatJson)
                .finish(),
        ),
    }
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

/// One line: `timestamp`, `level`, `target`, `message`, then the fields of the spans the event is
/// in (outermost first) and of the event itself, all at the top level; an event's field wins
/// over a span's of the same name.
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

        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        // A `log` record's target is its own, not the bridge's.
        let target = match fields.remove("log.target") {
            Some(target) => target,
            None => event.metadata().target().into(),
        };
        fields.retain(|name, _| !name.starts_with("log."));
        let mut line = vec![
            ("timestamp".to_owned(), Value::from(timestamp)),
            ("level".to_owned(), event.metadata().level().as_str().into()),
            ("target".to_owned(), target),
        ];
        line.extend(fields.remove_entry("message"));
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
        tracing::subscriber::with_default(
            subscriber(format, EnvFilter::new(filter), make_writer, false),
            log,
        );
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
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["target"], module_path!());
        assert_eq!(line["message"], "ztunnel did not accept the pod");
        assert_eq!(line["namespace"], "mesh");
        assert_eq!(line["name"], "client");
        assert_eq!(line["uid"], "0c3e1f2a");
        assert_eq!(line["attempt"], 2, "an event's number stays a number");
        assert!(line["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')));
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
