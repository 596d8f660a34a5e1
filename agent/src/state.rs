//! The agent's record of enrolled pods on tmpfs, for the next agent after a restart: the pinned
//! maps hold the redirection, but ztunnel needs the pod's name and netns again, and an upgrade to
//! another map layout enrolls the pod again. `weir-agent pods` reads it too, for the names and
//! statuses the maps do not hold.
use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
    sync::Mutex,
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::{enroll::Status, workload::Workload};

/// What the file holds for one pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Flattened: a file written before statuses were recorded is a map of plain workloads.
    #[serde(flatten)]
    pub workload: Workload,
    /// As last reported; `None` in files written before statuses were recorded.
    #[serde(default)]
    pub status: Option<Status>,
}

pub struct StateFile {
    path: PathBuf,
    /// Enrolled pods by uid, as last written to `path` (or about to be).
    records: Mutex<BTreeMap<String, Record>>,
}

impl StateFile {
    /// Reads what the previous agent recorded; an unreadable file is ignored.
    pub fn open(path: PathBuf) -> Self {
        let records = read(&path).unwrap_or_else(|error| {
            warn!(file = %path.display(), "unreadable pod state: ignored: {error:#}");
            BTreeMap::new()
        });
        Self {
            path,
            records: Mutex::new(records),
        }
    }

    pub fn get(&self, uid: &str) -> Option<Workload> {
        let records = self.records.lock().unwrap();
        records.get(uid).map(|record| record.workload.clone())
    }

    /// Forgets, without writing the file yet, the pods `keep` turns down, and returns them.
    pub fn drop_unless(&self, keep: impl Fn(&str) -> bool) -> Vec<Workload> {
        let mut records = self.records.lock().unwrap();
        let (kept, dropped): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut *records)
            .into_iter()
            .partition(|(uid, _)| keep(uid));
        *records = kept;
        dropped
            .into_values()
            .map(|record| record.workload)
            .collect()
    }

    pub fn insert(&self, workload: &Workload, status: Status) -> Result<()> {
        let record = Record {
            workload: workload.clone(),
            status: Some(status),
        };
        self.records
            .lock()
            .unwrap()
            .insert(workload.uid.clone(), record);
        self.save()
    }

    /// Records a recorded pod's status, without writing the file: the next [`Self::save`] does.
    pub fn set_status(&self, uid: &str, status: Option<Status>) {
        if let Some(record) = self.records.lock().unwrap().get_mut(uid) {
            record.status = status;
        }
    }

    pub fn remove(&self, uid: &str) -> Result<()> {
        if self.records.lock().unwrap().remove(uid).is_some() {
            self.save()?;
        }
        Ok(())
    }

    /// Writes the file atomically (temp file + rename): an agent killed mid-write leaves the
    /// previous record, and a reader never sees half a file.
    pub fn save(&self) -> Result<()> {
        let records = self.records.lock().unwrap();
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let temp = self.path.with_extension("tmp");
        std::fs::write(&temp, serde_json::to_vec(&*records)?)?;
        std::fs::rename(&temp, &self.path)
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// The records in the file at `path` by uid; none when there is no file (no pod recorded yet).
pub fn read(path: &Path) -> Result<BTreeMap<String, Record>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(error) => Err(error).with_context(|| format!("reading {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(uid: &str) -> Workload {
        Workload {
            uid: uid.into(),
            name: "app".into(),
            namespace: "mesh".into(),
            service_account: None,
            netns: "/var/run/netns/cni-1".into(),
            ips: vec!["10.1.0.5".parse().unwrap()],
            options: Default::default(),
        }
    }

    #[test]
    fn a_file_from_before_statuses_were_recorded_reads_with_no_status() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pods.json");
        let older = BTreeMap::from([("u1".to_owned(), workload("u1"))]);
        std::fs::write(&path, serde_json::to_vec(&older).unwrap()).unwrap();

        let records = read(&path).unwrap();
        assert_eq!(records["u1"].workload, workload("u1"));
        assert_eq!(records["u1"].status, None);
        assert_eq!(StateFile::open(path).get("u1"), Some(workload("u1")));
    }

    #[test]
    fn statuses_are_written_with_the_next_save_and_older_agents_still_read_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pods.json");
        let state = StateFile::open(path.clone());
        state.insert(&workload("u1"), Status::Pending).unwrap();
        assert_eq!(read(&path).unwrap()["u1"].status, Some(Status::Pending));

        state.set_status("u1", Some(Status::Enabled));
        assert_eq!(read(&path).unwrap()["u1"].status, Some(Status::Pending));
        state.save().unwrap();
        assert_eq!(read(&path).unwrap()["u1"].status, Some(Status::Enabled));

        let raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(raw["u1"]["status"], "enabled");
        let as_older_agents_read_it: BTreeMap<String, Workload> =
            serde_json::from_value(raw).unwrap();
        assert_eq!(as_older_agents_read_it["u1"], workload("u1"));
    }

    #[test]
    fn no_file_is_no_record_and_a_corrupt_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pods.json");
        assert!(read(&path).unwrap().is_empty());
        std::fs::write(&path, b"{not json").unwrap();
        assert!(read(&path).is_err());
    }
}
