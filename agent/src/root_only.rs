//! What belongs to root alone: the files that name the node's pods, and the peers of the unix
//! sockets that act on them. Pods run as other users on the same node.
use std::{
    fs::{File, OpenOptions, Permissions},
    io::{self, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::Path,
};

use anyhow::{Context, Result};
use tokio::net::UnixStream;

const FILE_MODE: u32 = 0o600;

/// Replaces `path` with `contents` at once (a temp file beside it, then a rename): a reader sees
/// the old file or the new one, never part of one.
pub fn replace_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    let temp = path.with_extension("tmp");
    open(
        &temp,
        File::options().write(true).create(true).truncate(true),
    )?
    .write_all(contents)?;
    std::fs::rename(&temp, path)
}

/// Opens `path` to append to, creating it if need be.
pub fn open_append(path: &Path) -> io::Result<File> {
    open(path, File::options().append(true).create(true))
}

fn open(path: &Path, options: &mut OpenOptions) -> io::Result<File> {
    let file = options.mode(FILE_MODE).open(path)?;
    // The mode above applies only to a file this creates: one an earlier agent left (or an
    // agent killed mid-write) keeps whatever mode it had.
    file.set_permissions(Permissions::from_mode(FILE_MODE))?;
    Ok(file)
}

/// Refuses a peer that is not root. The socket file is root's already; this also refuses a
/// descriptor passed to an unprivileged process, and a socket whose permissions were loosened.
/// `what` names the connection in the refusal.
pub fn require_root_peer(stream: &UnixStream, what: &str) -> Result<()> {
    let uid = stream.peer_cred().context("peer credentials")?.uid();
    anyhow::ensure!(uid == 0, "refusing a {what} connection from uid {uid}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    /// A file an earlier agent left readable by all, and the temp file of a write it was killed
    /// in, end root's alone.
    #[test]
    fn files_end_root_only_whatever_mode_they_had() {
        let dir = tempfile::tempdir().unwrap();
        let (replaced, appended) = (dir.path().join("r.json"), dir.path().join("a.journal"));
        for path in [&replaced, &replaced.with_extension("tmp"), &appended] {
            std::fs::write(path, "old").unwrap();
            std::fs::set_permissions(path, Permissions::from_mode(0o644)).unwrap();
        }
        replace_file(&replaced, b"new").unwrap();
        open_append(&appended).unwrap().write_all(b"+").unwrap();
        assert_eq!(std::fs::read_to_string(&replaced).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(&appended).unwrap(), "old+");
        assert!(!replaced.with_extension("tmp").exists());
        for path in [&replaced, &appended] {
            assert_eq!(mode(path), FILE_MODE, "{}", path.display());
        }

        let created = dir.path().join("created.json");
        replace_file(&created, b"{}").unwrap();
        assert_eq!(mode(&created), FILE_MODE);
    }
}
