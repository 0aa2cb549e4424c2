//! The endpoint cache (`epcache4`, `epcache6`; see xdpcni.h): each endpoint
//! record of `endpoints4/6` again, in the slot of its address's low bits, so
//! that the programs index an array instead of hashing. A slot is an inner
//! array of one [`EndpointCached`]; a record is replaced by swapping in a new
//! inner map (one pointer, under RCU), never written in place, so a program
//! reads the old record or the new one, never half of each.
//!
//! The hash maps stay the truth, which every reader but the programs
//! reads. Every change of a record ([`Maps::change_record`]) writes its slot
//! first (the record the writer has decided, or the slot emptied), then the
//! hash, under an exclusive `flock` of the layout directory, so that two
//! writers (the CNI plugin and the agent are separate processes) never
//! interleave. Slot first: a writer killed between the two leaves the
//! programs on its decision (a kernel-only flag or a cleared no-NAT flag in
//! force at once), never on the record it was replacing; a failed hash
//! write puts the slot back. [`Maps::refresh_cache`], run by every agent
//! start before it moves a link, rebuilds every slot from the hash. Two
//! addresses of the same slot: the first keeps it, the other is read from
//! the hash, and takes the slot when the first goes.
//!
//! A slot's change costs a grace period (the kernel's `synchronize_rcu`
//! after an update of a map of maps): one per address added, changed or
//! removed, none for a write that changes nothing; a refresh changes its
//! slots in one batch per family.

use std::{
    collections::BTreeMap,
    fs::File,
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
};

use aya::maps::{Array, ArrayOfMaps, IterableMap, MapData, MapError};

use super::Maps;
use crate::{
    abi::{
        epcache_slot, ip_of, EndpointCached, EndpointInfo, EPCACHE_SLOTS, FAMILY_IPV4, FAMILY_IPV6,
    },
    sys, Error, Result,
};

/// One family's cache: slot -> an inner map of one record.
pub(crate) type CacheMap = ArrayOfMaps<MapData, Array<MapData, EndpointCached>>;

/// The two caches and the directory whose lock serialises their writers.
pub(crate) struct EpCache {
    pub(super) v4: CacheMap,
    pub(super) v6: CacheMap,
    pub(super) dir: PathBuf,
}

/// Held while a record and its slot change: an exclusive `flock` of the
/// layout directory, released when dropped (or when the process dies).
pub(crate) struct CacheLock {
    _file: File,
}

impl CacheLock {
    fn take(dir: &Path) -> Result<Self> {
        let f = File::open(dir).map_err(|e| Error::io("opening to lock", dir, e))?;
        // SAFETY: flock on a descriptor this function owns; no memory passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(Error::io("locking", dir, std::io::Error::last_os_error()));
        }
        Ok(Self { _file: f })
    }
}

impl EpCache {
    fn map(&self, v6: bool) -> &CacheMap {
        if v6 {
            &self.v6
        } else {
            &self.v4
        }
    }

    /// What slot `slot` of a family's cache holds.
    fn get(&self, v6: bool, slot: u32) -> Result<Option<EndpointCached>> {
        let inner = match self.map(v6).get(&slot, 0) {
            Ok(inner) => inner,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                return Ok(None)
            }
            Err(e) => return Err(Error::map(format!("reading endpoint cache slot {slot}"), e)),
        };
        inner
            .get(&0, 0)
            .map(Some)
            .map_err(|e| Error::map(format!("reading endpoint cache slot {slot}"), e))
    }

    /// Makes `ip`'s slot hold its record `info`: a batch of one.
    fn put(&mut self, ip: IpAddr, info: &EndpointInfo) -> Result<()> {
        let entry = (epcache_slot(ip), EndpointCached::new(ip, *info));
        self.put_all(ip.is_ipv6(), &[entry])
    }

    /// Makes each slot of `entries` hold its record, in one batch (one
    /// grace period for all).
    fn put_all(&mut self, v6: bool, entries: &[(u32, EndpointCached)]) -> Result<()> {
        let mut inners = Vec::with_capacity(entries.len());
        for (slot, c) in entries {
            let op = || format!("caching an endpoint in slot {slot}");
            let mut inner =
                Array::<MapData, EndpointCached>::create(1, 0).map_err(|e| Error::map(op(), e))?;
            inner.set(0, *c, 0).map_err(|e| Error::map(op(), e))?;
            inners.push(inner);
        }
        let keys: Vec<u32> = entries.iter().map(|(slot, _)| *slot).collect();
        let fds: Vec<u32> = inners
            .iter()
            .map(|i| IterableMap::map(i).fd().as_fd().as_raw_fd() as u32)
            .collect();
        let pin = self.dir.join(Self::name(v6).as_str());
        let fd = sys::open_pin(&pin).map_err(|e| Error::io("opening", &pin, e))?;
        sys::map_update_batch(fd.as_fd(), &keys, &fds)
            .map_err(|e| Error::io("filling the endpoint cache", &pin, e))
    }

    fn name(v6: bool) -> super::MapName {
        if v6 {
            super::MapName::Epcache6
        } else {
            super::MapName::Epcache4
        }
    }

    /// Empties slot `slot` of a family's cache (through the pin: aya 0.14's
    /// `ArrayOfMaps` has no delete and does not lend its descriptor).
    fn clear(&mut self, v6: bool, slot: u32) -> Result<()> {
        let pin = self.dir.join(Self::name(v6).as_str());
        let fd = sys::open_pin(&pin).map_err(|e| Error::io("opening", &pin, e))?;
        sys::map_delete_index(fd.as_fd(), slot)
            .map(|_| ())
            .map_err(|e| Error::io("emptying a slot of", &pin, e))
    }
}

/// The address a slot holds, as an `IpAddr` of the family.
fn cached_ip(v6: bool, c: &EndpointCached) -> Option<IpAddr> {
    ip_of(if v6 { FAMILY_IPV6 } else { FAMILY_IPV4 }, c.addr)
}

impl Maps {
    /// Writes the record of `ip` (`want`: the record it will have; `None`:
    /// it goes) with `write`, the hash map's change, keeping its cache slot
    /// in step (module doc): the slot first, then the hash, under the lock.
    /// Replacing or emptying a slot costs the kernel a grace period
    /// (`synchronize_rcu` for maps of maps, ~14 ms on this VM), so a slot
    /// that already says `want` is not touched. If `write` fails the slot is
    /// made to say what the hash says again. Without a cache (the previous
    /// layout's maps, opened for a migration) it is `write` alone.
    pub(super) fn change_record<T>(
        &mut self,
        ip: IpAddr,
        want: Option<&EndpointInfo>,
        write: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        let Some(dir) = self.epcache.as_ref().map(|c| c.dir.clone()) else {
            return write(self);
        };
        let _lock = CacheLock::take(&dir)?;
        let emptied = self.cache_ahead(ip, want)?;
        match write(self) {
            Ok(out) => {
                if emptied {
                    self.give_slot(ip)?;
                }
                Ok(out)
            }
            Err(e) => {
                // Best effort: the slot back to the hash's word; the error
                // that matters is the write's.
                let _ = self.sync_slot(ip);
                Err(e)
            }
        }
    }

    /// Makes `ip`'s slot say `want` ahead of the hash: written if the slot
    /// is free, `ip`'s, or held by an address the hash no longer has;
    /// emptied if `ip` goes and holds it. Whether it was emptied.
    fn cache_ahead(&mut self, ip: IpAddr, want: Option<&EndpointInfo>) -> Result<bool> {
        let (v6, slot) = (ip.is_ipv6(), epcache_slot(ip));
        let Some(cache) = self.epcache.as_ref() else {
            return Ok(false);
        };
        let have = cache.get(v6, slot)?;
        let holder = have.as_ref().and_then(|c| cached_ip(v6, c));
        match want {
            None => {
                if holder == Some(ip) {
                    self.cache_mut()?.clear(v6, slot)?;
                    return Ok(true);
                }
                Ok(false)
            }
            Some(info) => {
                let entry = EndpointCached::new(ip, *info);
                if have == Some(entry) {
                    return Ok(false);
                }
                let free = match holder {
                    None => true,
                    Some(other) => other == ip || self.endpoint(other)?.is_none(),
                };
                if free {
                    self.cache_mut()?.put(ip, info)?;
                }
                Ok(false)
            }
        }
    }

    /// After `ip` left its slot: the slot to another address of the hash
    /// with the same slot, if there is one (two addresses of one slot are
    /// rare; the scan is of the family's records).
    fn give_slot(&mut self, ip: IpAddr) -> Result<()> {
        let (v6, slot) = (ip.is_ipv6(), epcache_slot(ip));
        let next = self
            .endpoints()?
            .into_iter()
            .find(|(a, _)| a.is_ipv6() == v6 && epcache_slot(*a) == slot);
        if let Some((a, info)) = next {
            self.cache_mut()?.put(a, &info)?;
        }
        Ok(())
    }

    /// Makes `ip`'s slot say what the hash says of `ip` (or of the
    /// address holding it).
    fn sync_slot(&mut self, ip: IpAddr) -> Result<()> {
        let (v6, slot) = (ip.is_ipv6(), epcache_slot(ip));
        let Some(cache) = self.epcache.as_ref() else {
            return Ok(());
        };
        let holder = cache.get(v6, slot)?.and_then(|c| cached_ip(v6, &c));
        match (holder, self.endpoint(ip)?) {
            (Some(h), _) if h != ip => Ok(()),
            (_, Some(info)) => self.cache_mut()?.put(ip, &info),
            (Some(_), None) => {
                self.cache_mut()?.clear(v6, slot)?;
                self.give_slot(ip)
            }
            (None, None) => Ok(()),
        }
    }

    fn cache_mut(&mut self) -> Result<&mut EpCache> {
        self.epcache.as_mut().ok_or(Error::Invalid {
            what: "endpoint cache",
            why: "these maps have none".into(),
        })
    }

    /// Rebuilds every slot of both caches from the hash maps (an agent
    /// starting: after a migration's fill, or a writer killed half way).
    /// A slot keeps the address it holds while the hash has it. How many
    /// slots changed.
    pub(crate) fn refresh_cache(&mut self) -> Result<usize> {
        let Some(dir) = self.epcache.as_ref().map(|c| c.dir.clone()) else {
            return Ok(0);
        };
        let _lock = CacheLock::take(&dir)?;
        let records = self.endpoints()?;
        let mut changed = 0;
        for v6 in [false, true] {
            let Some(cache) = self.epcache.as_mut() else {
                return Ok(0);
            };
            let mut have = BTreeMap::new();
            for slot in 0..EPCACHE_SLOTS {
                if let Some(c) = cache.get(v6, slot)? {
                    have.insert(slot, c);
                }
            }
            let family = || records.iter().filter(|(a, _)| a.is_ipv6() == v6);
            let mut want: BTreeMap<u32, EndpointCached> = BTreeMap::new();
            for (a, info) in family() {
                let slot = epcache_slot(*a);
                if have
                    .get(&slot)
                    .is_some_and(|c| cached_ip(v6, c) == Some(*a))
                {
                    want.insert(slot, EndpointCached::new(*a, *info));
                }
            }
            for (a, info) in family() {
                want.entry(epcache_slot(*a))
                    .or_insert_with(|| EndpointCached::new(*a, *info));
            }
            for slot in have.keys() {
                if !want.contains_key(slot) {
                    cache.clear(v6, *slot)?;
                    changed += 1;
                }
            }
            let put: Vec<(u32, EndpointCached)> = want
                .into_iter()
                .filter(|(slot, c)| have.get(slot) != Some(c))
                .collect();
            changed += put.len();
            cache.put_all(v6, &put)?;
        }
        Ok(changed)
    }

    /// What the cache holds for `ip`'s slot: the address there and its
    /// record (status, tests).
    pub fn cached(&self, ip: IpAddr) -> Result<Option<(IpAddr, EndpointInfo)>> {
        let Some(cache) = self.epcache.as_ref() else {
            return Ok(None);
        };
        let v6 = ip.is_ipv6();
        Ok(cache
            .get(v6, epcache_slot(ip))?
            .and_then(|c| cached_ip(v6, &c).map(|a| (a, c.info))))
    }
}
