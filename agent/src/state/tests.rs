//! The state file against real files: journal replay, folding, torn and unreadable lines.
use super::*;
use crate::workload::PodName;

fn workload(uid: &str) -> Workload {
    Workload {
        uid: uid.into(),
        pod: PodName::new("mesh", "app"),
        service_account: None,
        netns: "/var/run/netns/cni-1".into(),
        ips: vec!["10.1.0.5".parse().unwrap()],
        options: Default::default(),
        attachment: None,
        sidecar: None,
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
    let raw: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(raw["u1"]["status"], "enabled");
    // The pod's name as older agents wrote it: beside the uid, not nested.
    assert_eq!(
        (&raw["u1"]["namespace"], &raw["u1"]["name"]),
        (&"mesh".into(), &"app".into())
    );
    let as_older_agents_read_it: BTreeMap<String, Workload> = serde_json::from_value(raw).unwrap();
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

/// The files name every enrolled pod: root's alone, even where an earlier agent left them
/// readable by all (and a temp file of a write it was killed in).
#[test]
fn the_snapshot_and_journal_end_readable_by_root_only() {
    use std::os::unix::fs::PermissionsExt;
    let (_dir, path) = scratch_path();
    let journal = journal_path(&path);
    let readable_by_all = std::fs::Permissions::from_mode(0o644);
    for (file, contents) in [
        (&path, "{}"),
        (&journal, ""),
        (&path.with_extension("tmp"), "torn"),
    ] {
        std::fs::write(file, contents).unwrap();
        std::fs::set_permissions(file, readable_by_all.clone()).unwrap();
    }
    let state = StateFile::open(path.clone());
    state.insert(&workload("u1"), Status::Enabled).unwrap();
    let mode = |file: &Path| std::fs::metadata(file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&journal), 0o600, "the journal once appended to");
    state.save().unwrap();
    assert_eq!(mode(&path), 0o600, "the snapshot once written");
    assert_eq!(mode(&journal), 0o600, "the journal once emptied");
}
