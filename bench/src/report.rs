//! Samples and their summaries, and the report: a markdown table, JSON and an SVG of the scale
//! curve, with the machine the run was on.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::{json, Value};

use crate::ScalePoint;

/// Durations, summarised by median and 99th percentile.
#[derive(Default)]
pub struct Samples(Vec<Duration>);

impl Samples {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, sample: Duration) {
        self.0.push(sample);
    }

    /// Adds `other`'s samples to these.
    pub fn append(&mut self, other: Samples) {
        self.0.extend(other.0);
    }

    fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.0.clone();
        sorted.sort();
        let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
        sorted.get(index).copied().unwrap_or_default()
    }

    pub fn median(&self) -> Duration {
        self.quantile(0.5)
    }

    pub fn p99(&self) -> Duration {
        self.quantile(0.99)
    }

    /// "median (p99)".
    pub fn show(&self) -> String {
        format!("{} ({})", micros(self.median()), micros(self.p99()))
    }

    pub fn json(&self) -> Value {
        json!({
            "samples": self.0.len(),
            "median_us": self.median().as_secs_f64() * 1e6,
            "p99_us": self.p99().as_secs_f64() * 1e6,
        })
    }
}

impl FromIterator<Duration> for Samples {
    fn from_iter<I: IntoIterator<Item = Duration>>(samples: I) -> Self {
        Self(samples.into_iter().collect())
    }
}

impl<I: Iterator<Item = Duration>> From<I> for Samples {
    fn from(samples: I) -> Self {
        samples.collect()
    }
}

/// The value of `series` (a metric's name with its labels, as the text exposition format writes
/// them) in Prometheus text `metrics`.
pub fn metric(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.parse().ok())
}

pub fn micros(duration: Duration) -> String {
    format!("{}µs", duration.as_micros())
}

/// The middle value, or the mean of the middle two.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The median of pair-by-pair ratios, with their range.
pub fn ratio(ratios: &[f64]) -> String {
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let max = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.2}x [{min:.2}–{max:.2}]", median(ratios))
}

pub fn mebibytes(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

/// Sum of `bytes_memlock` over the pinned maps in `dir`, as bpftool reports them.
pub fn map_memory(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let output = Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(entry?.path())
            .output()
            .context("running bpftool")?;
        let info: Value = serde_json::from_slice(&output.stdout)?;
        total += info["bytes_memlock"].as_u64().unwrap_or(0);
    }
    Ok(total)
}

/// One section: a markdown table, notes under it, and its figures as JSON.
pub struct Table {
    title: String,
    columns: Vec<String>,
    rows: Vec<Vec<String>>,
    notes: Vec<String>,
    pub json: Value,
}

impl Table {
    pub fn new(title: &str, columns: &[&str]) -> Self {
        Self {
            title: title.to_owned(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            rows: Vec::new(),
            notes: Vec::new(),
            json: Value::Null,
        }
    }

    pub fn row(&mut self, cells: &[String]) {
        self.rows.push(cells.to_vec());
    }

    pub fn note(&mut self, note: String) {
        self.notes.push(note);
    }

    fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let mut out = format!("### {}\n\n", self.title);
        out += &line(&self.columns);
        out += &line(&vec!["---".to_owned(); self.columns.len()]);
        for row in &self.rows {
            out += &line(row);
        }
        for note in &self.notes {
            out += &format!("\n{note}\n");
        }
        out
    }
}

/// What the run was on; the load average says how shared the machine was.
fn machine() -> Value {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    };
    json!({
        "kernel": read("/proc/sys/kernel/osrelease"),
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "loadavg": read("/proc/loadavg"),
    })
}

pub struct Report {
    quick: bool,
    machine_at_start: Value,
    machine_at_end: Value,
    tables: Vec<Table>,
    curve: Vec<ScalePoint>,
    /// Why the run ended before its last section, when it did.
    stopped: Option<String>,
}

impl Report {
    pub fn new(quick: bool) -> Self {
        Self {
            quick,
            machine_at_start: machine(),
            machine_at_end: Value::Null,
            tables: Vec::new(),
            curve: Vec::new(),
            stopped: None,
        }
    }

    pub fn push(&mut self, table: Table) {
        self.tables.push(table);
    }

    pub fn scale_curve(&mut self, curve: Vec<ScalePoint>) {
        self.curve = curve;
    }

    pub fn finish(&mut self) {
        self.machine_at_end = machine();
    }

    /// Records that the run stopped with `error`: what was measured before it is still written.
    pub fn stopped(&mut self, error: &anyhow::Error) {
        self.stopped = Some(format!("{error:#}"));
    }

    pub fn markdown(&self) -> String {
        let m = &self.machine_at_start;
        let mut out = format!(
            "Linux {}, {} cores; load average at start: {}, at end: {}{}\n\n",
            m["kernel"].as_str().unwrap_or("?"),
            m["cores"],
            m["loadavg"].as_str().unwrap_or("?"),
            self.machine_at_end["loadavg"].as_str().unwrap_or("?"),
            if self.quick {
                " (--quick: tiny sizes, not a measurement)"
            } else {
                ""
            },
        );
        if let Some(error) = &self.stopped {
            out += &format!(
                "**The run stopped before its end**: {error}. The sections before it follow.\n\n"
            );
        }
        for table in &self.tables {
            out += &table.markdown();
            out += "\n";
        }
        out
    }

    pub fn json(&self) -> Value {
        json!({
            "quick": self.quick,
            "machine": self.machine_at_start,
            "loadavg_at_end": self.machine_at_end["loadavg"],
            "stopped": self.stopped,
            "sections": self.tables.iter().map(|t| json!({"title": t.title, "figures": t.json})).collect::<Vec<_>>(),
        })
    }

    /// bench.md, bench.json and scale.svg in `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join("bench.md"), self.markdown())?;
        std::fs::write(
            dir.join("bench.json"),
            serde_json::to_vec_pretty(&self.json())?,
        )?;
        plot_scale(&self.curve, &dir.join("scale.svg"))
    }
}

/// Against enrolled pods (log-scaled): one more pod's ADD latency (median and p99), and the
/// agent's resident memory.
fn plot_scale(curve: &[ScalePoint], file: &Path) -> Result<()> {
    let root = SVGBackend::new(file, (1080, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let (latency_area, rss_area) = root.split_horizontally(600);
    let pods = 1.0..curve.iter().map(|p| p.pods).max().unwrap_or(1).max(2) as f64 * 1.5;
    let micros = |pick: fn(&Samples) -> Duration| -> Vec<(f64, f64)> {
        curve
            .iter()
            .map(|p| (p.pods as f64, pick(&p.enroll).as_secs_f64() * 1e6))
            .collect()
    };
    let max_us = micros(Samples::p99)
        .into_iter()
        .map(|(_, us)| us)
        .fold(1.0, f64::max);
    let mut latency = ChartBuilder::on(&latency_area)
        .caption(
            "weir: one more pod's ADD by enrolled pods",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(pods.clone().log_scale(), 0.0..max_us * 1.1)?;
    latency
        .configure_mesh()
        .x_desc("enrolled pods")
        .y_desc("ADD latency (µs)")
        .draw()?;
    for (name, color, points) in [
        ("median", BLUE, micros(Samples::median)),
        ("p99", RED, micros(Samples::p99)),
    ] {
        latency
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
        latency.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    latency
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;

    let rss: Vec<(f64, f64)> = curve
        .iter()
        .map(|p| (p.pods as f64, p.rss as f64 / 1048576.0))
        .collect();
    let max_mib = rss.iter().map(|(_, mib)| *mib).fold(1.0, f64::max);
    let mut memory = ChartBuilder::on(&rss_area)
        .caption("weir-agent's RSS by enrolled pods", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(pods.log_scale(), 0.0..max_mib * 1.2)?;
    memory
        .configure_mesh()
        .x_desc("enrolled pods")
        .y_desc("RSS (MiB)")
        .draw()?;
    memory.draw_series(LineSeries::new(rss.clone(), GREEN.stroke_width(2)))?;
    memory.draw_series(rss.into_iter().map(|p| Circle::new(p, 3, GREEN.filled())))?;
    root.present()?;
    Ok(())
}
