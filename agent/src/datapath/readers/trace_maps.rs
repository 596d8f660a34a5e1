//! The programs' trace maps, opened from their pins by the agent's trace server: it runs on the
//! async runtime, beside the owner, and touches nothing the owner writes.
use std::path::Path;

use anyhow::{Context, Result};
use aya::maps::{Array, Map, MapData, PerCpuArray, RingBuf};
use weir_common::maps;

use crate::datapath::maps_dir;

pub struct TraceMaps {
    /// `TRACE_ON[0]`: the programs write records while it is non-zero.
    pub on: Array<MapData, u32>,
    pub events: RingBuf<MapData>,
    /// `TRACE_LOST[0]` per CPU: records the ring buffer had no room for.
    pub lost: PerCpuArray<MapData, u64>,
}

impl TraceMaps {
    /// Opens the maps pinned under `pin_root` by the datapath.
    pub fn open(pin_root: &Path) -> Result<Self> {
        let dir = maps_dir(pin_root);
        fn open<T: TryFrom<Map, Error = aya::maps::MapError>>(dir: &Path, name: &str) -> Result<T> {
            let path = dir.join(name);
            MapData::from_pin(&path)
                .and_then(Map::from_map_data)
                .and_then(T::try_from)
                .with_context(|| format!("opening {}", path.display()))
        }
        Ok(Self {
            on: open(&dir, maps::TRACE_ON)?,
            events: open(&dir, maps::TRACE_EVENTS)?,
            lost: open(&dir, maps::TRACE_LOST)?,
        })
    }
}
