//! A pod's redirection: per-pod setup inside its netns, then the map entries that switch it on;
//! unenrolling undoes both. `Owner::enroll` is the one place a pod's redirection is put in place.
use std::{
    fs::File,
    io,
    net::IpAddr,
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::{maps::PerCpuValues, Ebpf};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        family::Family,
        histogram::{exponential_buckets, Histogram},
    },
    registry::{Registry, Unit},
};
use tracing::{debug, warn};
use weir_common::{
    IpKey, PodConfig, PodCounters, POD_DNS_CAPTURE, POD_HAS_IPV4, POD_HAS_IPV6, POD_INBOUND_BYPASS,
    POD_SOCKET_LOOKUP_HANDOFF, POD_UID_LEN,
};

use super::{
    handoff::Handoff,
    netlink::{self, PodSetup, Rtnl},
    netns::{self, ReplyMarkSysctls},
    programs,
    watch::Interfaces,
    EnrollNetns, Enrolled, Owner,
};
use crate::{
    logging::chain,
    workload::{PodOptions, Workload},
};

const BPF_NOEXIST: u64 = 1;

/// Addresses indexed per pod beyond those the runtime gave it (link-local ones, a VM's). Each
/// takes an entry of `POD_IPS`, which every pod on the node shares: a pod with CAP_NET_ADMIN
/// could otherwise add addresses until no other pod can be enrolled.
const MAX_OTHER_ADDRESSES: usize = 16;

/// Why a pod can never be enrolled as asked, however often it is tried again: the namespace
/// named for it is not a pod's, or the pod cannot be told apart in the maps. Every other
/// enrollment failure may pass (the kernel busy or short of memory, the agent's own trouble).
#[derive(Debug, thiserror::Error)]
pub enum Unenrollable {
    /// Nothing at the netns path: the sandbox's namespace is gone, or never was.
    #[error("pod netns {} does not exist", .0.display())]
    NetnsMissing(PathBuf),
    /// Something other than a network namespace at the path (a netns file left behind once
    /// the namespace was unmounted, or another kind of namespace).
    #[error("pod netns {} is not a network namespace", .0.display())]
    NotANetns(PathBuf),
    #[error("refusing to redirect the node's own network namespace as pod {uid}")]
    NodeNetns { uid: String },
    #[error("pod uid {0:?} must be 1 to {POD_UID_LEN} bytes")]
    InvalidUid(String),
    #[error("pod {uid} has no IP")]
    NoIp { uid: String },
}

/// Where a pod's enrollment time goes, step by step (`weir_enroll_step_seconds{step}`): what an
/// operator looks at when enrollment is slow on a node, and what the bench reports.
#[derive(Clone)]
pub(super) struct EnrollSteps(Family<Step, Histogram>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct Step {
    step: &'static str,
}

impl Default for EnrollSteps {
    fn default() -> Self {
        Self(Family::new_with_constructor(|| {
            Histogram::new(exponential_buckets(2e-6, 2.0, 14))
        }))
    }
}

impl EnrollSteps {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "weir_enroll_step",
            "Time of each step of a pod's enrollment in the datapath: netns (entering it, its \
             rtnetlink socket and cookie), interfaces (link and address dumps), sysctls, maps, \
             routing (the return path's rules and routes), tc (clsact qdiscs, filters and \
             rerouting rules), finish",
            Unit::Seconds,
            self.0.clone(),
        );
    }

    fn stopwatch(&self) -> Stopwatch<'_> {
        Stopwatch {
            steps: self,
            since: Instant::now(),
        }
    }
}

/// Times consecutive steps.
struct Stopwatch<'a> {
    steps: &'a EnrollSteps,
    since: Instant,
}

impl Stopwatch<'_> {
    /// Ends `step` (begun when the previous one ended) now.
    fn lap(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps
            .0
            .get_or_create(&Step { step })
            .observe((now - self.since).as_secs_f64());
        self.since = now;
    }
}

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
    /// Each step is timed ([`EnrollSteps`]).
    pub(super) fn enroll(&mut self, pod: &Workload, netns: EnrollNetns) -> Result<OwnedFd> {
        let steps = self.enroll_steps.clone();
        let mut stopwatch = steps.stopwatch();
        let config = pod_config(pod, self.handoff.is_some())?;
        let pod_ips: Vec<IpKey> = pod.ips.iter().map(|ip| ip_key(*ip)).collect();
        let netns_file = self.open_netns(pod, netns)?;
        // Every fd the enrollment needs is taken before anything is written: an EMFILE after
        // the map entries went in would leave them to nobody.
        let handle: OwnedFd = netns_file.try_clone()?.into();
        // Map writes do not depend on the calling thread's netns, so every step runs in the pod.
        let inside = self.home.enter(netns_file.as_fd()).map_err(|error| {
            // setns takes namespaces only: anything else at the path is EINVAL.
            if error.raw_os_error() == Some(libc::EINVAL) {
                Unenrollable::NotANetns(pod.netns.clone()).into()
            } else {
                anyhow::Error::new(error).context("entering the pod netns")
            }
        })?;
        let mut rtnl = Rtnl::new().context("rtnetlink in the pod netns")?;
        let netns_cookie = netns::cookie_of(rtnl.as_fd(), Some(&self.cookie_answers))
            .context("the pod's netns cookie")?;
        if netns_cookie == self.node_netns_cookie {
            return Err(Unenrollable::NodeNetns {
                uid: pod.uid.clone(),
            }
            .into());
        }
        let subscription = self.subscribe(&pod.uid, netns_cookie, netns_file.as_fd())?;
        stopwatch.lap("netns");
        let found = Interfaces::read(&mut rtnl).context("listing the pod's interfaces");
        stopwatch.lap("interfaces");
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
        });
        let redirected = found.and_then(|found| {
            let ips = self.redirect(
                pod,
                &mut rtnl,
                netns_cookie,
                &config,
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
                self.roll_back(netns_cookie, &written, before.as_ref(), &mut rtnl);
                return Err(error.context(format!("enrolling pod {}", pod.uid)));
            }
        };
        // Only now that the new entries are in place do the previous ones go: a sandbox
        // recreated with another netns drops the old netns' entries, a pod re-enrolled in place
        // the addresses it no longer has.
        if let Some(before) = &before {
            if before.netns_cookie != netns_cookie {
                self.remove_entries(before.netns_cookie, &before.ips);
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
        debug!(uid = %pod.uid, netns_cookie, "pod enrolled");
        self.pods.insert(
            pod.uid.clone(),
            Enrolled {
                netns_cookie,
                ips,
                config,
                netns: Some(netns_file),
            },
        );
        drop(inside);
        stopwatch.lap("finish");
        Ok(handle)
    }

    fn open_netns(&self, pod: &Workload, netns: EnrollNetns) -> Result<File> {
        match netns {
            EnrollNetns::Path => File::open(&pod.netns).map_err(|error| {
                if error.kind() == io::ErrorKind::NotFound {
                    Unenrollable::NetnsMissing(pod.netns.clone()).into()
                } else {
                    anyhow::Error::new(error)
                        .context(format!("opening pod netns {}", pod.netns.display()))
                }
            }),
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
        before: Option<&Previous>,
        rtnl: &mut Rtnl,
    ) {
        let Some(before) = before else {
            self.remove_entries(netns_cookie, written);
            undo_pod_netns(rtnl);
            return;
        };
        let new: Vec<IpKey> = written
            .iter()
            .filter(|ip| before.netns_cookie != netns_cookie || !before.ips.contains(ip))
            .copied()
            .collect();
        if before.netns_cookie == netns_cookie {
            self.remove_ip_entries(netns_cookie, &new);
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
        self.remove_entries(netns_cookie, &new);
        undo_pod_netns(rtnl);
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
        config: &PodConfig,
        found: &Interfaces,
        (pod_ips, other_ips): (&[IpKey], &[IpKey]),
        stopwatch: &mut Stopwatch,
    ) -> Result<Vec<IpKey>> {
        self.sysctls
            .set(config.has(POD_HAS_IPV4), config.has(POD_HAS_IPV6))
            .context("reply-mark sysctls")?;
        stopwatch.lap("sysctls");
        let ips = self
            .write_map_entries(netns_cookie, config, pod_ips, other_ips)
            .context("writing the maps")?;
        fail::fail_point!("enroll-maps-written");
        stopwatch.lap("maps");
        set_up_pod_netns(
            rtnl,
            &self.ebpf,
            self.handoff.as_ref().map(|handoff| (handoff, netns_cookie)),
            &found.links,
            &pod.options.reroute_interfaces,
            |step| stopwatch.lap(step),
        )?;
        Ok(ips)
    }

    /// Counters first so no event is lost, the address index last since the tc program looks
    /// pods up through it. Returns the addresses indexed for the pod.
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

    pub(super) fn unenroll(&mut self, uid: &str) -> Result<bool> {
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
                    undo_pod_netns(&mut rtnl);
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

    /// Removes a pod's map entries and forgets it (it is no longer followed either); returns its
    /// netns handle, if held.
    fn remove_map_entries(&mut self, uid: &str) -> Option<File> {
        self.watches.remove(uid);
        let pod = self.pods.remove(uid)?;
        self.remove_entries(pod.netns_cookie, &pod.ips);
        pod.netns
    }

    fn remove_entries(&mut self, netns_cookie: u64, ips: &[IpKey]) {
        self.remove_ip_entries(netns_cookie, ips);
        let _ = self.pods_map.remove(&netns_cookie);
        let _ = self.counters.remove(&netns_cookie);
        if let Some(handoff) = &self.handoff {
            handoff.detach(netns_cookie);
        }
    }

    fn remove_ip_entries(&mut self, netns_cookie: u64, ips: &[IpKey]) {
        for ip in ips {
            // Only our own entry: another pod may have been given the IP since.
            if self.pod_ips.get(ip, 0).ok() == Some(netns_cookie) {
                let _ = self.pod_ips.remove(ip);
            }
        }
    }

    pub(super) fn pod_counters(&self, uid: &str) -> Result<Option<PodCounters>> {
        let Some(pod) = self.pods.get(uid) else {
            return Ok(None);
        };
        let per_cpu = self.counters.get(&pod.netns_cookie, 0)?;
        Ok(Some(sum_over_cpus(&per_cpu)))
    }

    pub(super) fn is_redirected(&self, uid: &str) -> bool {
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

/// Per-pod setup of a pod whose map entries are in place already (a recovered pod): the reply
/// path, and this agent's programs in place of the previous ones, on the interfaces the pod's
/// routing rules say are rerouted. The calling thread is in the pod's netns.
pub(super) fn prepare_pod_netns(
    rtnl: &mut Rtnl,
    sysctls: &mut ReplyMarkSysctls,
    ebpf: &Ebpf,
    handoff: Option<(&Handoff, u64)>,
    interfaces: &[(u32, String)],
) -> Result<()> {
    let rerouted = netlink::reroute_rules().context("reading the rerouted interfaces")?;
    // Its IPs are not known here: both families.
    sysctls.set(true, true).context("reply-mark sysctls")?;
    set_up_pod_netns(rtnl, ebpf, handoff, interfaces, &rerouted, |_| {})
}

/// The return path, the socket lookup hand-off where the kernel needs it (before the tc program
/// can hand anything to it), then the tc programs and the rerouting rules (see
/// [`Rtnl::set_up_return_path`] and [`Rtnl::attach_programs`]); `step_done` is told after each,
/// as `routing` and `tc`.
fn set_up_pod_netns(
    rtnl: &mut Rtnl,
    ebpf: &Ebpf,
    handoff: Option<(&Handoff, u64)>,
    interfaces: &[(u32, String)],
    rerouted: &[String],
    mut step_done: impl FnMut(&'static str),
) -> Result<()> {
    rtnl.set_up_return_path().context("return path")?;
    step_done("routing");
    if let Some((handoff, netns_cookie)) = handoff {
        handoff.attach(ebpf, netns_cookie)?;
    }
    let setup = PodSetup {
        interfaces,
        rerouted,
        inbound: programs::tc_program(ebpf, weir_common::programs::INBOUND)?,
        reroute: programs::tc_program(ebpf, weir_common::programs::REROUTE)?,
    };
    rtnl.attach_programs(&setup)
        .context("tc programs and rerouting rules")?;
    step_done("tc");
    Ok(())
}

/// A pod's enrollment as it stood before an attempt to enroll it again.
struct Previous {
    netns_cookie: u64,
    ips: Vec<IpKey>,
    config: PodConfig,
}

/// Best effort: called on rollback and unenroll, where the pod may be half set up or gone.
fn undo_pod_netns(rtnl: &mut Rtnl) {
    let undone = rtnl
        .non_loopback_interfaces()
        .and_then(|interfaces| rtnl.tear_down_pod(&interfaces));
    if let Err(error) = undone {
        debug!(%error, "removing the pod's tc programs and routing");
    }
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

fn pod_config(pod: &Workload, handoff: bool) -> Result<PodConfig> {
    if pod.uid.is_empty() || pod.uid.len() > POD_UID_LEN {
        return Err(Unenrollable::InvalidUid(pod.uid.clone()).into());
    }
    if pod.ips.is_empty() {
        return Err(Unenrollable::NoIp {
            uid: pod.uid.clone(),
        }
        .into());
    }
    let mut config = PodConfig {
        flags: 0,
        ipv4: [0; 4],
        ipv6: [0; 16],
        uid: [0; POD_UID_LEN],
    };
    config.uid[..pod.uid.len()].copy_from_slice(pod.uid.as_bytes());
    for ip in &pod.ips {
        match ip {
            IpAddr::V4(v4) if !config.has(POD_HAS_IPV4) => {
                config.ipv4 = v4.octets();
                config.flags |= POD_HAS_IPV4;
            }
            IpAddr::V6(v6) if !config.has(POD_HAS_IPV6) => {
                config.ipv6 = v6.octets();
                config.flags |= POD_HAS_IPV6;
            }
            _ => {}
        }
    }
    if pod.options.inbound_bypass {
        config.flags |= POD_INBOUND_BYPASS;
    }
    if pod.options.dns_capture {
        config.flags |= POD_DNS_CAPTURE;
    }
    if handoff {
        config.flags |= POD_SOCKET_LOOKUP_HANDOFF;
    }
    Ok(config)
}

/// A pod's options, as its `PodConfig` flags carry them.
pub(super) fn pod_options(config: &PodConfig) -> PodOptions {
    PodOptions {
        inbound_bypass: config.has(POD_INBOUND_BYPASS),
        dns_capture: config.has(POD_DNS_CAPTURE),
        // Kept per interface, not in the pod's entry: not recovered from the maps.
        reroute_interfaces: Vec::new(),
    }
}

pub(super) fn sum_over_cpus(per_cpu: &PerCpuValues<PodCounters>) -> PodCounters {
    per_cpu
        .iter()
        .fold(PodCounters::default(), |sum, c| PodCounters {
            outbound: sum.outbound + c.outbound,
            inbound: sum.inbound + c.inbound,
            dns: sum.dns + c.dns,
            bypassed: sum.bypassed + c.bypassed,
            dropped: sum.dropped + c.dropped,
        })
}

fn ip_key(ip: IpAddr) -> IpKey {
    match ip {
        IpAddr::V4(v4) => IpKey::from_v4(v4.octets()),
        IpAddr::V6(v6) => IpKey::from_v6(v6.octets()),
    }
}

pub(super) fn ip_addr(key: &IpKey) -> IpAddr {
    match key.v4() {
        Some(v4) => IpAddr::from(v4),
        None => IpAddr::from(key.octets),
    }
}
