//! The owner's periodic comparison of what the maps hold with what it enrolled. Something else
//! may change pinned maps (an operator with bpftool, a bug, a kernel that evicted an entry):
//! then a pod the agent, ztunnel and the pod's annotation call enabled would run uncaptured
//! without anyone noticing. Every mismatch is counted and logged; entries of enrolled pods are
//! written back, entries nobody enrolled are only reported.
use super::{pod_config::ip_addr, snapshot, Owner};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tracing::warn;

use crate::logging::chain;

/// `weir_datapath_mismatches_total{kind}`.
#[derive(Clone, Default)]
pub(super) struct Mismatches(Family<Kind, Counter>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct Kind {
    kind: &'static str,
}

/// An enrolled pod's `PODS` entry was missing or not its own: written back.
pub(super) const POD_ENTRY_MISSING: &str = "pod_entry_missing";
/// An enrolled pod's address was not indexed: written back.
pub(super) const ADDRESS_MISSING: &str = "address_missing";
/// An enrolled pod's address is indexed for another netns: reported only, since which of the
/// two holds it now cannot be told from the maps.
pub(super) const ADDRESS_ELSEWHERE: &str = "address_elsewhere";
/// A `PODS` entry no enrolled pod has: reported only (the orphan sweep and GC decide on pods).
pub(super) const UNKNOWN_POD_ENTRY: &str = "unknown_pod_entry";

impl Mismatches {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "weir_datapath_mismatches",
            "Differences found between weir's BPF maps and the pods the agent enrolled, by kind: \
             pod_entry_missing and address_missing (written back), address_elsewhere and \
             unknown_pod_entry (reported only)",
            self.0.clone(),
        );
    }

    fn count(&self, kind: &'static str) {
        self.0.get_or_create(&Kind { kind }).inc();
    }
}

impl Owner {
    /// Compares the maps with the enrolled pods, repairs what it can, and returns the kinds of
    /// mismatch found, one per mismatch.
    pub(super) fn audit(&mut self) -> Vec<&'static str> {
        let mut found = Vec::new();
        let mut report = |kind: &'static str, uid: &str, detail: String| {
            warn!(
                uid,
                kind, "the maps differ from the enrolled pods: {detail}"
            );
            found.push(kind);
        };
        for (uid, pod) in &self.pods {
            let entry = self.pods_map.get(&pod.netns_cookie, 0).ok();
            if entry != Some(pod.config) {
                report(
                    POD_ENTRY_MISSING,
                    uid,
                    format!("netns {}", pod.netns_cookie),
                );
                if let Err(error) = self.pods_map.insert(pod.netns_cookie, pod.config, 0) {
                    warn!(uid, error = chain(&error), "writing the pod's entry back");
                }
            }
            for ip in &pod.ips {
                match self.pod_ips.get(ip, 0) {
                    Ok(owner) if owner == pod.netns_cookie => {}
                    Ok(owner) => report(
                        ADDRESS_ELSEWHERE,
                        uid,
                        format!("{} is indexed for netns {owner}", ip_addr(ip)),
                    ),
                    Err(_) => {
                        report(ADDRESS_MISSING, uid, format!("{}", ip_addr(ip)));
                        if let Err(error) = self.pod_ips.insert(ip, pod.netns_cookie, 0) {
                            warn!(uid, error = chain(&error), "writing the pod's address back");
                        }
                    }
                }
            }
        }
        let enrolled: Vec<u64> = self.pods.values().map(|pod| pod.netns_cookie).collect();
        for entry in snapshot::pod_entries(&self.pods_map, &self.pod_ips) {
            if !enrolled.contains(&entry.netns_cookie) {
                report(
                    UNKNOWN_POD_ENTRY,
                    &entry.uid,
                    format!(
                        "netns {} is redirected but not enrolled",
                        entry.netns_cookie
                    ),
                );
            }
        }
        for kind in &found {
            self.mismatches.count(kind);
        }
        found
    }
}
