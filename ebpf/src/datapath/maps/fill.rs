//! Filling a layout being migrated from an older one (`crate::migrate`).

use aya::maps::{HashMap, MapData, PerCpuValues};

use super::{removed, MapName, Maps};
use crate::{abi::StatsValue, datapath::types::Filled, Error, Result};

impl Maps {
    /// Makes these maps (a layout being filled) say what `src` (the previous
    /// layout, same definitions) says, for the maps named in `only` (those of `src`
    /// that are other objects than these: a map pinned under both names is
    /// left alone). Every entry of each, but `cpu_map`'s (whose entries carry
    /// a program: `migrate::converge` writes them). The call can be repeated
    /// after a crash, when links may already run this layout's programs: so
    /// it never empties a map first (that was a window in which a moved link
    /// found no redirect target, and the cpumap stage drops what it cannot
    /// send): it writes `src`'s entries over these, then removes the entries
    /// `src` lacks, redirect targets added before the endpoint records and
    /// removed after them, as the writer verbs order them.
    pub(crate) fn fill_from(&mut self, src: &Maps, only: &[&str]) -> Result<Filled> {
        let copy = |name: MapName| only.contains(&name.as_str());
        let mut filled = Filled::default();
        macro_rules! replace {
            ($map:ident, $name:expr) => {
                if copy($name) {
                    replace_all(&mut self.$map, &src.$map, $name.as_str())?
                } else {
                    0
                }
            };
        }
        filled.policy_namespaces = replace!(policy_namespaces, MapName::PolicyNamespaces);
        if copy(MapName::PolicyGate) {
            self.policy_gate
                .set(0, src.policy_gate()?, 0)
                .map_err(|e| Error::map("migrating the policy gate", e))?;
        }
        let owners = src.slot_owner_list()?;
        filled.slots = owners.len();
        if copy(MapName::Counters) {
            self.fill_counters(src, &owners)?;
        }
        replace!(slot_owners, MapName::SlotOwners);
        replace!(port_slots, MapName::PortSlots);
        let tx = copy(MapName::TxPorts);
        let stale_tx: Vec<u32> = if tx {
            let want = src.tx_port_list()?;
            for &ifindex in &want {
                self.add_tx_port(ifindex)?;
                filled.tx_ports += 1;
            }
            self.tx_port_list()?
                .into_iter()
                .filter(|i| !want.contains(i))
                .collect()
        } else {
            Vec::new()
        };
        filled.nat_ports = replace!(nat_ports, MapName::NatPorts);
        filled.endpoints = replace!(endpoints4, MapName::Endpoints4);
        filled.endpoints += replace!(endpoints6, MapName::Endpoints6);
        for ifindex in stale_tx {
            self.remove_tx_port(ifindex)?;
        }
        Ok(filled)
    }

    /// Counter slots: every row of the slots `src`'s `owners` claim (and
    /// the shared slot 0) copied, those only this layout claimed zeroed.
    fn fill_counters(&mut self, src: &Maps, owners: &[(u32, u32)]) -> Result<()> {
        let op = || "migrating counters".to_string();
        let mut slots: std::collections::BTreeSet<u32> = self
            .slot_owner_list()?
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        let claimed: std::collections::BTreeSet<u32> =
            owners.iter().map(|(s, _)| *s).chain([0]).collect();
        slots.extend(claimed.iter().copied());
        let nr_cpus = aya::util::nr_cpus()
            .map_err(|(_, e)| Error::io("counting CPUs", "/sys/devices/system/cpu/possible", e))?;
        let per_slot = crate::abi::c_layout::XDPCNI_V_MAX;
        for slot in slots {
            for r in slot * per_slot..(slot + 1) * per_slot {
                let values = if claimed.contains(&slot) {
                    src.counters.get(&r, 0).map_err(|e| Error::map(op(), e))?
                } else {
                    PerCpuValues::try_from(vec![StatsValue::default(); nr_cpus]).map_err(|e| {
                        Error::Invalid {
                            what: "counters",
                            why: e.to_string(),
                        }
                    })?
                };
                self.counters
                    .set(r, values, 0)
                    .map_err(|e| Error::map(op(), e))?;
            }
        }
        Ok(())
    }
}

/// Makes hash map `dst` (named `what`) hold exactly the entries of `src`,
/// without a moment in which it holds fewer of them: `src`'s entries written
/// over `dst`'s, then those `src` lacks removed; how many.
fn replace_all<K: aya::Pod, V: aya::Pod>(
    dst: &mut HashMap<MapData, K, V>,
    src: &HashMap<MapData, K, V>,
    what: &str,
) -> Result<usize> {
    let mut n = 0;
    for kv in src.iter() {
        let (k, v) = kv.map_err(|e| Error::map(format!("migrating {what}"), e))?;
        dst.insert(k, v, 0)
            .map_err(|e| Error::map(format!("migrating an entry of {what}"), e))?;
        n += 1;
    }
    let keys: Vec<K> = dst
        .keys()
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::map(format!("listing {what}"), e))?;
    for k in keys {
        match src.get(&k, 0) {
            Ok(_) => {}
            Err(aya::maps::MapError::KeyNotFound) => {
                removed(dst.remove(&k), || format!("clearing {what}"))?;
            }
            Err(e) => return Err(Error::map(format!("reading {what}"), e)),
        }
    }
    Ok(n)
}
