//! Unenrolling the pods nobody took out: CNI GC (attachments the runtime no longer lists) and
//! the periodic orphan sweep (pods whose DEL never came). Both keep a pod whose netns could be
//! held where the agent cannot look.
use std::{collections::HashSet, sync::Arc, time::Duration};

use anyhow::{bail, Result};
use tracing::{info, warn, Instrument};
use weir_cni::protocol::Attachment;

use super::Enroller;
use crate::workload::Workload;

impl Enroller {
    /// CNI GC: unenrolls every pod enrolled through an attachment the runtime no longer lists
    /// and whose netns nothing holds any more: a runtime's list alone never takes a live pod's
    /// capture away.
    /// A pod enrolled without one (live, or recorded by an older agent) is not the runtime's to
    /// judge and stays; the orphan sweep covers it. Each pod is decided in its turn from its
    /// current record, so one re-added meanwhile under a new container stays. A failing pod
    /// does not stop the others; every failure is reported.
    pub async fn collect_garbage(&self, valid: &[Attachment]) -> Result<usize> {
        let valid: HashSet<&Attachment> = valid.iter().collect();
        let stale = |pod: &Workload| {
            pod.attachment
                .as_ref()
                .is_some_and(|attachment| !valid.contains(attachment))
        };
        let candidates: Vec<String> = self
            .state
            .workloads()
            .into_iter()
            .filter(|pod| stale(pod))
            .map(|pod| pod.uid)
            .collect();
        let mut removed = 0;
        let mut failures = Vec::new();
        for uid in candidates {
            let span = self.pod_span(&uid);
            let outcome = self
                .in_turn(&uid, async {
                    match self.state.get(&uid) {
                        Some(pod) if stale(&pod) => {
                            if !self.certainly_orphaned(&uid).await? {
                                info!(
                                    "GC: the runtime no longer lists the pod's attachment, but \
                                     its netns is still held: kept"
                                );
                                return Ok(false);
                            }
                            self.unenroll(&uid).await.map(|_| true)
                        }
                        _ => Ok(false),
                    }
                })
                .instrument(span.clone())
                .await;
            match outcome {
                Ok(true) => {
                    removed += 1;
                    span.in_scope(|| {
                        info!("GC: the runtime no longer has the pod's attachment: unenrolled")
                    });
                }
                Ok(false) => {}
                Err(error) => failures.push(format!("{uid}: {error:#}")),
            }
        }
        if !failures.is_empty() {
            bail!(
                "{} stale pods could not be unenrolled: {}",
                failures.len(),
                failures.join("; ")
            );
        }
        Ok(removed)
    }

    /// Every `interval`, unenrolls the pods whose DEL never came: nothing but weir and ztunnel
    /// holds their netns (see [`crate::datapath::Datapath::orphaned`]).
    pub async fn sweep_orphans(self: Arc<Self>, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            if let Err(error) = self.sweep_orphans_once().await {
                warn!("orphan sweep: {error:#}");
            }
        }
    }

    async fn sweep_orphans_once(&self) -> Result<()> {
        let candidates = self.datapath.orphaned(None).await?;
        if let Some(unsure) = candidates.unsure {
            self.orphans_kept.inc_by(candidates.pods.len() as u64);
            if !candidates.pods.is_empty() {
                warn!(
                    pods = ?candidates.pods,
                    "orphan sweep: not every namespace holder could be inspected ({unsure}): \
                     kept"
                );
            }
            return Ok(());
        }
        for uid in candidates.pods {
            let span = self.pod_span(&uid);
            // Checked again in the pod's turn: an ADD meanwhile (a new sandbox for the same
            // pod) holds a new netns, and that pod must stay.
            let removed = self
                .in_turn(&uid, async {
                    if !self.certainly_orphaned(&uid).await? {
                        return Ok(false);
                    }
                    self.unenroll(&uid).await
                })
                .instrument(span.clone())
                .await;
            span.in_scope(|| match removed {
                Ok(true) => {
                    self.orphans_removed.inc();
                    info!("orphan sweep: nothing holds the pod's netns: unenrolled");
                }
                Ok(false) => {}
                Err(error) => warn!("orphan sweep: unenrolling: {error:#}"),
            });
        }
        Ok(())
    }

    /// Whether nothing but weir and ztunnel holds the pod's netns, as far as every holder could
    /// be inspected; a pod that could be held where the agent cannot look counts as kept.
    async fn certainly_orphaned(&self, uid: &str) -> Result<bool> {
        let orphans = self.datapath.orphaned(Some(uid.to_owned())).await?;
        let looks_orphaned = !orphans.pods.is_empty();
        if let (true, Some(unsure)) = (looks_orphaned, &orphans.unsure) {
            self.orphans_kept.inc();
            warn!("not every namespace holder could be inspected ({unsure}): the pod is kept");
            return Ok(false);
        }
        Ok(looks_orphaned)
    }
}
