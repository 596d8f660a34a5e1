//! The node installer: puts weir's chained CNI plugin into the node's CNI configuration and keeps
//! it there, as istio-cni's install does.
//!
//! [`Installer::install`] copies the plugin binary into the host's CNI bin dir and adds weir as
//! the last plugin of the network config the runtime loads: the first file, in lexical order, of
//! the `*.conflist`/`*.conf`/`*.json` in the net dir that libcni accepts. A lone `.conf`/`.json`
//! becomes a `.conflist`. [`Installer::watch`] puts both back whenever another component (the
//! primary CNI restarting, Cilium with `cni.exclusive=true`, an admin) removes them or writes a
//! higher-priority file. [`Installer::uninstall`] takes them out again.
//!
//! Only weir's own entry is ever changed: every other field keeps its meaning, and the other
//! plugins keep their order. Key order and formatting are not kept (the file is re-serialized,
//! pretty-printed), as with istio-cni.
//!
//! With [`Placement::Owned`], the primary CNI's file is not edited: weir writes a file
//! of its own (`02-weir-cni.conflist` by default) holding the primary's config with weir appended,
//! named to sort first so the runtime loads it instead, and rewrites it whenever the primary's
//! changes. A primary CNI that rewrites its own file (on every start, for some) then cannot drop
//! weir from the chain, even while no agent runs: after a node reboot, pods start through weir-cni
//! (which fails closed for ambient pods until the agent is back) rather than around it.
//!
//! With [`Placement::Standalone`], weir-cni is not chained at all: weir writes a network config
//! of its own, named `istio-cni` (`YYY-istio-cni.conf` by default), for Multus to run as an extra
//! attachment of the pods whose `k8s.v1.cni.cncf.io/networks` name it, as istio-cni's
//! `chained: false` does on OpenShift. The plugin then gets no `prevResult` and the agent reads
//! the pod's addresses from its netns.
//!
//! In a pod, it also writes the plugin's kubeconfig (`weir-kubeconfig` in the net dir, 0600,
//! [`kubeconfig`]) from the agent's service account, names it in weir's entry, rewrites it when
//! the token rotates, and removes it on uninstall.
pub mod conflist;
pub(crate) mod files;
pub mod kubeconfig;
mod net_dir;
mod watch;

use std::{
    future::Future,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
};

use anyhow::{ensure, Context, Result};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use serde_json::Value;
use tokio::sync::watch as status_channel;
use tracing::{error, info, warn};

use self::{
    conflist::{Format, NetworkConfig, Object},
    files::FileAttrs,
    kubeconfig::KUBECONFIG_FILE,
    net_dir::{config_files, rewrite_list, to_json, wrap_into_list},
};
pub use self::{kubeconfig::ServiceAccount, net_dir::primary_config};

/// The plugin's binary name in the CNI bin dir, and its `type` in the conflist.
pub const PLUGIN_NAME: &str = "weir-cni";

/// The default name of weir's own conflist: as istio-cni's `02-istio-cni.conflist`, it sorts
/// before the `05-`, `10-` files primary CNIs write.
pub const DEFAULT_OWNED_CONFIG_FILE: &str = "02-weir-cni.conflist";

/// The default name of the standalone network config: as istio-cni's, it sorts after the configs
/// a runtime might load as the pod network.
pub const DEFAULT_STANDALONE_CONFIG_FILE: &str = "YYY-istio-cni.conf";

/// The standalone network's name: the NetworkAttachmentDefinition istio's injector names in a
/// sidecar pod's `k8s.v1.cni.cncf.io/networks` (with `pilot.cni.provider=multus`) is
/// `istio-cni`, and Multus finds the config of a definition without one by this name.
pub const STANDALONE_NETWORK_NAME: &str = "istio-cni";

/// The CNI version of the standalone config: the newest Multus runs delegates with.
const STANDALONE_CNI_VERSION: &str = "1.0.0";

/// Where weir-cni goes in the node's CNI configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Appended to the chain in the primary CNI's own file.
    #[default]
    Chained,
    /// Appended to a copy of the primary's chain, in weir's own file that sorts first.
    Owned,
    /// A network of its own, which Multus runs as an extra attachment.
    Standalone,
}

/// Where weir-cni goes, and the names of weir's own files in the net dir. Both names are known
/// in every placement, so that an install in one removes the file an earlier one in another
/// left, and the runtime never loads a config weir no longer keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CniPlacement {
    pub placement: Placement,
    /// weir's own conflist ([`Placement::Owned`]): it must sort before the primary's.
    pub owned_file: String,
    /// The standalone network config ([`Placement::Standalone`]).
    pub standalone_file: String,
}

impl Default for CniPlacement {
    fn default() -> Self {
        Self {
            placement: Placement::Chained,
            owned_file: DEFAULT_OWNED_CONFIG_FILE.into(),
            standalone_file: DEFAULT_STANDALONE_CONFIG_FILE.into(),
        }
    }
}

/// Where and what to install.
#[derive(Clone, Debug)]
pub struct InstallConfig {
    /// The host's CNI bin dir, e.g. `/opt/cni/bin`.
    pub cni_bin_dir: PathBuf,
    /// The host's CNI net dir, e.g. `/etc/cni/net.d`.
    pub cni_net_dir: PathBuf,
    /// The weir-cni binary to copy into `cni_bin_dir`.
    pub plugin_binary: PathBuf,
    /// The plugin's name: its binary's name in `cni_bin_dir` and its `type` in the conflist.
    pub plugin_name: String,
    /// Further fields of weir's conflist entry (`agent_socket`, `log_file`, ...): a JSON object,
    /// or null. The installer sets `type`, a default `name`, and the pod-annotations capability
    /// (merged into any `capabilities` given); a `cniVersion` is dropped (the list's applies).
    pub plugin_config: Value,
    /// Where weir-cni goes: the primary's chain, weir's own copy of it, or a network of its own.
    pub placement: CniPlacement,
    /// Credentials for the plugin's kubeconfig; `None` writes none (no API server, or the agent
    /// is not in a pod).
    pub service_account: Option<ServiceAccount>,
}

/// What [`Installer::install`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstallOutcome {
    /// Binary and entry were already in place; nothing was written.
    AlreadyInstalled { file: PathBuf },
    /// Something was written.
    Installed {
        /// The conflist that now holds weir's entry.
        file: PathBuf,
        /// The conflist was (re)written.
        config_changed: bool,
        /// The binary was (re)written.
        binary_changed: bool,
        /// The file that should hold weir's entry had none (or was missing).
        entry_restored: bool,
        /// weir's entry was missing from a config that had it: weir was installed on this node
        /// (its binary was in place) and another component rewrote the config meanwhile, while
        /// no agent ran.
        reinstated: bool,
    },
}

impl InstallOutcome {
    /// The conflist holding weir's entry.
    pub fn file(&self) -> &Path {
        match self {
            Self::AlreadyInstalled { file } | Self::Installed { file, .. } => file,
        }
    }
}

/// The installer's state, published through [`Installer::status`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstallStatus {
    /// weir's binary and entry were in place at the last check.
    pub installed: bool,
    /// The conflist holding weir's entry, when installed.
    pub config_file: Option<PathBuf>,
    /// How often [`Installer::watch`] had to put something back that another component removed.
    pub reinstalls: u64,
    /// How many of those were weir's entry, dropped by another component rewriting the config.
    pub config_rewrites: u64,
    /// [`Installer::watch`] is running, so a removal will be repaired.
    pub watching: bool,
}

impl InstallStatus {
    /// Installed and watched: what readiness means for istio-cni's installer.
    pub fn ready(&self) -> bool {
        self.installed && self.watching
    }
}

/// The net dir holds no network config libcni would load yet: the primary CNI has not written
/// one. Retry later (or let [`Installer::watch`] do it).
#[derive(Debug, thiserror::Error)]
#[error("no valid CNI network config in {} yet (has the primary CNI written one?)", dir.display())]
pub struct NoNetworkConfig {
    pub dir: PathBuf,
}

/// Installs weir's CNI plugin and keeps it installed. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct Installer {
    inner: Arc<Inner>,
}

struct Inner {
    config: InstallConfig,
    status: status_channel::Sender<InstallStatus>,
    metrics: Metrics,
    /// Set by the first successful install: later repairs count as reinstalls.
    ever_installed: AtomicBool,
    /// Serializes install and uninstall: each reads a file, then replaces it.
    file_lock: Mutex<()>,
}

impl Installer {
    pub fn new(config: InstallConfig) -> Self {
        let (status, _) = status_channel::channel(InstallStatus::default());
        Self {
            inner: Arc::new(Inner {
                config,
                status,
                metrics: Metrics::default(),
                ever_installed: AtomicBool::new(false),
                file_lock: Mutex::new(()),
            }),
        }
    }

    /// Copies the binary (only when its content differs), then makes weir the last plugin of the
    /// network config the runtime loads, wrapping a lone `.conf`/`.json` into a `.conflist` (the
    /// new file is written before the old one is removed, so the runtime always finds one).
    /// Idempotent: weir's entry is updated in place, moved last if it is not, never duplicated,
    /// and nothing is written when all is in place. Files that do not parse are reported and left
    /// alone. Fails with [`NoNetworkConfig`] while the net dir has no valid config.
    ///
    /// Blocking file I/O: from async code, use `spawn_blocking` (or [`Installer::watch`]).
    pub fn install(&self) -> Result<InstallOutcome> {
        self.inner.install()
    }

    /// Watches the net dir and the bin dir and re-installs (see [`Installer::install`]) whenever
    /// weir's entry or binary goes missing or stops being in the file the runtime loads; also
    /// checks every 30 s in case an event was missed. Keeps trying while the net dir has no
    /// config, so it may be started before the primary CNI is up. Runs until `shutdown` resolves;
    /// fails only if the directories cannot be watched.
    pub async fn watch(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        watch::run(self, shutdown).await
    }

    /// The installer's state, updated on every install, repair and uninstall.
    pub fn status(&self) -> status_channel::Receiver<InstallStatus> {
        self.inner.status.subscribe()
    }

    /// Removes weir's own files (see [`Placement`]), then weir's entry from
    /// every conflist in the net dir that holds one, leaving the rest of each as it was, then the
    /// binary. A conflist left with no plugin (it held only weir) is deleted, since runtimes
    /// reject an empty list. A conflist that install made out of a lone `.conf` stays a conflist
    /// (with the original plugin as its only entry, which libcni loads exactly as it loaded the
    /// `.conf`): nothing records that it was wrapped. Idempotent. Stop [`Installer::watch`]
    /// first, or it puts everything back.
    pub fn uninstall(&self) -> Result<()> {
        self.inner.uninstall()
    }

    /// Registers `istio_cni_installs_total{result}` and `istio_cni_install_ready` (istio-cni's
    /// names and meaning) and `weir_cni_config_rewrites_total`.
    pub fn register_metrics(&self, registry: &mut Registry) {
        let metrics = &self.inner.metrics;
        // prometheus-client appends `_total` to counters itself.
        registry.register(
            "istio_cni_installs",
            "Total number of CNI plugins installed by the Istio CNI installer",
            metrics.installs.clone(),
        );
        registry.register(
            "istio_cni_install_ready",
            "Whether the CNI plugin installation is ready or not",
            metrics.ready.clone(),
        );
        registry.register(
            "weir_cni_config_rewrites",
            "Times weir re-inserted its CNI plugin after another component rewrote the CNI config",
            metrics.config_rewrites.clone(),
        );
    }
}

impl Inner {
    fn install(&self) -> Result<InstallOutcome> {
        let _guard = self.file_lock.lock().unwrap_or_else(|e| e.into_inner());
        let on_node_before = self.binary_path().exists();
        let binary_changed = self
            .install_binary()
            .map_err(|e| self.install_failed(Some(RESULT_COPY_BINARIES_FAILURE), e))?;
        // Before the entry that names it. A plugin without it still decides from the verdict
        // cache, so a failure here does not hold back the entry: a chain without weir-cni lets
        // ambient pods start unredirected.
        if let Err(e) = self.install_kubeconfig() {
            self.metrics.count_install(RESULT_CREATE_KUBECONFIG_FAILURE);
            warn!("the plugin's kubeconfig is not written; retrying at the next check: {e:#}");
        }
        let (file, config_changed, entry_was_missing) = self.insert_entry().map_err(|e| {
            let waiting = e.is::<NoNetworkConfig>();
            // Waiting for the primary CNI is not a failure (istio-cni does not count it either).
            self.install_failed((!waiting).then_some(RESULT_CREATE_CNI_CONFIG_FAILURE), e)
        })?;
        let outcome = if binary_changed || config_changed {
            info!(file = %file.display(), config_changed, binary_changed, "installed weir's CNI plugin");
            InstallOutcome::Installed {
                file,
                config_changed,
                binary_changed,
                entry_restored: entry_was_missing,
                reinstated: on_node_before && entry_was_missing,
            }
        } else {
            InstallOutcome::AlreadyInstalled { file }
        };
        self.install_succeeded(&outcome);
        Ok(outcome)
    }

    fn install_binary(&self) -> Result<bool> {
        let source = &self.config.plugin_binary;
        let dest = self.binary_path();
        files::install_binary(source, &dest)
            .with_context(|| format!("copying {} to {}", source.display(), dest.display()))
    }

    /// Writes the plugin's kubeconfig when its content (the token, the CA) changed.
    fn install_kubeconfig(&self) -> Result<()> {
        let Some(account) = &self.config.service_account else {
            return Ok(());
        };
        let path = self.kubeconfig_path();
        let contents = account.kubeconfig()?;
        if kubeconfig::write(&path, &contents)
            .with_context(|| format!("writing {}", path.display()))?
        {
            info!(file = %path.display(), "wrote the plugin's kubeconfig");
        }
        Ok(())
    }

    /// Puts weir's entry last in the config the runtime loads; returns the file, whether it was
    /// written, and whether the config had no entry of weir's at all.
    fn insert_entry(&self) -> Result<(PathBuf, bool, bool)> {
        let mut entry =
            conflist::plugin_entry(&self.config.plugin_name, &self.config.plugin_config)?;
        if self.config.service_account.is_some() {
            entry.insert(
                "kubeconfig".into(),
                Value::from(self.kubeconfig_path().to_string_lossy()),
            );
        }
        if self.config.placement.placement == Placement::Standalone {
            return self.write_standalone_config(entry);
        }
        self.remove_own_file(&self.standalone_config_path(), Format::Single)?;
        let (path, config) = primary_config(&self.config.cni_net_dir, self.owned_file_name())?;
        if self.config.placement.placement == Placement::Owned {
            return self.write_owned_config(&path, config, entry);
        }
        self.remove_own_file(&self.owned_config_path(), Format::List)?;
        if config.holds_last(&entry) {
            return Ok((path, false, false));
        }
        let entry_was_missing = !config.holds_type(&self.config.plugin_name);
        if config.holds_type(conflist::ISTIO_CNI_PLUGIN_TYPE) {
            info!(
                file = %path.display(),
                "istio-cni's plugin is in the chain: weir's entry takes its place"
            );
        }
        let is_single = matches!(config, NetworkConfig::Single(_));
        let contents = to_json(&config.with_last(entry));
        let file = if is_single {
            wrap_into_list(&path, &contents)?
        } else {
            rewrite_list(&path, &contents)?;
            path
        };
        Ok((file, true, entry_was_missing))
    }

    /// Makes weir's own file the primary's config (at `primary`) with `entry` last. The primary's
    /// file is left as its CNI wrote it, except for an entry of weir's, which an install without
    /// an owned file put there.
    fn write_owned_config(
        &self,
        primary: &Path,
        config: NetworkConfig,
        entry: Object,
    ) -> Result<(PathBuf, bool, bool)> {
        let owned = self.owned_config_path();
        let primary_name = primary.file_name().unwrap_or_default();
        ensure!(
            self.owned_file_name() < primary_name.to_string_lossy().as_ref(),
            "weir's CNI config {} would not be loaded: the runtime loads the first file in lexical              order and the primary CNI's {} sorts before it; give --owned-cni-config-filename              (WEIR_OWNED_CNI_CONFIG_FILENAME) a name that sorts first, e.g. 01-weir-cni.conflist",
            owned.display(),
            primary.display(),
        );
        if let NetworkConfig::List(mut list) = config.clone() {
            self.remove_entry(primary, &mut list)?;
        }
        let contents = to_json(&config.with_last(entry));
        self.write_own_file(owned, Format::List, &contents, || {
            FileAttrs::of(primary).with_context(|| format!("reading {}", primary.display()))
        })
    }

    /// Writes the standalone network config, with `entry` as its plugin, and takes weir out of
    /// the chains and files another placement put it in. Needs no primary config: Multus's
    /// directory holds none. Refuses a name that would make it the config the runtime loads for
    /// the pod network, ahead of the files already there.
    fn write_standalone_config(&self, mut entry: Object) -> Result<(PathBuf, bool, bool)> {
        let path = self.standalone_config_path();
        self.remove_own_file(&self.owned_config_path(), Format::List)?;
        let others = config_files(&self.config.cni_net_dir)?
            .into_iter()
            .filter(|(other, _)| *other != path)
            .collect::<Vec<_>>();
        for (other, format) in &others {
            if let Ok(NetworkConfig::List(mut list)) = files::read_config(other, *format) {
                self.remove_entry(other, &mut list)?;
            }
        }
        if let Some((first, _)) = others.first() {
            ensure!(
                path.file_name() > first.file_name(),
                "weir's standalone CNI config {} would sort before {}, so a runtime reading this \
                 directory would load it as the pod network; give \
                 --standalone-cni-config-filename (WEIR_STANDALONE_CNI_CONFIG_FILENAME) a name \
                 that sorts last, e.g. {DEFAULT_STANDALONE_CONFIG_FILE}",
                path.display(),
                first.display(),
            );
        }
        entry.insert("name".into(), Value::from(STANDALONE_NETWORK_NAME));
        entry.insert("cniVersion".into(), Value::from(STANDALONE_CNI_VERSION));
        std::fs::create_dir_all(&self.config.cni_net_dir)
            .with_context(|| format!("creating {}", self.config.cni_net_dir.display()))?;
        self.write_own_file(path, Format::Single, &to_json(&entry), || {
            Ok(FileAttrs::config())
        })
    }

    /// Writes `contents` to one of weir's own files, at `path`, unless it holds them already;
    /// returns the path, whether it was written, and whether it held no entry of weir's before.
    /// `attrs` gives the mode and owner of a file that is written.
    fn write_own_file(
        &self,
        path: PathBuf,
        format: Format,
        contents: &[u8],
        attrs: impl FnOnce() -> Result<FileAttrs>,
    ) -> Result<(PathBuf, bool, bool)> {
        let previous = std::fs::read(&path).ok();
        if previous.as_deref() == Some(contents) {
            return Ok((path, false, false));
        }
        let entry_was_missing = !previous.is_some_and(|bytes| {
            NetworkConfig::parse(format, &bytes)
                .is_ok_and(|old| old.holds_type(&self.config.plugin_name))
        });
        files::write_atomically(&path, contents, &attrs()?)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok((path, true, entry_was_missing))
    }

    /// Removes one of weir's own files, when it is weir's (it holds weir's entry).
    fn remove_own_file(&self, path: &Path, format: Format) -> Result<()> {
        let is_weirs = files::read_config(path, format)
            .is_ok_and(|config| config.holds_type(&self.config.plugin_name));
        if is_weirs
            && files::remove_if_present(path)
                .with_context(|| format!("removing {}", path.display()))?
        {
            info!(file = %path.display(), "removed weir's own CNI config");
        }
        Ok(())
    }

    fn uninstall(&self) -> Result<()> {
        let _guard = self.file_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.remove_own_file(&self.owned_config_path(), Format::List)?;
        self.remove_own_file(&self.standalone_config_path(), Format::Single)?;
        for (path, format) in config_files(&self.config.cni_net_dir)? {
            match files::read_config(&path, format) {
                Ok(NetworkConfig::List(mut list)) => self.remove_entry(&path, &mut list)?,
                Ok(NetworkConfig::Single(_)) => {}
                Err(e) => error!("cannot check an invalid CNI config file for weir's entry: {e:#}"),
            }
        }
        let binary = self.binary_path();
        if files::remove_if_present(&binary)
            .with_context(|| format!("removing {}", binary.display()))?
        {
            info!(binary = %binary.display(), "removed weir's CNI plugin binary");
        }
        let kubeconfig = self.kubeconfig_path();
        if files::remove_if_present(&kubeconfig)
            .with_context(|| format!("removing {}", kubeconfig.display()))?
        {
            info!(file = %kubeconfig.display(), "removed the plugin's kubeconfig");
        }
        self.publish(|status| {
            status.installed = false;
            status.config_file = None;
        });
        Ok(())
    }

    fn remove_entry(&self, path: &Path, list: &mut Object) -> Result<()> {
        if conflist::remove_plugins(list, &self.config.plugin_name) == 0 {
            return Ok(());
        }
        if conflist::plugin_count(list) == 0 {
            files::remove_if_present(path)
                .with_context(|| format!("removing {}", path.display()))?;
            info!(file = %path.display(), "removed a CNI config that held only weir's entry");
        } else {
            rewrite_list(path, &to_json(list))?;
            info!(file = %path.display(), "removed weir's entry from the CNI config");
        }
        Ok(())
    }

    fn owned_file_name(&self) -> &str {
        &self.config.placement.owned_file
    }

    fn owned_config_path(&self) -> PathBuf {
        self.config.cni_net_dir.join(self.owned_file_name())
    }

    fn standalone_config_path(&self) -> PathBuf {
        self.config
            .cni_net_dir
            .join(&self.config.placement.standalone_file)
    }

    fn binary_path(&self) -> PathBuf {
        self.config.cni_bin_dir.join(&self.config.plugin_name)
    }

    fn kubeconfig_path(&self) -> PathBuf {
        self.config.cni_net_dir.join(KUBECONFIG_FILE)
    }

    fn install_succeeded(&self, outcome: &InstallOutcome) {
        let was_installed = self.status.borrow().installed;
        // Like istio-cni, count each time a valid install is reached, not each check.
        if !was_installed || matches!(outcome, InstallOutcome::Installed { .. }) {
            self.metrics.count_install(RESULT_SUCCESS);
        }
        self.ever_installed.store(true, Ordering::Relaxed);
        self.publish(|status| {
            status.installed = true;
            status.config_file = Some(outcome.file().to_owned());
        });
    }

    fn install_failed(&self, result: Option<&'static str>, error: anyhow::Error) -> anyhow::Error {
        if let Some(result) = result {
            self.metrics.count_install(result);
        }
        self.publish(|status| {
            status.installed = false;
            status.config_file = None;
        });
        error
    }

    /// Updates the status and the readiness gauge that mirrors it.
    fn publish(&self, update: impl FnOnce(&mut InstallStatus)) {
        self.status.send_modify(update);
        let ready = self.status.borrow().ready();
        self.metrics.ready.set(i64::from(ready));
    }
}

// The values of the `result` label of `istio_cni_installs_total`: istio-cni's.
const RESULT_SUCCESS: &str = "SUCCESS";
const RESULT_COPY_BINARIES_FAILURE: &str = "COPY_BINARIES_FAILURE";
const RESULT_CREATE_CNI_CONFIG_FAILURE: &str = "CREATE_CNI_CONFIG_FAILURE";
const RESULT_CREATE_KUBECONFIG_FAILURE: &str = "CREATE_KUBECONFIG_FAILURE";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Default)]
struct Metrics {
    installs: Family<ResultLabel, Counter>,
    ready: Gauge,
    config_rewrites: Counter,
}

impl Metrics {
    fn count_install(&self, result: &'static str) {
        self.installs.get_or_create(&ResultLabel { result }).inc();
    }
}

#[cfg(test)]
mod tests;
