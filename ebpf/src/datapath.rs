//! Loading, pinning, attaching and feeding the XDP datapath.
//!
//! Pin layout under a directory on bpffs (default `/sys/fs/bpf/xdpcni`):
//!
//! ```text
//! layout-2/                                    this build's layout (XDPCNI_LAYOUT)
//!   meta                                       layout, state (filling/complete), build
//!   endpoints4 endpoints6 tx_ports cpu_map nat_ports   maps, pinned by name by aya
//!   counters port_slots slot_owners                     per-veth counters (see xdpcni.h)
//!   policy_namespaces policy_gate                      what the CNI reads to hold a new pod
//!   progs/xdpcni_from_pod progs/xdpcni_cpumap  the programs in use
//!   progs/xdpcni_hold                          the tc program of a held pod
//! links/<ifindex>_native | _generic            one XDP bpf_link per host veth, shared by
//!                                              every layout (bpffs refuses names with dots)
//! links/<ifindex>_hold_ingress | _hold_egress  the two tcx links of a held pod
//! ```
//!
//! Layout 1 (before layouts had a number) pinned the maps and `progs/` in the
//! pin directory itself. Each layout has its own directory so that binaries
//! of two layouts never share a map: [`Datapath::open`] migrates an older
//! layout it finds into its own (`crate::migrate`), and a binary that finds
//! only a layout it does not know leaves it alone.
//!
//! Everything that carries traffic is pinned, so the process that loaded it
//! can exit (or crash) without detaching anything, and the next one reopens
//! the same objects: [`Datapath::open`] reuses pinned programs whose tag
//! matches the embedded object and swaps links atomically when it does not.

use std::{
    fmt, fs,
    net::IpAddr,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    str::FromStr,
};

use aya::{
    maps::{
        Array, CpuMap, DevMapHash, HashMap, IterableMap, Map, MapData, MapError, PerCpuArray,
        PerCpuValues,
    },
    programs::{
        links::{FdLink, PinnedLink},
        tc::TcAttachOptions,
        LinkOrder, SchedClassifier, TcAttachType, Xdp, XdpMode as AyaXdpMode,
    },
    Ebpf, EbpfLoader,
};
use tracing::{debug, info, warn};

use crate::{
    abi::{
        family_addr, ip_of, ipv4_key, ipv4_of_key, DatapathMeta, Endpoint6Key, EndpointInfo,
        NatPortKey, PolicyGate, PolicyNsKey, StatsValue, Verdict, VerdictKind, EP_NO_NAT_PORTS,
        MAX_CPUS, MAX_SLOTS,
    },
    sys, Error, Result, DATAPATH_OBJECT,
};

/// Name of the program attached to pod host veths.
pub const FROM_POD_PROGRAM: &str = "xdpcni_from_pod";
/// Name of the cpumap second-stage program.
pub const CPUMAP_PROGRAM: &str = "xdpcni_cpumap";
/// Name of the tc program that holds a pod until the agent classifies it.
pub const HOLD_PROGRAM: &str = "xdpcni_hold";
/// Default pin directory.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/xdpcni";

const MAP_ENDPOINTS4: &str = "endpoints4";
const MAP_ENDPOINTS6: &str = "endpoints6";
const MAP_META: &str = "meta";
const MAP_TX_PORTS: &str = "tx_ports";
const MAP_CPU_MAP: &str = "cpu_map";
const MAP_NAT_PORTS: &str = "nat_ports";
const MAP_COUNTERS: &str = "counters";
const MAP_PORT_SLOTS: &str = "port_slots";
const MAP_SLOT_OWNERS: &str = "slot_owners";
const MAP_POLICY_NAMESPACES: &str = "policy_namespaces";
const MAP_POLICY_GATE: &str = "policy_gate";
/// Every map of the datapath, as pinned.
const MAPS: [&str; 11] = [
    MAP_META,
    MAP_ENDPOINTS4,
    MAP_ENDPOINTS6,
    MAP_TX_PORTS,
    MAP_CPU_MAP,
    MAP_NAT_PORTS,
    MAP_COUNTERS,
    MAP_PORT_SLOTS,
    MAP_SLOT_OWNERS,
    MAP_POLICY_NAMESPACES,
    MAP_POLICY_GATE,
];
/// The maps of layout 1, pinned in the pin directory itself: the same
/// names, types, keys and values as this layout's, less `meta`.
pub(crate) const LAYOUT1_MAPS: [&str; 10] = [
    MAP_ENDPOINTS4,
    MAP_ENDPOINTS6,
    MAP_TX_PORTS,
    MAP_CPU_MAP,
    MAP_NAT_PORTS,
    MAP_COUNTERS,
    MAP_PORT_SLOTS,
    MAP_SLOT_OWNERS,
    MAP_POLICY_NAMESPACES,
    MAP_POLICY_GATE,
];

/// The directory of this build's layout under `pin_dir`: its maps and
/// `progs/` (the links stay in `pin_dir/links`, shared by every layout).
pub fn layout_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("layout-{}", crate::abi::LAYOUT))
}

/// `BPF_NOEXIST`: insert only if the key is absent.
const NOEXIST: u64 = 1;

/// How the program runs on a host veth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttachMode {
    /// Driver mode: veth runs it on `xdp_frame`s (needs GRO or XDP on the peer,
    /// and tx checksum offload off in the pod for TCP; see KERNEL-NOTES).
    Native,
    /// skb mode: runs in the stack on the skb, keeps checksum state, but drops
    /// redirected skbs larger than the target MTU (pod TSO must be off).
    Generic,
}

impl AttachMode {
    const fn xdp_mode(self) -> AyaXdpMode {
        match self {
            Self::Native => AyaXdpMode::Driver,
            Self::Generic => AyaXdpMode::Skb,
        }
    }

    /// `native` or `generic`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
        }
    }

    const fn other(self) -> Self {
        match self {
            Self::Native => Self::Generic,
            Self::Generic => Self::Native,
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AttachMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "native" => Ok(Self::Native),
            "generic" => Ok(Self::Generic),
            other => Err(Error::Invalid {
                what: "XDP mode",
                why: format!("{other:?} is neither \"native\" nor \"generic\""),
            }),
        }
    }
}

/// The tc hook of a host veth a hold is attached to: both, so that nothing
/// reaches the pod and nothing leaves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HoldHook {
    /// Frames from the pod (tcx ingress of the host veth).
    Ingress,
    /// Frames to the pod on the kernel path (tcx egress of the host veth).
    Egress,
}

impl HoldHook {
    /// Both hooks.
    pub const ALL: [HoldHook; 2] = [Self::Ingress, Self::Egress];

    const fn tc_type(self) -> TcAttachType {
        match self {
            Self::Ingress => TcAttachType::Ingress,
            Self::Egress => TcAttachType::Egress,
        }
    }
}

/// What a link pinned under `links/` is: `<ifindex>_<suffix>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LinkKind {
    /// The datapath's XDP program in this mode.
    Xdp(AttachMode),
    /// The hold program on this tc hook.
    Hold(HoldHook),
}

impl LinkKind {
    const ALL: [LinkKind; 4] = [
        Self::Xdp(AttachMode::Native),
        Self::Xdp(AttachMode::Generic),
        Self::Hold(HoldHook::Ingress),
        Self::Hold(HoldHook::Egress),
    ];

    const fn suffix(self) -> &'static str {
        match self {
            Self::Xdp(m) => m.as_str(),
            Self::Hold(HoldHook::Ingress) => "hold_ingress",
            Self::Hold(HoldHook::Egress) => "hold_egress",
        }
    }

    fn parse(suffix: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.suffix() == suffix)
    }

    /// The kernel's view of the link pinned at `pin`.
    pub(crate) fn state(self, pin: &Path) -> std::io::Result<sys::LinkState> {
        match self {
            Self::Xdp(_) => sys::pinned_xdp_link(pin),
            Self::Hold(_) => sys::pinned_tcx_link(pin),
        }
    }

    /// Whether the link pinned at `pin` is attached to `ifindex` still.
    fn is_live(self, pin: &Path, ifindex: u32) -> bool {
        matches!(self.state(pin), Ok(s) if s.ifindex == ifindex)
    }
}

/// The pin of the link of `kind` on `ifindex`: the one home of the name.
fn link_pin(pin_dir: &Path, ifindex: u32, kind: LinkKind) -> PathBuf {
    pin_dir
        .join("links")
        .join(format!("{ifindex}_{}", kind.suffix()))
}

/// An XDP program attached to a host veth through a pinned link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The host veth.
    pub ifindex: u32,
    /// Native or generic.
    pub mode: AttachMode,
    /// The kernel id of the attached program.
    pub prog_id: u32,
    /// The kernel id of the bpf_link.
    pub link_id: u32,
    /// Whether this call changed anything (new attach or program swap).
    pub changed: bool,
}

/// Per-verdict totals of one host veth, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    rows: Vec<(Verdict, StatsValue)>,
}

impl Counters {
    /// Packets counted with `verdict`.
    pub fn packets(&self, verdict: Verdict) -> u64 {
        self.get(verdict).packets
    }

    /// Packets and bytes counted with `verdict`.
    pub fn get(&self, verdict: Verdict) -> StatsValue {
        self.rows
            .iter()
            .find(|(v, _)| *v == verdict)
            .map(|(_, s)| *s)
            .unwrap_or_default()
    }

    /// Every non-zero verdict.
    pub fn iter(&self) -> impl Iterator<Item = (Verdict, StatsValue)> + '_ {
        self.rows.iter().copied()
    }

    /// Packets passed to the kernel, for any reason.
    pub fn passed(&self) -> u64 {
        self.of_kind(VerdictKind::Kernel)
    }

    /// Packets this veth's program redirected to another pod (each
    /// delivery once, on the sender's side).
    pub fn forwarded(&self) -> u64 {
        self.of_kind(VerdictKind::Forward)
    }

    /// Packets the fast path delivered to this veth's pod (the receive
    /// side of another veth's `forwarded`).
    pub fn received(&self) -> u64 {
        self.of_kind(VerdictKind::Received)
    }

    /// Packets counted with any verdict of `kind`.
    pub fn of_kind(&self, kind: VerdictKind) -> u64 {
        self.rows
            .iter()
            .filter(|(v, _)| v.kind() == kind)
            .map(|(_, s)| s.packets)
            .sum()
    }
}

/// L4 protocol of a NAT'd port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum L4Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl L4Proto {
    const fn number(self) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
        }
    }
}

/// `e: its source: its source...`, since aya's errors put the errno in sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

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

fn ensure_bpffs(dir: &Path) -> Result<()> {
    let probe = if dir.exists() {
        dir
    } else {
        dir.parent().unwrap_or(dir)
    };
    if !crate::bpffs::is_bpffs(probe)? {
        return Err(Error::NotBpffs(probe.to_path_buf()));
    }
    Ok(())
}

/// The pinned maps alone: what a short-lived process (the CNI plugin) needs to
/// register endpoints without loading programs.
pub struct Maps {
    meta: Option<Array<MapData, DatapathMeta>>,
    endpoints4: HashMap<MapData, u32, EndpointInfo>,
    endpoints6: HashMap<MapData, Endpoint6Key, EndpointInfo>,
    tx_ports: DevMapHash<MapData>,
    cpu_map: CpuMap<MapData>,
    nat_ports: HashMap<MapData, NatPortKey, u32>,
    counters: PerCpuArray<MapData, StatsValue>,
    port_slots: HashMap<MapData, u32, u32>,
    slot_owners: HashMap<MapData, u32, u32>,
    policy_namespaces: HashMap<MapData, PolicyNsKey, u32>,
    policy_gate: Array<MapData, PolicyGate>,
}

fn typed<T: TryFrom<Map, Error = MapError>>(name: &'static str, map: Option<Map>) -> Result<T> {
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
        let open = |name: &'static str| -> Result<Option<Map>> {
            let data = MapData::from_pin(dir.join(name))
                .map_err(|e| Error::map(format!("opening pinned map {name}"), e))?;
            Map::from_map_data(data)
                .map(Some)
                .map_err(|e| Error::map(format!("map {name}"), e))
        };
        Ok(Self {
            meta: if with_meta {
                Some(typed(MAP_META, open(MAP_META)?)?)
            } else {
                None
            },
            endpoints4: typed(MAP_ENDPOINTS4, open(MAP_ENDPOINTS4)?)?,
            endpoints6: typed(MAP_ENDPOINTS6, open(MAP_ENDPOINTS6)?)?,
            tx_ports: typed(MAP_TX_PORTS, open(MAP_TX_PORTS)?)?,
            cpu_map: typed(MAP_CPU_MAP, open(MAP_CPU_MAP)?)?,
            nat_ports: typed(MAP_NAT_PORTS, open(MAP_NAT_PORTS)?)?,
            counters: typed(MAP_COUNTERS, open(MAP_COUNTERS)?)?,
            port_slots: typed(MAP_PORT_SLOTS, open(MAP_PORT_SLOTS)?)?,
            slot_owners: typed(MAP_SLOT_OWNERS, open(MAP_SLOT_OWNERS)?)?,
            policy_namespaces: typed(MAP_POLICY_NAMESPACES, open(MAP_POLICY_NAMESPACES)?)?,
            policy_gate: typed(MAP_POLICY_GATE, open(MAP_POLICY_GATE)?)?,
        })
    }

    fn take(ebpf: &mut Ebpf) -> Result<Self> {
        Ok(Self {
            meta: Some(typed(MAP_META, ebpf.take_map(MAP_META))?),
            endpoints4: typed(MAP_ENDPOINTS4, ebpf.take_map(MAP_ENDPOINTS4))?,
            endpoints6: typed(MAP_ENDPOINTS6, ebpf.take_map(MAP_ENDPOINTS6))?,
            tx_ports: typed(MAP_TX_PORTS, ebpf.take_map(MAP_TX_PORTS))?,
            cpu_map: typed(MAP_CPU_MAP, ebpf.take_map(MAP_CPU_MAP))?,
            nat_ports: typed(MAP_NAT_PORTS, ebpf.take_map(MAP_NAT_PORTS))?,
            counters: typed(MAP_COUNTERS, ebpf.take_map(MAP_COUNTERS))?,
            port_slots: typed(MAP_PORT_SLOTS, ebpf.take_map(MAP_PORT_SLOTS))?,
            slot_owners: typed(MAP_SLOT_OWNERS, ebpf.take_map(MAP_SLOT_OWNERS))?,
            policy_namespaces: typed(MAP_POLICY_NAMESPACES, ebpf.take_map(MAP_POLICY_NAMESPACES))?,
            policy_gate: typed(MAP_POLICY_GATE, ebpf.take_map(MAP_POLICY_GATE))?,
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
    pub fn write_policy_gate(
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
                        map: MAP_POLICY_NAMESPACES,
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
    pub fn upsert_endpoint(&mut self, addr: IpAddr, info: &EndpointInfo) -> Result<()> {
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
                        IpAddr::V4(_) => MAP_ENDPOINTS4,
                        IpAddr::V6(_) => MAP_ENDPOINTS6,
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
    pub fn flag_kernel_only(&mut self, addr: IpAddr) -> Result<bool> {
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
    pub fn refresh_nat_flags(&mut self) -> Result<usize> {
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
    pub fn claim_slot(&mut self, ifindex: u32) -> Result<u32> {
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
    pub fn remove_endpoint(&mut self, addr: IpAddr) -> Result<bool> {
        let r = match addr {
            IpAddr::V4(v4) => self.endpoints4.remove(&ipv4_key(v4)),
            IpAddr::V6(v6) => self.endpoints6.remove(&Endpoint6Key { addr: v6.octets() }),
        };
        removed(r, || format!("removing endpoint {addr}"))
    }

    /// Removes every endpoint record pointing at host veth `ifindex`, named
    /// anywhere or not (an ADD killed before it saved its addresses leaves
    /// records nobody lists); the addresses removed.
    pub fn remove_endpoints_of(&mut self, ifindex: u32) -> Result<Vec<IpAddr>> {
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
    pub fn add_tx_port(&mut self, ifindex: u32) -> Result<()> {
        self.tx_ports
            .insert(ifindex, ifindex, None, 0)
            .map_err(|e| Error::XdpMap {
                op: format!("adding tx port {ifindex}"),
                source: Box::new(e),
            })
    }

    /// Removes host veth `ifindex` from the redirect targets.
    pub fn remove_tx_port(&mut self, ifindex: u32) -> Result<bool> {
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
    pub fn add_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<()> {
        self.set_no_nat(addr, false)?;
        let key = nat_key(addr, proto, port);
        self.nat_ports.insert(key, 1, 0).map_err(|e| {
            let op = format!("adding NAT port {addr} {proto:?}/{port}");
            if is_full(&e) {
                Error::MapFull {
                    map: MAP_NAT_PORTS,
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
    pub fn remove_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<bool> {
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
            of(MAP_ENDPOINTS4, &self.endpoints4, self.endpoints4.keys())?,
            of(MAP_ENDPOINTS6, &self.endpoints6, self.endpoints6.keys())?,
            of(MAP_TX_PORTS, &self.tx_ports, self.tx_ports.keys())?,
            of(MAP_NAT_PORTS, &self.nat_ports, self.nat_ports.keys())?,
            of(MAP_SLOT_OWNERS, &self.slot_owners, self.slot_owners.keys())?,
            of(
                MAP_POLICY_NAMESPACES,
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
    pub fn remove_counters(&mut self, ifindex: u32) -> Result<()> {
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

/// What [`Maps::fill_from`] copied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Filled {
    /// Endpoint records (addresses), both families.
    pub endpoints: usize,
    /// Redirect targets (devmap entries).
    pub tx_ports: usize,
    /// NAT'd ports.
    pub nat_ports: usize,
    /// Counter slots claimed, with every row of their values.
    pub slots: usize,
    /// Namespaces of the policy gate.
    pub policy_namespaces: usize,
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

        if copy(MAP_POLICY_NAMESPACES) {
            filled.policy_namespaces = replace_all(
                &mut self.policy_namespaces,
                &src.policy_namespaces,
                MAP_POLICY_NAMESPACES,
            )?;
        }
        if copy(MAP_POLICY_GATE) {
            self.policy_gate
                .set(0, src.policy_gate()?, 0)
                .map_err(|e| Error::map(op("the policy gate"), e))?;
        }

        // Counter slots: owners, each veth's slot, every row of their values.
        let owners = src.slot_owner_list()?;
        filled.slots = owners.len();
        if copy(MAP_COUNTERS) {
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
        if copy(MAP_SLOT_OWNERS) {
            replace_all(&mut self.slot_owners, &src.slot_owners, MAP_SLOT_OWNERS)?;
        }
        if copy(MAP_PORT_SLOTS) {
            replace_all(&mut self.port_slots, &src.port_slots, MAP_PORT_SLOTS)?;
        }
        if copy(MAP_NAT_PORTS) {
            filled.nat_ports = replace_all(&mut self.nat_ports, &src.nat_ports, MAP_NAT_PORTS)?;
        }
        if copy(MAP_ENDPOINTS4) {
            filled.endpoints += replace_all(&mut self.endpoints4, &src.endpoints4, MAP_ENDPOINTS4)?;
        }
        if copy(MAP_ENDPOINTS6) {
            filled.endpoints += replace_all(&mut self.endpoints6, &src.endpoints6, MAP_ENDPOINTS6)?;
        }
        if copy(MAP_TX_PORTS) {
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

/// The loaded datapath: programs, pinned links and maps.
pub struct Datapath {
    pub(crate) pin_dir: PathBuf,
    from_pod: Xdp,
    cpumap: Xdp,
    pub(crate) hold: SchedClassifier,
    pub(crate) maps: Maps,
    upgraded: bool,
    migration: Option<crate::migrate::Migration>,
}

impl Datapath {
    /// Loads the datapath into `pin_dir`, or takes over the one pinned there.
    ///
    /// Maps are reused from their pins. A pinned program whose tag equals the
    /// embedded one is reused as is, so nothing attached changes; a different
    /// one is replaced and every pinned link is swapped to the new program
    /// atomically (`bpf_link_update`), without a detach.
    pub fn open(pin_dir: &Path) -> Result<Self> {
        Self::open_object(pin_dir, DATAPATH_OBJECT)
    }

    /// [`Datapath::open`] with another build of the datapath object of this
    /// layout (an upgrade, or a rollback).
    pub fn open_object(pin_dir: &Path, object: &[u8]) -> Result<Self> {
        Self::open_with(pin_dir, object, &mut |_| {})
    }

    /// [`Datapath::open_object`], calling `step` with the name of each step
    /// of a migration from an older layout as it is reached
    /// (`migrate:started`, `migrate:filled`, `migrate:swapping`,
    /// `migrate:swapped`, `migrate:complete`, `migrate:removed`): the
    /// agent's crash points.
    pub fn open_with(pin_dir: &Path, object: &[u8], step: &mut dyn FnMut(&str)) -> Result<Self> {
        ensure_bpffs(pin_dir)?;
        let layout = layout_dir(pin_dir);
        for dir in [
            pin_dir.to_path_buf(),
            pin_dir.join("links"),
            // Layout 1's names for the programs (aliases: migrate.rs).
            pin_dir.join("progs"),
            layout.clone(),
            layout.join("progs"),
        ] {
            fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
            // Root's alone, whatever the umask: whoever can add a pin here
            // or open a map can steer every pod's traffic. (The kernel makes
            // the pins themselves 0600.)
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                .map_err(|e| Error::io("restricting", &dir, e))?;
        }
        ensure_bpffs(pin_dir)?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&layout)
            .load(object)
            .map_err(|e| Error::Load(Box::new(e)))?;
        let maps = Maps::take(&mut ebpf)?;
        let (from_pod, a) = Self::adopt_program(&mut ebpf, &layout, FROM_POD_PROGRAM)?;
        let (cpumap, b) = Self::adopt_program(&mut ebpf, &layout, CPUMAP_PROGRAM)?;
        // A held pod's links keep the program they were made with within a
        // layout: it drops alike in every build, and the agent removes them
        // once it has classified the pod (a migration moves them).
        let hold = Self::adopt_hold_program(&mut ebpf, &layout)?;
        let mut dp = Self {
            pin_dir: pin_dir.to_path_buf(),
            from_pod,
            cpumap,
            hold,
            maps,
            upgraded: a || b,
            migration: None,
        };
        // An older layout first: its links move to this build's programs.
        dp.migration = crate::migrate::converge(&mut dp, step)?;
        if dp.upgraded {
            dp.swap_all_links()?;
            dp.refresh_cpumap_programs()?;
        }
        Ok(dp)
    }

    /// Opens the datapath pinned in `pin_dir` without loading anything: the
    /// pinned maps and programs of this build's layout as they are (what the
    /// CNI plugin uses; it never replaces programs). Fails if they are not
    /// pinned there or not complete ([`crate::Pinned::ready`]).
    pub fn open_existing(pin_dir: &Path) -> Result<Self> {
        let maps = Maps::open_pinned(pin_dir)?;
        let meta = maps.meta()?.unwrap_or_default();
        if meta.state != crate::abi::META_COMPLETE {
            return Err(Error::NotReady(format!(
                "{} is being filled (from an older layout, or by an agent starting)",
                layout_dir(pin_dir).display()
            )));
        }
        let layout = layout_dir(pin_dir);
        let prog = |name: &'static str, attach_type| {
            let pin = layout.join("progs").join(name);
            Xdp::from_pin(&pin, attach_type)
                .map_err(|e| Error::program(format!("opening {}", pin.display()), e))
        };
        Ok(Self {
            pin_dir: pin_dir.to_path_buf(),
            from_pod: prog(
                FROM_POD_PROGRAM,
                aya_obj::programs::XdpAttachType::Interface,
            )?,
            cpumap: prog(CPUMAP_PROGRAM, aya_obj::programs::XdpAttachType::CpuMap)?,
            hold: {
                let pin = layout.join("progs").join(HOLD_PROGRAM);
                SchedClassifier::from_pin(&pin)
                    .map_err(|e| Error::program(format!("opening {}", pin.display()), e))?
            },
            maps,
            upgraded: false,
            migration: None,
        })
    }

    /// Loads the hold program and returns the one to use: the pinned one
    /// (in the layout directory `layout`) if it has the same tag, else the
    /// new one (now pinned).
    fn adopt_hold_program(ebpf: &mut Ebpf, layout: &Path) -> Result<SchedClassifier> {
        let name = HOLD_PROGRAM;
        let pin = layout.join("progs").join(name);
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or(Error::Missing {
                kind: "program",
                name,
            })?
            .try_into()
            .map_err(|e| Error::program(format!("program {name}"), e))?;
        prog.load()
            .map_err(|e| Error::program(format!("loading {name}"), e))?;
        let tag = |p: &SchedClassifier| {
            p.info()
                .map(|i| i.tag())
                .map_err(|e| Error::program(format!("info of {name}"), e))
        };
        let new_tag = tag(prog)?;
        let from_pin = || {
            SchedClassifier::from_pin(&pin)
                .map_err(|e| Error::program(format!("opening {}", pin.display()), e))
        };
        if pin.exists() {
            let pinned = from_pin()?;
            if tag(&pinned)? == new_tag {
                return Ok(pinned);
            }
            fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
        }
        prog.pin(&pin).map_err(|e| Error::Link {
            op: "pinning program",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        from_pin()
    }

    /// Loads `name` from the object and returns the program to use: the
    /// pinned one (in the layout directory `layout`) if it has the same tag,
    /// else the new one (now pinned).
    fn adopt_program(ebpf: &mut Ebpf, layout: &Path, name: &'static str) -> Result<(Xdp, bool)> {
        let pin = layout.join("progs").join(name);
        let prog: &mut Xdp = ebpf
            .program_mut(name)
            .ok_or(Error::Missing {
                kind: "program",
                name,
            })?
            .try_into()
            .map_err(|e| Error::program(format!("program {name}"), e))?;
        let attach_type = if name == CPUMAP_PROGRAM {
            aya_obj::programs::XdpAttachType::CpuMap
        } else {
            aya_obj::programs::XdpAttachType::Interface
        };
        prog.load()
            .map_err(|e| Error::program(format!("loading {name}"), e))?;
        let new_tag = prog
            .info()
            .map_err(|e| Error::program(format!("info of {name}"), e))?
            .tag();
        let mut replaced = false;
        if pin.exists() {
            let pinned = Xdp::from_pin(&pin, attach_type)
                .map_err(|e| Error::program(format!("opening {}", pin.display()), e))?;
            let old_tag = pinned
                .info()
                .map_err(|e| Error::program(format!("info of {}", pin.display()), e))?
                .tag();
            if old_tag == new_tag {
                debug!(program = name, "reusing pinned program");
                return Ok((pinned, false));
            }
            info!(program = name, old_tag, new_tag, "replacing pinned program");
            fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
            replaced = true;
        }
        prog.pin(&pin).map_err(|e| Error::Link {
            op: "pinning program",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        let pinned = Xdp::from_pin(&pin, attach_type)
            .map_err(|e| Error::program(format!("opening {}", pin.display()), e))?;
        Ok((pinned, replaced))
    }

    /// The pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Whether [`Datapath::open`] replaced pinned programs with new code.
    pub fn upgraded(&self) -> bool {
        self.upgraded
    }

    /// The migration from an older layout [`Datapath::open`] carried out,
    /// if it found one.
    pub fn migration(&self) -> Option<&crate::migrate::Migration> {
        self.migration.as_ref()
    }

    /// This build of the programs: `<crate version>+<tag of the program on
    /// host veths>`, as written in the datapath's meta.
    pub fn build(&self) -> Result<String> {
        let tag = self
            .from_pod
            .info()
            .map_err(|e| Error::program("program info", e))?
            .tag();
        Ok(format!("{}+{tag:016x}", env!("CARGO_PKG_VERSION")))
    }

    /// Each program's name and kernel id.
    pub fn program_ids(&self) -> Result<Vec<(&'static str, u32)>> {
        let id =
            |info: std::result::Result<aya::programs::ProgramInfo, aya::programs::ProgramError>| {
                info.map(|i| i.id())
                    .map_err(|e| Error::program("program info", e))
            };
        Ok(vec![
            (FROM_POD_PROGRAM, id(self.from_pod.info())?),
            (CPUMAP_PROGRAM, id(self.cpumap.info())?),
            (HOLD_PROGRAM, id(self.hold.info())?),
        ])
    }

    /// Kernel id of the hold program.
    pub(crate) fn hold_program_id(&self) -> Result<u32> {
        Ok(self
            .hold
            .info()
            .map_err(|e| Error::program("program info", e))?
            .id())
    }

    pub(crate) fn swap_pinned_link(&mut self, pin: &Path) -> Result<()> {
        self.swap_link(pin)
    }

    /// The maps.
    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// The maps, to update.
    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// The program that runs on pod host veths, e.g. for `test_run`.
    pub fn from_pod_program(&self) -> &Xdp {
        &self.from_pod
    }

    /// Kernel id of the program that runs on host veths.
    pub fn from_pod_program_id(&self) -> Result<u32> {
        Ok(self
            .from_pod
            .info()
            .map_err(|e| Error::program("program info", e))?
            .id())
    }

    fn link_pin(&self, ifindex: u32, mode: AttachMode) -> PathBuf {
        link_pin(&self.pin_dir, ifindex, LinkKind::Xdp(mode))
    }

    /// Holds the pod of host veth `ifindex` (named `ifname` in the calling
    /// thread's network namespace): the hold program on both tc hooks of
    /// the veth, first in their order, through pinned tcx links. Nothing
    /// but ARP and neighbour discovery reaches or leaves the pod until
    /// [`Datapath::release`]. Idempotent; whether anything was attached.
    pub fn hold(&mut self, ifindex: u32, ifname: &str) -> Result<bool> {
        let mut changed = false;
        for hook in HoldHook::ALL {
            let kind = LinkKind::Hold(hook);
            let pin = link_pin(&self.pin_dir, ifindex, kind);
            if pin.exists() {
                if kind.is_live(&pin, ifindex) {
                    continue;
                }
                fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
            }
            let id = self
                .hold
                .attach_with_options(
                    ifname,
                    hook.tc_type(),
                    TcAttachOptions::TcxOrder(LinkOrder::first()),
                )
                .map_err(|e| {
                    Error::program(format!("attaching the hold to {ifname} ({hook:?})"), e)
                })?;
            let link = self
                .hold
                .take_link(id)
                .map_err(|e| Error::program("taking link", e))?;
            let fd_link = FdLink::try_from(link).map_err(|e| Error::Link {
                op: "converting to an fd link (kernel without tcx?)",
                path: pin.clone(),
                message: error_chain(&e),
            })?;
            fd_link.pin(&pin).map_err(|e| Error::Link {
                op: "pinning link",
                path: pin.clone(),
                message: error_chain(&e),
            })?;
            changed = true;
        }
        Ok(changed)
    }

    /// Detaches whatever links of host veth `ifindex` are pinned under
    /// `pin_dir` (XDP and hold), without opening any layout's maps: what a
    /// DEL does where this build's layout is not ready.
    pub fn unlink(pin_dir: &Path, ifindex: u32) -> Result<bool> {
        Ok(detach_pins(pin_dir, ifindex)? | release_pins(pin_dir, ifindex)?)
    }

    /// Ends the hold of host veth `ifindex`; whether there was one.
    pub fn release(&mut self, ifindex: u32) -> Result<bool> {
        release_pins(&self.pin_dir, ifindex)
    }

    /// Whether host veth `ifindex` is held (either hook).
    pub fn is_held(&self, ifindex: u32) -> bool {
        is_held(&self.pin_dir, ifindex)
    }

    /// Attaches the datapath to host veth `ifindex` (resolved in the calling
    /// thread's network namespace) in `mode`, through a pinned link.
    ///
    /// Idempotent: a live link in the same mode running the current program is
    /// left alone; one running another program is swapped atomically; one in
    /// the other mode is replaced (the kernel allows one mode at a time).
    pub fn attach(&mut self, ifindex: u32, mode: AttachMode) -> Result<Attachment> {
        let want = self.from_pod_program_id()?;
        let other = self.link_pin(ifindex, mode.other());
        if other.exists() {
            unpin_link(&other)?;
        }
        let pin = self.link_pin(ifindex, mode);
        if pin.exists() {
            match sys::pinned_xdp_link(&pin) {
                Ok(state) if state.ifindex == ifindex => {
                    if state.prog_id == want {
                        return Ok(Attachment {
                            ifindex,
                            mode,
                            prog_id: want,
                            link_id: state.link_id,
                            changed: false,
                        });
                    }
                    self.swap_link(&pin)?;
                    return Ok(Attachment {
                        ifindex,
                        mode,
                        prog_id: want,
                        link_id: state.link_id,
                        changed: true,
                    });
                }
                Ok(state) => {
                    debug!(?state, pin = %pin.display(), "removing defunct link pin");
                }
                Err(e) => warn!(error = %e, pin = %pin.display(), "unreadable link pin"),
            }
            fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
        }

        let id = self
            .from_pod
            .attach_to_if_index(ifindex, mode.xdp_mode())
            .map_err(|e| Error::program(format!("attaching {mode} XDP to ifindex {ifindex}"), e))?;
        let link = self
            .from_pod
            .take_link(id)
            .map_err(|e| Error::program("taking link", e))?;
        let fd_link = FdLink::try_from(link).map_err(|e| Error::Link {
            op: "converting to an fd link (kernel without bpf_link for XDP?)",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        fd_link.pin(&pin).map_err(|e| Error::Link {
            op: "pinning link",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        let state = sys::pinned_xdp_link(&pin).map_err(|e| Error::Link {
            op: "reading link",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        Ok(Attachment {
            ifindex,
            mode,
            prog_id: state.prog_id,
            link_id: state.link_id,
            changed: true,
        })
    }

    fn swap_link(&mut self, pin: &Path) -> Result<()> {
        let link = PinnedLink::from_pin(pin).map_err(|e| Error::Link {
            op: "opening link",
            path: pin.to_path_buf(),
            message: error_chain(&e),
        })?;
        let xdp_link =
            aya::programs::xdp::XdpLink::try_from(FdLink::from(link)).map_err(|e| Error::Link {
                op: "opening link",
                path: pin.to_path_buf(),
                message: error_chain(&e),
            })?;
        let id = self
            .from_pod
            .attach_to_link(xdp_link)
            .map_err(|e| Error::program(format!("swapping program of {}", pin.display()), e))?;
        // The pin keeps the link; dropping our fd detaches nothing.
        drop(self.from_pod.take_link(id));
        info!(pin = %pin.display(), "swapped program atomically");
        Ok(())
    }

    fn swap_all_links(&mut self) -> Result<()> {
        for (ifindex, kind, pin) in self.link_pins()? {
            if matches!(kind, LinkKind::Xdp(_)) && kind.is_live(&pin, ifindex) {
                self.swap_link(&pin)?;
            }
        }
        Ok(())
    }

    fn refresh_cpumap_programs(&mut self) -> Result<()> {
        for cpu in 0..self.maps.cpu_map.len() {
            if let Some(qsize) = self.maps.cpu_queue_size(cpu)? {
                self.enable_cpu(cpu, qsize)?;
            }
        }
        Ok(())
    }

    /// The attachment of `ifindex`, if a live pinned link exists.
    pub fn attachment(&self, ifindex: u32) -> Result<Option<Attachment>> {
        for mode in [AttachMode::Native, AttachMode::Generic] {
            let pin = self.link_pin(ifindex, mode);
            if !pin.exists() {
                continue;
            }
            if let Ok(s) = sys::pinned_xdp_link(&pin) {
                if s.ifindex == ifindex {
                    return Ok(Some(Attachment {
                        ifindex,
                        mode,
                        prog_id: s.prog_id,
                        link_id: s.link_id,
                        changed: false,
                    }));
                }
            }
        }
        Ok(None)
    }

    /// Detaches the datapath from `ifindex`; `Ok(false)` if it was not attached.
    pub fn detach(&mut self, ifindex: u32) -> Result<bool> {
        detach_pins(&self.pin_dir, ifindex)
    }

    fn link_pins(&self) -> Result<Vec<(u32, LinkKind, PathBuf)>> {
        link_pins(&self.pin_dir)
    }

    /// Removes link pins (XDP and hold) whose device is gone (a pinned link
    /// outlives its veth); returns the ifindexes cleaned.
    pub fn gc_links(&mut self) -> Result<Vec<u32>> {
        let mut removed = Vec::new();
        for (ifindex, kind, pin) in self.link_pins()? {
            if !kind.is_live(&pin, ifindex) {
                match fs::remove_file(&pin) {
                    Ok(()) => removed.push(ifindex),
                    // The veth's DEL unpinned it first.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(Error::io("unpinning", &pin, e)),
                }
            }
        }
        Ok(removed)
    }

    /// Enables cpumap delivery on `cpu` with a queue of `queue_size` frames,
    /// running the second-stage program there.
    pub fn enable_cpu(&mut self, cpu: u32, queue_size: u32) -> Result<()> {
        if cpu >= self.maps.cpu_map.len() {
            return Err(Error::Invalid {
                what: "cpu",
                why: format!("{cpu} is beyond the cpumap ({})", self.maps.cpu_map.len()),
            });
        }
        let fd = self
            .cpumap
            .fd()
            .map_err(|e| Error::program("cpumap program fd", e))?;
        self.maps
            .cpu_map
            .set(cpu, queue_size, Some(fd), 0)
            .map_err(|e| Error::XdpMap {
                op: format!("enabling cpumap CPU {cpu}"),
                source: Box::new(e),
            })
    }

    /// Disables cpumap delivery on `cpu`.
    pub fn disable_cpu(&mut self, cpu: u32) -> Result<()> {
        // The kernel frees a cpumap entry written with queue size 0
        // (cpu_map_update_elem); aya 0.14 has no CpuMap::remove.
        self.maps
            .cpu_map
            .set(cpu, 0, None, 0)
            .map_err(|e| Error::XdpMap {
                op: format!("disabling cpumap CPU {cpu}"),
                source: Box::new(e),
            })
    }

    /// The pins of a complete datapath missing under `pin_dir` (maps,
    /// programs, the links directory): empty when nothing is.
    pub fn missing_pins(pin_dir: &Path) -> Vec<PathBuf> {
        let layout = layout_dir(pin_dir);
        MAPS.iter()
            .map(|m| layout.join(m))
            .chain(
                [FROM_POD_PROGRAM, CPUMAP_PROGRAM, HOLD_PROGRAM]
                    .iter()
                    .map(|p| layout.join("progs").join(p)),
            )
            .chain([pin_dir.join("links")])
            .filter(|p| !p.exists())
            .collect()
    }

    /// Removes every pin under `pin_dir`, detaching the datapath (and every
    /// hold) from every veth and freeing its maps once no process holds them.
    pub fn uninstall(pin_dir: &Path) -> Result<()> {
        if !pin_dir.exists() {
            return Ok(());
        }
        for (_, _, pin) in link_pins(pin_dir)? {
            unpin_link(&pin)?;
        }
        fs::remove_dir_all(pin_dir).map_err(|e| Error::io("removing", pin_dir, e))
    }
}

/// Detaches the link pinned at `pin` *now* (BPF_LINK_DETACH), then removes
/// the pin. Unlinking a bpffs pin alone releases the link only when the
/// inode's reference goes, later, from an RCU callback: the program would
/// linger on the device for a moment, and the device's features with it (a
/// veth peer's TSO is forced off while native XDP is on). `Ok(false)` if
/// there was no pin.
fn unpin_link(pin: &Path) -> Result<bool> {
    if !pin.exists() {
        return Ok(false);
    }
    if let Err(e) = sys::detach_pinned_link(pin) {
        warn!(pin = %pin.display(), error = %e, "BPF_LINK_DETACH failed; unpinning only");
    }
    match fs::remove_file(pin) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("unpinning", pin, e)),
    }
}

pub(crate) fn link_pins(pin_dir: &Path) -> Result<Vec<(u32, LinkKind, PathBuf)>> {
    let dir = pin_dir.join("links");
    let mut out = Vec::new();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io("listing", &dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", &dir, e))?;
        let name = entry.file_name();
        let Some((idx, suffix)) = name.to_str().and_then(|n| n.split_once('_')) else {
            continue;
        };
        if let (Ok(idx), Some(kind)) = (idx.parse::<u32>(), LinkKind::parse(suffix)) {
            out.push((idx, kind, entry.path()));
        }
    }
    Ok(out)
}

/// Detaches the XDP links of `ifindex`; whether there was one.
fn detach_pins(pin_dir: &Path, ifindex: u32) -> Result<bool> {
    unpin_kinds(pin_dir, ifindex, |k| matches!(k, LinkKind::Xdp(_)))
}

/// Removes the hold links of `ifindex`; whether there was one.
fn release_pins(pin_dir: &Path, ifindex: u32) -> Result<bool> {
    unpin_kinds(pin_dir, ifindex, |k| matches!(k, LinkKind::Hold(_)))
}

fn unpin_kinds(pin_dir: &Path, ifindex: u32, which: impl Fn(LinkKind) -> bool) -> Result<bool> {
    let mut any = false;
    for kind in LinkKind::ALL.into_iter().filter(|k| which(*k)) {
        any |= unpin_link(&link_pin(pin_dir, ifindex, kind))?;
    }
    Ok(any)
}

/// Whether a hold link of `ifindex` is pinned under `pin_dir` (what the CNI's
/// DEL and the agent read without opening the datapath).
pub fn is_held(pin_dir: &Path, ifindex: u32) -> bool {
    HoldHook::ALL
        .into_iter()
        .any(|h| link_pin(pin_dir, ifindex, LinkKind::Hold(h)).exists())
}
