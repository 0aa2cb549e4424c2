//! Services at the socket: the programs of `services.bpf.c`, loaded with
//! their maps pinned under `svc-layout-<N>` beside the datapath's layouts,
//! attached to a cgroup v2 directory, and the writes that keep the maps.
//!
//! Order of the writes, so a program never reads half a change: a new or
//! grown service gets its backends, then its slots, then its frontend (the
//! count that makes the new slots choosable); a shrunk or removed one loses
//! its frontend's count first, then the slots and backends past it.

use std::{
    fs,
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
        SvcAddr, SvcSlotKey, SvcValue, MAX_SERVICES, MAX_SVC_BACKENDS, MAX_SVC_NETNS, SVC_LAYOUT,
    },
    datapath::maps::{is_full, removed},
    Error, Result,
};

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

/// The Service maps' directory under a pin directory.
pub fn svc_layout_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("svc-layout-{SVC_LAYOUT}"))
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

/// The loaded programs and their pinned maps.
pub struct Services {
    ebpf: Ebpf,
}

impl Services {
    /// Loads the Service programs, their maps pinned in (or reused from)
    /// `svc-layout-<N>` under `pin_dir`.
    pub fn open(pin_dir: &Path) -> Result<Self> {
        let dir = svc_layout_dir(pin_dir);
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io("restricting", &dir, e))?;
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

    /// Translates the sockets of the network namespace with this cookie
    /// (`SO_NETNS_COOKIE`) from now on.
    pub fn add_netns(&mut self, cookie: u64) -> Result<()> {
        let mut m: HashMap<&mut MapData, u64, u32> = map(&mut self.ebpf, "svc_netns")?;
        m.insert(cookie, 1, 0).map_err(|e| {
            full_or(
                e,
                "svc_netns",
                MAX_SVC_NETNS,
                format!("adding netns {cookie}"),
            )
        })
    }

    /// Stops translating that namespace's sockets.
    pub fn remove_netns(&mut self, cookie: u64) -> Result<bool> {
        let mut m: HashMap<&mut MapData, u64, u32> = map(&mut self.ebpf, "svc_netns")?;
        removed(m.remove(&cookie), || format!("removing netns {cookie}"))
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

fn map<'a, K: aya::Pod, V: aya::Pod>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<HashMap<&'a mut MapData, K, V>> {
    let m = ebpf
        .map_mut(name)
        .ok_or(Error::Missing { kind: "map", name })?;
    HashMap::try_from(m).map_err(|e| Error::map(format!("opening {name}"), e))
}

fn full_or(e: aya::maps::MapError, map: &'static str, capacity: u32, op: String) -> Error {
    if is_full(&e) {
        Error::MapFull { map, capacity, op }
    } else {
        Error::map(op, e)
    }
}
