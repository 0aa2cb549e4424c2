//! The pinned maps and every typed read of them; their writes are in
//! `writes.rs` (private to the crate), the migration's fill in `fill.rs`.

mod cache;
mod fill;
mod writes;

use std::{net::IpAddr, path::Path};

use aya::{
    maps::{Array, CpuMap, DevMapHash, HashMap, IterableMap, Map, MapData, MapError, PerCpuArray},
    Ebpf,
};

use super::{
    layout_dir,
    types::{Counters, L4Proto},
};
use crate::{
    abi::{
        family_addr, ip_of, ipv4_key, ipv4_of_key, DatapathMeta, Endpoint6Key, EndpointInfo,
        NatPortKey, PolicyGate, PolicyNsKey, StatsValue, Verdict,
    },
    Error, Result,
};

/// Every map of the datapath, by the name it is pinned under: the one list
/// of them (opening, loading, migrating and checking all go through it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MapName {
    /// `meta`: this datapath's layout, state and build (layouts 2 and up).
    Meta,
    /// `endpoints4`: IPv4 pod address -> endpoint.
    Endpoints4,
    /// `endpoints6`: IPv6 pod address -> endpoint.
    Endpoints6,
    /// `tx_ports`: the devmap of host veths.
    TxPorts,
    /// `cpu_map`: the cpumap.
    CpuMap,
    /// `nat_ports`: NAT'd (address, protocol, port)s the fast path leaves to the kernel.
    NatPorts,
    /// `counters`: per-slot, per-verdict counters.
    Counters,
    /// `port_slots`: host veth ifindex -> counter slot.
    PortSlots,
    /// `slot_owners`: counter slot -> host veth ifindex.
    SlotOwners,
    /// `policy_namespaces`: namespaces a NetworkPolicy may select a new pod in.
    PolicyNamespaces,
    /// `policy_gate`: whether the agent has classified new pods (the CNI's hold).
    PolicyGate,
    /// `epcache4`: the IPv4 endpoint records again, by slot (`cache.rs`).
    Epcache4,
    /// `epcache6`: the IPv6 endpoint records again, by slot.
    Epcache6,
}

impl MapName {
    /// Every map, `meta` first.
    pub(crate) const ALL: [MapName; 13] = [
        Self::Meta,
        Self::Endpoints4,
        Self::Endpoints6,
        Self::TxPorts,
        Self::CpuMap,
        Self::NatPorts,
        Self::Counters,
        Self::PortSlots,
        Self::SlotOwners,
        Self::PolicyNamespaces,
        Self::PolicyGate,
        Self::Epcache4,
        Self::Epcache6,
    ];

    /// The name it is pinned under.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Meta => "meta",
            Self::Endpoints4 => "endpoints4",
            Self::Endpoints6 => "endpoints6",
            Self::TxPorts => "tx_ports",
            Self::CpuMap => "cpu_map",
            Self::NatPorts => "nat_ports",
            Self::Counters => "counters",
            Self::PortSlots => "port_slots",
            Self::SlotOwners => "slot_owners",
            Self::PolicyNamespaces => "policy_namespaces",
            Self::PolicyGate => "policy_gate",
            Self::Epcache4 => "epcache4",
            Self::Epcache6 => "epcache6",
        }
    }

    /// The maps of the previous layout (2): the same names, types, keys
    /// and values as this layout's, less the endpoint cache.
    pub(crate) fn previous() -> impl Iterator<Item = &'static str> {
        Self::ALL
            .into_iter()
            .filter(|m| !matches!(m, Self::Epcache4 | Self::Epcache6))
            .map(Self::as_str)
    }

    /// The names layout 1 pinned in the pin directory itself, which layout
    /// 2 kept as aliases of its own maps: the previous layout's, less
    /// `meta`.
    pub(crate) fn layout1() -> impl Iterator<Item = &'static str> {
        Self::previous().filter(|m| *m != Self::Meta.as_str())
    }
}

/// `BPF_NOEXIST`: insert only if the key is absent.
const NOEXIST: u64 = 1;
/// `Ok(true)` if a map delete removed something, `Ok(false)` if the key was
/// not there (aya reports that as KeyNotFound or as ENOENT).
pub(crate) fn removed(
    result: std::result::Result<(), MapError>,
    op: impl FnOnce() -> String,
) -> Result<bool> {
    match result {
        Ok(()) => Ok(true),
        Err(MapError::KeyNotFound) => Ok(false),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(false)
        }
        Err(e) => Err(Error::map(op(), e)),
    }
}

pub(crate) fn is_full(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::E2BIG))
}

/// The pinned maps alone: what a short-lived process (the CNI plugin) needs to
/// register endpoints without loading programs.
pub struct Maps {
    meta: Array<MapData, DatapathMeta>,
    endpoints4: HashMap<MapData, u32, EndpointInfo>,
    endpoints6: HashMap<MapData, Endpoint6Key, EndpointInfo>,
    tx_ports: DevMapHash<MapData>,
    pub(super) cpu_map: CpuMap<MapData>,
    nat_ports: HashMap<MapData, NatPortKey, u32>,
    counters: PerCpuArray<MapData, StatsValue>,
    port_slots: HashMap<MapData, u32, u32>,
    slot_owners: HashMap<MapData, u32, u32>,
    policy_namespaces: HashMap<MapData, PolicyNsKey, u32>,
    policy_gate: Array<MapData, PolicyGate>,
    /// This layout's endpoint cache; `None` in an older layout's maps.
    epcache: Option<cache::EpCache>,
}

fn typed<T: TryFrom<Map, Error = MapError>>(name: MapName, map: Option<Map>) -> Result<T> {
    let name = name.as_str();
    let map = map.ok_or(Error::Missing { kind: "map", name })?;
    T::try_from(map).map_err(|e| Error::map(format!("map {name}"), e))
}

impl Maps {
    /// Opens the maps of this build's layout pinned under `pin_dir` by a
    /// [`Datapath`], whatever their state (see [`Maps::meta`]).
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        Self::open_dir(&layout_dir(pin_dir), true)
    }

    /// Opens the maps of the previous layout (pinned in its own directory),
    /// to read them: the CNI plugin reads its policy gate while the agent has
    /// not migrated it. Nothing but a migration writes into another layout.
    pub fn open_previous(pin_dir: &Path) -> Result<Self> {
        Self::open_dir(&super::previous_layout_dir(pin_dir), false)
    }

    /// Opens the maps pinned in `dir`: this build's layout (`own`: with its
    /// endpoint cache) or the previous one's (the same maps, no cache).
    pub(crate) fn open_dir(dir: &Path, own: bool) -> Result<Self> {
        Self::build(dir, own, |name| {
            let data = MapData::from_pin(dir.join(name))
                .map_err(|e| Error::map(format!("opening pinned map {name}"), e))?;
            Map::from_map_data(data)
                .map(Some)
                .map_err(|e| Error::map(format!("map {name}"), e))
        })
    }

    /// The maps of `ebpf`, just loaded with its maps pinned in `layout`.
    pub(super) fn take(ebpf: &mut Ebpf, layout: &Path) -> Result<Self> {
        Self::build(layout, true, |name| Ok(ebpf.take_map(name)))
    }

    /// The maps pinned in `dir`, each from `get` by its name (a pin or a
    /// loaded object): this build's layout (`own`: with the endpoint
    /// cache), or the previous one's.
    fn build(
        dir: &Path,
        own: bool,
        mut get: impl FnMut(&'static str) -> Result<Option<Map>>,
    ) -> Result<Self> {
        let mut map = |m: MapName| -> Result<Option<Map>> { get(m.as_str()) };
        Ok(Self {
            epcache: if own {
                Some(cache::EpCache {
                    v4: typed(MapName::Epcache4, map(MapName::Epcache4)?)?,
                    v6: typed(MapName::Epcache6, map(MapName::Epcache6)?)?,
                    dir: dir.to_path_buf(),
                })
            } else {
                None
            },
            meta: typed(MapName::Meta, map(MapName::Meta)?)?,
            endpoints4: typed(MapName::Endpoints4, map(MapName::Endpoints4)?)?,
            endpoints6: typed(MapName::Endpoints6, map(MapName::Endpoints6)?)?,
            tx_ports: typed(MapName::TxPorts, map(MapName::TxPorts)?)?,
            cpu_map: typed(MapName::CpuMap, map(MapName::CpuMap)?)?,
            nat_ports: typed(MapName::NatPorts, map(MapName::NatPorts)?)?,
            counters: typed(MapName::Counters, map(MapName::Counters)?)?,
            port_slots: typed(MapName::PortSlots, map(MapName::PortSlots)?)?,
            slot_owners: typed(MapName::SlotOwners, map(MapName::SlotOwners)?)?,
            policy_namespaces: typed(MapName::PolicyNamespaces, map(MapName::PolicyNamespaces)?)?,
            policy_gate: typed(MapName::PolicyGate, map(MapName::PolicyGate)?)?,
        })
    }

    /// What this datapath is (layout, state, build).
    pub fn meta(&self) -> Result<DatapathMeta> {
        self.meta
            .get(&0, 0)
            .map_err(|e| Error::map("reading the datapath's meta", e))
    }

    /// The policy gate: whether `policy_namespaces` is complete.
    pub fn policy_gate(&self) -> Result<PolicyGate> {
        self.policy_gate
            .get(&0, 0)
            .map_err(|e| Error::map("reading the policy gate", e))
    }

    /// Whether namespace `ns` holds NetworkPolicies, as the agent last wrote.
    /// A name that cannot be a namespace is reported as holding some (the
    /// safe side: its pods are held).
    pub fn is_policy_namespace(&self, ns: &str) -> Result<bool> {
        let Some(key) = PolicyNsKey::of(ns) else {
            return Ok(true);
        };
        match self.policy_namespaces.get(&key, 0) {
            Ok(_) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(Error::map(format!("reading policy namespace {ns}"), e)),
        }
    }

    /// Every namespace listed, with its count of policies.
    pub fn policy_namespaces(&self) -> Result<std::collections::BTreeMap<String, u32>> {
        self.policy_namespaces
            .iter()
            .map(|kv| {
                kv.map(|(k, v)| (k.name(), v))
                    .map_err(|e| Error::map("listing policy namespaces", e))
            })
            .collect()
    }

    fn has_nat_port(&self, addr: IpAddr) -> Result<bool> {
        Ok(self.nat_ports()?.iter().any(|(ip, _, _)| *ip == addr))
    }

    /// The counter slot of host veth `ifindex`, if it has one.
    pub fn slot(&self, ifindex: u32) -> Result<Option<u32>> {
        match self.port_slots.get(&ifindex, 0) {
            Ok(s) => Ok(Some(s)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::map(
                format!("reading the counter slot of {ifindex}"),
                e,
            )),
        }
    }

    /// The endpoint record of `addr`, if any.
    pub fn endpoint(&self, addr: IpAddr) -> Result<Option<EndpointInfo>> {
        let r = match addr {
            IpAddr::V4(v4) => self.endpoints4.get(&ipv4_key(v4), 0),
            IpAddr::V6(v6) => self.endpoints6.get(&Endpoint6Key { addr: v6.octets() }, 0),
        };
        match r {
            Ok(info) => Ok(Some(info)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::map(format!("reading endpoint {addr}"), e)),
        }
    }

    /// Every endpoint record, IPv4 first.
    pub fn endpoints(&self) -> Result<Vec<(IpAddr, EndpointInfo)>> {
        let mut out = Vec::new();
        for kv in self.endpoints4.iter() {
            let (k, v) = kv.map_err(|e| Error::map("listing IPv4 endpoints", e))?;
            out.push((IpAddr::V4(ipv4_of_key(k)), v));
        }
        for kv in self.endpoints6.iter() {
            let (k, v) = kv.map_err(|e| Error::map("listing IPv6 endpoints", e))?;
            out.push((IpAddr::from(k.addr), v));
        }
        Ok(out)
    }

    /// Every redirect target (devmap entry), by ifindex.
    pub fn tx_port_list(&self) -> Result<Vec<u32>> {
        self.tx_ports
            .keys()
            .map(|k| k.map_err(|e| Error::map("listing tx ports", e)))
            .collect()
    }

    /// Every claimed counter slot: (slot, the ifindex that owns it).
    pub fn slot_owner_list(&self) -> Result<Vec<(u32, u32)>> {
        self.slot_owners
            .iter()
            .map(|kv| kv.map_err(|e| Error::map("listing counter slots", e)))
            .collect()
    }

    /// Whether `ifindex` is a redirect target.
    pub fn has_tx_port(&self, ifindex: u32) -> Result<bool> {
        match self.tx_ports.get(ifindex, 0) {
            Ok(_) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(Error::map(format!("reading tx port {ifindex}"), e)),
        }
    }

    /// The queue size of cpumap CPU `cpu`, or `None` when it is not enabled.
    pub fn cpu_queue_size(&self, cpu: u32) -> Result<Option<u32>> {
        match self.cpu_map.get(cpu, 0) {
            Ok(v) if v.queue_size > 0 => Ok(Some(v.queue_size)),
            Ok(_) | Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::map(format!("reading cpumap entry {cpu}"), e)),
        }
    }

    /// Every NAT'd port as (address, protocol, port).
    pub fn nat_ports(&self) -> Result<Vec<(IpAddr, L4Proto, u16)>> {
        let mut out = Vec::new();
        for k in self.nat_ports.keys() {
            let k = k.map_err(|e| Error::map("listing NAT ports", e))?;
            let proto = match k.proto {
                6 => L4Proto::Tcp,
                17 => L4Proto::Udp,
                _ => continue,
            };
            if let Some(ip) = ip_of(k.family, k.addr) {
                out.push((ip, proto, u16::from_be(k.port)));
            }
        }
        Ok(out)
    }

    /// How full each map that can fill is: its entries against its size
    /// (`cpu_map` and the arrays have fixed rows and are left out; the
    /// counter slots in use are `slot_owners`).
    pub fn fill(&self) -> Result<Vec<MapFill>> {
        fn of<K: aya::Pod, V, M: IterableMap<K, V>>(
            name: &'static str,
            map: &M,
            keys: impl Iterator<Item = std::result::Result<K, MapError>>,
        ) -> Result<MapFill> {
            let capacity = map
                .map()
                .info()
                .map_err(|e| Error::map(format!("map {name} info"), e))?
                .max_entries();
            let mut entries = 0;
            for k in keys {
                k.map_err(|e| Error::map(format!("counting {name}"), e))?;
                entries += 1;
            }
            Ok(MapFill {
                name,
                entries,
                capacity,
            })
        }
        Ok(vec![
            of(
                MapName::Endpoints4.as_str(),
                &self.endpoints4,
                self.endpoints4.keys(),
            )?,
            of(
                MapName::Endpoints6.as_str(),
                &self.endpoints6,
                self.endpoints6.keys(),
            )?,
            of(
                MapName::TxPorts.as_str(),
                &self.tx_ports,
                self.tx_ports.keys(),
            )?,
            of(
                MapName::NatPorts.as_str(),
                &self.nat_ports,
                self.nat_ports.keys(),
            )?,
            of(
                MapName::SlotOwners.as_str(),
                &self.slot_owners,
                self.slot_owners.keys(),
            )?,
            of(
                MapName::PolicyNamespaces.as_str(),
                &self.policy_namespaces,
                self.policy_namespaces.keys(),
            )?,
        ])
    }

    /// Counters of host veth `ifindex` (nothing if it has no counter slot).
    pub fn counters(&self, ifindex: u32) -> Result<Counters> {
        let Some(slot) = self.slot(ifindex)? else {
            return Ok(Counters::default());
        };
        self.slot_counters(slot)
    }

    /// Counters of the shared slot 0: veths that found no free slot.
    pub fn shared_counters(&self) -> Result<Counters> {
        self.slot_counters(0)
    }

    fn slot_counters(&self, slot: u32) -> Result<Counters> {
        let mut rows = Vec::new();
        for &verdict in Verdict::ALL {
            let per_cpu = self
                .counters
                .get(&row(slot, verdict), 0)
                .map_err(|e| Error::map(format!("reading counter slot {slot}"), e))?;
            let sum = per_cpu
                .iter()
                .fold(StatsValue::default(), |a, v| StatsValue {
                    packets: a.packets + v.packets,
                    bytes: a.bytes + v.bytes,
                });
            if sum.packets > 0 {
                rows.push((verdict, sum));
            }
        }
        Ok(Counters { rows })
    }
}

/// The `counters` row of (slot, verdict), as the C side computes it.
const fn row(slot: u32, verdict: Verdict) -> u32 {
    slot * crate::abi::c_layout::XDPCNI_V_MAX + verdict as u32
}

fn nat_key(addr: IpAddr, proto: L4Proto, port: u16) -> NatPortKey {
    let (family, addr) = family_addr(addr);
    NatPortKey {
        family,
        proto: proto.number(),
        port: port.to_be(),
        addr,
    }
}

/// How full one map is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapFill {
    /// The map's pinned name.
    pub name: &'static str,
    /// Entries in it now.
    pub entries: u32,
    /// Its `max_entries`.
    pub capacity: u32,
}
