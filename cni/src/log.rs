//! A minimal line logger, hand-written to keep the plugin small and quick to start. A run's
//! lines are kept until it ends: when the agent answered the run's request they go to the agent,
//! which logs them with its own lines about the pod (`kubectl logs` of the agent shows the whole
//! CNI ADD); otherwise, or when the agent does not take them, they go to the configured file or
//! to stderr (which runtimes capture). Never to stdout: it carries the CNI result.
use std::fmt::Display;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::agent;
use crate::protocol::{Command, LogRecord, PluginLog, Request, Response};

pub use crate::protocol::LogLevel;

/// How long the agent may take to take a run's lines: the pod's verdict is known by then, and a
/// log line is not worth holding its start up for long.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(1);

pub struct Log {
    /// The lowest level written locally; the agent gets every line and filters them itself.
    level: LogLevel,
    /// `None`: stderr.
    file: Option<File>,
    /// Who the lines are about (command, pod, container), set once known.
    context: String,
    lines: Vec<(SystemTime, LogRecord)>,
    /// The agent that answered this run's request, and the request.
    answered_by: Option<(PathBuf, Request)>,
}

impl Log {
    pub fn stderr() -> Self {
        Self {
            level: LogLevel::default(),
            file: None,
            context: String::new(),
            lines: Vec::new(),
            answered_by: None,
        }
    }

    /// Switches to the configured file; when it cannot be opened the lines keep going to stderr,
    /// since failing a pod over a log file would be worse than a lost line.
    pub fn configure(&mut self, level: LogLevel, file: Option<&Path>) {
        self.level = level;
        if let Some(path) = file {
            match OpenOptions::new().create(true).append(true).open(path) {
                Ok(file) => self.file = Some(file),
                Err(err) => self.warn(format!("cannot open log file {}: {err}", path.display())),
            }
        }
    }

    /// Adds to what the lines are about (the command first, then the pod once known).
    pub fn add_context(&mut self, context: &str) {
        if !self.context.is_empty() {
            self.context.push(' ');
        }
        self.context.push_str(context);
    }

    /// The agent at `socket` answered `request`: the run's lines go to it first.
    pub fn answered(&mut self, socket: &Path, request: &Request) {
        self.answered_by = Some((socket.to_owned(), request.clone()));
    }

    pub fn error(&mut self, msg: impl Display) {
        self.push(LogLevel::Error, msg);
    }
    pub fn warn(&mut self, msg: impl Display) {
        self.push(LogLevel::Warn, msg);
    }
    pub fn info(&mut self, msg: impl Display) {
        self.push(LogLevel::Info, msg);
    }
    pub fn debug(&mut self, msg: impl Display) {
        self.push(LogLevel::Debug, msg);
    }

    fn push(&mut self, level: LogLevel, msg: impl Display) {
        let msg = msg.to_string();
        self.lines
            .push((SystemTime::now(), LogRecord { level, msg }));
    }

    /// Hands the run's lines to the agent that answered its request; writes them locally when
    /// none did, or when it does not take them (an agent older than [`Command::Log`]).
    pub fn finish(self) {
        if self.lines.is_empty() {
            return;
        }
        if let Some((socket, request)) = &self.answered_by {
            let records = self.lines.iter().map(|(_, record)| record.clone());
            let forwarded = Request {
                command: Command::Log,
                ips: Vec::new(),
                annotations: Default::default(),
                valid_attachments: Vec::new(),
                plugin_log: Some(PluginLog {
                    command: request.command,
                    records: records.collect(),
                }),
                ..request.clone()
            };
            if let Ok(Response::Ok { .. }) = agent::call(socket, &forwarded, FORWARD_TIMEOUT) {
                return;
            }
        }
        for (time, record) in &self.lines {
            self.write(*time, record);
        }
    }

    fn write(&self, time: SystemTime, record: &LogRecord) {
        if record.level > self.level {
            return;
        }
        let time = utc_timestamp(time);
        let level = record.level.label();
        let msg = &record.msg;
        let line = if self.context.is_empty() {
            format!("{time} {level:5} {msg}\n")
        } else {
            format!("{time} {level:5} {} {msg}\n", self.context)
        };
        // One write per line: with O_APPEND, concurrent plugin runs do not interleave lines.
        // A failed log write is dropped: there is nowhere better to report it.
        // `&File` is a writer: logging needs no `&mut self`.
        let _ = match self.file.as_ref() {
            Some(mut file) => file.write_all(line.as_bytes()),
            None => std::io::stderr().write_all(line.as_bytes()),
        };
    }
}

/// RFC 3339 UTC with milliseconds, e.g. `2024-11-30T04:19:06.476Z`.
fn utc_timestamp(now: SystemTime) -> String {
    let since_epoch = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since_epoch.as_secs();
    let (year, month, day) = civil_from_days(secs / 86_400);
    let time_of_day = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        time_of_day / 3600,
        time_of_day / 60 % 60,
        time_of_day % 60,
        since_epoch.subsec_millis()
    )
}

/// Days since 1970-01-01 to (year, month, day): Howard Hinnant's `civil_from_days`, restricted
/// to dates after the epoch.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64, millis: u64) -> String {
        utc_timestamp(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(millis))
    }

    #[test]
    fn formats_utc_timestamps() {
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(1_732_940_346, 476), "2024-11-30T04:19:06.476Z");
        assert_eq!(at(951_782_400, 0), "2000-02-29T00:00:00.000Z");
        assert_eq!(at(4_107_542_399, 999), "2100-02-28T23:59:59.999Z");
    }

    #[test]
    fn levels_are_ordered_by_verbosity() {
        assert!(LogLevel::Error < LogLevel::Warn && LogLevel::Info < LogLevel::Debug);
        let level: LogLevel = serde_json::from_str("\"debug\"").unwrap();
        assert_eq!(level, LogLevel::Debug);
        assert!(serde_json::from_str::<LogLevel>("\"trace\"").is_err());
    }
}
