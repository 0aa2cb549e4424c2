//! The NetworkPolicy maps (`pol_*`, lib/policy.h): each isolated pod's
//! verdicts, written by the agent alone, and the flow table the programs
//! keep. A pod's verdicts change as one: the new ones are written under a
//! new id beside the old, the pod's records then name the new id (one
//! write per address), the generation is bumped (flows allowed before are
//! checked again at their next packet), and only then do the old entries
//! go. A program sees the old verdicts or the new, never a mix.

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
};

use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        Array, HashMap as BpfHash, Map, MapData, MapError, PerCpuArray,
    },
    Ebpf,
};

use super::maps::{is_full, removed};
use crate::{
    abi::{
        family_addr, PolNamedKey, PolPeerKey, PolPod, PolPodKey, PolPortKey, PolState,
        MAX_POL_NAMED, MAX_POL_PEERS, MAX_POL_PODS, MAX_POL_PORTS, POL_NAMED_OUT,
        POL_PEER_FIXED_BITS, POL_PORT_FIXED_BITS, POL_STATS,
    },
    Error, Result,
};

/// One pod's verdicts, as the programs read them: what the agent compiles
/// from the policies that select the pod (`xdpcni-agent`'s netpol).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodVerdicts {
    /// `POL_ISOLATED_IN`, `POL_ISOLATED_OUT` (`POL_NAMED_OUT` is set here
    /// when `named` has entries).
    pub flags: u32,
    /// Groups allowing every peer, by direction (`POL_INGRESS`, `POL_EGRESS`).
    pub any_peer: [u64; 2],
    /// Groups allowing every port and protocol, by direction.
    pub any_port: [u64; 2],
    /// (direction, prefix address, prefix length, groups): the groups whose
    /// peers the prefix holds. Prefixes of one direction do not overlap.
    pub peers: Vec<(u8, IpAddr, u8, u64)>,
    /// (direction, protocol, port, prefix length, groups): the groups whose
    /// ports the prefix of ports holds. Prefixes of one direction and
    /// protocol do not overlap.
    pub ports: Vec<(u8, u8, u16, u8, u64)>,
    /// Egress (destination, protocol, port)s allowed by a named port.
    pub named: Vec<(IpAddr, u8, u16)>,
}

/// What one pod's verdicts occupy, to remove them.
#[derive(Clone, Default)]
struct Written {
    verdicts: PodVerdicts,
    peers: Vec<Key<PolPeerKey>>,
    ports: Vec<Key<PolPortKey>>,
    named: Vec<PolNamedKey>,
}

/// What [`PolicyMaps::sync`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicySynced {
    /// Pods whose verdicts were written anew.
    pub written: usize,
    /// Pods whose verdicts went.
    pub removed: usize,
    /// Pods whose verdicts could not be written (a map is full): their
    /// addresses and why. They have none in the maps.
    pub failed: Vec<(Vec<IpAddr>, String)>,
    /// The generation in force after it.
    pub generation: u64,
}

/// Counts of the policy check (`pol_stats`), summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyStats {
    /// New flows allowed and recorded.
    pub new: u64,
    /// Packets of recorded flows.
    pub hit: u64,
    /// Recorded flows allowed again under new verdicts.
    pub recheck: u64,
    /// Packets refused.
    pub refused: u64,
    /// Packets left to the kernel's rules.
    pub kernel: u64,
}

impl PolicyStats {
    /// The counts in the `pol_stats` pinned under `pin_dir` (this build's
    /// layout), without opening the other maps: what a scrape reads.
    pub fn read_pinned(pin_dir: &std::path::Path) -> Result<Self> {
        let path = super::layout_dir(pin_dir).join("pol_stats");
        let data = MapData::from_pin(&path)
            .map_err(|e| Error::map(format!("opening {}", path.display()), e))?;
        let map: PerCpuArray<MapData, u64> = typed("pol_stats", Some(Map::PerCpuArray(data)))?;
        let mut v = [0u64; POL_STATS as usize];
        for (i, slot) in v.iter_mut().enumerate() {
            let per_cpu = map
                .get(&(i as u32), 0)
                .map_err(map_err("reading pol_stats".into()))?;
            *slot = per_cpu.iter().sum();
        }
        Ok(Self {
            new: v[0],
            hit: v[1],
            recheck: v[2],
            refused: v[3],
            kernel: v[4],
        })
    }
}

/// The policy maps of a datapath.
pub struct PolicyMaps {
    pods: BpfHash<MapData, PolPodKey, PolPod>,
    peers: LpmTrie<MapData, PolPeerKey, u64>,
    ports: LpmTrie<MapData, PolPortKey, u64>,
    named: BpfHash<MapData, PolNamedKey, u32>,
    state: Array<MapData, PolState>,
    /// Id -> what it occupies; filled from the maps at open.
    written: HashMap<u32, Written>,
    next_id: u32,
}

fn map_err(doing: String) -> impl FnOnce(MapError) -> Error {
    move |e| Error::map(doing, e)
}

fn full_or(map: &'static str, capacity: u32, op: String) -> impl FnOnce(MapError) -> Error {
    move |e| {
        if is_full(&e) {
            Error::MapFull { map, capacity, op }
        } else {
            Error::map(op, e)
        }
    }
}

fn typed<T: TryFrom<Map, Error = MapError>>(name: &'static str, map: Option<Map>) -> Result<T> {
    let map = map.ok_or(Error::Missing { kind: "map", name })?;
    T::try_from(map).map_err(|e| Error::map(format!("map {name}"), e))
}

impl PolicyMaps {
    /// The policy maps of `ebpf`, just loaded (created, or reused from their
    /// pins: an older binary of the layout may not have made them).
    pub(crate) fn take(ebpf: &mut Ebpf) -> Result<Self> {
        Self::build(|name| Ok(ebpf.take_map(name)))
    }

    fn build(mut get: impl FnMut(&'static str) -> Result<Option<Map>>) -> Result<Self> {
        let mut m = Self {
            pods: typed("pol_pods", get("pol_pods")?)?,
            peers: typed("pol_peers", get("pol_peers")?)?,
            ports: typed("pol_ports", get("pol_ports")?)?,
            named: typed("pol_named", get("pol_named")?)?,
            state: typed("pol_state", get("pol_state")?)?,
            written: HashMap::new(),
            next_id: 1,
        };
        m.index()?;
        Ok(m)
    }

    /// Rebuilds what each id occupies from the maps (after a start: an
    /// earlier agent wrote them).
    fn index(&mut self) -> Result<()> {
        let mut written: HashMap<u32, Written> = HashMap::new();
        for kv in self.pods.iter() {
            let (_, pod) = kv.map_err(map_err("reading pol_pods".into()))?;
            written.entry(pod.id).or_default().verdicts = verdicts_of(&pod);
        }
        for k in self.peers.keys() {
            let k = k.map_err(map_err("reading pol_peers".into()))?;
            written.entry(k.data().id).or_default().peers.push(k);
        }
        for k in self.ports.keys() {
            let k = k.map_err(map_err("reading pol_ports".into()))?;
            written.entry(k.data().id).or_default().ports.push(k);
        }
        for k in self.named.keys() {
            let k = k.map_err(map_err("reading pol_named".into()))?;
            written.entry(k.id).or_default().named.push(k);
        }
        self.next_id = written.keys().max().map_or(1, |m| m.wrapping_add(1).max(1));
        // The entries are not read back: a pod found here is written anew
        // at the first sync (its verdicts compare unequal), then its old id goes.
        self.written = written;
        Ok(())
    }

    /// The id of the pod of `addrs` and its verdicts, if it has some.
    fn current(&self, addrs: &[IpAddr]) -> Result<Option<(u32, PolPod)>> {
        for ip in addrs {
            match self.pods.get(&PolPodKey::of(*ip), 0) {
                Ok(p) => return Ok(Some((p.id, p))),
                Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(Error::map(format!("reading pol_pods {ip}"), e)),
            }
        }
        Ok(None)
    }

    /// Makes the maps hold exactly `want`: (the pod's addresses, its
    /// verdicts, the CLOCK_MONOTONIC ns its window closes at). Pods with
    /// verdicts not in `want` lose them. The generation is bumped when
    /// anything changed.
    pub fn sync(&mut self, want: &[(Vec<IpAddr>, PodVerdicts, u64)]) -> Result<PolicySynced> {
        let mut out = PolicySynced::default();
        let mut keep: BTreeSet<PolPodKey> = BTreeSet::new();
        let mut stale: Vec<u32> = Vec::new();
        for (addrs, verdicts, window) in want {
            for ip in addrs {
                keep.insert(PolPodKey::of(*ip));
            }
            match self.write_pod(addrs, verdicts, *window) {
                Ok(Some(old)) => {
                    out.written += 1;
                    stale.extend(old);
                }
                Ok(None) => {}
                Err(e @ Error::MapFull { .. }) => {
                    for ip in addrs {
                        keep.remove(&PolPodKey::of(*ip));
                    }
                    out.failed.push((addrs.clone(), e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        // Pods no longer wanted (or whose write failed): records first.
        let have: Vec<(PolPodKey, PolPod)> = self
            .pods
            .iter()
            .collect::<std::result::Result<_, _>>()
            .map_err(map_err("reading pol_pods".into()))?;
        for (k, p) in have {
            if keep.contains(&k) {
                continue;
            }
            removed(self.pods.remove(&k), || "removing a pol_pods record".into())?;
            out.removed += 1;
            stale.push(p.id);
        }
        if out.written > 0 || out.removed > 0 {
            out.generation = self.bump()?;
        } else {
            out.generation = self.generation()?;
        }
        // Ids no record names any more: their entries go, after the bump.
        let named: std::collections::HashSet<u32> = self
            .pods
            .iter()
            .filter_map(|kv| kv.ok().map(|(_, p)| p.id))
            .collect();
        stale.sort_unstable();
        stale.dedup();
        for id in stale.into_iter().filter(|id| !named.contains(id)) {
            self.remove_id(id)?;
        }
        Ok(out)
    }

    /// Writes the verdicts of the pod of `addrs` (nothing when they are in
    /// force already): `Some(old ids)` when something was written.
    fn write_pod(
        &mut self,
        addrs: &[IpAddr],
        verdicts: &PodVerdicts,
        window: u64,
    ) -> Result<Option<Vec<u32>>> {
        let mut verdicts = verdicts.clone();
        if !verdicts.named.is_empty() {
            verdicts.flags |= POL_NAMED_OUT;
        }
        let cur = self.current(addrs)?;
        let mut olds = Vec::new();
        let id = match cur {
            Some((id, pod))
                if self
                    .written
                    .get(&id)
                    .is_some_and(|w| w.verdicts == verdicts) =>
            {
                let all_same = addrs.iter().all(|ip| {
                    self.pods
                        .get(&PolPodKey::of(*ip), 0)
                        .is_ok_and(|p| p.id == id && p.window_until == window)
                });
                if all_same && pod.window_until == window {
                    return Ok(None);
                }
                id
            }
            other => {
                let id = self.write_entries(&verdicts)?;
                if let Some((old, _)) = other {
                    olds.push(old);
                }
                id
            }
        };
        let rec = PolPod {
            id,
            flags: verdicts.flags,
            any_peer: verdicts.any_peer,
            any_port: verdicts.any_port,
            window_until: window,
        };
        for ip in addrs {
            if let Ok(p) = self.pods.get(&PolPodKey::of(*ip), 0) {
                if p.id != id {
                    olds.push(p.id);
                }
            }
            self.pods
                .insert(PolPodKey::of(*ip), rec, 0)
                .map_err(full_or(
                    "pol_pods",
                    MAX_POL_PODS,
                    format!("writing pol_pods {ip}"),
                ))?;
        }
        Ok(Some(olds))
    }

    /// Writes the entries of `v` under a new id, which it returns; on a
    /// failure what it wrote goes again.
    fn write_entries(&mut self, v: &PodVerdicts) -> Result<u32> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let mut w = Written {
            verdicts: v.clone(),
            ..Written::default()
        };
        let result = self.put_entries(id, v, &mut w);
        self.written.insert(id, w);
        if let Err(e) = result {
            self.remove_id(id)?;
            return Err(e);
        }
        Ok(id)
    }

    fn put_entries(&mut self, id: u32, v: &PodVerdicts, w: &mut Written) -> Result<()> {
        for (dir, ip, plen, mask) in &v.peers {
            let (family, addr) = family_addr(*ip);
            let key = Key::new(
                POL_PEER_FIXED_BITS + u32::from(*plen),
                PolPeerKey {
                    id,
                    dir: *dir,
                    family,
                    pad: [0; 2],
                    addr,
                },
            );
            self.peers.insert(&key, mask, 0).map_err(full_or(
                "pol_peers",
                MAX_POL_PEERS,
                format!("writing pol_peers {ip}/{plen}"),
            ))?;
            w.peers.push(key);
        }
        for (dir, proto, port, plen, mask) in &v.ports {
            let key = Key::new(
                POL_PORT_FIXED_BITS + u32::from(*plen),
                PolPortKey {
                    id,
                    dir: *dir,
                    proto: *proto,
                    port: port.to_be(),
                },
            );
            self.ports.insert(&key, mask, 0).map_err(full_or(
                "pol_ports",
                MAX_POL_PORTS,
                format!("writing pol_ports {port}/{plen}"),
            ))?;
            w.ports.push(key);
        }
        for (ip, proto, port) in &v.named {
            let (family, addr) = family_addr(*ip);
            let key = PolNamedKey {
                id,
                family,
                proto: *proto,
                port: port.to_be(),
                addr,
            };
            self.named.insert(key, 1, 0).map_err(full_or(
                "pol_named",
                MAX_POL_NAMED,
                format!("writing pol_named {ip} {port}"),
            ))?;
            w.named.push(key);
        }
        Ok(())
    }

    /// Removes every entry of `id`.
    fn remove_id(&mut self, id: u32) -> Result<()> {
        let Some(w) = self.written.remove(&id) else {
            return Ok(());
        };
        for k in &w.peers {
            removed(self.peers.remove(k), || "removing a pol_peers entry".into())?;
        }
        for k in &w.ports {
            removed(self.ports.remove(k), || "removing a pol_ports entry".into())?;
        }
        for k in &w.named {
            removed(self.named.remove(k), || "removing a pol_named entry".into())?;
        }
        Ok(())
    }

    /// The generation in force.
    pub fn generation(&self) -> Result<u64> {
        self.state
            .get(&0, 0)
            .map(|s| s.generation)
            .map_err(map_err("reading pol_state".into()))
    }

    /// Bumps the generation: every recorded flow is checked again at its
    /// next packet. Returns the new one.
    pub fn bump(&mut self) -> Result<u64> {
        let generation = self.generation()? + 1;
        self.state
            .set(0, PolState { generation }, 0)
            .map_err(map_err("writing pol_state".into()))?;
        Ok(generation)
    }
}

/// The verdicts a pol_pods record says alone (its entries are not read
/// back: they compare unequal to any compiled verdicts with entries).
fn verdicts_of(p: &PolPod) -> PodVerdicts {
    PodVerdicts {
        flags: p.flags,
        any_peer: p.any_peer,
        any_port: p.any_port,
        peers: Vec::new(),
        ports: Vec::new(),
        named: if p.flags & POL_NAMED_OUT != 0 {
            vec![(IpAddr::from([0u8; 4]), 0, 0)]
        } else {
            Vec::new()
        },
    }
}

impl super::Datapath {
    fn policy_maps(&mut self) -> Result<&mut PolicyMaps> {
        self.policy.as_mut().ok_or(Error::Missing {
            kind: "map",
            name: "pol_pods",
        })
    }

    /// Makes the NetworkPolicy verdicts those of `want` (see
    /// [`PolicyMaps::sync`]).
    pub fn sync_policy(
        &mut self,
        want: &[(Vec<IpAddr>, PodVerdicts, u64)],
    ) -> Result<PolicySynced> {
        self.policy_maps()?.sync(want)
    }
}
