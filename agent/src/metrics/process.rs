//! The standard `process_*` series every Prometheus client exports, for the agent itself: what
//! dashboards and alerts built for any exporter already read.
use std::fmt;

use procfs::process::{LimitValue, Process};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge, MetricType},
};
use tracing::warn;

#[derive(Debug)]
pub(super) struct ProcessMetrics;

/// What /proc says of this process.
struct Sample {
    cpu_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    open_fds: usize,
    max_fds: Option<u64>,
    start_time_seconds: f64,
}

fn sample() -> procfs::ProcResult<Sample> {
    let me = Process::myself()?;
    let stat = me.stat()?;
    let ticks = procfs::ticks_per_second() as f64;
    let max_fds = match me.limits()?.max_open_files.soft_limit {
        LimitValue::Value(limit) => Some(limit),
        LimitValue::Unlimited => None,
    };
    Ok(Sample {
        cpu_seconds: (stat.utime + stat.stime) as f64 / ticks,
        resident_bytes: stat.rss * procfs::page_size(),
        virtual_bytes: stat.vsize,
        open_fds: me.fd_count()?,
        max_fds,
        start_time_seconds: procfs::boot_time_secs()? as f64 + stat.starttime as f64 / ticks,
    })
}

impl Collector for ProcessMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let sample = match sample() {
            Ok(sample) => sample,
            Err(error) => {
                warn!(%error, "reading the agent's own process metrics");
                return Ok(());
            }
        };
        ConstCounter::new(sample.cpu_seconds).encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?)?;
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                Some(sample.resident_bytes as f64),
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                Some(sample.virtual_bytes as f64),
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                Some(sample.open_fds as f64),
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                sample.max_fds.map(|max| max as f64),
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                Some(sample.start_time_seconds),
            ),
        ];
        for (name, help, value) in gauges {
            let Some(value) = value else { continue };
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}
