//! The net dir as the runtime reads it: which config file libcni loads, and how weir's edits
//! reach that file (rewritten in place through a symlink, or a lone config wrapped into a list).
use std::{
    io,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use tracing::{error, info};

use super::{
    conflist::{Format, NetworkConfig, Object},
    files::{self, FileAttrs},
    NoNetworkConfig,
};

/// The primary CNI's network config in the net dir `dir`: what the runtime would load without
/// weir's own file (named `owned_file`), as libcni picks it: the first file in lexical order that
/// parses. Fails with [`NoNetworkConfig`] while there is none.
pub fn primary_config(dir: &Path, owned_file: &str) -> Result<(PathBuf, NetworkConfig)> {
    for (path, format) in config_files(dir)? {
        if path.file_name().is_some_and(|name| name == owned_file) {
            continue;
        }
        match files::read_config(&path, format) {
            Ok(config) => return Ok((path, config)),
            // The runtime does not load this file either; it is its owner's to fix, so
            // weir leaves it as it is.
            Err(e) => error!("skipping an invalid CNI config file: {e:#}"),
        }
    }
    Err(NoNetworkConfig {
        dir: dir.to_owned(),
    }
    .into())
}

/// The net dir's config files; none while the dir does not exist (the primary CNI, or the
/// kubelet's hostPath mount, creates it).
pub(super) fn config_files(dir: &Path) -> Result<Vec<(PathBuf, Format)>> {
    match files::config_files(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        listed => listed.with_context(|| format!("listing {}", dir.display())),
    }
}

/// Rewrites a conflist in place. A symlink is followed, as libcni follows it to read, so the link
/// stays and its target gets the change; the target's mode and owner are kept.
pub(super) fn rewrite_list(path: &Path, contents: &[u8]) -> Result<()> {
    let target = path
        .canonicalize()
        .with_context(|| format!("resolving {}", path.display()))?;
    let attrs = FileAttrs::of(&target).with_context(|| format!("reading {}", target.display()))?;
    files::write_atomically(&target, contents, &attrs)
        .with_context(|| format!("writing {}", target.display()))
}

/// Turns the lone plugin config at `path` into `<stem>.conflist` holding `contents`, with its
/// mode and owner, and returns the new path. The new file is written before the old one goes, so
/// the runtime always finds a config: `x.conf` sorts before `x.conflist`, so until it goes the
/// runtime keeps loading it; `x.conflist` sorts before `x.json`, so it takes over at once. A
/// symlinked `.conf` is replaced by a regular `.conflist` (the link's target is not touched).
pub(super) fn wrap_into_list(path: &Path, contents: &[u8]) -> Result<PathBuf> {
    let list_path = path.with_extension("conflist");
    if list_path.exists() {
        // Shadowed by `path` until now, so no runtime was loading it: typically weir's own
        // earlier wrap, from before the primary CNI wrote its `.conf` again.
        info!(file = %list_path.display(), "replacing a CNI config shadowed by {}", path.display());
    }
    let attrs = FileAttrs::of(path).with_context(|| format!("reading {}", path.display()))?;
    files::write_atomically(&list_path, contents, &attrs)
        .with_context(|| format!("writing {}", list_path.display()))?;
    files::remove_if_present(path).with_context(|| format!("removing {}", path.display()))?;
    info!(from = %path.display(), to = %list_path.display(), "wrapped a lone CNI config into a conflist");
    Ok(list_path)
}

/// A config file's content: pretty-printed (as CNIs write them) with a final newline.
pub(super) fn to_json(list: &Object) -> Vec<u8> {
    let mut json = serde_json::to_vec_pretty(list).expect("a JSON object always serializes");
    json.push(b'\n');
    json
}
