//! The endpoint cache (`epcache4`, `epcache6`; see xdpcni.h): each endpoint
//! record of `endpoints4/6` again, in the slot of its address's low bits, so
//! that the programs index an array instead of hashing. A slot is an inner
//! array of one [`EndpointCached`]; a record is replaced by swapping in a new
//! inner map (one pointer, under RCU), never written in place, so a program
//! reads the old record or the new one, never half of each.
//!
//! The hash maps stay the truth and the cache never says more than they do:
//! every change of a record ([`Maps::change_record`]) empties its address's
//! slot first, changes the hash, then fills the slot from the hash, all
//! under an exclusive `flock` of the layout directory, so that two writers
//! (the CNI plugin and the agent are separate processes) never cache what
//! the other has just changed. A writer killed half way leaves a slot empty
//! (the programs then read the hash), never stale; [`Maps::refresh_cache`],
//! run by every agent start, rebuilds every slot from the hash. Two
//! addresses of the same slot: the first keeps it, the other is read from
//! the hash, and takes the slot when the first goes.

use std::{
    collections::BTreeMap,
    fs::File,
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
};

use aya::maps::{Array, ArrayOfMaps, MapData, MapError};

use super::Maps;
use crate::{
    abi::{epcache_slot, ip_of, EndpointCached, EndpointInfo, EPCACHE_SLOTS, FAMILY_IPV4},
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

    /// Makes slot `slot` hold `ip`'s record `info`: a new inner map, swapped in.
    fn put(&mut self, ip: IpAddr, info: &EndpointInfo) -> Result<()> {
        let slot = epcache_slot(ip);
        let op = || format!("caching endpoint {ip} in slot {slot}");
        let mut inner =
            Array::<MapData, EndpointCached>::create(1, 0).map_err(|e| Error::map(op(), e))?;
        inner
            .set(0, EndpointCached::new(ip, *info), 0)
            .map_err(|e| Error::map(op(), e))?;
        let map = if ip.is_ipv6() {
            &mut self.v6
        } else {
            &mut self.v4
        };
        map.set(slot, &inner, 0).map_err(|e| Error::map(op(), e))
    }

    /// Empties slot `slot` of a family's cache (through the pin: aya 0.14's
    /// `ArrayOfMaps` has no delete and does not lend its descriptor).
    fn clear(&mut self, v6: bool, slot: u32) -> Result<()> {
        let name = if v6 {
            super::MapName::Epcache6
        } else {
            super::MapName::Epcache4
        };
        let pin = self.dir.join(name.as_str());
        let fd = sys::open_pin(&pin).map_err(|e| Error::io("opening", &pin, e))?;
        sys::map_delete_index(fd.as_fd(), slot)
            .map(|_| ())
            .map_err(|e| Error::io("emptying a slot of", &pin, e))
    }
}

/// The address a slot holds, as an `IpAddr` of the family.
fn cached_ip(v6: bool, c: &EndpointCached) -> Option<IpAddr> {
    ip_of(if v6 { 6 } else { FAMILY_IPV4 }, c.addr)
}

impl Maps {
    /// Changes the hash record of `ip` with `change` and keeps its cache
    /// slot in step (module doc): slot emptied if it holds `ip`, `change`,
    /// slot filled from the hash (or, if `ip` is gone, given to another
    /// address of the same slot). Without a cache (an older layout opened
    /// for a migration) it is `change` alone.
    pub(super) fn change_record<T>(
        &mut self,
        ip: IpAddr,
        change: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        let Some(dir) = self.epcache.as_ref().map(|c| c.dir.clone()) else {
            return change(self);
        };
        let _lock = CacheLock::take(&dir)?;
        self.uncache(ip)?;
        let out = change(self)?;
        self.cache(ip)?;
        Ok(out)
    }

    fn uncache(&mut self, ip: IpAddr) -> Result<()> {
        let Some(cache) = self.epcache.as_mut() else {
            return Ok(());
        };
        let (v6, slot) = (ip.is_ipv6(), epcache_slot(ip));
        if cache
            .get(v6, slot)?
            .is_some_and(|c| cached_ip(v6, &c) == Some(ip))
        {
            cache.clear(v6, slot)?;
        }
        Ok(())
    }

    /// Fills `ip`'s slot from the hash: with `ip`'s record if the slot is
    /// free or holds an address the hash no longer has; with another
    /// address of the slot if `ip` has no record.
    fn cache(&mut self, ip: IpAddr) -> Result<()> {
        let (v6, slot) = (ip.is_ipv6(), epcache_slot(ip));
        let Some(cache) = self.epcache.as_ref() else {
            return Ok(());
        };
        let holder = cache.get(v6, slot)?.and_then(|c| cached_ip(v6, &c));
        if let Some(other) = holder {
            if other != ip && self.endpoint(other)?.is_some() {
                return Ok(());
            }
        }
        let record = match self.endpoint(ip)? {
            Some(info) => Some((ip, info)),
            None => self
                .endpoints()?
                .into_iter()
                .find(|(a, _)| a.is_ipv6() == v6 && epcache_slot(*a) == slot),
        };
        let Some(cache) = self.epcache.as_mut() else {
            return Ok(());
        };
        match record {
            Some((a, info)) => cache.put(a, &info),
            None if holder.is_some() => cache.clear(v6, slot),
            None => Ok(()),
        }
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
            for (slot, c) in &want {
                if have.get(slot) != Some(c) {
                    let ip = cached_ip(v6, c).ok_or(Error::Invalid {
                        what: "endpoint cache",
                        why: format!("slot {slot}: no address"),
                    })?;
                    cache.put(ip, &c.info)?;
                    changed += 1;
                }
            }
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
