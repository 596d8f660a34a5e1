//! The agent's record of enrolled pods on tmpfs, for the next agent after a restart: the pinned
//! maps hold the redirection, but ztunnel needs the pod's name and netns again, and an upgrade to
//! another map layout enrolls the pod again. `weir-agent pods` reads it too, for the names and
//! statuses the maps do not hold.
//!
//! Two files: the snapshot at the configured path (a JSON map of records by uid, the format
//! older agents read) and a journal beside it (`<path>.journal`) that every change appends one
//! line to. A pod's change costs one small append whatever the number of pods: rewriting the
//! snapshot each time would make every ADD O(pods), and at 5,000 pods that write would be most
//! of the agent's CPU. The journal is folded into the snapshot once it is as long as the snapshot, at
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

use crate::{
    root_only,
    workload::{Status, Workload},
};

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

    /// Whether the pod has a record.
    pub fn contains(&self, uid: &str) -> bool {
        self.records.lock().unwrap().pods.contains_key(uid)
    }

    /// The records counted by `key`.
    pub fn count_by<K: Ord>(&self, key: impl Fn(&Record) -> K) -> BTreeMap<K, usize> {
        let records = self.records.lock().unwrap();
        let mut counts = BTreeMap::new();
        for record in records.pods.values() {
            *counts.entry(key(record)).or_default() += 1;
        }
        counts
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
                let opened = root_only::open_append(&journal_path(&self.path))
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
        root_only::replace_file(&self.path, &serde_json::to_vec(&records.pods)?)
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
mod tests;
