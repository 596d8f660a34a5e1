//! File-system work: the files libcni sees, crash-safe writes, the plugin binary.
use std::{
    fs::{self, File, Permissions},
    io::{self, Read},
    os::unix::fs::{fchown, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use super::conflist::{Format, NetworkConfig};

/// The network config files of a CNI net dir, in the order libcni considers them
/// (`libcni.ConfFiles`, then sorted by name): every entry with a CNI extension that is not a
/// directory, symlinks included (reading one follows it).
pub fn config_files(dir: &Path) -> io::Result<Vec<(PathBuf, Format)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            continue;
        }
        if let Some(format) = Format::of(&entry.file_name()) {
            files.push((entry.path(), format));
        }
    }
    files.sort_by(|(a, _), (b, _)| a.cmp(b));
    Ok(files)
}

/// Reads and parses one network config file, following symlinks as libcni does.
pub fn read_config(path: &Path, format: Format) -> Result<NetworkConfig> {
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    NetworkConfig::parse(format, &bytes).with_context(|| format!("parsing {}", path.display()))
}

/// The network config files of `dir` that hold istio-cni's plugin (none where `dir` cannot be
/// read): where istio-cni's node agent installed itself.
pub fn istio_cni_configs(dir: &Path) -> Vec<PathBuf> {
    config_files(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|(file, format)| {
            read_config(file, *format)
                .is_ok_and(|config| config.holds_type(super::conflist::ISTIO_CNI_PLUGIN_TYPE))
        })
        .map(|(file, _)| file)
        .collect()
}

/// The mode and owner a written file gets.
pub struct FileAttrs {
    mode: u32,
    /// `(uid, gid)`; `None` leaves the writer's.
    owner: Option<(u32, u32)>,
}

impl FileAttrs {
    /// Those of the file at `path` (following symlinks), so a rewrite keeps them.
    pub fn of(path: &Path) -> io::Result<Self> {
        let metadata = fs::metadata(path)?;
        Ok(Self {
            mode: metadata.mode() & 0o7777,
            owner: Some((metadata.uid(), metadata.gid())),
        })
    }

    /// A credential: root's alone.
    pub fn secret() -> Self {
        Self {
            mode: 0o600,
            owner: None,
        }
    }

    /// A network config weir writes from nothing: readable by all, as CNIs write theirs.
    pub fn config() -> Self {
        Self {
            mode: 0o644,
            owner: None,
        }
    }

    /// A plugin binary: the runtime executes it, everyone may read it.
    pub fn executable() -> Self {
        Self {
            mode: 0o755,
            owner: None,
        }
    }
}

/// Replaces `path` with `contents` so that a reader (the runtime, loading its config for a pod)
/// sees the old file or the new one, never a part of one, even across a crash: a temp file in
/// the same directory (a rename is only atomic within a file system; the temp name has no CNI
/// extension, so libcni never loads it), fsynced, renamed over `path`, then the directory fsynced
/// so the rename itself is durable.
pub fn write_atomically(
    path: &Path,
    mut contents: impl io::Read,
    attrs: &FileAttrs,
) -> io::Result<()> {
    let dir = parent(path);
    let mut temp = tempfile::Builder::new()
        .prefix(".weir-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    io::copy(&mut contents, &mut temp)?;
    let file = temp.as_file();
    file.set_permissions(Permissions::from_mode(attrs.mode))?;
    if let Some((uid, gid)) = attrs.owner {
        let metadata = file.metadata()?;
        if (metadata.uid(), metadata.gid()) != (uid, gid) {
            fchown(file, Some(uid), Some(gid))?;
        }
    }
    file.sync_all()?;
    temp.persist(path).map_err(|e| e.error)?;
    File::open(dir)?.sync_all()
}

/// Makes `dest` a copy of `source` with mode 0755; returns whether anything changed. An
/// identical binary is left alone, so a running agent does not rewrite it on every check. Both
/// are streamed, never read whole: a plugin binary is megabytes, and reading it at every check
/// left that much of the agent's heap in use for good.
pub fn install_binary(source: &Path, dest: &Path) -> io::Result<bool> {
    match fs::metadata(dest) {
        Ok(current) if same_contents(source, dest)? => {
            if current.mode() & 0o7777 == 0o755 {
                return Ok(false);
            }
            fs::set_permissions(dest, Permissions::from_mode(0o755))?;
            return Ok(true);
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    write_atomically(dest, File::open(source)?, &FileAttrs::executable())?;
    Ok(true)
}

fn same_contents(a: &Path, b: &Path) -> io::Result<bool> {
    let (mut a, mut b) = (File::open(a)?, File::open(b)?);
    if a.metadata()?.len() != b.metadata()?.len() {
        return Ok(false);
    }
    let (mut chunk_a, mut chunk_b) = (vec![0; 64 * 1024], vec![0; 64 * 1024]);
    loop {
        let read = a.read(&mut chunk_a)?;
        if read == 0 {
            return Ok(true);
        }
        b.read_exact(&mut chunk_b[..read])?;
        if chunk_a[..read] != chunk_b[..read] {
            return Ok(false);
        }
    }
}

/// Removes a file (a symlink itself, not its target); returns whether it was there.
pub fn remove_if_present(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}
