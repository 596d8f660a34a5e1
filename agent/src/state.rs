//! The agent's record of enrolled pods on tmpfs, for the next agent after a restart: the pinned
//! maps hold the redirection, but ztunnel needs the pod's name and netns again, and an upgrade to
//! another map layout enrolls the pod again. `weir-agent pods` reads it too, for the names and
//! statuses the maps do not hold.
//!
//! Two files: the snapshot at the configured path (a JSON map of records by uid, the format
//! older agents read) and a journal beside it (`<path>.journal`) that every change appends one
//! line to. A pod's change costs one small append whatever the number of pods: rewriting the
//! snapshot each time made every ADD O(pods), and at 5,000 pods that write was most of the
//! agent's CPU. The journal is folded into the snapshot once it is as long as the snapshot, at
//! recovery and at a clean stop, so the cost per change stays constant.
use std::{
    collections::BTreeMap,
    fs::File,
    io::{self, Write},
    path::{Path, PathBuf},
    sync::Mutex,
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::workload::{Status, Workload};

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

/// One journal line: a pod's whole record as of this change, or `null` once it is gone. Whole
/// records make replay idempotent: a journal replayed onto a snapshot that already holds it
/// (an agent killed between writing the snapshot and emptying the journal) gives the same pods.
#[derive(Serialize, Deserialize)]
struct Entry<R> {
    uid: String,
    record: Option<R>,
}

/// A journal shorter than this is never folded: folding a handful of pods each time would cost
/// more than it saves.
const MIN_JOURNAL_TO_FOLD: usize = 256;

pub struct StateFile {
    path: PathBuf,
    records: Mutex<Records>,
    /// What could not be read at open (a record by uid, or a whole file), for recovery to
    /// count; dropped from the files with the next [`Self::save`].
    unreadable: Vec<String>,
}

/// Enrolled pods by uid, and the journal that records their changes since the snapshot.
struct Records {
    pods: BTreeMap<String, Record>,
    /// Opened at the first change.
    journal: Option<File>,
    /// Lines in the journal.
    journal_lines: usize,
    /// The journal's length up to its last whole line, as read at open: a torn line after it
    /// is cut before the first append, which would otherwise be glued to it.
    journal_whole: u64,
}

impl StateFile {
    /// Reads what the previous agent recorded. An unreadable record is left out (and a whole
    /// file when it cannot be parsed at all): its pod is still recovered from the maps, unnamed.
    pub fn open(path: PathBuf) -> Self {
        let Read {
            records,
            unreadable,
            journal_lines,
            journal_whole,
        } = read_each(&path);
        for why in &unreadable {
            warn!(file = %path.display(), "unreadable pod state: ignored: {why}");
        }
        Self {
            path,
            records: Mutex::new(Records {
                pods: records,
                journal: None,
                journal_lines,
                journal_whole,
            }),
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

    /// The pod's recorded status: what its annotation says, as this agent or the previous one
    /// last set it.
    pub fn status(&self, uid: &str) -> Option<Status> {
        let records = self.records.lock().unwrap();
        records.pods.get(uid).and_then(|record| record.status)
    }

    pub fn get(&self, uid: &str) -> Option<Workload> {
        let records = self.records.lock().unwrap();
        records.pods.get(uid).map(|record| record.workload.clone())
    }

    /// Forgets, without writing the files yet, the pods `keep` turns down, and returns them.
    pub fn drop_unless(&self, keep: impl Fn(&str) -> bool) -> Vec<Workload> {
        let mut records = self.records.lock().unwrap();
        let (kept, dropped): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut records.pods)
            .into_iter()
            .partition(|(uid, _)| keep(uid));
        records.pods = kept;
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
        self.record_change(&mut records, &workload.uid)
    }

    /// Records a recorded pod's status; a pod without a record has none to change.
    pub fn set_status(&self, uid: &str, status: Option<Status>) -> Result<()> {
        let mut records = self.records.lock().unwrap();
        match records.pods.get_mut(uid) {
            Some(record) if record.status != status => record.status = status,
            _ => return Ok(()),
        }
        self.record_change(&mut records, uid)
    }

    pub fn remove(&self, uid: &str) -> Result<()> {
        let mut records = self.records.lock().unwrap();
        if records.pods.remove(uid).is_none() {
            return Ok(());
        }
        self.record_change(&mut records, uid)
    }

    /// Appends the pod's record as it now is to the journal, in one write: an agent killed
    /// meanwhile leaves at most a torn last line, which readers skip (the pod is then recovered
    /// as of its previous line, or from the maps). The journal is folded once it has grown as
    /// long as the snapshot.
    fn record_change(&self, records: &mut Records, uid: &str) -> Result<()> {
        let mut line = serde_json::to_vec(&Entry {
            uid: uid.to_owned(),
            record: records.pods.get(uid),
        })?;
        line.push(b'\n');
        let journal = match &mut records.journal {
            Some(journal) => journal,
            None => {
                self.create_dir()?;
                let opened = File::options()
                    .create(true)
                    .append(true)
                    .open(journal_path(&self.path))
                    .and_then(|file| {
                        if file.metadata()?.len() > records.journal_whole {
                            file.set_len(records.journal_whole)?;
                        }
                        Ok(file)
                    })
                    .with_context(|| format!("opening {}", journal_path(&self.path).display()))?;
                records.journal.insert(opened)
            }
        };
        if let Err(error) = journal.write_all(&line) {
            // Part of the line may be written: cut it off, or the next line would be glued to
            // it and both lost to readers.
            let _ = journal.set_len(records.journal_whole);
            return Err(error)
                .with_context(|| format!("writing {}", journal_path(&self.path).display()));
        }
        records.journal_whole += line.len() as u64;
        records.journal_lines += 1;
        if records.journal_lines >= records.pods.len().max(MIN_JOURNAL_TO_FOLD) {
            self.fold(records)?;
        }
        Ok(())
    }

    /// Writes every record to the snapshot and empties the journal: a clean file for the next
    /// agent, without what could not be read at open.
    pub fn save(&self) -> Result<()> {
        let mut records = self.records.lock().unwrap();
        self.fold(&mut records)
    }

    /// The snapshot is replaced atomically (temp file + rename), then the journal emptied: an
    /// agent killed between the two leaves a journal the snapshot already holds, which replays
    /// to the same records.
    fn fold(&self, records: &mut Records) -> Result<()> {
        self.create_dir()?;
        let temp = self.path.with_extension("tmp");
        std::fs::write(&temp, serde_json::to_vec(&records.pods)?)?;
        std::fs::rename(&temp, &self.path)
            .with_context(|| format!("writing {}", self.path.display()))?;
        let journal = journal_path(&self.path);
        match &records.journal {
            Some(file) => file.set_len(0),
            None => match std::fs::remove_file(&journal) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
                _ => Ok(()),
            },
        }
        .with_context(|| format!("emptying {}", journal.display()))?;
        records.journal_lines = 0;
        records.journal_whole = 0;
        Ok(())
    }

    fn create_dir(&self) -> Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(())
    }
}

/// Where the changes since the snapshot at `path` are appended.
pub fn journal_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".journal");
    PathBuf::from(name)
}

/// The records at `path` (snapshot and journal) by uid; none when there is no file (no pod
/// recorded yet). Any unreadable part is an error.
pub fn read(path: &Path) -> Result<BTreeMap<String, Record>> {
    let read = read_each(path);
    match read.unreadable.first() {
        Some(why) => anyhow::bail!("{}: {why}", path.display()),
        None => Ok(read.records),
    }
}

struct Read {
    records: BTreeMap<String, Record>,
    /// Why each part that could not be read was set aside.
    unreadable: Vec<String>,
    journal_lines: usize,
    journal_whole: u64,
}

/// Like [`read`], record by record: one that does not parse is set aside (why, by uid) rather
/// than costing every other pod its record.
fn read_each(path: &Path) -> Read {
    let mut unreadable = Vec::new();
    let mut raw: BTreeMap<String, serde_json::Value> = match read_file(path) {
        Ok(Some(bytes)) => serde_json::from_slice(&bytes)
            .with_context(|| format!("parsing {}", path.display()))
            .unwrap_or_else(|error| {
                unreadable.push(format!("{error:#}"));
                BTreeMap::new()
            }),
        Ok(None) => BTreeMap::new(),
        Err(error) => {
            unreadable.push(format!("{error:#}"));
            BTreeMap::new()
        }
    };
    let journal = journal_path(path);
    let (mut journal_lines, mut journal_whole) = (0, 0);
    match read_file(&journal) {
        Ok(bytes) => {
            let bytes = bytes.unwrap_or_default();
            // A last line without its newline is a write the agent was killed in: not recorded.
            let complete = bytes
                .iter()
                .rposition(|&byte| byte == b'\n')
                .map_or(&[][..], |end| &bytes[..=end]);
            journal_whole = complete.len() as u64;
            for (number, line) in complete.split(|&byte| byte == b'\n').enumerate() {
                if line.is_empty() {
                    continue;
                }
                journal_lines += 1;
                match serde_json::from_slice::<Entry<serde_json::Value>>(line) {
                    Ok(Entry {
                        uid,
                        record: Some(record),
                    }) => {
                        raw.insert(uid, record);
                    }
                    Ok(Entry { uid, record: None }) => {
                        raw.remove(&uid);
                    }
                    Err(error) => unreadable.push(format!(
                        "{} line {}: {error}",
                        journal.display(),
                        number + 1
                    )),
                }
            }
        }
        Err(error) => unreadable.push(format!("{error:#}")),
    }
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
    Read {
        records,
        unreadable,
        journal_lines,
        journal_whole,
    }
}

/// A file's bytes; `None` when there is no file.
fn read_file(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
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
            attachment: None,
        }
    }

    /// Where a test's state file goes, in a directory that lives as long as the guard.
    fn scratch_path() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pods.json");
        (dir, path)
    }

    /// A disk that fills up mid-line: the torn part is cut off, so the records written once
    /// there is room again are read back.
    #[test]
    fn a_journal_write_that_fails_partway_loses_nothing_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
            .arg(dir.path())
            .status();
        if !mounted.is_ok_and(|status| status.success()) {
            assert!(
                std::env::var_os("CI").is_none(),
                "mounting a tmpfs needs root"
            );
            return;
        }
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = std::process::Command::new("umount").arg(self.0).status();
            }
        }
        let _unmount = Unmount(dir.path());
        let path = dir.path().join("pods.json");
        let state = StateFile::open(path.clone());
        // Leaves a few hundred bytes free: the next journal line does not fit whole.
        let filler = dir.path().join("filler");
        std::fs::write(&filler, vec![0u8; 64 * 1024 - 4096]).unwrap();
        let mut written = 0;
        let error = loop {
            match state.insert(&workload(&format!("u{written}")), Status::Enabled) {
                Ok(()) => written += 1,
                Err(error) => break error,
            }
        };
        assert!(format!("{error:#}").contains("No space left"), "{error:#}");
        std::fs::remove_file(&filler).unwrap();
        state.insert(&workload("after"), Status::Enabled).unwrap();

        let records = read(&path).unwrap();
        assert!(records.contains_key("after"), "{:?}", records.keys());
        assert_eq!(records.len(), written + 1);
    }

    #[test]
    fn a_file_from_before_statuses_were_recorded_reads_with_no_status() {
        let (_dir, path) = scratch_path();
        let older = BTreeMap::from([("u1".to_owned(), workload("u1"))]);
        std::fs::write(&path, serde_json::to_vec(&older).unwrap()).unwrap();

        let records = read(&path).unwrap();
        assert_eq!(records["u1"].workload, workload("u1"));
        assert_eq!(records["u1"].status, None);
        assert_eq!(StateFile::open(path).get("u1"), Some(workload("u1")));
    }

    #[test]
    fn every_change_reads_back_at_once_and_a_save_leaves_the_format_older_agents_read() {
        let (_dir, path) = scratch_path();
        let state = StateFile::open(path.clone());
        state.insert(&workload("u1"), Status::Pending).unwrap();
        assert_eq!(read(&path).unwrap()["u1"].status, Some(Status::Pending));
        state.set_status("u1", Some(Status::Enabled)).unwrap();
        assert_eq!(read(&path).unwrap()["u1"].status, Some(Status::Enabled));
        assert!(!path.exists(), "a change only appends to the journal");
        let journal = std::fs::read(journal_path(&path)).unwrap();
        state.set_status("u1", Some(Status::Enabled)).unwrap();
        assert_eq!(
            std::fs::read(journal_path(&path)).unwrap(),
            journal,
            "a status the record has already is not written again"
        );

        state.save().unwrap();
        assert_eq!(std::fs::read(journal_path(&path)).unwrap(), b"");
        let raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(raw["u1"]["status"], "enabled");
        let as_older_agents_read_it: BTreeMap<String, Workload> =
            serde_json::from_value(raw).unwrap();
        assert_eq!(as_older_agents_read_it["u1"], workload("u1"));
        assert_eq!(StateFile::open(path).get("u1"), Some(workload("u1")));
    }

    #[test]
    fn the_journal_stays_as_short_as_the_snapshot_and_removals_are_recorded() {
        let (_dir, path) = scratch_path();
        let state = StateFile::open(path.clone());
        let pods = MIN_JOURNAL_TO_FOLD + 44;
        for n in 0..pods {
            state
                .insert(&workload(&format!("u{n}")), Status::Pending)
                .unwrap();
        }
        for status in [Status::Enabled, Status::Pending, Status::Enabled] {
            for n in 0..pods {
                state.set_status(&format!("u{n}"), Some(status)).unwrap();
            }
        }
        let records = read(&path).unwrap();
        assert_eq!(records.len(), pods);
        assert!(records.values().all(|r| r.status == Some(Status::Enabled)));
        let lines = || {
            std::fs::read(journal_path(&path))
                .unwrap()
                .iter()
                .filter(|&&byte| byte == b'\n')
                .count()
        };
        // 1,200 changes: the journal was folded on the way.
        assert!(lines() <= pods, "{} lines", lines());

        for n in 0..pods {
            state.remove(&format!("u{n}")).unwrap();
        }
        assert!(read(&path).unwrap().is_empty());
        assert!(lines() <= pods, "{} lines", lines());
    }

    #[test]
    fn a_torn_last_line_and_a_journal_replayed_twice_lose_nothing() {
        let (_dir, path) = scratch_path();
        let state = StateFile::open(path.clone());
        state.insert(&workload("u1"), Status::Enabled).unwrap();
        state.insert(&workload("u2"), Status::Pending).unwrap();
        let before = read(&path).unwrap();

        // Killed between writing the snapshot and emptying the journal.
        let journal = std::fs::read(journal_path(&path)).unwrap();
        state.save().unwrap();
        std::fs::write(journal_path(&path), &journal).unwrap();
        assert_eq!(read(&path).unwrap(), before);

        // Killed in the middle of a journal write.
        let mut torn = journal.clone();
        torn.extend_from_slice(br#"{"uid":"u3","rec"#);
        std::fs::write(journal_path(&path), torn).unwrap();
        assert_eq!(read(&path).unwrap(), before);
        let reopened = StateFile::open(path.clone());
        assert!(reopened.unreadable().is_empty());
        reopened.set_status("u2", Some(Status::Enabled)).unwrap();
        assert_eq!(read(&path).unwrap()["u2"].status, Some(Status::Enabled));
    }

    #[test]
    fn no_file_is_no_record_and_a_corrupt_one_is_an_error() {
        let (_dir, path) = scratch_path();
        assert!(read(&path).unwrap().is_empty());
        std::fs::write(&path, b"{not json").unwrap();
        assert!(read(&path).is_err());
        assert_eq!(StateFile::open(path).unreadable().len(), 1);
    }

    #[test]
    fn an_unreadable_record_costs_only_its_own_pod() {
        let (_dir, path) = scratch_path();
        let state = StateFile::open(path.clone());
        state.insert(&workload("u1"), Status::Enabled).unwrap();
        state.insert(&workload("u2"), Status::Enabled).unwrap();
        state.save().unwrap();
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
