//! A decoded decision, as sent to readers (one JSON object per line) and printed.
use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use weir_common::{Endpoint, TraceHook, TraceRecord, TraceVerdict};

use crate::{inspect, workload::Mode};

/// One decision of the programs, with its pod's name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The pod's namespace and name; absent when the agent does not know the pod (a frame
    /// dropped before its addresses were read).
    pub namespace: Option<String>,
    pub pod: Option<String>,
    /// `ambient` or `sidecar`; absent when the agent does not know the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    pub netns_cookie: u64,
    /// connect, sendmsg, tc-ingress, reroute or getsockopt.
    pub hook: String,
    /// What was decided: see `weir-agent trace --help`.
    pub verdict: String,
    /// tcp or udp; absent for a frame whose protocol was never read.
    pub protocol: Option<String>,
    pub source: SocketAddr,
    /// For outbound, the original destination the app asked for.
    pub destination: SocketAddr,
    /// Where the connection was sent (a ztunnel listener); absent for a pass or a drop.
    pub target: Option<SocketAddr>,
}

/// A line from the agent to a reader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Message {
    Decision(Box<Decision>),
    /// Records this reader did not get: the ring buffer was full, or the reader fell behind.
    Lost {
        lost: u64,
    },
}

/// Every verdict's name, with what it means (the help text of `--verdict`).
pub const VERDICTS: [(TraceVerdict, &str, &str); 23] = [
    (
        TraceVerdict::Outbound,
        "outbound",
        "sent to the outbound listener (15001): ztunnel's or the sidecar's",
    ),
    (
        TraceVerdict::Inbound,
        "inbound",
        "handed to the inbound listener (15006): ztunnel's or the sidecar's",
    ),
    (
        TraceVerdict::Dns,
        "dns",
        "sent to the DNS proxy (15053): ztunnel's or the sidecar's",
    ),
    (
        TraceVerdict::ProbeBypass,
        "probe-bypass",
        "a kubelet probe from the node, let through",
    ),
    (
        TraceVerdict::PassInboundBypass,
        "pass-inbound-bypass",
        "inbound let through: the pod bypasses inbound capture",
    ),
    (
        TraceVerdict::PassZtunnel,
        "pass-ztunnel",
        "ztunnel's own socket",
    ),
    (
        TraceVerdict::PassLocal,
        "pass-local",
        "to loopback or to the pod's own address",
    ),
    (
        TraceVerdict::PassHbone,
        "pass-hbone",
        "HBONE (15008) to ztunnel's listener",
    ),
    (
        TraceVerdict::PassUncaptured,
        "pass-uncaptured",
        "not captured: UDP other than DNS",
    ),
    (
        TraceVerdict::DropFragment,
        "drop-fragment",
        "a first fragment of a new connection",
    ),
    (
        TraceVerdict::DropUnparsable,
        "drop-unparsable",
        "headers that cannot be read or walked",
    ),
    (
        TraceVerdict::DropVlan,
        "drop-vlan",
        "more VLAN tags than walked",
    ),
    (
        TraceVerdict::DropHboneNotZtunnel,
        "drop-hbone-not-ztunnel",
        "15008 to a listener not ztunnel's",
    ),
    (
        TraceVerdict::DropNoZtunnel,
        "drop-no-ztunnel",
        "ztunnel not listening in the pod",
    ),
    (
        TraceVerdict::DropNoProxy,
        "drop-no-proxy",
        "a sidecar's proxy not listening in the pod",
    ),
    (
        TraceVerdict::DropTupleTaken,
        "drop-tuple-taken",
        "a rerouted SYN on another connection's tuple, or not recordable",
    ),
    (
        TraceVerdict::RefuseProbeAddress,
        "refuse-probe-address",
        "connect to the probe source address",
    ),
    (
        TraceVerdict::RefuseNoAddress,
        "refuse-no-address",
        "no pod address of the destination's family",
    ),
    (
        TraceVerdict::RefuseNoRoom,
        "refuse-no-room",
        "no room to record the original destination",
    ),
    (
        TraceVerdict::OriginalDst,
        "original-dst",
        "SO_ORIGINAL_DST answered for ztunnel or the sidecar's proxy",
    ),
    (
        TraceVerdict::PassProxy,
        "pass-proxy",
        "the sidecar's own proxy (its uid or gid, or 127.0.0.6)",
    ),
    (
        TraceVerdict::PassExcluded,
        "pass-excluded",
        "not captured by the sidecar pod's port and range lists",
    ),
    (
        TraceVerdict::Hairpin,
        "hairpin",
        "the sidecar's proxy to its own pod, sent to its inbound listener (15006)",
    ),
];

pub(crate) fn verdict_name(verdict: TraceVerdict) -> &'static str {
    VERDICTS
        .iter()
        .find(|(v, _, _)| *v == verdict)
        .map_or("unknown", |(_, name, _)| name)
}

pub(crate) fn hook_name(hook: TraceHook) -> &'static str {
    match hook {
        TraceHook::Connect => "connect",
        TraceHook::Sendmsg => "sendmsg",
        TraceHook::TcIngress => "tc-ingress",
        TraceHook::Reroute => "reroute",
        TraceHook::Getsockopt => "getsockopt",
    }
}

fn socket_addr(endpoint: &Endpoint) -> SocketAddr {
    let ip = Ipv6Addr::from(endpoint.ip.octets);
    let ip = ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4);
    SocketAddr::new(ip, endpoint.port)
}

/// A traced pod as the agent knows it.
#[derive(Clone, Debug)]
struct PodName {
    namespace: String,
    pod: String,
    mode: Mode,
}

/// Pod names by netns cookie, from the pinned maps and the state file as `weir-agent pods`
/// reads them, refreshed when a record names a pod not seen yet.
pub struct PodNames {
    pin_root: PathBuf,
    state_file: PathBuf,
    names: HashMap<u64, PodName>,
    refreshed: Option<Instant>,
}

/// A pod enrolled a moment ago is named by the next refresh; no more than one per this.
const REFRESH_AT_MOST_EVERY: Duration = Duration::from_millis(200);

impl PodNames {
    pub fn new(pin_root: PathBuf, state_file: PathBuf) -> Self {
        Self {
            pin_root,
            state_file,
            names: HashMap::new(),
            refreshed: None,
        }
    }

    fn name(&mut self, netns_cookie: u64) -> Option<PodName> {
        if netns_cookie == 0 {
            return None;
        }
        if !self.names.contains_key(&netns_cookie)
            && self
                .refreshed
                .is_none_or(|at| at.elapsed() >= REFRESH_AT_MOST_EVERY)
        {
            self.refresh();
        }
        self.names.get(&netns_cookie).cloned()
    }

    fn refresh(&mut self) {
        self.refreshed = Some(Instant::now());
        match inspect::pods(&self.pin_root, &self.state_file) {
            Ok(rows) => {
                self.names = rows
                    .into_iter()
                    .filter_map(|row| {
                        let name = PodName {
                            namespace: row.namespace?,
                            pod: row.name?,
                            mode: row.mode,
                        };
                        Some((row.netns_cookie?, name))
                    })
                    .collect();
            }
            Err(error) => tracing::warn!(error = format!("{error:#}"), "naming traced pods"),
        }
    }

    /// The decision a record tells, with its pod's name.
    pub fn decision(&mut self, record: &TraceRecord) -> Decision {
        let name = self.name(record.netns_cookie);
        let target = socket_addr(&record.target);
        Decision {
            namespace: name.as_ref().map(|name| name.namespace.clone()),
            pod: name.as_ref().map(|name| name.pod.clone()),
            mode: name.map(|name| name.mode),
            netns_cookie: record.netns_cookie,
            hook: TraceHook::from_u8(record.hook)
                .map_or("unknown", hook_name)
                .into(),
            verdict: TraceVerdict::from_u8(record.verdict)
                .map_or("unknown", verdict_name)
                .into(),
            protocol: match record.protocol {
                6 => Some("tcp".into()),
                17 => Some("udp".into()),
                _ => None,
            },
            source: socket_addr(&record.source),
            destination: socket_addr(&record.destination),
            target: (target.port() != 0).then_some(target),
        }
    }
}

impl fmt::Display for Decision {
    /// `namespace/pod  hook  protocol source -> destination  verdict [-> target]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pod = match (&self.namespace, &self.pod) {
            (Some(namespace), Some(pod)) if self.mode == Some(Mode::Sidecar) => {
                format!("{namespace}/{pod} (sidecar)")
            }
            (Some(namespace), Some(pod)) => format!("{namespace}/{pod}"),
            _ if self.netns_cookie == 0 => "-".to_string(),
            _ => format!("netns:{}", self.netns_cookie),
        };
        write!(
            f,
            "{pod:<32} {:<10} {:<3} {} -> {} {}",
            self.hook,
            self.protocol.as_deref().unwrap_or("-"),
            self.source,
            self.destination,
            self.verdict
        )?;
        if let Some(target) = self.target {
            write!(f, " -> {target}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_common::IpKey;

    #[test]
    fn every_verdict_has_one_name() {
        for verdict in TraceVerdict::ALL {
            let names = VERDICTS.iter().filter(|(v, _, _)| *v == verdict).count();
            assert_eq!(names, 1, "{verdict:?}");
        }
    }

    #[test]
    fn a_record_reads_as_its_decision() {
        let mut names = PodNames::new("/nonexistent".into(), "/nonexistent".into());
        let record = TraceRecord {
            netns_cookie: 0,
            source: Endpoint::new(IpKey::from_v4([10, 0, 0, 5]), 0),
            destination: Endpoint::new(IpKey::from_v4([10, 96, 0, 1]), 80),
            target: Endpoint::new(IpKey::from_v4([10, 0, 0, 5]), 15001),
            protocol: 6,
            hook: TraceHook::Connect as u8,
            verdict: TraceVerdict::Outbound as u8,
            _pad: 0,
        };
        let decision = names.decision(&record);
        assert_eq!(decision.verdict, "outbound");
        assert_eq!(decision.hook, "connect");
        assert_eq!(decision.destination, "10.96.0.1:80".parse().unwrap());
        assert_eq!(decision.target, Some("10.0.0.5:15001".parse().unwrap()));
        let line = serde_json::to_string(&Message::Decision(Box::new(decision.clone()))).unwrap();
        assert_eq!(
            serde_json::from_str::<Message>(&line).unwrap(),
            Message::Decision(Box::new(decision))
        );
        assert_eq!(
            serde_json::from_str::<Message>(r#"{"lost":3}"#).unwrap(),
            Message::Lost { lost: 3 }
        );
    }
}
