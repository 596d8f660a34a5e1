//! Each enrolled pod's slot: a small number, unique on the node, that weir's tc filters on the
//! pod's interfaces carry as their classid. The inbound program reads it (`skb->tc_classid`) and
//! finds the pod in `POD_SLOTS`, so it knows whose interface a packet arrived on without going by
//! the packet's destination, which a pod can make any address.
use std::collections::{BTreeSet, HashMap as StdHashMap};

use anyhow::{Context, Result};
use aya::{
    maps::{HashMap, MapData},
    Ebpf,
};
use tracing::debug;
use weir_common::{maps, PodConfig, MAX_POD_SLOT};

use crate::datapath::kernel::programs;

/// The pinned `POD_SLOTS` map and, by netns cookie, the slots it gives.
pub(in crate::datapath) struct PodSlots {
    map: HashMap<MapData, u32, u64>,
    by_netns: StdHashMap<u64, u32>,
    free: FreeSlots,
}

impl PodSlots {
    /// Takes the map, and the slots an earlier agent gave the pods still enrolled: the filters
    /// in their netns carry them. A slot whose pod is not in `pods_map` is an earlier agent's
    /// that stopped between the two writes: freed.
    pub(in crate::datapath) fn take(
        ebpf: &mut Ebpf,
        pods_map: &HashMap<MapData, u64, PodConfig>,
    ) -> Result<Self> {
        let mut map: HashMap<MapData, u32, u64> = programs::take_map(ebpf, maps::POD_SLOTS)?;
        let entries: Vec<(u32, u64)> = map.iter().filter_map(|entry| entry.ok()).collect();
        let mut by_netns = StdHashMap::new();
        for (slot, netns_cookie) in entries {
            if pods_map.get(&netns_cookie, 0).is_ok() {
                by_netns.insert(netns_cookie, slot);
            } else {
                debug!(
                    slot,
                    netns_cookie, "freeing the slot of a pod no longer enrolled"
                );
                let _ = map.remove(&slot);
            }
        }
        let free = FreeSlots::besides(by_netns.values().copied());
        Ok(Self {
            map,
            by_netns,
            free,
        })
    }

    /// The slot of the pod in netns `netns_cookie`: the one it has, or the lowest free one,
    /// written to the map before it is returned (so before any filter carries it).
    pub(in crate::datapath) fn slot_of(&mut self, netns_cookie: u64) -> Result<u32> {
        if let Some(slot) = self.slot(netns_cookie) {
            return Ok(slot);
        }
        let slot = self
            .free
            .lowest()
            .with_context(|| format!("every pod slot ({MAX_POD_SLOT}) is taken"))?;
        self.map
            .insert(slot, netns_cookie, 0)
            .context("writing the pod's slot")?;
        self.free.take(slot);
        self.by_netns.insert(netns_cookie, slot);
        Ok(slot)
    }

    /// The slot the pod in netns `netns_cookie` has, if any.
    pub(in crate::datapath) fn slot(&self, netns_cookie: u64) -> Option<u32> {
        self.by_netns.get(&netns_cookie).copied()
    }

    /// Frees the slot of the pod in netns `netns_cookie`, if it has one.
    pub(super) fn free(&mut self, netns_cookie: u64) {
        if let Some(slot) = self.by_netns.remove(&netns_cookie) {
            let _ = self.map.remove(&slot);
            self.free.give_back(slot);
        }
    }
}

/// The free slots, 1 to [`MAX_POD_SLOT`], lowest first: a node's slots stay as few as its pods.
#[derive(Debug, Default)]
struct FreeSlots {
    /// Free slots below `highest`.
    below: BTreeSet<u32>,
    /// The highest slot taken.
    highest: u32,
}

impl FreeSlots {
    /// Every slot free but `taken`.
    fn besides(taken: impl Iterator<Item = u32>) -> Self {
        let taken: BTreeSet<u32> = taken.collect();
        let highest = taken.last().copied().unwrap_or(0);
        Self {
            below: (1..highest).filter(|slot| !taken.contains(slot)).collect(),
            highest,
        }
    }

    /// The lowest free slot, if any is left.
    fn lowest(&self) -> Option<u32> {
        self.below
            .first()
            .copied()
            .or((self.highest < MAX_POD_SLOT).then_some(self.highest + 1))
    }

    fn take(&mut self, slot: u32) {
        self.below.remove(&slot);
        for free in self.highest + 1..slot {
            self.below.insert(free);
        }
        self.highest = self.highest.max(slot);
    }

    fn give_back(&mut self, slot: u32) {
        if slot == self.highest {
            self.highest -= 1;
            while self.below.remove(&self.highest) {
                self.highest -= 1;
            }
        } else {
            self.below.insert(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take_lowest(free: &mut FreeSlots) -> u32 {
        let slot = free.lowest().unwrap();
        free.take(slot);
        slot
    }

    #[test]
    fn slots_are_given_lowest_first_and_reused() {
        let mut free = FreeSlots::default();
        assert_eq!([1, 2, 3].map(|_| take_lowest(&mut free)), [1, 2, 3]);
        free.give_back(2);
        assert_eq!(take_lowest(&mut free), 2);
        free.give_back(3);
        free.give_back(2);
        assert_eq!(free.highest, 1);
        assert!(free.below.is_empty());
        assert_eq!(take_lowest(&mut free), 2);
    }

    #[test]
    fn an_earlier_agents_slots_stay_taken() {
        let mut free = FreeSlots::besides([5, 2].into_iter());
        assert_eq!([1, 3, 4, 6].map(|_| take_lowest(&mut free)), [1, 3, 4, 6]);
    }

    #[test]
    fn no_slot_past_the_last() {
        let mut free = FreeSlots::besides([MAX_POD_SLOT - 1].into_iter());
        assert_eq!(take_lowest(&mut free), 1);
        free.give_back(1);
        free.take(MAX_POD_SLOT);
        assert_eq!(free.below.len() as u32, MAX_POD_SLOT - 2);
        for _ in 0..MAX_POD_SLOT - 2 {
            take_lowest(&mut free);
        }
        assert_eq!(free.lowest(), None);
    }
}
