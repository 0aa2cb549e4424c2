//! The pinned maps and every typed read and write of them.

use std::{net::IpAddr, path::Path};

use aya::{
    maps::{
        Array, CpuMap, DevMapHash, HashMap, IterableMap, Map, MapData, MapError, PerCpuArray,
        PerCpuValues,
    },
    Ebpf,
};
use tracing::warn;

use super::{
    layout_dir,
    types::{Counters, Filled, L4Proto},
};
use crate::{
    abi::{
        family_addr, ip_of, ipv4_key, ipv4_of_key, DatapathMeta, Endpoint6Key, EndpointInfo,
        NatPortKey, PolicyGate, PolicyNsKey, StatsValue, Verdict, EP_NO_NAT_PORTS, MAX_CPUS,
        MAX_SLOTS,
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
}

impl MapName {
    /// Every map, `meta` first.
    pub(crate) const ALL: [MapName; 11] = [
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
        }
    }

    /// The maps of layout 1, pinned in the pin directory itself: the same
    /// names, types, keys and values as this layout's, less `meta`.
    pub(crate) fn layout1() -> impl Iterator<Item = &'static str> {
        Self::ALL
            .into_iter()
            .filter(|m| *m != Self::Meta)
            .map(Self::as_str)
    }
}

/// `BPF_NOEXIST`: insert only if the key is absent.
const NOEXIST: u64 = 1;
/// `Ok(true)` if a map delete removed something, `Ok(false)` if the key was
/// not there (aya reports that as KeyNotFound or as ENOENT).
fn removed(result: std::result::Result<(), MapError>, op: impl FnOnce() -> String) -> Result<bool> {
    match result {
        Ok(()) => Ok(true),
        Err(MapError::KeyNotFound) => Ok(false),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(false)
        }
        Err(e) => Err(Error::map(op(), e)),
    }
}

fn is_full(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::E2BIG))
}

/// The pinned maps alone: what a short-lived process (the CNI plugin) needs to
/// register endpoints without loading programs.
pub struct Maps {
    meta: Option<Array<MapData, DatapathMeta>>,
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

    /// Opens the maps pinned in `dir`: a layout directory (`with_meta`), or
    /// the pin directory of layout 1, whose maps have this layout's
    /// definitions but no `meta`.
    /// Opens the maps of layout 1 (pinned in `pin_dir` itself), to read
    /// them: the CNI plugin reads its policy gate while the agent has not
    /// migrated it. Nothing but a migration writes into another layout.
    pub fn open_layout1(pin_dir: &Path) -> Result<Self> {
        Self::open_dir(pin_dir, false)
    }

    pub(crate) fn open_dir(dir: &Path, with_meta: bool) -> Result<Self> {
        Self::build(with_meta, |name| {
            let data = MapData::from_pin(dir.join(name))
                .map_err(|e| Error::map(format!("opening pinned map {name}"), e))?;
            Map::from_map_data(data)
                .map(Some)
                .map_err(|e| Error::map(format!("map {name}"), e))
        })
    }

    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self> {
        Self::build(true, |name| Ok(ebpf.take_map(name)))
    }

    /// The maps, each from `get` by its name (a pin or a loaded object).
    fn build(
        with_meta: bool,
        mut get: impl FnMut(&'static str) -> Result<Option<Map>>,
    ) -> Result<Self> {
        let mut map = |m: MapName| -> Result<Option<Map>> { get(m.as_str()) };
        Ok(Self {
            meta: if with_meta {
                Some(typed(MapName::Meta, map(MapName::Meta)?)?)
            } else {
                None
            },
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

    /// What this datapath is (layout, state, build); `None` for layout 1,
    /// which has no `meta`.
    pub fn meta(&self) -> Result<Option<DatapathMeta>> {
        match &self.meta {
            Some(m) => m
                .get(&0, 0)
                .map(Some)
                .map_err(|e| Error::map("reading the datapath's meta", e)),
            None => Ok(None),
        }
    }

    pub(crate) fn set_meta(&mut self, meta: DatapathMeta) -> Result<()> {
        match &mut self.meta {
            Some(m) => m
                .set(0, meta, 0)
                .map_err(|e| Error::map("writing the datapath's meta", e)),
            None => Err(Error::Invalid {
                what: "datapath",
                why: "layout 1 has no meta".into(),
            }),
        }
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

    /// Makes `policy_namespaces` list exactly `want` (namespace -> number of
    /// policies), then marks the gate complete. Additions go before
    /// removals, so a namespace never looks free of policies on the way;
    /// when the list cannot be written (a full map, a name that does not
    /// fit), the gate is marked incomplete instead and the error returned:
    /// every new pod is then held (the safe side).
    pub(crate) fn write_policy_gate(
        &mut self,
        want: &std::collections::BTreeMap<String, u32>,
    ) -> Result<()> {
        let written = self.write_policy_namespaces(want);
        let mut gate = self.policy_gate()?;
        gate.complete = u32::from(written.is_ok());
        gate.pad = 0;
        gate.generation = gate.generation.wrapping_add(1);
        self.policy_gate
            .set(0, gate, 0)
            .map_err(|e| Error::map("writing the policy gate", e))?;
        written
    }

    fn write_policy_namespaces(
        &mut self,
        want: &std::collections::BTreeMap<String, u32>,
    ) -> Result<()> {
        let have = self.policy_namespaces()?;
        for (ns, n) in want {
            if have.get(ns) == Some(n) {
                continue;
            }
            let key = PolicyNsKey::of(ns).ok_or_else(|| Error::Invalid {
                what: "namespace",
                why: format!(
                    "{ns:?} does not fit in {} bytes",
                    crate::abi::NS_NAME_LEN - 1
                ),
            })?;
            self.policy_namespaces.insert(key, n, 0).map_err(|e| {
                let op = format!("listing policy namespace {ns}");
                if is_full(&e) {
                    Error::MapFull {
                        map: MapName::PolicyNamespaces.as_str(),
                        capacity: crate::abi::c_layout::XDPCNI_MAX_POLICY_NS,
                        op,
                    }
                } else {
                    Error::map(op, e)
                }
            })?;
        }
        for ns in have.keys().filter(|ns| !want.contains_key(*ns)) {
            if let Some(key) = PolicyNsKey::of(ns) {
                removed(self.policy_namespaces.remove(&key), || {
                    format!("unlisting policy namespace {ns}")
                })?;
            }
        }
        Ok(())
    }

    /// Inserts or replaces the endpoint record of `addr`. The fields the maps
    /// own are filled in here: `stats_slot` (its veth's counter slot, claimed
    /// on first use) and [`EP_NO_NAT_PORTS`] (set when `nat_ports` holds no
    /// port of `addr`); the caller's values of both are ignored.
    pub(crate) fn upsert_endpoint(&mut self, addr: IpAddr, info: &EndpointInfo) -> Result<()> {
        if info.cpu_mask != 0 && info.cpu_mask >> MAX_CPUS.min(63) > 1 {
            return Err(Error::Invalid {
                what: "cpu_mask",
                why: format!("{:#x} names CPUs beyond {}", info.cpu_mask, MAX_CPUS - 1),
            });
        }
        let mut info = *info;
        info.stats_slot = self.claim_slot(info.ifindex)?;
        info.flags &= !EP_NO_NAT_PORTS;
        if !self.has_nat_port(addr)? {
            info.flags |= EP_NO_NAT_PORTS;
        }
        self.put_endpoint(addr, &info).map_err(|e| {
            let op = format!("inserting endpoint {addr}");
            if is_full(&e) {
                Error::MapFull {
                    map: match addr {
                        IpAddr::V4(_) => MapName::Endpoints4.as_str(),
                        IpAddr::V6(_) => MapName::Endpoints6.as_str(),
                    },
                    capacity: crate::abi::c_layout::XDPCNI_MAX_ENDPOINTS,
                    op,
                }
            } else {
                Error::map(op, e)
            }
        })
    }

    /// Writes a record as given, in the map of its family.
    fn put_endpoint(
        &mut self,
        addr: IpAddr,
        info: &EndpointInfo,
    ) -> std::result::Result<(), MapError> {
        match addr {
            IpAddr::V4(v4) => self.endpoints4.insert(ipv4_key(v4), info, 0),
            IpAddr::V6(v6) => self
                .endpoints6
                .insert(Endpoint6Key { addr: v6.octets() }, info, 0),
        }
    }

    /// Flags the record of `addr`, if any, kernel-only: no program
    /// redirects to or from it any more. Whether there was one.
    pub(crate) fn flag_kernel_only(&mut self, addr: IpAddr) -> Result<bool> {
        let Some(mut info) = self.endpoint(addr)? else {
            return Ok(false);
        };
        if info.flags & crate::abi::EP_KERNEL_ONLY != 0 {
            return Ok(true);
        }
        info.flags |= crate::abi::EP_KERNEL_ONLY;
        self.put_endpoint(addr, &info)
            .map_err(|e| Error::map(format!("flagging endpoint {addr} kernel-only"), e))?;
        Ok(true)
    }

    /// Sets or clears [`EP_NO_NAT_PORTS`] on the record of `addr`, if any.
    fn set_no_nat(&mut self, addr: IpAddr, no_nat: bool) -> Result<()> {
        let Some(mut info) = self.endpoint(addr)? else {
            return Ok(());
        };
        let flags = if no_nat {
            info.flags | EP_NO_NAT_PORTS
        } else {
            info.flags & !EP_NO_NAT_PORTS
        };
        if flags == info.flags {
            return Ok(());
        }
        info.flags = flags;
        self.put_endpoint(addr, &info)
            .map_err(|e| Error::map(format!("flagging endpoint {addr}"), e))
    }

    /// Makes every endpoint's [`EP_NO_NAT_PORTS`] agree with `nat_ports`:
    /// repairs what a writer racing a NAT port change may have left. Returns
    /// how many records changed.
    pub(crate) fn refresh_nat_flags(&mut self) -> Result<usize> {
        let natted: std::collections::HashSet<IpAddr> =
            self.nat_ports()?.into_iter().map(|(ip, _, _)| ip).collect();
        let mut changed = 0;
        for (ip, info) in self.endpoints()? {
            let want = !natted.contains(&ip);
            if (info.flags & EP_NO_NAT_PORTS != 0) != want {
                self.set_no_nat(ip, want)?;
                changed += 1;
            }
        }
        Ok(changed)
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

    /// The counter slot of `ifindex`, claimed if it has none: the first free
    /// slot, taken with `BPF_NOEXIST` in `slot_owners` so that concurrent
    /// writers (parallel CNI ADDs, the agent) never share one. Its rows start
    /// at zero. With every slot taken, the shared slot 0 (and a warning).
    pub(crate) fn claim_slot(&mut self, ifindex: u32) -> Result<u32> {
        if let Some(s) = self.slot(ifindex)? {
            return Ok(s);
        }
        for slot in 1..MAX_SLOTS {
            match self.slot_owners.insert(slot, ifindex, NOEXIST) {
                Ok(()) => {}
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
                {
                    // Taken; ours only if a claim of this ifindex stopped
                    // half way (between the two inserts).
                    if self.slot_owners.get(&slot, 0).ok() != Some(ifindex) {
                        continue;
                    }
                }
                Err(e) => return Err(Error::map(format!("claiming counter slot {slot}"), e)),
            }
            self.zero_slot(slot)?;
            self.port_slots
                .insert(ifindex, slot, 0)
                .map_err(|e| Error::map(format!("recording counter slot of {ifindex}"), e))?;
            return Ok(slot);
        }
        warn!(
            ifindex,
            capacity = MAX_SLOTS - 1,
            "every counter slot is taken: this veth counts in the shared slot 0"
        );
        Ok(0)
    }

    fn zero_slot(&mut self, slot: u32) -> Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(path, e)| Error::io("reading", path, e))?;
        for &v in Verdict::ALL {
            let zero = PerCpuValues::try_from(vec![StatsValue::default(); cpus]).map_err(|e| {
                Error::io(
                    "sizing per-CPU counters from",
                    "/sys/devices/system/cpu/possible",
                    e,
                )
            })?;
            self.counters
                .set(row(slot, v), zero, 0)
                .map_err(|e| Error::map(format!("zeroing counter slot {slot}"), e))?;
        }
        Ok(())
    }

    /// Removes the endpoint record of `addr`; `Ok(false)` if there was none.
    pub(crate) fn remove_endpoint(&mut self, addr: IpAddr) -> Result<bool> {
        let r = match addr {
            IpAddr::V4(v4) => self.endpoints4.remove(&ipv4_key(v4)),
            IpAddr::V6(v6) => self.endpoints6.remove(&Endpoint6Key { addr: v6.octets() }),
        };
        removed(r, || format!("removing endpoint {addr}"))
    }

    /// Removes every endpoint record pointing at host veth `ifindex`, named
    /// anywhere or not (an ADD killed before it saved its addresses leaves
    /// records nobody lists); the addresses removed.
    pub(crate) fn remove_endpoints_of(&mut self, ifindex: u32) -> Result<Vec<IpAddr>> {
        let mine: Vec<IpAddr> = self
            .endpoints()?
            .into_iter()
            .filter(|(_, e)| e.ifindex == ifindex)
            .map(|(ip, _)| ip)
            .collect();
        for ip in &mine {
            self.remove_endpoint(*ip)?;
        }
        Ok(mine)
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

    /// Makes host veth `ifindex` a redirect target (devmap entry).
    pub(crate) fn add_tx_port(&mut self, ifindex: u32) -> Result<()> {
        self.tx_ports
            .insert(ifindex, ifindex, None, 0)
            .map_err(|e| Error::XdpMap {
                op: format!("adding tx port {ifindex}"),
                source: Box::new(e),
            })
    }

    /// Removes host veth `ifindex` from the redirect targets.
    pub(crate) fn remove_tx_port(&mut self, ifindex: u32) -> Result<bool> {
        removed(self.tx_ports.remove(ifindex), || {
            format!("removing tx port {ifindex}")
        })
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

    /// Sends replies from `(addr, proto, port)` to the kernel, which may NAT them.
    /// Clears the address's [`EP_NO_NAT_PORTS`] first, so no packet skips a
    /// lookup that would now match.
    pub(crate) fn add_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<()> {
        self.set_no_nat(addr, false)?;
        let key = nat_key(addr, proto, port);
        self.nat_ports.insert(key, 1, 0).map_err(|e| {
            let op = format!("adding NAT port {addr} {proto:?}/{port}");
            if is_full(&e) {
                Error::MapFull {
                    map: MapName::NatPorts.as_str(),
                    capacity: crate::abi::c_layout::XDPCNI_MAX_NAT_PORTS,
                    op,
                }
            } else {
                Error::map(op, e)
            }
        })
    }

    /// Undoes [`Maps::add_nat_port`].
    /// Undoes [`Maps::add_nat_port`]. The address's record keeps looking its
    /// ports up (the safe side) until [`Maps::refresh_nat_flags`], which the
    /// agent runs after each batch of changes: one scan per batch, not one
    /// per removed port.
    pub(crate) fn remove_nat_port(
        &mut self,
        addr: IpAddr,
        proto: L4Proto,
        port: u16,
    ) -> Result<bool> {
        removed(self.nat_ports.remove(&nat_key(addr, proto, port)), || {
            format!("removing NAT port {addr}/{port}")
        })
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

    /// Forgets the counters of `ifindex` (its veth is gone) and frees its slot.
    pub(crate) fn remove_counters(&mut self, ifindex: u32) -> Result<()> {
        let Some(slot) = self.slot(ifindex)? else {
            return Ok(());
        };
        if slot != 0 {
            self.zero_slot(slot)?;
        }
        removed(self.port_slots.remove(&ifindex), || {
            format!("removing the counter slot of {ifindex}")
        })?;
        if slot != 0 && self.slot_owners.get(&slot, 0).ok() == Some(ifindex) {
            removed(self.slot_owners.remove(&slot), || {
                format!("freeing counter slot {slot}")
            })?;
        }
        Ok(())
    }
}

impl Maps {
    /// Makes these maps (a layout being filled) say what `src` (layout 1,
    /// same definitions) says, for the maps named in `only` (those of `src`
    /// that are other objects than these: a map pinned under both names is
    /// left alone). Every entry of each, but `cpu_map`'s (whose entries carry
    /// a program: `migrate::converge` writes them). Entries of an earlier,
    /// abandoned fill go first, so the call can be repeated after a crash.
    pub(crate) fn fill_from(&mut self, src: &Maps, only: &[&str]) -> Result<Filled> {
        let op = |what: &str| format!("migrating {what}");
        let copy = |name: &str| only.contains(&name);
        let mut filled = Filled::default();

        if copy(MapName::PolicyNamespaces.as_str()) {
            filled.policy_namespaces = replace_all(
                &mut self.policy_namespaces,
                &src.policy_namespaces,
                MapName::PolicyNamespaces.as_str(),
            )?;
        }
        if copy(MapName::PolicyGate.as_str()) {
            self.policy_gate
                .set(0, src.policy_gate()?, 0)
                .map_err(|e| Error::map(op("the policy gate"), e))?;
        }

        // Counter slots: owners, each veth's slot, every row of their values.
        let owners = src.slot_owner_list()?;
        filled.slots = owners.len();
        if copy(MapName::Counters.as_str()) {
            // The slots this layout claimed: zeroed unless src claims them.
            let mut slots: std::collections::BTreeSet<u32> = self
                .slot_owner_list()?
                .into_iter()
                .map(|(s, _)| s)
                .collect();
            let claimed: std::collections::BTreeSet<u32> =
                owners.iter().map(|(s, _)| *s).chain([0]).collect();
            slots.extend(claimed.iter().copied());
            let nr_cpus = aya::util::nr_cpus().map_err(|(_, e)| {
                Error::io("counting CPUs", "/sys/devices/system/cpu/possible", e)
            })?;
            let per_slot = crate::abi::c_layout::XDPCNI_V_MAX;
            for slot in slots {
                for r in slot * per_slot..(slot + 1) * per_slot {
                    let values = if claimed.contains(&slot) {
                        src.counters
                            .get(&r, 0)
                            .map_err(|e| Error::map(op("counters"), e))?
                    } else {
                        PerCpuValues::try_from(vec![StatsValue::default(); nr_cpus]).map_err(
                            |e| Error::Invalid {
                                what: "counters",
                                why: e.to_string(),
                            },
                        )?
                    };
                    self.counters
                        .set(r, values, 0)
                        .map_err(|e| Error::map(op("counters"), e))?;
                }
            }
        }
        if copy(MapName::SlotOwners.as_str()) {
            replace_all(
                &mut self.slot_owners,
                &src.slot_owners,
                MapName::SlotOwners.as_str(),
            )?;
        }
        if copy(MapName::PortSlots.as_str()) {
            replace_all(
                &mut self.port_slots,
                &src.port_slots,
                MapName::PortSlots.as_str(),
            )?;
        }
        if copy(MapName::NatPorts.as_str()) {
            filled.nat_ports = replace_all(
                &mut self.nat_ports,
                &src.nat_ports,
                MapName::NatPorts.as_str(),
            )?;
        }
        if copy(MapName::Endpoints4.as_str()) {
            filled.endpoints += replace_all(
                &mut self.endpoints4,
                &src.endpoints4,
                MapName::Endpoints4.as_str(),
            )?;
        }
        if copy(MapName::Endpoints6.as_str()) {
            filled.endpoints += replace_all(
                &mut self.endpoints6,
                &src.endpoints6,
                MapName::Endpoints6.as_str(),
            )?;
        }
        if copy(MapName::TxPorts.as_str()) {
            for ifindex in self.tx_port_list()? {
                self.remove_tx_port(ifindex)?;
            }
            for ifindex in src.tx_port_list()? {
                self.add_tx_port(ifindex)?;
                filled.tx_ports += 1;
            }
        }
        Ok(filled)
    }
}

/// Makes hash map `dst` (named `what`) hold exactly the entries of `src`;
/// how many.
fn replace_all<K: aya::Pod, V: aya::Pod>(
    dst: &mut HashMap<MapData, K, V>,
    src: &HashMap<MapData, K, V>,
    what: &str,
) -> Result<usize> {
    drain(dst, what)?;
    let mut n = 0;
    for kv in src.iter() {
        let (k, v) = kv.map_err(|e| Error::map(format!("migrating {what}"), e))?;
        dst.insert(k, v, 0)
            .map_err(|e| Error::map(format!("migrating an entry of {what}"), e))?;
        n += 1;
    }
    Ok(n)
}

/// Empties hash map `m` (named `what`).
fn drain<K: aya::Pod, V: aya::Pod>(m: &mut HashMap<MapData, K, V>, what: &str) -> Result<()> {
    let keys: Vec<K> = m
        .keys()
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::map(format!("listing {what}"), e))?;
    for k in keys {
        removed(m.remove(&k), || format!("clearing {what}"))?;
    }
    Ok(())
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
