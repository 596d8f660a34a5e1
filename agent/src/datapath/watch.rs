//! Interfaces and addresses that appear in (or leave) an enrolled pod after its ADD: a secondary
//! network attached later, an address added by hand or by a VM's tooling. Each enrolled pod has
//! a netlink subscription to its namespace's link and address changes (one socket per pod, made
//! inside its netns), all served by one task each on a single worker thread. A change only wakes
//! the owner: when the pod's interfaces or addresses differ from what it was enrolled with, it
//! enrolls the pod again, which indexes new addresses, drops gone ones and puts the tc programs
//! on new interfaces, as idempotent enrollment does anyway. Other changes (an address finishing
//! duplicate address detection, a link going up) cost two netlink dumps.
use std::{io, net::IpAddr, os::fd::AsFd, sync::mpsc};

use anyhow::{Context, Result};
use netlink_sys::Socket;
use tokio::{io::unix::AsyncFd, task::AbortHandle};
use tracing::{debug, warn};

use super::{Command, Owner};
use crate::{
    netlink::{self, Rtnl},
    netns,
    workload::Workload,
};

/// The worker thread serving every subscription; its tasks end with it.
pub(super) struct Watcher {
    runtime: tokio::runtime::Runtime,
    /// Where a change is reported: the owner's own command queue.
    owner: mpsc::Sender<Command>,
}

/// One pod's subscription; dropping it closes the socket.
pub(super) struct Watch {
    netns_cookie: u64,
    /// What the pod was last enrolled with, to enroll it again on a change.
    workload: Workload,
    /// The pod's interfaces and addresses when it was last enrolled.
    enrolled_with: Interfaces,
    task: AbortHandle,
}

/// A pod's interfaces and addresses but loopback, sorted.
#[derive(PartialEq, Eq)]
pub(super) struct Interfaces {
    /// `(ifindex, name)`.
    pub links: Vec<(u32, String)>,
    pub addresses: Vec<IpAddr>,
}

impl Interfaces {
    /// Those of `rtnl`'s netns.
    pub(super) fn read(rtnl: &mut Rtnl) -> io::Result<Self> {
        let mut links = rtnl.non_loopback_interfaces()?;
        let mut addresses = rtnl.non_loopback_addresses()?;
        links.sort();
        addresses.sort();
        Ok(Self { links, addresses })
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Watcher {
    pub(super) fn start(owner: mpsc::Sender<Command>) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("weir-pod-watch")
            .enable_io()
            .build()
            .context("starting the pod interface watcher")?;
        Ok(Self { runtime, owner })
    }

    /// Follows the changes `socket` (subscribed in the pod's netns) reports.
    fn follow(
        &self,
        socket: Socket,
        workload: &Workload,
        netns_cookie: u64,
        enrolled_with: Interfaces,
    ) -> Watch {
        let (owner, uid) = (self.owner.clone(), workload.uid.clone());
        let task = self.runtime.spawn(async move {
            if let Err(error) = report_changes(socket, &owner, uid.clone(), netns_cookie).await {
                warn!(uid, %error, "pod interface changes are no longer followed");
            }
        });
        Watch {
            netns_cookie,
            workload: workload.clone(),
            enrolled_with,
            task: task.abort_handle(),
        }
    }
}

/// Wakes the owner once per burst of changes, until the owner is gone or the task aborted.
async fn report_changes(
    socket: Socket,
    owner: &mpsc::Sender<Command>,
    uid: String,
    netns_cookie: u64,
) -> io::Result<()> {
    // SAFETY: the socket owns its fd, open and the same until it is dropped with the AsyncFd.
    let socket = unsafe { AsyncFd::register(socket) }?;
    loop {
        let mut ready = socket.readable().await?;
        // The messages' content does not matter (the owner looks at the whole pod again), so
        // each is read into a few bytes on the stack, the rest of it discarded: a buffer per
        // pod would cost thousands of pods their memory.
        loop {
            let mut discard = [0u8; 16];
            match ready.get_inner().recv(&mut &mut discard[..], 0) {
                Ok(_) => {}
                Err(error) if error.raw_os_error() == Some(libc::ENOBUFS) => {}
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                Err(error) => return Err(error),
            }
        }
        ready.clear_ready();
        let changed = Command::InterfacesChanged {
            uid: uid.clone(),
            netns_cookie,
        };
        if owner.send(changed).is_err() {
            return Ok(());
        }
    }
}

impl Owner {
    /// Follows the pod's interface changes from now on (the calling thread is in its netns);
    /// a pod already followed in this netns only has its workload updated.
    /// A subscription to the changes of the calling thread's netns (the pod's), made before the
    /// pod's interfaces are read so that no change in between goes unseen; `None` when the pod
    /// is followed in this netns already.
    pub(super) fn subscribe(&self, uid: &str, netns_cookie: u64) -> Result<Option<Socket>> {
        if self
            .watches
            .get(uid)
            .is_some_and(|watch| watch.netns_cookie == netns_cookie)
        {
            return Ok(None);
        }
        let socket = netlink::subscribe_interface_changes()
            .context("subscribing to the pod's interface changes")?;
        Ok(Some(socket))
    }

    /// Follows the pod's changes from now on through `subscription` (from [`Self::subscribe`]);
    /// without one, the pod already followed has its workload and interfaces updated.
    pub(super) fn watch(
        &mut self,
        workload: &Workload,
        netns_cookie: u64,
        enrolled_with: Interfaces,
        subscription: Option<Socket>,
    ) {
        match subscription {
            Some(socket) => {
                let watch = self
                    .watcher
                    .follow(socket, workload, netns_cookie, enrolled_with);
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
    pub(super) fn interfaces_changed(&mut self, uid: &str, netns_cookie: u64) {
        let Some(watch) = self.watches.get(uid) else {
            return;
        };
        let Some(netns) = self.pods.get(uid).and_then(|pod| pod.netns.as_ref()) else {
            return;
        };
        if watch.netns_cookie != netns_cookie {
            return;
        }
        let now = netns::enter(netns.as_fd())
            .map_err(anyhow::Error::from)
            .and_then(|_inside| Ok(Interfaces::read(&mut Rtnl::new()?)?));
        if now.is_ok_and(|now| now == watch.enrolled_with) {
            return;
        }
        let workload = watch.workload.clone();
        debug!(uid, "pod interfaces changed");
        if let Err(error) = self.enroll(&workload) {
            // Enrollment took the pod out entirely: stop following it too.
            self.watches.remove(uid);
            warn!(
                uid,
                error = format!("{error:#}"),
                "re-enrolling after an interface change"
            );
        }
    }
}
