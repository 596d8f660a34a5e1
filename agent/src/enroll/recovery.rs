//! Recovery at start: the pods the pinned maps still redirect taken back after an agent restart,
//! and the pods another map layout holds (an upgrade) moved into this one.
use std::sync::Arc;

use anyhow::Result;
use tracing::{info, warn, Instrument};

use super::{zds_info, Enroller};
use crate::{
    logging::pod_span,
    workload::{PodName, Status},
    zds::{WorkloadInfo, ZdsError},
};

impl Enroller {
    /// After an agent restart: the pods the pinned maps still redirect are taken back, their
    /// netns found again, and registered with the ZDS server, so ztunnel's next snapshot names
    /// them (Add with the netns, or Keep when it cannot be found). They stay pending until
    /// ztunnel acks them.
    ///
    /// One pod never stops the start: a record that cannot be read, or a pod whose netns cannot
    /// be taken back, is logged and counted, and the pod is recovered as far as it can be. It
    /// stays redirected and named to ztunnel (Keep): removing its map entries would let a pod
    /// that still runs send traffic around the mesh. The orphan sweep removes it once nothing
    /// holds its netns, and a DEL or GC does as for any pod.
    pub async fn recover(&self) -> Result<()> {
        for why in self.state.unreadable() {
            self.recovery_failures.inc();
            warn!("recovery: unreadable pod state, recovered from the maps unnamed: {why}");
        }
        let enrolled = self.datapath.enrolled().await?;
        // Known to the state file but not to these maps: enrolled by an agent with another map
        // layout (an upgrade). They are enrolled again, into this one.
        let migrate = self
            .state
            .drop_unless(|uid| enrolled.iter().any(|known| known == uid));
        for uid in enrolled {
            self.recover_pod(&uid).instrument(self.pod_span(&uid)).await;
        }
        for pod in migrate.iter().filter(|pod| pod.netns.exists()) {
            async {
                match self.enroll(pod).await {
                    Ok(_) => info!("pod moved to this agent's map layout"),
                    Err(error) => warn!("moving the pod to this map layout: {error:#}"),
                }
            }
            .instrument(pod_span(&pod.pod.namespace, &pod.pod.name, &pod.uid))
            .await;
        }
        if let Err(error) = self.datapath.retire_other_layouts().await {
            warn!("retiring older map layouts: {error:#}");
        }
        // A clean file for the next agent: without the migrated pods and what could not be read.
        if let Err(error) = self.state.save() {
            warn!("recording the recovered pods: {error:#}");
        }
        Ok(())
    }

    /// Takes back one pod the pinned maps still redirect (see [`Self::recover`]).
    async fn recover_pod(&self, uid: &str) {
        let record = self.state.get(uid);
        let netns = match self.datapath.adopt(uid, record.clone()).await {
            Ok(netns) => netns,
            Err(error) => {
                self.recovery_failures.inc();
                warn!("recovery: taking the pod's netns back failed: {error:#}");
                None
            }
        };
        if record.as_ref().is_some_and(|pod| pod.sidecar.is_some()) {
            info!(
                netns_found = netns.is_some(),
                mode = "sidecar",
                "recovered an enrolled pod"
            );
            return;
        }
        let info: WorkloadInfo = record
            .as_ref()
            .map(|pod| zds_info(&pod.pod, pod.service_account.as_deref()))
            .unwrap_or_default();
        let name = PodName::new(&info.namespace, &info.name);
        info!(netns_found = netns.is_some(), "recovered an enrolled pod");
        let handed_over = netns.is_some();
        let recorded = self.state.status(uid);
        // Without its netns the pod is only named in snapshots (Keep): not confirmed. With
        // it, a pod that was enabled stays so: still redirected, and in the snapshot the
        // next ztunnel connection gets.
        let status = match self.zds.add(uid, info, netns.map(Arc::new)).await {
            Ok(()) if handed_over => Status::Enabled,
            Err(ZdsError::NotConnected) if handed_over => recorded.unwrap_or(Status::Pending),
            _ => Status::Pending,
        };
        // The annotation already says what the record does: no write for it.
        let publish = recorded != Some(status);
        self.update_status(uid, Some((status, name)), publish).await;
    }
}
