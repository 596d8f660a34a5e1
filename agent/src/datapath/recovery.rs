//! After an agent restart: the enrolled pods rebuilt from the pinned maps, and each one's
//! network namespace found again by its cookie (named namespaces, then every process's).
use std::{
    collections::{HashMap as StdHashMap, HashSet},
    fs::{self, File},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use tracing::debug;
use weir_common::{IpKey, PodConfig};

use super::{discovery, pods::prepare_pod_netns, snapshot, Enrolled, Owner};
use crate::netns;

/// Rebuilds the owner's index from the pinned maps after a restart.
pub(super) fn recover_pods(
    pods_map: &HashMap<MapData, u64, PodConfig>,
    pod_ips: &HashMap<MapData, IpKey, u64>,
) -> StdHashMap<String, Enrolled> {
    snapshot::pod_entries(pods_map, pod_ips)
        .into_iter()
        .map(|entry| {
            let enrolled = Enrolled {
                netns_cookie: entry.netns_cookie,
                ips: entry.ips,
                netns: None,
            };
            (entry.uid, enrolled)
        })
        .collect()
}

impl Owner {
    pub(super) fn adopt(&mut self, uid: &str, hint: Option<&Path>) -> Result<Option<OwnedFd>> {
        let Some(pod) = self.pods.get_mut(uid) else {
            return Ok(None);
        };
        let cookie = pod.netns_cookie;
        let candidates = hint
            .map(Path::to_path_buf)
            .into_iter()
            .chain(named_namespaces())
            .chain(discovery::processes().map(|process| discovery::netns_path(&process)));
        let mut seen = HashSet::new();
        for path in candidates {
            let Ok(file) = File::open(&path) else {
                continue;
            };
            let Ok(stat) = nix::sys::stat::fstat(file.as_raw_fd()) else {
                continue;
            };
            if !seen.insert((stat.st_dev, stat.st_ino)) {
                continue;
            }
            let matches = netns::enter(file.as_fd())
                .and_then(|_inside| netns::current_cookie())
                .is_ok_and(|found| found == cookie);
            if matches {
                debug!(uid, path = %path.display(), "pod netns recovered");
                let handle = file.try_clone()?.into();
                pod.netns = Some(file);
                self.refresh_pod_netns(uid)?;
                return Ok(Some(handle));
            }
        }
        Ok(None)
    }

    /// Puts this agent's tc programs on a recovered pod (replacing the previous agent's in
    /// place, so an upgrade reaches running pods) and makes sure its return path is there.
    fn refresh_pod_netns(&mut self, uid: &str) -> Result<()> {
        let netns = match self.pods.get(uid).and_then(|pod| pod.netns.as_ref()) {
            Some(netns) => netns.try_clone()?,
            None => return Ok(()),
        };
        let _inside = netns::enter(netns.as_fd()).context("entering the pod netns")?;
        prepare_pod_netns(&mut self.ebpf)
    }
}

/// The namespaces runtimes name under /var/run/netns (containerd's `cni-<uuid>`).
fn named_namespaces() -> impl Iterator<Item = PathBuf> {
    fs::read_dir("/var/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
}
