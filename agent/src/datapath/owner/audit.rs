//! The owner's periodic comparison of what the maps and the pods' netns hold with what it
//! enrolled. Something else may change pinned maps (an operator with bpftool, a bug, a kernel
//! that evicted an entry), and a pod with CAP_NET_ADMIN may change weir's objects in its own
//! netns (delete its tc filter, put one before it, delete its return path's rule or routes):
//! then a pod the agent, ztunnel and the pod's annotation call enabled would run uncaptured, or
//! its replies would no longer reach ztunnel, without anyone noticing. Every mismatch is counted
//! and logged; what weir put in place for an enrolled pod is put back, anything else is only
//! reported.
use std::os::fd::AsFd;

use super::{Enrolled, Owner};
use crate::datapath::{
    kernel::{netlink::Rtnl, programs},
    pod::{
        config::ip_addr,
        enroll::{captured_interfaces, netns_setup},
        istio_rules,
        netns_setup::{self, restore_pod_netns, Drift, TcProgramIds},
    },
    readers::snapshot,
};
use anyhow::{Context, Result};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tracing::warn;
use weir_common::{POD_HAS_IPV4, POD_HAS_IPV6};

use crate::logging::chain;

/// `weir_datapath_mismatches_total{kind}`.
#[derive(Clone, Default)]
pub(in crate::datapath) struct Mismatches(Family<Kind, Counter>);

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
/// weir's tc filter was missing from an enrolled pod's interface, or held another program:
/// attached again.
pub(super) const TC_FILTER_MISSING: &str = "tc_filter_missing";
/// Another tc filter runs before weir's on an enrolled pod's interface, or keeps it from being
/// attached again: reported only (see [`restore_pod_netns`]).
pub(super) const TC_FILTER_PRECEDED: &str = "tc_filter_preceded";
/// A rule or route of an enrolled pod's return path was missing: added again.
pub(super) const RETURN_PATH_MISSING: &str = "return_path_missing";
/// The probe source's cgroup path names a new cgroup (kubelet restarted): the programs were
/// given its id. Also followed every second between audits.
pub(super) const PROBE_CGROUP_MOVED: &str = "probe_cgroup_moved";

impl Mismatches {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "weir_datapath_mismatches",
            "Differences found between weir's BPF maps or the enrolled pods' network namespaces \
             and the pods the agent enrolled, by kind: pod_entry_missing, address_missing, \
             tc_filter_missing, return_path_missing and probe_cgroup_moved (put back), \
             address_elsewhere, unknown_pod_entry and tc_filter_preceded (reported only)",
            self.0.clone(),
        );
    }

    pub(super) fn count(&self, kind: &'static str) {
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
        // Before their ids are read: a pod recovered after a restart may need one this agent
        // has not loaded yet.
        let needed: Vec<&'static str> = (self.pods.iter())
            .flat_map(|(uid, pod)| self.tc_programs_of(uid, pod))
            .collect();
        if let Err(error) = programs::load_tc_programs(&mut self.ebpf, &needed) {
            warn!(
                error = format!("{error:#}"),
                "loading the pods' tc programs"
            );
        }
        match TcProgramIds::of(&self.ebpf) {
            Ok(program_ids) => {
                for (uid, pod) in &self.pods {
                    let drifts = match self.netns_drifts(uid, pod, &program_ids) {
                        Ok(drifts) => drifts,
                        Err(error) => {
                            warn!(
                                uid,
                                error = format!("{error:#}"),
                                "auditing the pod's netns"
                            );
                            continue;
                        }
                    };
                    for drift in drifts {
                        let (kind, detail) = match drift {
                            Drift::FilterMissing(interface) => {
                                (TC_FILTER_MISSING, format!("no tc filter on {interface}"))
                            }
                            Drift::FilterPreceded(interface) => (
                                TC_FILTER_PRECEDED,
                                format!("another tc filter runs first on {interface}"),
                            ),
                            Drift::ReturnPathMissing(object) => {
                                (RETURN_PATH_MISSING, format!("no return path {object}"))
                            }
                        };
                        report(kind, uid, detail);
                    }
                }
            }
            Err(error) => warn!(
                error = format!("{error:#}"),
                "the tc programs' ids: the pods' netns are not audited"
            ),
        }
        for kind in &found {
            self.mismatches.count(kind);
        }
        // Counted where it is followed, every second too.
        if self.follow_probe_cgroup() {
            found.push(PROBE_CGROUP_MOVED);
        }
        self.retire_istio_rules();
        self.watcher.drop_unneeded_route_changes();
        found
    }

    /// Takes what is left of istio's in-pod rules out of the pods taken over from istio-cni,
    /// once no connection needs it (see [`istio_rules`]).
    fn retire_istio_rules(&mut self) {
        let home = &self.home;
        for (uid, pod) in self.pods.iter_mut().filter(|(_, pod)| pod.istio_rules_left) {
            let Some(netns) = &pod.netns else {
                continue;
            };
            let left = home.enter(netns.as_fd()).and_then(|_inside| {
                let mut rtnl = Rtnl::new()?;
                Ok(istio_rules::take_over(uid, &mut rtnl))
            });
            match left {
                Ok(left) => pod.istio_rules_left = left,
                Err(error) => warn!(uid, %error, "entering the pod's netns for istio's rules"),
            }
        }
    }

    /// The tc programs an audited pod's interfaces get (see [`Self::netns_drifts`]).
    fn tc_programs_of(&self, uid: &str, pod: &Enrolled) -> Vec<&'static str> {
        let Some(watch) = self.watches.get(uid) else {
            return Vec::new();
        };
        let (workload, links) = watch.enrolled_as();
        let interfaces = captured_interfaces(workload, links);
        netns_setup::reroute(workload, &pod.config).programs(&interfaces)
    }

    /// How an enrolled pod's netns differs from how it was set up, put right where it can be
    /// (see [`restore_pod_netns`]). Only pods whose netns is held and whose workload is known:
    /// one recovered after a restart is looked at once it is adopted with its record.
    fn netns_drifts(
        &self,
        uid: &str,
        pod: &Enrolled,
        program_ids: &TcProgramIds,
    ) -> Result<Vec<Drift>> {
        let (Some(netns), Some(watch), Some(slot)) = (
            &pod.netns,
            self.watches.get(uid),
            self.pod_slots.slot(pod.netns_cookie),
        ) else {
            return Ok(Vec::new());
        };
        let (workload, links) = watch.enrolled_as();
        let _inside = self
            .home
            .enter(netns.as_fd())
            .context("entering the pod netns")?;
        let mut rtnl = Rtnl::new().context("rtnetlink in the pod netns")?;
        let interfaces = captured_interfaces(workload, links);
        let families = (pod.config.has(POD_HAS_IPV4), pod.config.has(POD_HAS_IPV6));
        restore_pod_netns(
            &mut rtnl,
            &self.ebpf,
            self.handoff
                .as_ref()
                .map(|handoff| (handoff, pod.netns_cookie)),
            &netns_setup(workload, &pod.config, &interfaces, slot),
            (program_ids, families),
        )
    }
}
