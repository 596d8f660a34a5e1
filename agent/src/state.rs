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
    records: Mutex<Records>,
    /// The number of changes the file on disk holds; held while writing it.
    written: Mutex<u64>,
    /// What could not be read at open (a record by uid, or the whole file), for recovery to
    /// count; dropped from the file with the next save.
    unreadable: Vec<String>,
}

/// Enrolled pods by uid, as last written to the file (or about to be).
struct Records {
    pods: BTreeMap<String, Record>,
    /// How many changes `pods` has seen: a save that finds the file holding this many has
    /// nothing to write.
    changes: u64,
}

impl StateFile {
    /// Reads what the previous agent recorded. An unreadable record is left out (and the whole
    /// file when it cannot be parsed at all): its pod is still recovered from the maps, unnamed.
    pub fn open(path: PathBuf) -> Self {
        let (records, unreadable) = match read_each(&path) {
            Ok(read) => read,
            Err(error) => (BTreeMap::new(), vec![format!("{error:#}")]),
        };
        for why in &unreadable {
            warn!(file = %path.display(), "unreadable pod state: ignored: {why}");
        }
        Self {
            path,
            records: Mutex::new(Records {
                pods: records,
                changes: 0,
            }),
            written: Mutex::new(0),
            unreadable,
        }
    }

    /// What could not be read when the file was opened.
    pub fn unreadable(&self) -> &[String] {
        &self.unreadable
    }

    /// Every recorded pod.
    pub fn workloads(&self) -> Vec<Workload> {
        let records = self.records.lock().unwrap();
        records
            .pods
            .values()
            .map(|record| record.workload.clone())
            .collect()
    }

    pub fn get(&self, uid: &str) -> Option<Workload> {
        let records = self.records.lock().unwrap();
        records.pods.get(uid).map(|record| record.workload.clone())
    }

    /// Forgets, without writing the file yet, the pods `keep` turns down, and returns them.
    pub fn drop_unless(&self, keep: impl Fn(&str) -> bool) -> Vec<Workload> {
        let mut records = self.records.lock().unwrap();
        let (kept, dropped): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut records.pods)
            .into_iter()
            .partition(|(uid, _)| keep(uid));
        records.pods = kept;
        records.changes += 1;
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
        let mut records = self.records.lock().unwrap();
        records.pods.insert(workload.uid.clone(), record);
        records.changes += 1;
        drop(records);
        self.save()
    }

    /// Records a recorded pod's status, without writing the file: the next [`Self::save`] does.
    pub fn set_status(&self, uid: &str, status: Option<Status>) {
        let mut records = self.records.lock().unwrap();
        if let Some(record) = records.pods.get_mut(uid) {
            record.status = status;
            records.changes += 1;
        }
    }

    pub fn remove(&self, uid: &str) -> Result<()> {
        let mut records = self.records.lock().unwrap();
        if records.pods.remove(uid).is_none() {
            return Ok(());
        }
        records.changes += 1;
        drop(records);
        self.save()
    }

    /// Writes the file atomically (temp file + rename): an agent killed mid-write leaves the
    /// previous record, and a reader never sees half a file. Returns once the file holds every
    /// change made before the call. Concurrent callers share writes: the whole file is
    /// serialized each time, so when many pods are added at once (a node's reboot storm) one
    /// write made after all their changes serves all of them, and the others return at once.
    pub fn save(&self) -> Result<()> {
        let mut written = self.written.lock().unwrap();
        let (bytes, changes) = {
            let records = self.records.lock().unwrap();
            // Without a change since open, a save still writes: it drops what could not be read.
            if *written >= records.changes && records.changes > 0 {
                return Ok(());
            }
            (serde_json::to_vec(&records.pods)?, records.changes)
        };
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let temp = self.path.with_extension("tmp");
        std::fs::write(&temp, bytes)?;
        std::fs::rename(&temp, &self.path)
            .with_context(|| format!("writing {}", self.path.display()))?;
        *written = changes;
        Ok(())
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

/// Like [`read`], record by record: one that does not parse is set aside (why, by uid) rather
/// than costing every other pod its record.
fn read_each(path: &Path) -> Result<(BTreeMap<String, Record>, Vec<String>)> {
    let raw: BTreeMap<String, serde_json::Value> = match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))?
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => BTreeMap::new(),
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    let mut unreadable = Vec::new();
    let records = raw
        .into_iter()
        .filter_map(|(uid, value)| match serde_json::from_value(value) {
            Ok(record) => Some((uid, record)),
            Err(error) => {
                unreadable.push(format!("record of pod {uid}: {error}"));
                None
            }
        })
        .collect();
    Ok((records, unreadable))
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
            attachment: None,
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
        assert_eq!(StateFile::open(path).unreadable().len(), 1);
    }

    #[test]
    fn an_unreadable_record_costs_only_its_own_pod() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pods.json");
        let state = StateFile::open(path.clone());
        state.insert(&workload("u1"), Status::Enabled).unwrap();
        state.insert(&workload("u2"), Status::Enabled).unwrap();
        let mut raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        raw["u2"]["ips"] = "garbage".into();
        std::fs::write(&path, raw.to_string()).unwrap();

        let reopened = StateFile::open(path);
        assert_eq!(reopened.get("u1"), Some(workload("u1")));
        assert_eq!(reopened.get("u2"), None);
        assert_eq!(reopened.unreadable().len(), 1);
        assert!(reopened.unreadable()[0].contains("u2"));
    }
}
