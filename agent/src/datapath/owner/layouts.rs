//! Retiring other map layouts after an upgrade: the pods this agent now holds leave the older
//! layout's maps, and the layout goes once no pod is left in it.
use std::{fs, os::fd::AsFd};

use anyhow::{Context, Result};
use aya::maps::MapData;
use tracing::{info, warn};
use weir_common::{maps, ABI_VERSION};

use super::Owner;
use crate::datapath::kernel::bpf_sys;

impl Owner {
    pub(super) fn retire_other_layouts(&self) -> Result<()> {
        let current = format!("abi-{ABI_VERSION}");
        for entry in fs::read_dir(&self.pin_root)? {
            let dir = entry?.path();
            let name = dir
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if !name.starts_with("abi-") || name == current {
                continue;
            }
            // Every layout keys PODS by netns cookie (see weir_common::maps::PODS).
            let pods = MapData::from_pin(dir.join(maps::PODS))
                .with_context(|| format!("opening {}/{}", dir.display(), maps::PODS))?;
            for pod in self.pods.values() {
                bpf_sys::map_delete(pods.fd().as_fd(), &pod.netns_cookie.to_ne_bytes())?;
            }
            if bpf_sys::map_is_empty(pods.fd().as_fd(), size_of::<u64>())? {
                fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
                info!(
                    layout = name,
                    "retired an older map layout: its pods are migrated"
                );
            } else {
                warn!(
                    layout = name,
                    "pods this agent does not know are still enrolled in an older map layout: \
                     kept (their redirection stays) until they are gone"
                );
            }
        }
        Ok(())
    }
}
