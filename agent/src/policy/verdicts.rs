//! The verdict cache the plugin decides from while the agent is away: written by whichever policy
//! source the agent runs, from [`super::PolicyConfig::verdict_cache`].
use std::{
    path::{Path, PathBuf},
    sync::Mutex,
};

use anyhow::{Context, Result};
use weir_cni::protocol::VerdictCache;

use crate::root_only;

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

/// Writes the verdict cache at once, since the plugin may read it any time; root's alone, since it
/// names every ambient pod (the plugin runs as root).
fn write_verdict_cache(path: &Path, cache: &VerdictCache) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    root_only::replace_file(path, &serde_json::to_vec_pretty(cache)?)
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_rewritten_when_the_nodes_other_pods_change() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("verdicts.json");
        let writer = VerdictWriter::new(path.clone());
        let known = |pods: &[&str]| VerdictCache {
            other_pods: pods.iter().map(|pod| pod.to_string()).collect(),
            ..VerdictCache::default()
        };
        let read =
            || -> VerdictCache { serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap() };
        writer.write(known(&["plain/a"])).unwrap();
        assert_eq!(read(), known(&["plain/a"]));

        std::fs::remove_file(&path).unwrap();
        writer.write(known(&["plain/a"])).unwrap();
        assert!(!path.exists(), "an unchanged cache is not rewritten");

        writer.write(known(&["plain/a", "plain/b"])).unwrap();
        assert_eq!(read(), known(&["plain/a", "plain/b"]));
    }
}
