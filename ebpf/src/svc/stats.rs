//! The Service programs' counters, read from their pin.

use std::path::Path;

use aya::maps::{HashMap, MapData, PerCpuArray};

use super::svc_layout_dir;
use crate::{
    abi::{
        SvcNat, SvcNatKey, NAT_MADE, NAT_NO_TUPLE, SVC_EXPIRED, SVC_LEFT, SVC_NO_BACKEND,
        SVC_TRANSLATED,
    },
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
    /// Entries the programs made in it (`svc_nat_stats`).
    pub nat_made: u64,
    /// Entries evicted from it: those made less those in it (the programs
    /// remove none of their own). Read made first, then the entries, so a
    /// flow made meanwhile makes it lower for a moment, never higher: a
    /// counter keeps the highest it saw.
    pub nat_evictions: u64,
    /// New north-south flows left to kube-proxy because no reply tuple
    /// was free.
    pub nat_no_tuple: u64,
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
        let (nat_made, nat_no_tuple) =
            (nat_row(pin_dir, NAT_MADE)?, nat_row(pin_dir, NAT_NO_TUPLE)?);
        let (nat_entries, nat_capacity) = nat_fill(pin_dir)?;
        Ok(Some(Self {
            translated: row(SVC_TRANSLATED)?,
            no_backend: row(SVC_NO_BACKEND)?,
            left: row(SVC_LEFT)?,
            expired: row(SVC_EXPIRED)?,
            nat_entries,
            nat_capacity,
            nat_made,
            nat_evictions: nat_made.saturating_sub(u64::from(nat_entries)),
            nat_no_tuple,
        }))
    }
}

/// The smallest north-south NAT table [`make_nat_table`] makes.
pub const MIN_SVC_NAT: u32 = 1024;
/// The largest (16 Mi entries: about 2 GiB of kernel memory).
pub const MAX_SVC_NAT_CAPACITY: u32 = 1 << 24;
/// `BPF_MAP_TYPE_LRU_HASH`.
const LRU_HASH: u32 = 9;

/// Makes the north-south NAT table (`svc_nat`) with `capacity` entries in
/// the Service layout under `pin_dir`, before either object that uses it
/// is loaded (both reuse the pin, by name). A table made already keeps its
/// size (its flows with it): its size is returned, for the caller to say
/// when it is not `capacity`.
pub fn make_nat_table(pin_dir: &Path, capacity: u32) -> Result<u32> {
    crate::bpffs::ensure_bpffs(pin_dir)?;
    let dir = svc_layout_dir(pin_dir);
    let pin = dir.join("svc_nat");
    if pin.exists() {
        let data = MapData::from_pin(&pin)
            .map_err(|e| Error::map(format!("opening {}", pin.display()), e))?;
        return Ok(data
            .info()
            .map_err(|e| Error::map("svc_nat info", e))?
            .max_entries());
    }
    if !(MIN_SVC_NAT..=MAX_SVC_NAT_CAPACITY).contains(&capacity) {
        return Err(Error::Invalid {
            what: "the north-south NAT table's size",
            why: format!("{capacity} is outside {MIN_SVC_NAT}..={MAX_SVC_NAT_CAPACITY}"),
        });
    }
    super::make_layout_dir(&dir)?;
    let shape = crate::sys::MapShape {
        map_type: LRU_HASH,
        key_size: u32::try_from(std::mem::size_of::<SvcNatKey>()).unwrap_or(u32::MAX),
        value_size: u32::try_from(std::mem::size_of::<SvcNat>()).unwrap_or(u32::MAX),
        max_entries: capacity,
    };
    crate::sys::create_pinned_map(&pin, "svc_nat", shape)
        .map_err(|e| Error::io("making the NAT table", &pin, e))?;
    Ok(capacity)
}

/// Row `row` of `svc_nat_stats` summed over CPUs, 0 where it was never
/// made (an older agent's Service maps).
fn nat_row(pin_dir: &Path, row: u32) -> Result<u64> {
    let pin = svc_layout_dir(pin_dir).join("svc_nat_stats");
    if !pin.exists() {
        return Ok(0);
    }
    let data =
        MapData::from_pin(&pin).map_err(|e| Error::map(format!("opening {}", pin.display()), e))?;
    let stats: PerCpuArray<MapData, u64> = PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data))
        .map_err(|e| Error::map("svc_nat_stats", e))?;
    let v = stats
        .get(&row, 0)
        .map_err(|e| Error::map(format!("reading svc_nat_stats[{row}]"), e))?;
    Ok(v.iter().copied().fold(0u64, u64::wrapping_add))
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
