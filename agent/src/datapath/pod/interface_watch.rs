//! Interfaces and addresses that appear in (or leave) an enrolled pod after its ADD: a secondary
//! network attached later, an address added by hand or by a VM's tooling. One netlink socket in
//! the node's netns hears the link and address changes of every namespace that has an id there
//! (`NETLINK_LISTEN_ALL_NSID`); each enrolled pod is followed by its netns' id. A change only
//! wakes the owner: when the pod's interfaces or addresses differ from what it was enrolled with,
//! it enrolls the pod again, which indexes new addresses, drops gone ones and puts the tc
//! programs on new interfaces, as idempotent enrollment does anyway. Other changes (an address
//! finishing duplicate address detection, a link going up) cost two netlink dumps. However fast
//! a pod changes (a container with CAP_NET_ADMIN can flap addresses in a loop), at most one
//! re-read of it waits in the owner's queue ([`PendingRereads`]): other pods' commands never
//! queue behind a backlog of its changes.
use std::{
    collections::{HashMap, HashSet},
    io,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc, Mutex,
    },
};

use anyhow::{Context, Result};
use ipnet::IpNet;
use netlink_sys::Socket;
use tokio::io::unix::AsyncFd;
use tracing::{debug, warn};

use crate::datapath::{
    kernel::netlink::{self, Link, Rtnl},
    owner::{
        tasks::{Task, Tasks},
        Command, Owner, Traced,
    },
    EnrollNetns,
};
use crate::{logging::pod_span, workload::Workload};

/// Followed pods by the id of their netns in the node's.
type Followed = Arc<Mutex<HashMap<i32, FollowedPod>>>;

/// A followed pod: its uid and netns cookie, and whether its route changes matter too (see
/// [`excludes_interfaces`]).
#[derive(Clone)]
struct FollowedPod {
    uid: String,
    netns_cookie: u64,
    routes: bool,
}

/// The one subscription to every pod's changes, read by a task that wakes the owner.
pub(in crate::datapath) struct Watcher {
    _task: Task,
    /// An rtnetlink socket in the node's netns: it names pods' namespaces by their ids there.
    node: Rtnl,
    followed: Followed,
    pending: PendingRereads,
    /// The subscription's socket (a duplicate of the task's fd) and whether it receives route
    /// changes: only while a followed pod's routes decide its capture (see
    /// [`netlink::follow_route_changes`]).
    route_changes: (OwnedFd, bool),
}

/// The pods, by `(uid, netns cookie)`, whose re-read is in the owner's queue and not yet begun.
/// The watcher wakes the owner only for a pod it adds here; the owner takes the pod out just
/// before it re-reads it, so a change during the re-read schedules exactly one more. Interface
/// work queued is thus bounded by the number of followed pods, whatever the rate of changes or
/// of lost-message overflows.
#[derive(Clone, Default)]
struct PendingRereads(Arc<Mutex<HashSet<(String, u64)>>>);

impl PendingRereads {
    /// Whether the pod was not pending yet: then the caller is to wake the owner for it.
    fn schedule(&self, uid: &str, netns_cookie: u64) -> bool {
        self.0
            .lock()
            .unwrap()
            .insert((uid.to_owned(), netns_cookie))
    }

    /// The owner is about to re-read the pod: a change from now on needs another re-read.
    fn begin(&self, uid: &str, netns_cookie: u64) {
        self.0
            .lock()
            .unwrap()
            .remove(&(uid.to_owned(), netns_cookie));
    }
}

/// One pod's entry in the followed set, made before its interfaces are read so that no change
/// in between goes unseen; dropping it (a failed enrollment, an unenrolled pod) stops following.
pub(in crate::datapath) struct Subscription {
    namespace_id: i32,
    uid: String,
    netns_cookie: u64,
    followed: Followed,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut followed = self.followed.lock().unwrap();
        // Only its own entry: the id may name another pod's netns by now.
        let own = (self.uid.as_str(), self.netns_cookie);
        if followed
            .get(&self.namespace_id)
            .is_some_and(|pod| (pod.uid.as_str(), pod.netns_cookie) == own)
        {
            followed.remove(&self.namespace_id);
        }
    }
}

/// A followed pod.
pub(in crate::datapath) struct Watch {
    /// What the pod was last enrolled with, to enroll it again on a change.
    workload: Workload,
    /// The pod's interfaces and addresses when it was last enrolled.
    enrolled_with: Interfaces,
    /// Its netns, by id and cookie.
    subscription: Subscription,
}

impl Watch {
    /// What the pod was last enrolled with: its workload and its interfaces but loopback, from
    /// which the audit knows how its netns was set up.
    pub(in crate::datapath) fn enrolled_as(&self) -> (&Workload, &[Link]) {
        (&self.workload, &self.enrolled_with.links)
    }
}

/// A pod's interfaces and addresses but loopback, sorted, and where its pod excludes
/// interfaces its main routes.
#[derive(PartialEq, Eq)]
pub(in crate::datapath) struct Interfaces {
    /// `(ifindex, name)`.
    pub links: Vec<Link>,
    pub addresses: Vec<IpAddr>,
    /// Each main route's destination and the interface it leaves by; read only for a pod that
    /// excludes interfaces (see [`Interfaces::read`]).
    pub routes: Vec<(IpNet, u32)>,
}

impl Interfaces {
    /// Those of `rtnl`'s netns, with its routes for a `pod` that excludes interfaces (a route
    /// dump more, only for such pods).
    pub(in crate::datapath) fn read(rtnl: &mut Rtnl, pod: Option<&Workload>) -> io::Result<Self> {
        let mut links = rtnl.non_loopback_interfaces()?;
        let mut addresses = rtnl.non_loopback_addresses()?;
        links.sort();
        addresses.sort();
        let routes = match pod.is_some_and(excludes_interfaces) {
            true => rtnl.main_routes()?,
            false => Vec::new(),
        };
        Ok(Self {
            links,
            addresses,
            routes,
        })
    }

    /// The pod's routes with whether each leaves by one of `excluded` (interface names).
    pub(super) fn routes_out_of(&self, excluded: &[String]) -> Vec<(IpNet, bool)> {
        self.routes
            .iter()
            .map(|(destination, ifindex)| {
                let out_of_excluded = self
                    .links
                    .iter()
                    .any(|link| link.index == *ifindex && excluded.contains(&link.name));
                (*destination, out_of_excluded)
            })
            .collect()
    }
}

/// Whether the pod is a sidecar pod with `excludeInterfaces`, whose routes decide its capture.
pub(in crate::datapath) fn excludes_interfaces(pod: &Workload) -> bool {
    pod.sidecar
        .as_ref()
        .is_some_and(|sidecar| !sidecar.exclude_interfaces.is_empty())
}

impl Watcher {
    /// Subscribes (the calling thread is in the node's netns) and reports changes to `owner`'s
    /// command queue from now on, from a task on `tasks`.
    pub(in crate::datapath) fn start(
        owner: mpsc::Sender<Traced>,
        alive: Arc<AtomicBool>,
        tasks: &Tasks,
    ) -> Result<Self> {
        let socket = netlink::subscribe_interface_changes()
            .context("subscribing to the pods' interface changes")?;
        // SAFETY: the socket's fd is open until the socket is dropped, after this duplicate.
        let route_changes = unsafe { BorrowedFd::borrow_raw(socket.as_raw_fd()) }
            .try_clone_to_owned()
            .context("duplicating the interface changes' socket")?;
        let followed = Followed::default();
        let reported = followed.clone();
        let pending = PendingRereads::default();
        let scheduled = pending.clone();
        alive.store(true, Ordering::Relaxed);
        let task = tasks.spawn(async move {
            if let Err(error) = report_changes(socket, &owner, &reported, &scheduled).await {
                warn!(%error, "pod interface changes are no longer followed");
                alive.store(false, Ordering::Relaxed);
            }
        });
        Ok(Self {
            _task: task,
            node: Rtnl::new().context("rtnetlink in the node netns")?,
            followed,
            pending,
            route_changes: (route_changes, false),
        })
    }

    /// Receives route changes from now on (before the pod's routes are read: none goes
    /// unseen).
    fn follow_route_changes(&mut self) -> Result<()> {
        let (socket, following) = &mut self.route_changes;
        if !*following {
            netlink::follow_route_changes(socket.as_fd(), true)
                .context("subscribing to route changes")?;
            *following = true;
        }
        Ok(())
    }

    /// Stops receiving route changes once no followed pod needs them.
    pub(in crate::datapath) fn drop_unneeded_route_changes(&mut self) {
        let (socket, following) = &mut self.route_changes;
        if *following && !self.followed.lock().unwrap().values().any(|pod| pod.routes) {
            match netlink::follow_route_changes(socket.as_fd(), false) {
                Ok(()) => *following = false,
                Err(error) => warn!(%error, "unsubscribing from route changes"),
            }
        }
    }
}

/// Receive errors in a row (other than lost messages) after which the watch gives up, and
/// `/healthz` says so: a restarted agent subscribes afresh and re-reads every pod.
const MAX_RECEIVE_ERRORS: u32 = 10;

/// Wakes the owner for each changed pod that has no re-read pending, until the owner is gone.
async fn report_changes(
    socket: Socket,
    owner: &mpsc::Sender<Traced>,
    followed: &Followed,
    pending: &PendingRereads,
) -> io::Result<()> {
    // SAFETY: the socket owns its fd, open and the same until it is dropped with the AsyncFd.
    let socket = unsafe { AsyncFd::register(socket) }?;
    let mut errors_in_a_row = 0;
    loop {
        let mut ready = socket.readable().await?;
        let (mut changed, mut overflowed, mut failed) = (HashSet::new(), false, false);
        let mut routes_changed = HashSet::new();
        loop {
            match netlink::recv_change(ready.get_inner()) {
                Ok(netlink::Change {
                    namespace_id: Some(id),
                    route,
                }) => {
                    match route {
                        true => routes_changed.insert(id),
                        false => changed.insert(id),
                    };
                }
                // The node's own changes.
                Ok(netlink::Change {
                    namespace_id: None, ..
                }) => {}
                // Changes were lost: any pod may have changed.
                Err(error) if error.raw_os_error() == Some(libc::ENOBUFS) => overflowed = true,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                // Whatever the message said is lost, as with ENOBUFS; the watch goes on unless
                // the socket keeps failing.
                Err(error) => {
                    errors_in_a_row += 1;
                    if errors_in_a_row >= MAX_RECEIVE_ERRORS {
                        return Err(error);
                    }
                    warn!(%error, "reading pod interface changes; every pod is checked");
                    (overflowed, failed) = (true, true);
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    break;
                }
            }
        }
        // After a failed read more may be waiting: the socket is read again at once.
        if failed {
            drop(ready);
        } else {
            errors_in_a_row = 0;
            ready.clear_ready();
        }
        let pods: Vec<FollowedPod> = {
            let followed = followed.lock().unwrap();
            match overflowed {
                true => followed.values().cloned().collect(),
                false => {
                    let routes = routes_changed
                        .iter()
                        .filter_map(|id| followed.get(id))
                        .filter(|pod| pod.routes);
                    changed
                        .iter()
                        .filter_map(|id| followed.get(id))
                        .chain(routes)
                        .cloned()
                        .collect()
                }
            }
        };
        for FollowedPod {
            uid, netns_cookie, ..
        } in pods
        {
            if !pending.schedule(&uid, netns_cookie) {
                continue;
            }
            if owner
                .send((
                    tracing::Span::none(),
                    Command::InterfacesChanged { uid, netns_cookie },
                ))
                .is_err()
            {
                return Ok(());
            }
        }
    }
}

impl Owner {
    /// Follows the changes of the pod's netns (`netns`, an fd of it) from now on, before the
    /// pod's interfaces are read so that no change in between goes unseen, its route changes
    /// too when `routes`; `None` when the pod is followed in this netns already (then only
    /// `routes` is updated).
    pub(in crate::datapath) fn subscribe(
        &mut self,
        uid: &str,
        (netns_cookie, netns): (u64, BorrowedFd<'_>),
        routes: bool,
    ) -> Result<Option<Subscription>> {
        if routes {
            self.watcher.follow_route_changes()?;
        }
        if let Some(watch) = self
            .watches
            .get(uid)
            .filter(|watch| watch.subscription.netns_cookie == netns_cookie)
        {
            let mut followed = self.watcher.followed.lock().unwrap();
            if let Some(pod) = followed.get_mut(&watch.subscription.namespace_id) {
                pod.routes = routes;
            }
            return Ok(None);
        }
        let namespace_id = self
            .watcher
            .node
            .namespace_id(netns)
            .context("the pod netns' id in the node's")?;
        let followed = self.watcher.followed.clone();
        followed.lock().unwrap().insert(
            namespace_id,
            FollowedPod {
                uid: uid.to_owned(),
                netns_cookie,
                routes,
            },
        );
        Ok(Some(Subscription {
            namespace_id,
            uid: uid.to_owned(),
            netns_cookie,
            followed,
        }))
    }

    /// Follows the pod's changes from now on through `subscription` (from [`Self::subscribe`]);
    /// without one, the pod already followed has its workload and interfaces updated.
    pub(in crate::datapath) fn watch(
        &mut self,
        workload: &Workload,
        enrolled_with: Interfaces,
        subscription: Option<Subscription>,
    ) {
        match subscription {
            Some(subscription) => {
                let watch = Watch {
                    workload: workload.clone(),
                    enrolled_with,
                    subscription,
                };
                self.watches.insert(workload.uid.clone(), watch);
            }
            None => {
                if let Some(watch) = self.watches.get_mut(&workload.uid) {
                    watch.workload = workload.clone();
                    watch.enrolled_with = enrolled_with;
                }
            }
        }
    }

    /// Something changed in a followed pod's links or addresses: when its interfaces or
    /// addresses are not those it was enrolled with, enroll it again as it was enrolled.
    pub(in crate::datapath) fn interfaces_changed(&mut self, uid: &str, netns_cookie: u64) {
        self.watcher.pending.begin(uid, netns_cookie);
        let Some(watch) = self.watches.get(uid) else {
            return;
        };
        let Some(netns) = self.pods.get(uid).and_then(|pod| pod.netns.as_ref()) else {
            return;
        };
        if watch.subscription.netns_cookie != netns_cookie {
            return;
        }
        let now = self
            .home
            .enter(netns.as_fd())
            .map_err(anyhow::Error::from)
            .and_then(|_inside| Ok(Interfaces::read(&mut Rtnl::new()?, Some(&watch.workload))?));
        if now.is_ok_and(|now| now == watch.enrolled_with) {
            return;
        }
        let workload = watch.workload.clone();
        let _pod = pod_span(&workload.pod.namespace, &workload.pod.name, uid).entered();
        debug!("pod interfaces changed");
        // A failed attempt leaves the pod as it was enrolled; the next change tries again.
        if let Err(error) = self.enroll(&workload, EnrollNetns::Held) {
            warn!(
                error = format!("{error:#}"),
                "re-enrolling after an interface change"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PendingRereads;

    #[test]
    fn a_pod_has_at_most_one_reread_pending_and_a_change_during_one_schedules_another() {
        let pending = PendingRereads::default();
        assert!(pending.schedule("a", 1), "the first change wakes the owner");
        for _ in 0..1000 {
            assert!(
                !pending.schedule("a", 1),
                "later ones wait for that re-read"
            );
        }
        assert!(pending.schedule("b", 2), "another pod is not held back");
        assert!(
            pending.schedule("a", 3),
            "the same pod in a new netns is another pod"
        );

        pending.begin("a", 1);
        assert!(
            pending.schedule("a", 1),
            "a change once the re-read began needs one more"
        );
        assert!(!pending.schedule("a", 1));
    }
}
