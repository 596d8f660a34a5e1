//! A minimal line logger. stdout carries the CNI result, so logs go to the configured file or to
//! stderr (which runtimes capture). Hand-written to keep the plugin small and quick to start.
use std::fmt::Display;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
}

impl LogLevel {
    fn label(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
        }
    }
}

pub struct Log {
    level: LogLevel,
    /// `None`: stderr.
    file: Option<File>,
    /// Who the lines are about (command, pod, container), set once known.
    context: String,
}

impl Log {
    pub fn stderr() -> Self {
        Self {
            level: LogLevel::default(),
            file: None,
            context: String::new(),
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

    pub fn error(&self, msg: impl Display) {
        self.write(LogLevel::Error, msg);
    }
    pub fn warn(&self, msg: impl Display) {
        self.write(LogLevel::Warn, msg);
    }
    pub fn info(&self, msg: impl Display) {
        self.write(LogLevel::Info, msg);
    }
    pub fn debug(&self, msg: impl Display) {
        self.write(LogLevel::Debug, msg);
    }

    fn write(&self, level: LogLevel, msg: impl Display) {
        if level > self.level {
            return;
        }
        let time = utc_timestamp(SystemTime::now());
        let level = level.label();
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
