//! The verdict cache the plugin decides from while the agent is away: written by whichever policy
//! source the agent runs, from [`super::PolicyConfig::verdict_cache`].
use std::{
    path::{Path, PathBuf},
    sync::Mutex,
};

use anyhow::{Context, Result};
use weir_cni::protocol::VerdictCache;

/// The verdict cache the plugin falls back on, rewritten only on change, one writer at a time.
pub struct VerdictWriter {
    path: PathBuf,
    written: Mutex<Option<VerdictCache>>,
}

impl VerdictWriter {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            written: Mutex::new(None),
        }
    }

    pub fn write(&self, verdicts: VerdictCache) -> Result<()> {
        let mut written = self.written.lock().unwrap();
        if written.as_ref() != Some(&verdicts) {
            write_verdict_cache(&self.path, &verdicts)?;
            *written = Some(verdicts);
        }
        Ok(())
    }
}

/// Writes the verdict cache atomically (temp file + rename): the plugin may read it any time.
fn write_verdict_cache(path: &Path, cache: &VerdictCache) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temp = path.with_extension("tmp");
    std::fs::write(&temp, serde_json::to_vec_pretty(cache)?)?;
    std::fs::rename(&temp, path).with_context(|| format!("writing {}", path.display()))
}
