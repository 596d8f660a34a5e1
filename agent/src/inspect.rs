//! `weir-agent pods`: what weir holds on this node, for an operator on the node without an API
//! server.
//!
//! Two sources, both read without disturbing a running agent: the pinned maps, which say what
//! the kernel redirects (uid, netns cookie, addresses, options, counters), and the agent's state
//! file, which names the pods and records their status. A pod found in only one of them is still
//! listed, and flagged: a map entry with no record has no name, and a record with no map entry is
//! an orphan, a pod the agent holds as enrolled that nothing redirects.
use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::Result;
use serde::Serialize;
use tracing::warn;
use weir_common::PodCounters;

use crate::{
    datapath::{self, PinnedPod},
    state::{self, Record},
    workload::{Mode, PodOptions, Status},
};

/// The JSON output's fields, for `--help`.
pub const JSON_FIELDS: &str = "\
JSON output (--output json): one array, sorted like the table, of objects with these fields (and
YAML output, --output yaml, one sequence of the same):
  namespace, name    the pod's (null: the state file has no record of it)
  uid                metadata.uid
  mode               \"ambient\" (redirected to ztunnel) or \"sidecar\" (to its own istio-proxy)
  status             \"enabled\" (ztunnel acked), \"pending\" (redirected, not acked), or null
                     (not recorded, or a sidecar pod, which ztunnel never acks)
  ips                addresses the maps index for the pod (its IPs and its interfaces' other
                     addresses); the recorded IPs for a pod not in the maps
  netns_cookie       the pod's network namespace cookie, the maps' key (null: not in the maps)
  netns              the netns path recorded at enrollment (null: no record)
  options            {\"inbound_bypass\": bool, \"dns_capture\": bool, and
                     \"reroute_interfaces\": [names], from the state file, when there are any}
  counters           {\"outbound\", \"inbound\", \"dns\", \"bypassed\", \"dropped\"}, summed over
                     CPUs (null: not in the maps)
  in_maps            the pinned maps hold the pod (false: an orphan record, nothing redirects it)
  in_state_file      the state file records the pod (false: its name and status are unknown)";

/// One pod, from the maps and the state file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodRow {
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub uid: String,
    pub mode: Mode,
    pub status: Option<Status>,
    pub ips: Vec<IpAddr>,
    pub netns_cookie: Option<u64>,
    pub netns: Option<PathBuf>,
    pub options: PodOptions,
    pub counters: Option<Counters>,
    pub in_maps: bool,
    pub in_state_file: bool,
}

/// A pod's counters, summed over CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Counters {
    pub outbound: u64,
    pub inbound: u64,
    pub dns: u64,
    pub bypassed: u64,
    pub dropped: u64,
}

impl From<PodCounters> for Counters {
    fn from(c: PodCounters) -> Self {
        Self {
            outbound: c.outbound,
            inbound: c.inbound,
            dns: c.dns,
            bypassed: c.bypassed,
            dropped: c.dropped,
        }
    }
}

/// Every pod weir holds on the node: in the maps pinned under `pin_root`, or in `state_file`.
pub fn pods(pin_root: &Path, state_file: &Path) -> Result<Vec<PodRow>> {
    let pinned = datapath::pinned_pods(pin_root)?.unwrap_or_else(|| {
        warn!(pin_root = %pin_root.display(), "no weir maps pinned there");
        Vec::new()
    });
    Ok(rows(pinned, state::read(state_file)?))
}

/// Joins the maps' pods and the state file's records by uid, sorted by namespace/name (pods
/// without a name last).
pub fn rows(pinned: Vec<PinnedPod>, mut records: BTreeMap<String, Record>) -> Vec<PodRow> {
    let mut rows: Vec<PodRow> = pinned
        .into_iter()
        .map(|pod| {
            let record = records.remove(&pod.uid);
            PodRow {
                namespace: record.as_ref().map(|r| r.workload.pod.namespace.clone()),
                name: record.as_ref().map(|r| r.workload.pod.name.clone()),
                mode: pod.mode,
                status: record
                    .as_ref()
                    .and_then(|r| r.status)
                    .filter(|_| pod.mode == Mode::Ambient),
                netns: record.as_ref().map(|r| r.workload.netns.clone()),
                in_state_file: record.is_some(),
                uid: pod.uid,
                ips: pod.ips,
                netns_cookie: Some(pod.netns_cookie),
                // The maps hold the flags; which interfaces are rerouted, only the record.
                options: PodOptions {
                    reroute_interfaces: record
                        .as_ref()
                        .map(|r| r.workload.options.reroute_interfaces.clone())
                        .unwrap_or_default(),
                    ..pod.options
                },
                counters: pod.counters.map(Counters::from),
                in_maps: true,
            }
        })
        .collect();
    rows.extend(records.into_values().map(|record| PodRow {
        mode: record.workload.mode(),
        status: record.status.filter(|_| record.workload.sidecar.is_none()),
        namespace: Some(record.workload.pod.namespace),
        name: Some(record.workload.pod.name),
        uid: record.workload.uid,
        ips: record.workload.ips,
        netns_cookie: None,
        netns: Some(record.workload.netns),
        options: record.workload.options,
        counters: None,
        in_maps: false,
        in_state_file: true,
    }));
    rows.sort_by(|a, b| {
        let key = |row: &PodRow| (row.name.is_none(), row.namespace.clone(), row.name.clone());
        key(a).cmp(&key(b)).then_with(|| a.uid.cmp(&b.uid))
    });
    rows
}

const HEADER: [&str; 13] = [
    "POD",
    "UID",
    "MODE",
    "STATUS",
    "IPS",
    "NETNS COOKIE",
    "OPTIONS",
    "OUTBOUND",
    "INBOUND",
    "DNS",
    "BYPASSED",
    "DROPPED",
    "NOTE",
];

/// The wide table's columns besides the table's, before its NOTE.
const WIDE_HEADER: [&str; 2] = ["NETNS", "REROUTED INTERFACES"];

const NONE: &str = "-";

/// The rows as an aligned text table, one line per pod under a header line.
pub fn table(rows: &[PodRow]) -> String {
    aligned(
        std::iter::once(HEADER.map(String::from).to_vec())
            .chain(rows.iter().map(|row| row_cells(row).to_vec()))
            .collect(),
    )
}

/// [`table`] with the netns path the pod was enrolled with and the interfaces its traffic is
/// rerouted from besides.
pub fn wide_table(rows: &[PodRow]) -> String {
    let widened = |mut cells: Vec<String>, wide: [String; 2]| {
        let note = cells.len() - 1;
        cells.splice(note..note, wide);
        cells
    };
    aligned(
        std::iter::once(widened(
            HEADER.map(String::from).to_vec(),
            WIDE_HEADER.map(String::from),
        ))
        .chain(rows.iter().map(|row| {
            let netns = row
                .netns
                .as_ref()
                .map_or(NONE.into(), |netns| netns.display().to_string());
            let rerouted = or_none(row.options.reroute_interfaces.join(","));
            widened(row_cells(row).to_vec(), [netns, rerouted])
        }))
        .collect(),
    )
}

/// Lines of cells, each column as wide as its widest cell.
fn aligned(cells: Vec<Vec<String>>) -> String {
    let columns = cells.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|column| cells.iter().map(|row| row[column].len()).max().unwrap_or(0))
        .collect();
    cells
        .iter()
        .map(|row| {
            let line: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(cell, width)| format!("{cell:width$}"))
                .collect();
            format!("{}\n", line.join("  ").trim_end())
        })
        .collect()
}

fn or_none(text: String) -> String {
    if text.is_empty() {
        NONE.into()
    } else {
        text
    }
}

fn row_cells(row: &PodRow) -> [String; 13] {
    let pod = match (&row.namespace, &row.name) {
        (Some(namespace), Some(name)) => format!("{namespace}/{name}"),
        _ => "<unknown>".into(),
    };
    let status = match row.status {
        Some(Status::Enabled) => "enabled",
        Some(Status::Pending) => "pending",
        None => NONE,
    };
    let ips: Vec<String> = row.ips.iter().map(IpAddr::to_string).collect();
    let options: Vec<&str> = [
        (row.options.inbound_bypass, "inbound-bypass"),
        (row.options.dns_capture, "dns-capture"),
    ]
    .into_iter()
    .filter_map(|(on, option)| on.then_some(option))
    .collect();
    let counter = |count: fn(&Counters) -> u64| {
        row.counters
            .as_ref()
            .map_or(NONE.into(), |counters| count(counters).to_string())
    };
    let note = match (row.in_maps, row.in_state_file) {
        (false, _) => "orphan: not in the maps, not redirected",
        (true, false) => "not in the state file",
        (true, true) => "",
    };
    [
        pod,
        row.uid.clone(),
        row.mode.as_str().into(),
        status.into(),
        or_none(ips.join(",")),
        row.netns_cookie
            .map_or(NONE.into(), |cookie| cookie.to_string()),
        or_none(options.join(",")),
        counter(|c| c.outbound),
        counter(|c| c.inbound),
        counter(|c| c.dns),
        counter(|c| c.bypassed),
        counter(|c| c.dropped),
        note.into(),
    ]
}

/// The rows as one JSON array (fields: [`JSON_FIELDS`]).
pub fn json(rows: &[PodRow]) -> Result<String> {
    Ok(serde_json::to_string_pretty(rows)? + "\n")
}

/// The rows as one YAML sequence, with the JSON output's fields.
pub fn yaml(rows: &[PodRow]) -> Result<String> {
    Ok(serde_saphyr::to_string(&rows)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{PodName, SidecarRedirect, Workload};

    const APP: &str = "0b1c9f4e-1111-4a5b-9c3d-000000000001";
    const STRAY: &str = "0b1c9f4e-2222-4a5b-9c3d-000000000002";
    const GHOST: &str = "0b1c9f4e-3333-4a5b-9c3d-000000000003";

    fn pinned(uid: &str, netns_cookie: u64, ips: &[&str]) -> PinnedPod {
        PinnedPod {
            uid: uid.into(),
            netns_cookie,
            ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            options: PodOptions::default(),
            mode: Mode::Ambient,
            counters: Some(PodCounters {
                outbound: 3,
                inbound: 2,
                dns: 1,
                bypassed: 0,
                dropped: 7,
            }),
        }
    }

    fn record(uid: &str, namespace: &str, name: &str, status: Option<Status>) -> Record {
        Record {
            workload: Workload {
                uid: uid.into(),
                pod: PodName::new(namespace, name),
                service_account: None,
                netns: format!("/var/run/netns/{name}").into(),
                ips: vec!["10.1.0.9".parse().unwrap()],
                options: PodOptions {
                    inbound_bypass: true,
                    dns_capture: false,
                    ..PodOptions::default()
                },
                attachment: None,
                sidecar: None,
            },
            status,
        }
    }

    /// `mesh/app` in both sources, an unnamed pod only in the maps, `default/ghost` only in the
    /// state file.
    fn node() -> Vec<PodRow> {
        rows(
            vec![
                pinned(STRAY, 4097, &["10.1.0.7"]),
                pinned(APP, 4099, &["fe80::1", "10.1.0.5", "fd00::5"]),
            ],
            BTreeMap::from([
                (
                    APP.into(),
                    record(APP, "mesh", "app", Some(Status::Enabled)),
                ),
                (GHOST.into(), record(GHOST, "default", "ghost", None)),
            ]),
        )
    }

    #[test]
    fn pods_in_one_source_only_are_listed_and_flagged_sorted_by_namespace_and_name() {
        let rows = node();
        let order: Vec<(Option<&str>, &str)> = rows
            .iter()
            .map(|row| (row.name.as_deref(), row.uid.as_str()))
            .collect();
        assert_eq!(
            order,
            [(Some("ghost"), GHOST), (Some("app"), APP), (None, STRAY)]
        );
        let [ghost, app, stray] = &rows[..] else {
            unreachable!()
        };
        assert!(app.in_maps && app.in_state_file);
        assert_eq!(app.status, Some(Status::Enabled));
        // The maps decide what is redirected: their options and addresses, not the record's.
        assert_eq!(app.options, PodOptions::default());
        assert_eq!(app.ips.len(), 3);
        assert_eq!(app.netns, Some("/var/run/netns/app".into()));

        assert!(stray.in_maps && !stray.in_state_file);
        assert_eq!((&stray.namespace, stray.status), (&None, None));

        assert!(!ghost.in_maps && ghost.in_state_file);
        assert_eq!((ghost.netns_cookie, ghost.counters), (None, None));
        assert_eq!(ghost.ips, ["10.1.0.9".parse::<IpAddr>().unwrap()]);
        assert!(ghost.options.inbound_bypass);
    }

    #[test]
    fn a_sidecar_pod_is_listed_by_its_mode_without_an_ambient_status() {
        let mut sidecar = record(APP, "shop", "cart", Some(Status::Enabled));
        sidecar.workload.sidecar = Some(SidecarRedirect::default());
        let mut pod = pinned(APP, 4099, &["10.1.0.5"]);
        pod.mode = Mode::Sidecar;
        let in_both = rows(vec![pod], BTreeMap::from([(APP.into(), sidecar.clone())]));
        let in_state_file = rows(Vec::new(), BTreeMap::from([(APP.into(), sidecar)]));
        for row in [&in_both[0], &in_state_file[0]] {
            assert_eq!((row.mode, row.status), (Mode::Sidecar, None));
        }
    }

    #[test]
    fn table_aligns_columns_and_marks_what_is_unknown() {
        let expected = "\
POD            UID                                   MODE     STATUS   IPS                       NETNS COOKIE  OPTIONS         OUTBOUND  INBOUND  DNS  BYPASSED  DROPPED  NOTE
default/ghost  0b1c9f4e-3333-4a5b-9c3d-000000000003  ambient  -        10.1.0.9                  -             inbound-bypass  -         -        -    -         -        orphan: not in the maps, not redirected
mesh/app       0b1c9f4e-1111-4a5b-9c3d-000000000001  ambient  enabled  fe80::1,10.1.0.5,fd00::5  4099          dns-capture     3         2        1    0         7
<unknown>      0b1c9f4e-2222-4a5b-9c3d-000000000002  ambient  -        10.1.0.7                  4097          dns-capture     3         2        1    0         7        not in the state file
";
        assert_eq!(table(&node()), expected);
    }

    #[test]
    fn the_wide_table_adds_the_netns_and_the_rerouted_interfaces() {
        let mut rows = node();
        rows[1].options.reroute_interfaces = vec!["net1".into(), "net2".into()];
        let expected = "\
POD            UID                                   MODE     STATUS   IPS                       NETNS COOKIE  OPTIONS         OUTBOUND  INBOUND  DNS  BYPASSED  DROPPED  NETNS                 REROUTED INTERFACES  NOTE
default/ghost  0b1c9f4e-3333-4a5b-9c3d-000000000003  ambient  -        10.1.0.9                  -             inbound-bypass  -         -        -    -         -        /var/run/netns/ghost  -                    orphan: not in the maps, not redirected
mesh/app       0b1c9f4e-1111-4a5b-9c3d-000000000001  ambient  enabled  fe80::1,10.1.0.5,fd00::5  4099          dns-capture     3         2        1    0         7        /var/run/netns/app    net1,net2
<unknown>      0b1c9f4e-2222-4a5b-9c3d-000000000002  ambient  -        10.1.0.7                  4097          dns-capture     3         2        1    0         7        -                     -                    not in the state file
";
        assert_eq!(wide_table(&rows), expected);
    }

    #[test]
    fn yaml_has_the_json_outputs_objects() {
        let rows = node();
        let read: serde_json::Value = serde_saphyr::from_str(&yaml(&rows).unwrap()).unwrap();
        assert_eq!(read, serde_json::to_value(&rows).unwrap());
    }

    #[test]
    fn an_empty_node_is_a_header_line_or_an_empty_array() {
        assert_eq!(
            table(&[]),
            "POD  UID  MODE  STATUS  IPS  NETNS COOKIE  OPTIONS  OUTBOUND  INBOUND  DNS  \
             BYPASSED  DROPPED  NOTE\n"
        );
        assert_eq!(json(&[]).unwrap(), "[]\n");
    }

    #[test]
    fn json_has_the_documented_fields() {
        let value: serde_json::Value = serde_json::from_str(&json(&node()).unwrap()).unwrap();
        assert_eq!(
            value[1],
            serde_json::json!({
                "namespace": "mesh",
                "name": "app",
                "uid": APP,
                "mode": "ambient",
                "status": "enabled",
                "ips": ["fe80::1", "10.1.0.5", "fd00::5"],
                "netns_cookie": 4099,
                "netns": "/var/run/netns/app",
                "options": {"inbound_bypass": false, "dns_capture": true},
                "counters": {"outbound": 3, "inbound": 2, "dns": 1, "bypassed": 0, "dropped": 7},
                "in_maps": true,
                "in_state_file": true,
            })
        );
        assert_eq!(value[0]["netns_cookie"], serde_json::Value::Null);
        assert_eq!(value[0]["counters"], serde_json::Value::Null);
        assert_eq!(value[2]["name"], serde_json::Value::Null);
        for field in value[1].as_object().unwrap().keys() {
            assert!(JSON_FIELDS.contains(field.as_str()), "{field} undocumented");
        }
    }
}
