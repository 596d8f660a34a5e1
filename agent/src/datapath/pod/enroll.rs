//! A pod's redirection: the map entries that switch it on and the setup inside its netns;
//! unenrolling undoes both. `Owner::enroll` is the one place a pod's redirection is put in place.
use std::{
    borrow::Cow,
    fs::File,
    io,
    os::fd::{AsFd, OwnedFd},
    time::Duration,
};

use anyhow::{Context, Result};
use tracing::{debug, info, warn};
use weir_common::{IpKey, PodConfig, PodCounters, POD_HAS_IPV4, POD_HAS_IPV6, POD_SIDECAR_IPV6};

use super::{
    config::{ip_key, pod_config, sum_over_cpus, Unenrollable},
    enroll_steps::Stopwatch,
    interface_watch::{excludes_interfaces, Interfaces},
    istio_rules,
    netns_setup::{reroute, set_up_pod_netns, undo_pod_netns, PodNetnsSetup},
    sidecar_lists::ListEntries,
    userns::IdMaps,
};
use crate::datapath::{
    kernel::{
        netlink::{Link, Reroute, ReturnPath, Rtnl},
        netns,
    },
    owner::{Enrolled, Owner},
    EnrollNetns,
};
use crate::{logging::chain, workload::Workload};

pub(super) const BPF_NOEXIST: u64 = 1;

/// Addresses indexed per pod beyond those the runtime gave it (link-local ones, a VM's). Each
/// takes an entry of `POD_IPS`, which every pod on the node shares: a pod with CAP_NET_ADMIN
/// could otherwise add addresses until no other pod can be enrolled.
const MAX_OTHER_ADDRESSES: usize = 16;

impl Owner {
    /// Where a pod is enrolled.
    ///
    /// The order leaves no moment without capture, also when a pod moves from another agent's
    /// map layout (whose tc program and maps still redirect it until this one takes over): the
    /// reply-mark sysctls, then the map entries, and only then netlink puts the return path in
    /// place and this agent's tc program over whatever filter the pod had, so the program never
    /// runs before the maps name the pod. Nothing needs the return path before that: ztunnel
    /// dials the pod only once it has the pod, after enrollment, and a pod moving from another
    /// layout has it already. Any failure takes the pod out entirely: never half-redirected.
    /// Each step is timed ([`super::enroll_steps::EnrollSteps`]).
    pub(in crate::datapath) fn enroll(
        &mut self,
        pod: &Workload,
        netns: EnrollNetns,
    ) -> Result<OwnedFd> {
        let steps = self.enroll_steps.clone();
        let mut stopwatch = steps.stopwatch();
        let mut config = pod_config(pod, self.handoff.is_some())?;
        let pod_ips: Vec<IpKey> = pod.ips.iter().map(|ip| ip_key(*ip)).collect();
        let live = matches!(netns, EnrollNetns::Found(_));
        let netns_file = self.open_netns(pod, netns)?;
        if pod.sidecar.is_some() {
            // The proxy's ids as the programs see them, when the pod has ids of its own.
            if let Some(maps) = IdMaps::of_netns_owner(netns_file.as_fd())? {
                config.proxy_uid = maps.uid(config.proxy_uid);
                config.proxy_gid = maps.gid(config.proxy_gid);
            }
        }
        // Every fd the enrollment needs is taken before anything is written: an EMFILE after
        // the map entries went in would leave them to nobody.
        let handle: OwnedFd = netns_file.try_clone()?.into();
        // Map writes do not depend on the calling thread's netns, so every step runs in the pod.
        let inside = self
            .home
            .enter(netns_file.as_fd())
            .map_err(|error| Unenrollable::on_enter(&pod.netns, error))?;
        let mut rtnl = Rtnl::new().context("rtnetlink in the pod netns")?;
        let netns_cookie = netns::cookie_of(rtnl.as_fd(), Some(&self.cookie_answers))
            .context("the pod's netns cookie")?;
        if netns_cookie == self.node_netns_cookie {
            return Err(Unenrollable::NodeNetns {
                uid: pod.uid.clone(),
            }
            .into());
        }
        let routes = excludes_interfaces(pod);
        let subscription = self.subscribe(&pod.uid, (netns_cookie, netns_file.as_fd()), routes)?;
        stopwatch.lap("netns");
        let found = Interfaces::read(&mut rtnl, Some(pod)).context("listing the pod's interfaces");
        stopwatch.lap("interfaces");
        let excluded_routes = match (&found, &pod.sidecar) {
            (Ok(found), Some(sidecar)) => found.routes_out_of(&sidecar.exclude_interfaces),
            _ => Vec::new(),
        };
        let lists = ListEntries::of(netns_cookie, pod.sidecar.as_ref(), &excluded_routes)?;
        // Addresses beyond the pod's IPs (link-local ones) are indexed too, up to a bound, and
        // removed on failure.
        let mut other_ips: Vec<IpKey> = found
            .iter()
            .flat_map(|found| &found.addresses)
            .map(|ip| ip_key(*ip))
            .filter(|ip| !pod_ips.contains(ip))
            .collect();
        if other_ips.len() > MAX_OTHER_ADDRESSES {
            warn!(
                uid = %pod.uid,
                addresses = other_ips.len(),
                "the pod has more addresses than the runtime gave it than weir indexes; only \
                 the first {MAX_OTHER_ADDRESSES} are"
            );
            other_ips.truncate(MAX_OTHER_ADDRESSES);
        }
        let before = self.pods.get(&pod.uid).map(|previous| Previous {
            netns_cookie: previous.netns_cookie,
            ips: previous.ips.clone(),
            config: previous.config,
            lists: previous.lists.clone(),
        });
        // The entries the pod's lists had in this netns: none if it is new here.
        let lists_before = match &before {
            Some(before) if before.netns_cookie == netns_cookie => before.lists.clone(),
            _ => Some(ListEntries::default()),
        };
        let redirected = found.and_then(|found| {
            let ips = self.redirect(
                pod,
                &mut rtnl,
                netns_cookie,
                (&config, &lists, lists_before.as_ref()),
                &found,
                (&pod_ips, &other_ips),
                &mut stopwatch,
            )?;
            self.watch(pod, found, subscription);
            Ok(ips)
        });
        let ips = match redirected {
            Ok(ips) => ips,
            Err(error) => {
                let written = [&pod_ips[..], &other_ips].concat();
                self.roll_back(netns_cookie, &written, &lists, before.as_ref(), &mut rtnl);
                return Err(error.context(format!("enrolling pod {}", pod.uid)));
            }
        };
        // Only now that the new entries are in place do the previous ones go: a sandbox
        // recreated with another netns drops the old netns' entries, a pod re-enrolled in place
        // the addresses it no longer has.
        if let Some(before) = &before {
            if before.netns_cookie != netns_cookie {
                self.remove_entries(before.netns_cookie, &before.ips, before.lists.as_ref());
            } else {
                let gone: Vec<IpKey> = before
                    .ips
                    .iter()
                    .filter(|ip| !ips.contains(ip))
                    .copied()
                    .collect();
                self.remove_ip_entries(netns_cookie, &gone);
            }
        }
        // A running pod enrolled live may have been redirected by istio-cni until now; its
        // rules go only once weir's programs redirect it: never a moment without redirection.
        let istio_rules_left = match live {
            true => istio_rules::take_over(&pod.uid, &mut rtnl),
            false => (self.pods.get(&pod.uid)).is_some_and(|enrolled| enrolled.istio_rules_left),
        };
        debug!(uid = %pod.uid, netns_cookie, "pod enrolled");
        self.pods.insert(
            pod.uid.clone(),
            Enrolled {
                netns_cookie,
                ips,
                config,
                lists: Some(lists),
                netns: Some(netns_file),
                istio_rules_left,
                tracked_ahead_of_istio: false,
            },
        );
        drop(inside);
        stopwatch.lap("finish");
        Ok(handle)
    }

    fn open_netns(&self, pod: &Workload, netns: EnrollNetns) -> Result<File> {
        match netns {
            EnrollNetns::Path => {
                File::open(&pod.netns).map_err(|error| Unenrollable::on_open(&pod.netns, error))
            }
            EnrollNetns::Held => self
                .pods
                .get(&pod.uid)
                .and_then(|enrolled| enrolled.netns.as_ref())
                .context("the pod's network namespace is not held: it must be found again")?
                .try_clone()
                .context("duplicating the held pod netns"),
            EnrollNetns::Found(fd) => Ok(File::from(fd)),
        }
    }

    /// Undoes what one failed enrollment wrote, and nothing it found: a pod that was
    /// redirected before the attempt stays redirected as it was, its previous entries and
    /// programs intact.
    fn roll_back(
        &mut self,
        netns_cookie: u64,
        written: &[IpKey],
        lists: &ListEntries,
        before: Option<&Previous>,
        rtnl: &mut Rtnl,
    ) {
        let Some(before) = before else {
            self.remove_entries(netns_cookie, written, Some(lists));
            undo_pod_netns(rtnl, ReturnPath::Remove);
            return;
        };
        let new: Vec<IpKey> = written
            .iter()
            .filter(|ip| before.netns_cookie != netns_cookie || !before.ips.contains(ip))
            .copied()
            .collect();
        if before.netns_cookie == netns_cookie {
            self.remove_ip_entries(netns_cookie, &new);
            if let Some(previous) = &before.lists {
                if let Err(error) = self
                    .sidecar_lists
                    .write(netns_cookie, previous, Some(lists))
                {
                    warn!(
                        netns_cookie,
                        error = format!("{error:#}"),
                        "restoring the pod's previous sidecar lists"
                    );
                }
            }
            if let Err(error) = self.pods_map.insert(netns_cookie, before.config, 0) {
                warn!(
                    netns_cookie,
                    error = chain(&error),
                    "restoring the pod's previous entry"
                );
            }
            return;
        }
        // Another netns: the attempt's entries all go, and addresses it took over from the
        // previous netns are handed back.
        self.remove_entries(netns_cookie, &new, Some(lists));
        undo_pod_netns(rtnl, ReturnPath::Remove);
        for ip in &before.ips {
            if self.pod_ips.get(ip, 0).is_err() {
                if let Err(error) = self.pod_ips.insert(ip, before.netns_cookie, BPF_NOEXIST) {
                    warn!(
                        netns_cookie,
                        error = chain(&error),
                        "restoring the pod's previous address"
                    );
                }
            }
        }
    }

    /// The steps of [`Self::enroll`] inside the pod's netns; returns the addresses indexed for
    /// the pod.
    #[allow(clippy::too_many_arguments)] // enroll's state, split out only to roll back as one
    fn redirect(
        &mut self,
        pod: &Workload,
        rtnl: &mut Rtnl,
        netns_cookie: u64,
        (config, lists, lists_before): (&PodConfig, &ListEntries, Option<&ListEntries>),
        found: &Interfaces,
        (pod_ips, other_ips): (&[IpKey], &[IpKey]),
        stopwatch: &mut Stopwatch,
    ) -> Result<Vec<IpKey>> {
        self.sysctls
            .set(config.has(POD_HAS_IPV4), config.has(POD_HAS_IPV6))
            .context("reply-mark sysctls")?;
        stopwatch.lap("sysctls");
        // Before the pod's entry, which tells the programs to read them.
        self.sidecar_lists
            .write(netns_cookie, lists, lists_before)
            .context("writing the sidecar lists")?;
        let ips = self
            .write_map_entries(netns_cookie, config, pod_ips, other_ips)
            .context("writing the maps")?;
        // Before the filters that carry it: the tc program finds the pod through it.
        let slot = self
            .pod_slots
            .slot_of(netns_cookie)
            .context("giving the pod a slot")?;
        let interfaces = captured_interfaces(pod, &found.links);
        let setup = netns_setup(pod, config, &interfaces, slot);
        self.make_translations(netns_cookie, &setup.rerouted)?;
        fail::fail_point!("enroll-maps-written");
        stopwatch.lap("maps");
        setup.load_programs(&mut self.ebpf)?;
        set_up_pod_netns(
            rtnl,
            &self.ebpf,
            self.handoff.as_ref().map(|handoff| (handoff, netns_cookie)),
            &setup,
            |step| stopwatch.lap(step),
        )?;
        Ok(ips)
    }

    /// Gives a pod whose rerouted connections are translated its translation map, which the
    /// translating programs need before their filters go on: without it they drop new
    /// connections.
    pub(in crate::datapath) fn make_translations(
        &mut self,
        netns_cookie: u64,
        rerouted: &Reroute,
    ) -> Result<()> {
        if rerouted.translated && !rerouted.interfaces.is_empty() {
            self.translations.make(netns_cookie)?;
        }
        Ok(())
    }

    /// Counters first so no event is lost, the address index last since the socket programs
    /// look pods up through it. Returns the addresses indexed for the pod.
    fn write_map_entries(
        &mut self,
        netns_cookie: u64,
        config: &PodConfig,
        pod_ips: &[IpKey],
        other_ips: &[IpKey],
    ) -> Result<Vec<IpKey>> {
        // BPF_NOEXIST: a re-enrolled pod keeps its counts, in one syscall and without a race
        // between a lookup and the insert.
        let zero = vec![PodCounters::default(); aya::util::nr_cpus().map_err(|(_, e)| e)?];
        let insert_zero = || {
            let values = aya::maps::PerCpuValues::try_from(zero.clone())?;
            self.counters.insert(netns_cookie, values, BPF_NOEXIST)
        };
        match retrying_enomem(insert_zero) {
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.kind() == io::ErrorKind::AlreadyExists => {}
            other => other?,
        }
        retrying_enomem(|| self.pods_map.insert(netns_cookie, config, 0))?;
        let mut indexed = pod_ips.to_vec();
        for ip in pod_ips {
            retrying_enomem(|| self.pod_ips.insert(ip, netns_cookie, 0))?;
        }
        // Addresses outside the pod's IPs (link-local ones) are not unique on a node: the pod
        // that claimed one first keeps it.
        for ip in other_ips {
            match retrying_enomem(|| self.pod_ips.insert(ip, netns_cookie, BPF_NOEXIST)) {
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.kind() == io::ErrorKind::AlreadyExists =>
                {
                    match self.pod_ips.get(ip, 0) {
                        Ok(owner) if owner == netns_cookie => indexed.push(*ip),
                        owner => warn!(
                            netns_cookie,
                            ?owner,
                            ip = ?ip,
                            "address already indexed for another pod"
                        ),
                    }
                }
                other => {
                    other?;
                    indexed.push(*ip);
                }
            }
        }
        Ok(indexed)
    }

    pub(in crate::datapath) fn unenroll(&mut self, uid: &str) -> Result<bool> {
        if !self.pods.contains_key(uid) {
            return Ok(false);
        }
        // Maps first: redirection stops at once, whatever happens next.
        let netns = self.remove_map_entries(uid);
        if let Some(netns) = netns {
            // The netns may already be gone with the pod; then so is everything in it.
            let inside = self
                .home
                .enter(netns.as_fd())
                .and_then(|inside| Ok((inside, Rtnl::new()?)));
            match inside {
                Ok((_inside, mut rtnl)) => {
                    undo_pod_netns(&mut rtnl, ReturnPath::Remove);
                    if let Err(error) = self.sysctls.reset() {
                        debug!(uid, %error, "resetting the pod's reply-mark sysctls");
                    }
                }
                Err(error) => debug!(uid, %error, "pod netns not entered for cleanup"),
            }
        }
        debug!(uid, "pod unenrolled");
        Ok(true)
    }

    /// Leaves the ambient pod to istio's in-pod rules once they redirect it (istio-cni's agent
    /// put them there): weir's map entries and tc programs go and the pod is forgotten; its
    /// return path stays. Until then conntrack is made to follow the pod's connections, so that
    /// istio's rules leave those made under weir's path alone. Returns whether the pod was left:
    /// not while istio's rules are not there yet, nor for a sidecar pod (istio-cni redirects
    /// those only when they start) or one whose netns this owner does not hold.
    pub(in crate::datapath) fn hand_back(&mut self, uid: &str) -> Result<bool> {
        let Some(pod) = self.pods.get_mut(uid) else {
            return Ok(true);
        };
        // istio's rules are istio-cni's again: the audit must not take them out of the pod.
        pod.istio_rules_left = false;
        if pod.config.has(weir_common::POD_SIDECAR) {
            return Ok(false);
        }
        let Some(netns) = &pod.netns else {
            return Ok(false);
        };
        let inside = match self.home.enter(netns.as_fd()) {
            Ok(inside) => inside,
            // Gone with the pod: nothing is left to redirect.
            Err(error) => {
                debug!(uid, %error, "pod netns not entered: the pod is gone");
                drop(self.remove_map_entries(uid));
                return Ok(true);
            }
        };
        let mut rtnl = Rtnl::new()?;
        let families = (pod.config.has(POD_HAS_IPV4), pod.config.has(POD_HAS_IPV6));
        if !istio_rules::IstioRules::find(&mut rtnl)?.redirect_families(families.0, families.1) {
            if !pod.tracked_ahead_of_istio {
                let followed = istio_rules::track_ahead_of_istio(&mut rtnl)?;
                debug!(
                    uid,
                    followed, "conntrack follows the pod's connections ahead of istio's rules"
                );
                pod.tracked_ahead_of_istio = true;
            }
            return Ok(false);
        }
        // Maps first, as for an unenrollment: a packet tc still sees meets no pod and passes
        // on to istio's rules.
        drop(self.remove_map_entries(uid));
        undo_pod_netns(&mut rtnl, ReturnPath::Keep);
        if let Err(error) = istio_rules::stop_tracking_ahead_of_istio() {
            warn!(uid, %error, "removing weir's hand-back table from the pod");
        }
        drop(inside);
        info!(uid, "the pod is left to istio's in-pod rules");
        Ok(true)
    }

    /// Removes a pod's map entries and forgets it (it is no longer followed either); returns its
    /// netns handle, if held.
    fn remove_map_entries(&mut self, uid: &str) -> Option<File> {
        self.watches.remove(uid);
        let pod = self.pods.remove(uid)?;
        self.remove_entries(pod.netns_cookie, &pod.ips, pod.lists.as_ref());
        pod.netns
    }

    /// `lists`: the pod's sidecar list entries, `None` where they are not known.
    fn remove_entries(&mut self, netns_cookie: u64, ips: &[IpKey], lists: Option<&ListEntries>) {
        self.remove_ip_entries(netns_cookie, ips);
        let _ = self.pods_map.remove(&netns_cookie);
        self.sidecar_lists.remove(lists, netns_cookie);
        let _ = self.counters.remove(&netns_cookie);
        self.pod_slots.free(netns_cookie);
        if let Some(handoff) = &self.handoff {
            handoff.detach(netns_cookie);
        }
        self.translations.remove(netns_cookie);
    }

    fn remove_ip_entries(&mut self, netns_cookie: u64, ips: &[IpKey]) {
        for ip in ips {
            // Only our own entry: another pod may have been given the IP since.
            if self.pod_ips.get(ip, 0).ok() == Some(netns_cookie) {
                let _ = self.pod_ips.remove(ip);
            }
        }
    }

    pub(in crate::datapath) fn pod_counters(&self, uid: &str) -> Result<Option<PodCounters>> {
        let Some(pod) = self.pods.get(uid) else {
            return Ok(None);
        };
        let per_cpu = self.counters.get(&pod.netns_cookie, 0)?;
        Ok(Some(sum_over_cpus(&per_cpu)))
    }

    pub(in crate::datapath) fn is_redirected(&self, uid: &str) -> bool {
        let Some(pod) = self.pods.get(uid) else {
            return false;
        };
        let config_intact = self
            .pods_map
            .get(&pod.netns_cookie, 0)
            .is_ok_and(|config| config.uid.starts_with(uid.as_bytes()));
        config_intact
            && pod
                .ips
                .iter()
                .all(|ip| self.pod_ips.get(ip, 0).ok() == Some(pod.netns_cookie))
    }
}

/// The pod's interfaces (`links`) that get weir's programs: all but a sidecar pod's excluded ones
/// (istio's `excludeInterfaces`: never captured inbound there), unless rerouted too (istio puts
/// the rerouting rules above the exclusions).
pub(in crate::datapath) fn captured_interfaces<'a>(
    pod: &Workload,
    links: &'a [Link],
) -> Cow<'a, [Link]> {
    let excluded = pod
        .sidecar
        .as_ref()
        .map_or(&[][..], |sidecar| &sidecar.exclude_interfaces[..]);
    if excluded.is_empty() {
        return Cow::Borrowed(links);
    }
    let rerouted = &pod.options.reroute_interfaces;
    let kept = links
        .iter()
        .filter(|link| !excluded.contains(&link.name) || rerouted.contains(&link.name));
    Cow::Owned(kept.cloned().collect())
}

/// What enrollment sets the pod's netns up with, on `interfaces` (see [`captured_interfaces`]),
/// with its filters carrying `slot`.
pub(in crate::datapath) fn netns_setup<'a>(
    pod: &'a Workload,
    config: &PodConfig,
    interfaces: &'a [Link],
    slot: u32,
) -> PodNetnsSetup<'a> {
    PodNetnsSetup {
        interfaces,
        rerouted: reroute(pod, config),
        passthrough_v6: config.has(POD_SIDECAR_IPV6),
        slot,
    }
}

/// A pod's enrollment as it stood before an attempt to enroll it again.
struct Previous {
    netns_cookie: u64,
    ips: Vec<IpKey>,
    config: PodConfig,
    lists: Option<ListEntries>,
}

/// Runs a map insert again while the kernel answers ENOMEM, a few times over about 50 ms. weir's
/// hash maps are not preallocated (a preallocated per-CPU counters map would cost its full size
/// on every CPU of a big node), so their elements come from per-CPU caches that the kernel
/// refills asynchronously (`bpf_mem_alloc`): a burst of inserts, as in a node's reboot storm,
/// can find one empty for a moment. A lasting shortage still fails the enrollment.
fn retrying_enomem(
    mut insert: impl FnMut() -> Result<(), aya::maps::MapError>,
) -> Result<(), aya::maps::MapError> {
    let mut pause = Duration::from_micros(100);
    loop {
        match insert() {
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOMEM)
                    && pause < Duration::from_millis(50) =>
            {
                std::thread::sleep(pause);
                pause *= 2;
            }
            other => return other,
        }
    }
}
