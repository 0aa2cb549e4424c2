//! The Service programs' counters, read from their pin.

use std::path::Path;

use aya::maps::{HashMap, MapData, PerCpuArray};

use super::svc_layout_dir;
use crate::{
    abi::{SvcNat, SvcNatKey, SVC_EXPIRED, SVC_LEFT, SVC_NO_BACKEND, SVC_TRANSLATED},
    Error, Result,
};

/// What the programs did with the node's pods' calls to a frontend since
/// the Service maps were made, summed over CPUs (the `svc_stats` rows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// Sent to a backend chosen at the socket.
    pub translated: u64,
    /// No ready backend: left to kube-proxy, which refuses them.
    pub no_backend: u64,
    /// Left to kube-proxy for another reason (the backend chosen is the
    /// calling pod itself, a socket record that could not be written).
    pub left: u64,
    /// Left to kube-proxy because the writer's lease had run out.
    pub expired: u64,
    /// Entries in `svc_nat` (two per north-south flow; an LRU: at its
    /// size, a new flow evicts the least recently used entry).
    pub nat_entries: u32,
    /// Its size (`max_entries`).
    pub nat_capacity: u32,
}

impl ServiceStats {
    /// Reads the pinned `svc_stats` under `pin_dir` (its own handle, so a
    /// scrape never waits for the writer); `None` where no Service maps were
    /// made.
    pub fn read_pinned(pin_dir: &Path) -> Result<Option<Self>> {
        let pin = svc_layout_dir(pin_dir).join("svc_stats");
        if !pin.exists() {
            return Ok(None);
        }
        let data = MapData::from_pin(&pin)
            .map_err(|e| Error::map(format!("opening {}", pin.display()), e))?;
        let stats: PerCpuArray<MapData, u64> =
            PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data))
                .map_err(|e| Error::map("svc_stats", e))?;
        let row = |i: u32| -> Result<u64> {
            let v = stats
                .get(&i, 0)
                .map_err(|e| Error::map(format!("reading svc_stats[{i}]"), e))?;
            Ok(v.iter().copied().fold(0u64, u64::wrapping_add))
        };
        let (nat_entries, nat_capacity) = nat_fill(pin_dir)?;
        Ok(Some(Self {
            translated: row(SVC_TRANSLATED)?,
            no_backend: row(SVC_NO_BACKEND)?,
            left: row(SVC_LEFT)?,
            expired: row(SVC_EXPIRED)?,
            nat_entries,
            nat_capacity,
        }))
    }
}

/// The north-south NAT table's entries and size, (0, 0) where it was
/// never made (an older agent's Service maps).
fn nat_fill(pin_dir: &Path) -> Result<(u32, u32)> {
    let pin = svc_layout_dir(pin_dir).join("svc_nat");
    if !pin.exists() {
        return Ok((0, 0));
    }
    let data =
        MapData::from_pin(&pin).map_err(|e| Error::map(format!("opening {}", pin.display()), e))?;
    let capacity = data
        .info()
        .map_err(|e| Error::map("svc_nat info", e))?
        .max_entries();
    let nat: HashMap<MapData, SvcNatKey, SvcNat> =
        HashMap::try_from(aya::maps::Map::LruHashMap(data))
            .map_err(|e| Error::map("svc_nat", e))?;
    let entries = nat.keys().filter(|k| k.is_ok()).count();
    Ok((u32::try_from(entries).unwrap_or(u32::MAX), capacity))
}
