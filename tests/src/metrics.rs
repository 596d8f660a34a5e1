//! Prometheus text exposition, read the way a scraper reads it: a sample found by its metric
//! name and its labels (in any order), for the agent's /metrics and for a registry in the test.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::agent::http_get;
use crate::wait::wait_until;

/// One exposition: the text of a scrape, or of an encoded registry.
pub struct Metrics {
    text: String,
}

impl Metrics {
    pub fn from_text(text: String) -> Self {
        Self { text }
    }

    /// GET /metrics at `addr` (the agent's metrics address); an error unless it answers 200.
    pub fn scrape(addr: SocketAddr) -> Result<Self> {
        let (status, text) = http_get(addr, "/metrics")?;
        if status != 200 {
            bail!("/metrics answered {status}: {text}");
        }
        Ok(Self::from_text(text))
    }

    /// A registry's metrics, as the agent would serve them.
    pub fn of_registry(registry: &prometheus_client::registry::Registry) -> Self {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry)
            .expect("encoding a registry into a String");
        Self::from_text(text)
    }

    /// The value of the sample `name` (with its suffix: `_total`, `_count`, ...) whose labels are
    /// exactly `labels`; `None` when there is no such sample.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut wanted: Vec<(&str, &str)> = labels.to_vec();
        wanted.sort_unstable();
        self.text
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(Sample::parse)
            .find(|sample| sample.name == name && sample.sorted_labels() == wanted)
            .map(|sample| sample.value)
    }

    /// The label names of each sample `name`, sorted, without duplicates.
    pub fn label_names(&self, name: &str) -> std::collections::BTreeSet<Vec<&str>> {
        self.text
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(Sample::parse)
            .filter(|sample| sample.name == name)
            .map(|sample| {
                let mut names: Vec<&str> = sample.labels.iter().map(|(key, _)| *key).collect();
                names.sort_unstable();
                names
            })
            .collect()
    }

    /// Waits until the agent at `addr` serves the sample `name` with `labels` at `value`.
    pub fn wait_for(
        addr: SocketAddr,
        timeout: Duration,
        name: &str,
        labels: &[(&str, &str)],
        value: f64,
    ) {
        let what = format!("{name}{labels:?} = {value} in the agent's /metrics");
        wait_until(timeout, &what, || {
            Self::scrape(addr).is_ok_and(|metrics| metrics.value(name, labels) == Some(value))
        });
    }
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// One sample line: `name{label="value",...} value [timestamp]`.
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

impl<'a> Sample<'a> {
    fn parse(line: &'a str) -> Option<Self> {
        let name_end = line.find(['{', ' '])?;
        let name = &line[..name_end];
        let (labels, rest) = match line[name_end..].strip_prefix('{') {
            Some(inside) => parse_labels(inside)?,
            None => (Vec::new(), &line[name_end..]),
        };
        let value = rest.split_whitespace().next()?.parse().ok()?;
        Some(Self {
            name,
            labels,
            value,
        })
    }

    fn sorted_labels(&self) -> Vec<(&str, &str)> {
        let mut labels: Vec<(&str, &str)> = self
            .labels
            .iter()
            .map(|(key, value)| (*key, value.as_str()))
            .collect();
        labels.sort_unstable();
        labels
    }
}

/// The labels after a sample's `{`, unescaped, and what follows the closing `}`.
fn parse_labels(mut text: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        text = text.trim_start_matches([',', ' ']);
        if let Some(rest) = text.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (key, after_key) = text.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after_key.char_indices();
        let end = loop {
            match chars.next()? {
                (index, '"') => break index,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    escaped => value.push(escaped),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((key.trim(), value));
        text = &after_key[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::Metrics;

    #[test]
    fn samples_are_found_by_name_and_labels_in_any_order() {
        let metrics = Metrics::from_text(
            "# TYPE a counter\n\
             a_total 3\n\
             b{x=\"1\",y=\"q\\\"uote\"} 2.5\n\
             b{x=\"2\"} 7\n"
                .to_owned(),
        );
        assert_eq!(metrics.value("a_total", &[]), Some(3.0));
        assert_eq!(
            metrics.value("b", &[("y", "q\"uote"), ("x", "1")]),
            Some(2.5)
        );
        assert_eq!(metrics.value("b", &[("x", "2")]), Some(7.0));
        assert_eq!(metrics.value("b", &[("x", "1")]), None);
        assert_eq!(metrics.value("a", &[]), None);
    }
}
