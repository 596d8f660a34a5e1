//! The agent's record of enrolled pods on tmpfs, for the next agent after a restart: the pinned
//! maps hold the redirection, but ztunnel needs the pod's name and netns again, and an upgrade to
//! another map layout enrolls the pod again.
use std::{collections::BTreeMap, path::PathBuf, sync::Mutex};

use anyhow::{Context, Result};
use tracing::warn;

use crate::workload::Workload;

pub struct StateFile {
    path: PathBuf,
    /// Enrolled pods by uid, as last written to `path` (or about to be).
    workloads: Mutex<BTreeMap<String, Workload>>,
}

impl StateFile {
    /// Reads what the previous agent recorded; an unreadable file is ignored.
    pub fn open(path: PathBuf) -> Self {
        let workloads = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|error| {
                warn!(file = %path.display(), %error, "unreadable pod state: ignored");
                BTreeMap::new()
            }),
            Err(_) => BTreeMap::new(),
        };
        Self {
            path,
            workloads: Mutex::new(workloads),
        }
    }

    pub fn get(&self, uid: &str) -> Option<Workload> {
        self.workloads.lock().unwrap().get(uid).cloned()
    }

    /// Forgets, without writing the file yet, the pods `keep` turns down, and returns them.
    pub fn drop_unless(&self, keep: impl Fn(&str) -> bool) -> Vec<Workload> {
        let mut workloads = self.workloads.lock().unwrap();
        let (kept, dropped): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut *workloads)
            .into_iter()
            .partition(|(uid, _)| keep(uid));
        *workloads = kept;
        dropped.into_values().collect()
    }

    pub fn insert(&self, workload: &Workload) -> Result<()> {
        self.workloads
            .lock()
            .unwrap()
            .insert(workload.uid.clone(), workload.clone());
        self.save()
    }

    pub fn remove(&self, uid: &str) -> Result<()> {
        if self.workloads.lock().unwrap().remove(uid).is_some() {
            self.save()?;
        }
        Ok(())
    }

    /// Writes the file atomically (temp file + rename): an agent killed mid-write leaves the
    /// previous record.
    pub fn save(&self) -> Result<()> {
        let workloads = self.workloads.lock().unwrap();
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let temp = self.path.with_extension("tmp");
        std::fs::write(&temp, serde_json::to_vec(&*workloads)?)?;
        std::fs::rename(&temp, &self.path)
            .with_context(|| format!("writing {}", self.path.display()))
    }
}
