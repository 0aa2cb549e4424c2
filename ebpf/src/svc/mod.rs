//! Services at the socket: the programs of `services.bpf.c`, loaded with
//! their maps pinned under `svc-layout-<N>` beside the datapath's layouts,
//! attached to a cgroup v2 directory, and the writes that keep the maps.
//!
//! Order of the writes, so a program never reads half a change: a new or
//! grown service gets its backends, then its slots, then its frontend (the
//! count that makes the new slots choosable); a shrunk or removed one loses
//! its frontend's count first, then the slots and backends past it.

mod cgroup;
mod plan;
mod scope;
mod stats;

pub use cgroup::cgroup2_root;
pub use scope::SourceRanges;
pub use stats::{make_nat_table, ServiceStats, MAX_SVC_NAT_CAPACITY, MIN_SVC_NAT};

pub use plan::{plan, Ids, Op, Want};

use std::{
    collections::BTreeMap,
    fs,
    os::fd::AsFd,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use aya::{
    maps::{HashMap, MapData},
    programs::{links::CgroupAttachMode, CgroupSockAddr},
    Ebpf, EbpfLoader,
};

use crate::{
    abi::{
        SvcAddr, SvcRevnatKey, SvcSlotKey, SvcValue, MAX_SERVICES, MAX_SVC_BACKENDS, SVC_LAYOUT,
    },
    datapath::maps::{is_full, removed},
    Error, Result,
};

/// `IPPROTO_UDP`.
const IPPROTO_UDP: u8 = 17;

/// The compiled Service programs (BPF ELF with BTF), as built by `build.rs`.
pub static SERVICES_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/services.bpf.o"));

/// The programs, each on its cgroup hook (the section names of services.bpf.c).
pub const SOCK_PROGRAMS: [&str; 8] = [
    "xdpcni_connect4",
    "xdpcni_connect6",
    "xdpcni_sendmsg4",
    "xdpcni_sendmsg6",
    "xdpcni_recvmsg4",
    "xdpcni_recvmsg6",
    "xdpcni_getpeername4",
    "xdpcni_getpeername6",
];

/// How long the writer vouches for the maps at each renewal: past it
/// (a writer gone that long, or rolled back to a release without these
/// programs) nothing new is translated and kube-proxy decides.
pub const SVC_LEASE_SECS: u32 = 60;

/// The Service maps' directory under a pin directory.
pub fn svc_layout_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("svc-layout-{SVC_LAYOUT}"))
}

/// CLOCK_MONOTONIC in nanoseconds: the programs' bpf_ktime_get_ns().
pub fn monotonic_ns() -> Result<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer for the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return Err(Error::io(
            "reading",
            Path::new("CLOCK_MONOTONIC"),
            std::io::Error::last_os_error(),
        ));
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    Ok(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
}

/// One service as the programs choose for it: its frontend, its id, and its
/// ready backends, each with its backend id (unique to this service).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceEntry {
    /// Address, port and protocol clients name.
    pub frontend: SvcAddr,
    /// Its id (keys its slots).
    pub id: u32,
    /// `SVC_AFFINITY` or 0.
    pub flags: u32,
    /// Seconds of ClientIP affinity.
    pub affinity_timeout: u32,
    /// (backend id, backend), in slot order.
    pub backends: Vec<(u32, SvcAddr)>,
}

/// The Service layout's directory `dir` made, root's alone.
pub(crate) fn make_layout_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| Error::io("restricting", dir, e))
}

/// The loaded programs and their pinned maps.
pub struct Services {
    ebpf: Ebpf,
}

impl Services {
    /// Loads the Service programs, their maps pinned in (or reused from)
    /// `svc-layout-<N>` under `pin_dir`.
    pub fn open(pin_dir: &Path) -> Result<Self> {
        let dir = svc_layout_dir(pin_dir);
        make_layout_dir(&dir)?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&dir)
            .load(SERVICES_OBJECT)
            .map_err(Box::new)?;
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = program(&mut ebpf, name)?;
            prog.load()
                .map_err(|e| Error::program(format!("loading {name}"), e))?;
        }
        Ok(Self { ebpf })
    }

    /// Attaches every program to the cgroup v2 directory `cgroup`, beside
    /// any program already there. They stay attached while `self` lives.
    /// (aya attaches through a bpf_link on this kernel, and a cgroup link is
    /// always attached as one of many: the mode must be `Single`, flags 0;
    /// `AllowMultiple` makes link_create fail with EINVAL.)
    pub fn attach(&mut self, cgroup: &Path) -> Result<()> {
        let dir = fs::File::open(cgroup).map_err(|e| Error::io("opening", cgroup, e))?;
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = program(&mut self.ebpf, name)?;
            prog.attach(&dir, CgroupAttachMode::Single).map_err(|e| {
                Error::program(format!("attaching {name} to {}", cgroup.display()), e)
            })?;
        }
        Ok(())
    }

    /// Attaches every program to `cgroup` through links pinned under
    /// `svc-layout-<N>/links`, so that translation goes on while no agent
    /// runs; where a link is pinned already (an agent restart, an upgrade)
    /// it is moved to this build's program at once (BPF_LINK_UPDATE), with
    /// no moment without a program.
    pub fn attach_pinned(&mut self, pin_dir: &Path, cgroup: &Path) -> Result<()> {
        let links = svc_layout_dir(pin_dir).join("links");
        fs::create_dir_all(&links).map_err(|e| Error::io("creating", &links, e))?;
        let dir = fs::File::open(cgroup).map_err(|e| Error::io("opening", cgroup, e))?;
        for name in SOCK_PROGRAMS {
            let pin = links.join(name);
            let prog: &mut CgroupSockAddr = program(&mut self.ebpf, name)?;
            if pin.exists() {
                let fd = prog
                    .fd()
                    .map_err(|e| Error::program(format!("the fd of {name}"), e))?;
                crate::sys::update_pinned_link(&pin, fd.as_fd())
                    .map_err(|e| Error::io("moving the link", &pin, e))?;
                continue;
            }
            let id = prog.attach(&dir, CgroupAttachMode::Single).map_err(|e| {
                Error::program(format!("attaching {name} to {}", cgroup.display()), e)
            })?;
            let link = prog
                .take_link(id)
                .map_err(|e| Error::program(format!("taking the link of {name}"), e))?;
            crate::datapath::links::pin_link(link, &pin, "making a cgroup link pinnable")?;
        }
        Ok(())
    }

    /// Detaches the pinned links (uninstall): no socket is translated from
    /// then on. True if any was there.
    pub fn detach_pinned(pin_dir: &Path) -> Result<bool> {
        let links = svc_layout_dir(pin_dir).join("links");
        let mut any = false;
        for name in SOCK_PROGRAMS {
            let pin = links.join(name);
            if pin.exists() {
                crate::sys::detach_pinned_link(&pin)
                    .map_err(|e| Error::io("detaching the link", &pin, e))?;
                fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
                any = true;
            }
        }
        Ok(any)
    }

    /// Vouches for the maps for `secs` seconds from now: until then the
    /// programs translate (`svc_lease`); 0 stops them at once. The writer
    /// renews it well before it runs out.
    pub fn renew_lease(&mut self, secs: u32) -> Result<()> {
        let until = if secs == 0 {
            0
        } else {
            monotonic_ns()?.saturating_add(u64::from(secs) * 1_000_000_000)
        };
        let m = self.ebpf.map_mut("svc_lease").ok_or(Error::Missing {
            kind: "map",
            name: "svc_lease",
        })?;
        let mut lease: aya::maps::Array<&mut MapData, u64> =
            aya::maps::Array::try_from(m).map_err(|e| Error::map("opening svc_lease", e))?;
        lease
            .set(0, until, 0)
            .map_err(|e| Error::map("writing svc_lease", e))
    }

    /// Writes one service: its backends, then its slots, then its frontend
    /// (see the module's note on order). `old` is what was written for it
    /// before, if anything: slots and backends it no longer has are removed
    /// after the frontend stops naming them.
    pub fn set_service(&mut self, s: &ServiceEntry, old: Option<&ServiceEntry>) -> Result<()> {
        let count = u32::try_from(s.backends.len()).unwrap_or(u32::MAX);
        if count > crate::abi::SVC_MAX_CHOICES {
            return Err(Error::Invalid {
                what: "service",
                why: format!(
                    "{count} backends, more than the {} one service chooses among",
                    crate::abi::SVC_MAX_CHOICES
                ),
            });
        }
        let shrinks = old.is_some_and(|o| o.backends.len() > s.backends.len());
        let value = SvcValue {
            id: s.id,
            count,
            flags: s.flags,
            affinity_timeout: s.affinity_timeout,
        };
        if shrinks {
            // The smaller count first: no connect picks a slot about to go.
            self.write_frontend(s.frontend, value)?;
        }
        {
            let mut backends: HashMap<&mut MapData, u32, SvcAddr> =
                map(&mut self.ebpf, "svc_backends")?;
            for (bid, b) in &s.backends {
                backends.insert(*bid, *b, 0).map_err(|e| {
                    full_or(
                        e,
                        "svc_backends",
                        MAX_SVC_BACKENDS,
                        format!("adding backend {bid}"),
                    )
                })?;
            }
        }
        {
            let mut slots: HashMap<&mut MapData, SvcSlotKey, u32> =
                map(&mut self.ebpf, "svc_slots")?;
            for (index, (bid, _)) in (0u32..).zip(&s.backends) {
                let key = SvcSlotKey { id: s.id, index };
                slots.insert(key, *bid, 0).map_err(|e| {
                    full_or(
                        e,
                        "svc_slots",
                        MAX_SVC_BACKENDS,
                        format!("adding slot {index}"),
                    )
                })?;
            }
        }
        if !shrinks {
            self.write_frontend(s.frontend, value)?;
        }
        if let Some(old) = old {
            self.drop_rest(old, s)?;
        }
        Ok(())
    }

    /// What the maps hold, read back (an agent that restarts keeps every
    /// id: the sockets' records name them). Only a frontend's first `count`
    /// slots count; anything else is an orphan [`Services::sync`] removes.
    pub fn written(&mut self) -> Result<BTreeMap<SvcAddr, ServiceEntry>> {
        let fronts: Vec<(SvcAddr, SvcValue)> = {
            let m: HashMap<&mut MapData, SvcAddr, SvcValue> = map(&mut self.ebpf, "services")?;
            m.iter()
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| Error::map("reading services", e))?
        };
        let slots: HashMap<&MapData, SvcSlotKey, u32> = map_ref(&self.ebpf, "svc_slots")?;
        let backends: HashMap<&MapData, u32, SvcAddr> = map_ref(&self.ebpf, "svc_backends")?;
        let mut out = BTreeMap::new();
        for (frontend, v) in fronts {
            let mut list = Vec::new();
            for index in 0..v.count {
                // A slot or backend missing (a writer stopped half-way) ends
                // the list: the entry then differs from any want, and the
                // next sync writes it whole.
                let key = SvcSlotKey { id: v.id, index };
                let Some(bid) = found(slots.get(&key, 0), || {
                    format!("reading slot {index} of {}", v.id)
                })?
                else {
                    break;
                };
                let Some(b) = found(backends.get(&bid, 0), || format!("reading backend {bid}"))?
                else {
                    break;
                };
                list.push((bid, b));
            }
            out.insert(
                frontend,
                ServiceEntry {
                    frontend,
                    id: v.id,
                    flags: v.flags,
                    affinity_timeout: v.affinity_timeout,
                    backends: list,
                },
            );
        }
        Ok(out)
    }

    /// Makes the maps hold `want` (frontend -> what it chooses among): the
    /// writes [`plan`] gives, then the slots and backends nothing names
    /// (left by a writer that stopped half-way). Returns the number of
    /// writes.
    pub fn sync(&mut self, want: &BTreeMap<SvcAddr, Want>) -> Result<usize> {
        self.sync_gone(want).map(|(writes, _)| writes)
    }

    /// [`Services::sync`], also returning each UDP (frontend, backend) pair
    /// the maps held before and no longer hold: the backends whose
    /// connected sockets must be closed, as kube-proxy deletes their
    /// conntrack entries.
    pub fn sync_gone(
        &mut self,
        want: &BTreeMap<SvcAddr, Want>,
    ) -> Result<(usize, Vec<(SvcAddr, SvcAddr)>)> {
        let written = self.written()?;
        let mut ids = Ids::after(&written);
        let ops = plan(&written, want, &mut ids).ok_or(Error::Invalid {
            what: "service ids",
            why: "all 2^32 ids used: restart the agent with empty Service maps".into(),
        })?;
        for op in &ops {
            match op {
                Op::Set { entry, old } => self.set_service(entry, old.as_ref())?,
                Op::Remove(e) => self.remove_service(e)?,
            }
        }
        let now = self.written()?;
        self.remove_orphans(&now)?;
        Ok((ops.len(), gone_udp(&written, &now)))
    }

    /// The frontend socket `cookie` was translated from when the programs
    /// sent it to `backend`, if their record of it is still there.
    pub fn translated_from(&self, cookie: u64, backend: SvcAddr) -> Result<Option<SvcAddr>> {
        let revnat: HashMap<&MapData, SvcRevnatKey, SvcAddr> = map_ref(&self.ebpf, "svc_revnat")?;
        let key = SvcRevnatKey {
            cookie,
            to: backend,
            pad: 0,
        };
        found(revnat.get(&key, 0), || {
            format!("reading the record of socket {cookie}")
        })
    }

    fn remove_orphans(&mut self, now: &BTreeMap<SvcAddr, ServiceEntry>) -> Result<()> {
        let counts: BTreeMap<u32, u32> = now
            .values()
            .map(|e| (e.id, u32::try_from(e.backends.len()).unwrap_or(u32::MAX)))
            .collect();
        let named: std::collections::BTreeSet<u32> = now
            .values()
            .flat_map(|e| e.backends.iter().map(|b| b.0))
            .collect();
        let mut slots: HashMap<&mut MapData, SvcSlotKey, u32> = map(&mut self.ebpf, "svc_slots")?;
        let stray: Vec<SvcSlotKey> = slots
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| counts.get(&k.id).is_none_or(|c| k.index >= *c))
            .collect();
        for k in stray {
            removed(slots.remove(&k), || {
                format!("removing stray slot {}/{}", k.id, k.index)
            })?;
        }
        let mut backends: HashMap<&mut MapData, u32, SvcAddr> =
            map(&mut self.ebpf, "svc_backends")?;
        let stray: Vec<u32> = backends
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| !named.contains(k))
            .collect();
        for k in stray {
            removed(backends.remove(&k), || {
                format!("removing stray backend {k}")
            })?;
        }
        Ok(())
    }

    /// Removes a service: its frontend first, then its slots and backends.
    pub fn remove_service(&mut self, s: &ServiceEntry) -> Result<()> {
        {
            let mut fe: HashMap<&mut MapData, SvcAddr, SvcValue> = map(&mut self.ebpf, "services")?;
            removed(fe.remove(&s.frontend), || {
                format!("removing service {}", s.id)
            })?;
        }
        let empty = ServiceEntry {
            backends: Vec::new(),
            ..s.clone()
        };
        self.drop_rest(s, &empty)
    }

    fn write_frontend(&mut self, fe: SvcAddr, value: SvcValue) -> Result<()> {
        let mut m: HashMap<&mut MapData, SvcAddr, SvcValue> = map(&mut self.ebpf, "services")?;
        m.insert(fe, value, 0).map_err(|e| {
            full_or(
                e,
                "services",
                MAX_SERVICES,
                format!("writing service {}", value.id),
            )
        })
    }

    /// Slots past `now`'s count and backend ids `now` no longer has.
    fn drop_rest(&mut self, old: &ServiceEntry, now: &ServiceEntry) -> Result<()> {
        {
            let mut slots: HashMap<&mut MapData, SvcSlotKey, u32> =
                map(&mut self.ebpf, "svc_slots")?;
            for index in now.backends.len()..old.backends.len() {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                let key = SvcSlotKey { id: old.id, index };
                removed(slots.remove(&key), || format!("removing slot {index}"))?;
            }
        }
        let mut backends: HashMap<&mut MapData, u32, SvcAddr> =
            map(&mut self.ebpf, "svc_backends")?;
        for (bid, _) in &old.backends {
            if !now.backends.iter().any(|(b, _)| b == bid) {
                removed(backends.remove(bid), || format!("removing backend {bid}"))?;
            }
        }
        Ok(())
    }
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut CgroupSockAddr> {
    ebpf.program_mut(name)
        .ok_or(Error::Missing {
            kind: "program",
            name,
        })?
        .try_into()
        .map_err(|e| Error::program(format!("{name} is not a cgroup sock_addr program"), e))
}

/// Each UDP (frontend, backend) pair of `before` that `after` lacks.
fn gone_udp(
    before: &BTreeMap<SvcAddr, ServiceEntry>,
    after: &BTreeMap<SvcAddr, ServiceEntry>,
) -> Vec<(SvcAddr, SvcAddr)> {
    let mut out = Vec::new();
    for (fe, e) in before.iter().filter(|(fe, _)| fe.proto == IPPROTO_UDP) {
        let still = |b: &SvcAddr| {
            after
                .get(fe)
                .is_some_and(|a| a.backends.iter().any(|x| x.1 == *b))
        };
        out.extend(
            e.backends
                .iter()
                .filter(|b| !still(&b.1))
                .map(|b| (*fe, b.1)),
        );
    }
    out
}

fn map<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<T>
where
    T: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
{
    let m = ebpf
        .map_mut(name)
        .ok_or(Error::Missing { kind: "map", name })?;
    T::try_from(m).map_err(|e| Error::map(format!("opening {name}"), e))
}

/// A lookup's value, `None` if the key is absent.
fn found<V>(
    r: std::result::Result<V, aya::maps::MapError>,
    op: impl FnOnce() -> String,
) -> Result<Option<V>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(aya::maps::MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(Error::map(op(), e)),
    }
}

fn map_ref<'a, T>(ebpf: &'a Ebpf, name: &'static str) -> Result<T>
where
    T: TryFrom<&'a aya::maps::Map, Error = aya::maps::MapError>,
{
    let m = ebpf.map(name).ok_or(Error::Missing { kind: "map", name })?;
    T::try_from(m).map_err(|e| Error::map(format!("opening {name}"), e))
}

fn full_or(e: aya::maps::MapError, map: &'static str, capacity: u32, op: String) -> Error {
    if is_full(&e) {
        Error::MapFull { map, capacity, op }
    } else {
        Error::map(op, e)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests may panic
    use super::*;

    fn entry(fe: &str, proto: u8, backends: &[(u32, &str)]) -> (SvcAddr, ServiceEntry) {
        let frontend = SvcAddr::new(fe.parse().unwrap(), proto);
        let backends = backends
            .iter()
            .map(|(id, b)| (*id, SvcAddr::new(b.parse().unwrap(), proto)))
            .collect();
        let e = ServiceEntry {
            frontend,
            id: 1,
            flags: 0,
            affinity_timeout: 0,
            backends,
        };
        (frontend, e)
    }

    #[test]
    fn gone_udp_pairs_are_the_udp_backends_a_frontend_lost() {
        let before = BTreeMap::from([
            entry(
                "10.96.0.10:53",
                17,
                &[(1, "10.1.0.2:53"), (2, "10.1.0.3:53")],
            ),
            entry("10.96.0.11:53", 17, &[(3, "10.1.0.2:53")]),
            entry("10.96.0.10:80", 6, &[(4, "10.1.0.2:80")]),
        ]);
        // .10 loses 10.1.0.2 (which .11 keeps... until .11 goes too); TCP is
        // never listed.
        let after = BTreeMap::from([entry("10.96.0.10:53", 17, &[(2, "10.1.0.3:53")])]);
        let ip = |a: &str, p| SvcAddr::new(a.parse().unwrap(), p);
        assert_eq!(
            gone_udp(&before, &after),
            vec![
                (ip("10.96.0.10:53", 17), ip("10.1.0.2:53", 17)),
                (ip("10.96.0.11:53", 17), ip("10.1.0.2:53", 17)),
            ]
        );
        assert!(gone_udp(&before, &before).is_empty());
    }
}
