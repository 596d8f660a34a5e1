//! Keeping weir installed: watching the CNI dirs, debouncing, accounting for repairs.
use std::{
    collections::VecDeque,
    future::Future,
    path::Path,
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use anyhow::{Context, Result};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::{
    sync::mpsc,
    task,
    time::{self, Instant},
};
use tracing::{error, info, warn};

use super::{
    conflist::Format, kubeconfig::KUBECONFIG_FILE, Inner, InstallConfig, InstallOutcome, Installer,
    NoNetworkConfig, Placement,
};

/// How long the dirs must stay quiet before a check: CNIs and editors write a file in several
/// steps (truncate, write, chmod; or a temp file, then a rename), and a check in between would
/// take a half-written file for an invalid one.
const DEBOUNCE: Duration = Duration::from_millis(100);
/// A check comes this long after the first event at the latest, even if events keep coming.
const DEBOUNCE_MAX: Duration = Duration::from_secs(1);
/// A check without any event, for events that never come: an inotify queue overflow, a
/// symlinked config whose target lives in a dir that is not watched.
const RESYNC_INTERVAL: Duration = Duration::from_secs(30);
/// More config rewrites than this within `REWRITE_WINDOW` mean another component is fighting
/// weir over the file.
const REWRITE_WARN_THRESHOLD: usize = 3;
const REWRITE_WINDOW: Duration = Duration::from_secs(60);

type Events = mpsc::UnboundedReceiver<notify::Result<Event>>;

pub(super) async fn run(installer: &Installer, shutdown: impl Future<Output = ()>) -> Result<()> {
    let inner = &installer.inner;
    let (sender, mut events) = mpsc::unbounded_channel();
    // Watching starts before the first check, so nothing that changes after it goes unnoticed.
    let _watcher = watch_dirs(&inner.config, sender)?;
    let _watching = Watching::start(inner);
    let mut rewrites = RewriteHistory::default();
    check(inner, &mut rewrites).await;
    let mut resync = time::interval_at(Instant::now() + RESYNC_INTERVAL, RESYNC_INTERVAL);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            event = events.recv() => {
                let event = event.context("the file watcher stopped")?;
                if is_relevant(inner, &event) {
                    settle(inner, &mut events).await;
                    check(inner, &mut rewrites).await;
                }
            }
            _ = resync.tick() => check(inner, &mut rewrites).await,
        }
    }
}

fn watch_dirs(
    config: &InstallConfig,
    sender: mpsc::UnboundedSender<notify::Result<Event>>,
) -> Result<RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |event| {
        // Fails only once `run` has returned, when nobody needs the event any more.
        let _ = sender.send(event);
    })
    .context("starting a file watcher")?;
    for dir in [&config.cni_net_dir, &config.cni_bin_dir] {
        watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .with_context(|| format!("watching {}", dir.display()))?;
    }
    Ok(watcher)
}

/// Whether an event may concern weir's entry or binary. Reads are not (weir's own checks read
/// every config), nor are files libcni ignores, weir's temp files among them.
fn is_relevant(inner: &Inner, event: &notify::Result<Event>) -> bool {
    let Ok(event) = event else {
        return true; // the watcher may have lost events
    };
    if matches!(event.kind, EventKind::Access(_)) {
        return false;
    }
    let plugin_name = inner.config.plugin_name.as_str();
    event.paths.is_empty()
        || event.paths.iter().any(|path| {
            path.file_name().is_some_and(|name| {
                name == plugin_name || name == KUBECONFIG_FILE || Format::of(name).is_some()
            })
        })
}

/// Waits for the dirs to stay quiet for `DEBOUNCE`, `DEBOUNCE_MAX` at most.
async fn settle(inner: &Inner, events: &mut Events) {
    let deadline = Instant::now() + DEBOUNCE_MAX;
    let mut quiet_until = Instant::now() + DEBOUNCE;
    while Instant::now() < deadline {
        match time::timeout_at(quiet_until.min(deadline), events.recv()).await {
            Ok(Some(event)) if is_relevant(inner, &event) => {
                quiet_until = Instant::now() + DEBOUNCE;
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return,
        }
    }
}

/// Installs what is missing, and accounts for it when it is a repair: something put back that
/// another component removed, not weir's own file following the primary CNI's changes.
async fn check(inner: &Arc<Inner>, rewrites: &mut RewriteHistory) {
    let was_installed = inner.ever_installed.load(Ordering::Relaxed);
    let installer = Arc::clone(inner);
    let outcome = match task::spawn_blocking(move || installer.install()).await {
        Ok(outcome) => outcome,
        Err(e) => {
            error!("checking weir's CNI install failed: {e}");
            return;
        }
    };
    match outcome {
        Ok(InstallOutcome::Installed {
            file,
            config_changed,
            binary_changed,
            entry_restored,
            reinstated,
        }) if reinstated
            || was_installed
                && (binary_changed
                    || entry_restored
                    || inner.config.placement.placement != Placement::Owned) =>
        {
            repaired(inner, &file, config_changed, rewrites)
        }
        Ok(_) => {}
        Err(e) if e.is::<NoNetworkConfig>() => info!("{e}; waiting"),
        Err(e) => warn!("weir's CNI plugin is not installed; retrying on the next change: {e:#}"),
    }
}

fn repaired(inner: &Inner, file: &Path, config_changed: bool, rewrites: &mut RewriteHistory) {
    inner.publish(|status| status.reinstalls += 1);
    if !config_changed {
        return; // only the binary: the install logged it
    }
    inner.metrics.config_rewrites.inc();
    inner.publish(|status| status.config_rewrites += 1);
    let recent = rewrites.record(Instant::now());
    if recent > REWRITE_WARN_THRESHOLD {
        warn!(
            "another component keeps rewriting {} ({recent} times within a minute): \
             with Cilium set cni.exclusive=false",
            file.display()
        );
    } else {
        info!(file = %file.display(), "put weir's entry back into a rewritten CNI config");
    }
}

/// Marks the installer as watching for as long as it lives.
struct Watching<'a>(&'a Inner);

impl<'a> Watching<'a> {
    fn start(inner: &'a Inner) -> Self {
        inner.publish(|status| status.watching = true);
        Self(inner)
    }
}

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        self.0.publish(|status| status.watching = false);
    }
}

/// Recent config rewrites, to tell a one-off (a CNI upgrade) from a fight.
#[derive(Default)]
struct RewriteHistory {
    recent: VecDeque<Instant>,
}

impl RewriteHistory {
    /// Records a rewrite at `now`; returns how many happened within `REWRITE_WINDOW`.
    fn record(&mut self, now: Instant) -> usize {
        while self
            .recent
            .front()
            .is_some_and(|&at| now.duration_since(at) > REWRITE_WINDOW)
        {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
        self.recent.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrite_history_counts_within_the_window() {
        let mut history = RewriteHistory::default();
        let start = Instant::now();
        assert_eq!(history.record(start), 1);
        assert_eq!(history.record(start + Duration::from_secs(30)), 2);
        assert_eq!(history.record(start + Duration::from_secs(59)), 3);
        assert_eq!(history.record(start + Duration::from_secs(61)), 3);
        assert_eq!(history.record(start + Duration::from_secs(200)), 1);
    }
}
