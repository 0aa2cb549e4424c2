//! Which sockets are translated: the network namespaces of `svc_netns`
//! (the node's pods, and the node itself under `nodeSockets`), their own
//! addresses in `svc_own`, and the source a node's call keeps
//! (`svc_node_src`); and which outside clients a LoadBalancer IP serves
//! (`svc_source_ranges`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    HashMap, MapData,
};

use super::{full_or, map, map_ref, Services};
use crate::{
    abi::{
        family_addr, SvcAddr, SvcIp, SvcOwnKey, SvcRangeKey, MAX_SERVICES, MAX_SVC_NETNS,
        MAX_SVC_OWN, MAX_SVC_RANGES, RANGE_FIXED_BITS, SVC_NS_NODE, SVC_NS_POD,
    },
    datapath::maps::removed,
    Result,
};

impl Services {
    /// Translates the sockets of the network namespace with this cookie
    /// (`SO_NETNS_COOKIE`) from now on, as a pod's ([`SVC_NS_POD`]) or the
    /// node's own ([`SVC_NS_NODE`]).
    pub fn add_netns(&mut self, cookie: u64, flags: u32) -> Result<()> {
        let mut m: HashMap<&mut MapData, u64, u32> = map(&mut self.ebpf, "svc_netns")?;
        m.insert(cookie, flags, 0).map_err(|e| {
            full_or(
                e,
                "svc_netns",
                MAX_SVC_NETNS,
                format!("adding netns {cookie}"),
            )
        })
    }

    /// Makes `svc_netns` hold exactly the namespaces of `want` (namespace
    /// cookie -> its own addresses: the node's pods, and the node itself
    /// when `node` names its cookie) and `svc_own` exactly their addresses.
    /// A new namespace's addresses go in before the namespace (its first
    /// translated call already knows itself), a gone one leaves before its
    /// addresses. Returns the namespaces (added, removed).
    pub fn sync_netns(
        &mut self,
        want: &BTreeMap<u64, BTreeSet<IpAddr>>,
        node: Option<u64>,
    ) -> Result<(usize, usize)> {
        let have: BTreeMap<u64, u32> = {
            let m: HashMap<&MapData, u64, u32> = map_ref(&self.ebpf, "svc_netns")?;
            m.iter().filter_map(|kv| kv.ok()).collect()
        };
        let have_own: BTreeSet<SvcOwnKey> = {
            let m: HashMap<&MapData, SvcOwnKey, u32> = map_ref(&self.ebpf, "svc_own")?;
            m.keys().filter_map(|k| k.ok()).collect()
        };
        let want_own: BTreeSet<SvcOwnKey> = want
            .iter()
            .flat_map(|(ns, ips)| ips.iter().map(|ip| SvcOwnKey::new(*ns, *ip)))
            .collect();
        let mut own: HashMap<&mut MapData, SvcOwnKey, u32> = map(&mut self.ebpf, "svc_own")?;
        for k in want_own.difference(&have_own) {
            own.insert(k, 1, 0)
                .map_err(|e| full_or(e, "svc_own", MAX_SVC_OWN, format!("adding {k:?}")))?;
        }
        let mut counts = (0, 0);
        for c in want.keys() {
            let flags = if Some(*c) == node {
                SVC_NS_POD | SVC_NS_NODE
            } else {
                SVC_NS_POD
            };
            match have.get(c) {
                Some(f) if *f == flags => {}
                had => {
                    self.add_netns(*c, flags)?;
                    counts.0 += usize::from(had.is_none());
                }
            }
        }
        for c in have.keys().filter(|c| !want.contains_key(c)) {
            if self.remove_netns(*c)? {
                counts.1 += 1;
            }
        }
        let mut own: HashMap<&mut MapData, SvcOwnKey, u32> = map(&mut self.ebpf, "svc_own")?;
        for k in have_own.difference(&want_own) {
            removed(own.remove(k), || format!("removing {k:?}"))?;
        }
        Ok(counts)
    }

    /// Makes `svc_node_src` hold exactly `want`: frontend -> the source a
    /// translated call of the node's own to it binds to (see `struct
    /// svc_ip`). Returns the entries (written, removed).
    pub fn sync_node_src(&mut self, want: &BTreeMap<SvcAddr, IpAddr>) -> Result<(usize, usize)> {
        let want: BTreeMap<SvcAddr, SvcIp> = want
            .iter()
            .map(|(fe, src)| (*fe, SvcIp::from(*src)))
            .collect();
        let have: BTreeMap<SvcAddr, SvcIp> = {
            let m: HashMap<&MapData, SvcAddr, SvcIp> = map_ref(&self.ebpf, "svc_node_src")?;
            m.iter().filter_map(|kv| kv.ok()).collect()
        };
        let mut m: HashMap<&mut MapData, SvcAddr, SvcIp> = map(&mut self.ebpf, "svc_node_src")?;
        let mut counts = (0, 0);
        for (k, v) in &want {
            if have.get(k) != Some(v) {
                m.insert(k, v, 0).map_err(|e| {
                    full_or(e, "svc_node_src", MAX_SERVICES, format!("adding {k:?}"))
                })?;
                counts.0 += 1;
            }
        }
        for k in have.keys().filter(|k| !want.contains_key(k)) {
            if removed(m.remove(k), || format!("removing {k:?}"))? {
                counts.1 += 1;
            }
        }
        Ok(counts)
    }

    /// Stops translating that namespace's sockets.
    pub fn remove_netns(&mut self, cookie: u64) -> Result<bool> {
        let mut m: HashMap<&mut MapData, u64, u32> = map(&mut self.ebpf, "svc_netns")?;
        removed(m.remove(&cookie), || format!("removing netns {cookie}"))
    }

    /// Adds to `svc_source_ranges` what `want` holds and it lacks (before
    /// the frontends are written: a LoadBalancer IP never appears without
    /// its ranges). How many entries were written.
    pub fn add_source_ranges(&mut self, want: &SourceRanges) -> Result<usize> {
        let have = self.source_range_entries()?;
        let mut m: LpmTrie<&mut MapData, SvcRangeKey, u32> =
            map(&mut self.ebpf, "svc_source_ranges")?;
        let mut n = 0;
        for (k, allow) in range_entries(want) {
            if have.get(&k) != Some(&allow) {
                let key = Key::new(k.0, k.1);
                m.insert(&key, allow, 0).map_err(|e| {
                    full_or(
                        e,
                        "svc_source_ranges",
                        MAX_SVC_RANGES,
                        format!("adding {:?}/{}", k.1.fe, k.0),
                    )
                })?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Removes from `svc_source_ranges` what `want` does not hold (after
    /// the frontends are written). How many entries went.
    pub fn prune_source_ranges(&mut self, want: &SourceRanges) -> Result<usize> {
        let keep: BTreeMap<(u32, SvcRangeKey), u32> = range_entries(want).collect();
        let have = self.source_range_entries()?;
        let mut m: LpmTrie<&mut MapData, SvcRangeKey, u32> =
            map(&mut self.ebpf, "svc_source_ranges")?;
        let mut n = 0;
        for k in have.keys().filter(|k| !keep.contains_key(*k)) {
            if removed(m.remove(&Key::new(k.0, k.1)), || {
                format!("removing {:?}/{}", k.1.fe, k.0)
            })? {
                n += 1;
            }
        }
        Ok(n)
    }

    fn source_range_entries(&self) -> Result<BTreeMap<(u32, SvcRangeKey), u32>> {
        let m: LpmTrie<&MapData, SvcRangeKey, u32> = map_ref(&self.ebpf, "svc_source_ranges")?;
        Ok(m.iter()
            .filter_map(|kv| kv.ok())
            .map(|(k, v)| ((k.prefix_len(), k.data()), v))
            .collect())
    }
}

/// Outside frontend (a LoadBalancer IP) -> its `loadBalancerSourceRanges`
/// (network address, prefix length), none empty.
pub type SourceRanges = BTreeMap<SvcAddr, Vec<(IpAddr, u8)>>;

/// The trie's entries for `want`: each frontend's own (prefix
/// [`RANGE_FIXED_BITS`], refused: 0), and each range of the frontend's
/// family (its prefix after the frontend's, allowed: 1).
fn range_entries(want: &SourceRanges) -> impl Iterator<Item = ((u32, SvcRangeKey), u32)> + '_ {
    want.iter().flat_map(|(fe, ranges)| {
        let own = (
            (
                RANGE_FIXED_BITS,
                SvcRangeKey {
                    fe: *fe,
                    src: [0; 16],
                },
            ),
            0,
        );
        let v4 = fe.ip().is_some_and(|ip| ip.is_ipv4());
        std::iter::once(own).chain(ranges.iter().filter(move |(ip, _)| ip.is_ipv4() == v4).map(
            |(ip, len)| {
                let (_, src) = family_addr(*ip);
                (
                    (
                        RANGE_FIXED_BITS + u32::from(*len),
                        SvcRangeKey { fe: *fe, src },
                    ),
                    1,
                )
            },
        ))
    })
}
