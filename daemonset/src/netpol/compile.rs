//! A pod's rules ([`PodRules`], the model's output that the nftables table
//! is written from) turned into the verdicts the programs read
//! ([`PodVerdicts`], the `pol_*` maps): the second output of the one
//! translation.
//!
//! Rules with the same ports form a group (one bit of a 64-bit mask); a
//! group's peers are the union of its rules' peers. Address space is cut at
//! every group's range ends into intervals, each with the mask of the groups
//! whose peers hold it, and each interval written as the prefixes that cover
//! it (LPM entries that never overlap); ports alike per protocol. A flow is
//! allowed in a direction when one group allows both its peer and its port,
//! which is the union of rules the table's chains check. Named egress ports
//! are exact (peer, protocol, port) entries of their own.

use std::{collections::BTreeMap, net::IpAddr};

use xdpcni_ebpf::{
    abi::{POL_EGRESS, POL_INGRESS, POL_ISOLATED_IN, POL_ISOLATED_OUT, POL_MAX_GROUPS},
    PodVerdicts,
};

use super::{
    addrs::AddrSet,
    model::{Enforcement, Peers, PodRules, Ports, Proto, Rule},
    ports::PortRange,
};

/// Why a pod's rules cannot be verdicts in the datapath (the pod stays on
/// the kernel path, where the table enforces them).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotCompiled {
    /// More groups (distinct port sets) than a mask has bits.
    #[error("{0} distinct port sets in one direction (the datapath holds {POL_MAX_GROUPS})")]
    TooManyGroups(usize),
}

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// The protocols the fast path carries with ports; SCTP never takes it.
fn ipproto(p: Proto) -> Option<u8> {
    match p {
        Proto::Tcp => Some(IPPROTO_TCP),
        Proto::Udp => Some(IPPROTO_UDP),
        Proto::Sctp => None,
    }
}

/// The prefixes covering `[lo, hi]` in a space of `width` bits: (first
/// value, prefix length).
pub fn prefixes(lo: u128, hi: u128, width: u32) -> Vec<(u128, u8)> {
    let ones = |k: u32| {
        if k >= 128 {
            u128::MAX
        } else {
            (1u128 << k) - 1
        }
    };
    let mut out = Vec::new();
    let mut lo = lo;
    loop {
        let mut k = if lo == 0 {
            width
        } else {
            lo.trailing_zeros().min(width)
        };
        while k > 0 && ones(k) > hi - lo {
            k -= 1;
        }
        out.push((lo, (width - k) as u8));
        let last = lo + ones(k);
        if last >= hi {
            return out;
        }
        lo = last + 1;
    }
}

/// `ranges[g]`: group g's inclusive ranges. The intervals between every
/// range end, merged where neighbours are held by the same groups, each
/// with those groups (ascending); what no group holds is left out. A sweep
/// over the ends: any number of groups.
pub fn partition(ranges: &[Vec<(u128, u128)>], max: u128) -> Vec<(u128, u128, Vec<usize>)> {
    // (point, group, +1 at a start / -1 past an end)
    let mut events: Vec<(u128, usize, i32)> = Vec::new();
    for (g, rs) in ranges.iter().enumerate() {
        for &(lo, hi) in rs {
            events.push((lo, g, 1));
            if hi < max {
                events.push((hi + 1, g, -1));
            }
        }
    }
    events.sort_unstable();
    let mut held = vec![0i32; ranges.len()];
    let mut out: Vec<(u128, u128, Vec<usize>)> = Vec::new();
    let mut i = 0;
    while i < events.len() {
        let start = events[i].0;
        while i < events.len() && events[i].0 == start {
            held[events[i].1] += events[i].2;
            i += 1;
        }
        let end = events.get(i).map_or(max, |e| e.0 - 1);
        let groups: Vec<usize> = (0..held.len()).filter(|g| held[*g] > 0).collect();
        if groups.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.2 == groups && last.1.checked_add(1) == Some(start) => last.1 = end,
            _ => out.push((start, end, groups)),
        }
    }
    out
}

/// The bit mask of `groups` (all below 64).
fn mask(groups: &[usize]) -> u64 {
    groups.iter().fold(0, |m, g| m | 1 << g)
}

/// One group: rules with the same ports.
#[derive(Default)]
struct Group {
    any_peer: bool,
    peers: AddrSet,
}

/// The entries of one direction's `rules` into `v` (`dir` its index):
/// the rules grouped by their ports, each group's peers and ports as
/// intervals, the intervals partitioned into the prefixes the maps hold.
fn direction(
    rules: &[Rule],
    dir: u8,
    sets: &BTreeMap<String, AddrSet>,
    v: &mut PodVerdicts,
) -> Result<(), NotCompiled> {
    let groups = group_rules(rules, dir, sets, v);
    if groups.len() > POL_MAX_GROUPS as usize {
        return Err(NotCompiled::TooManyGroups(groups.len()));
    }
    let iv = intervals(groups, usize::from(dir), v);
    emit(dir, iv, v);
    Ok(())
}

/// Ports as written (None: any) -> the group of rules with those ports;
/// egress rules' named ports go to `v.named` as they are met.
fn group_rules(
    rules: &[Rule],
    dir: u8,
    sets: &BTreeMap<String, AddrSet>,
    v: &mut PodVerdicts,
) -> BTreeMap<Option<Vec<PortRange>>, Group> {
    let mut groups: BTreeMap<Option<Vec<PortRange>>, Group> = BTreeMap::new();
    for rule in rules {
        let key = match &rule.ports {
            Ports::Any => None,
            Ports::Only { numeric, named } => {
                if dir == POL_EGRESS {
                    for (ip, proto, port) in named {
                        if let Some(p) = ipproto(*proto) {
                            v.named.push((*ip, p, *port));
                        }
                    }
                }
                if numeric.is_empty() {
                    continue;
                }
                Some(numeric.clone())
            }
        };
        let group = groups.entry(key).or_default();
        match &rule.peers {
            Peers::Any => group.any_peer = true,
            Peers::Set(name) => {
                if let Some(set) = sets.get(name) {
                    group.peers.extend(set);
                }
            }
        }
    }
    groups
}

/// Each group's intervals, indexed by its group number: IPv4 and IPv6 peers,
/// and ports by protocol.
#[derive(Default)]
struct Intervals {
    v4: Vec<Vec<(u128, u128)>>,
    v6: Vec<Vec<(u128, u128)>>,
    by_proto: BTreeMap<u8, Vec<Vec<(u128, u128)>>>,
}

/// The groups as intervals; a group of any peer or any port sets its bit in
/// `v.any_peer` / `v.any_port` of direction `d` instead.
fn intervals(
    groups: BTreeMap<Option<Vec<PortRange>>, Group>,
    d: usize,
    v: &mut PodVerdicts,
) -> Intervals {
    let mut iv = Intervals::default();
    for (g, (ports, mut group)) in groups.into_iter().enumerate() {
        let bit = 1u64 << g;
        group.peers.normalize();
        if group.any_peer {
            v.any_peer[d] |= bit;
            iv.v4.push(Vec::new());
            iv.v6.push(Vec::new());
        } else {
            iv.v4.push(
                group
                    .peers
                    .v4()
                    .map(|(a, b)| (u128::from(u32::from(a)), u128::from(u32::from(b))))
                    .collect(),
            );
            iv.v6.push(
                group
                    .peers
                    .v6()
                    .map(|(a, b)| (u128::from(a), u128::from(b)))
                    .collect(),
            );
        }
        match ports {
            None => v.any_port[d] |= bit,
            Some(ranges) => {
                for r in ranges {
                    let Some(p) = ipproto(r.proto) else { continue };
                    let per = iv.by_proto.entry(p).or_default();
                    per.resize(g + 1, Vec::new());
                    per[g].push((u128::from(r.lo), u128::from(r.hi)));
                }
            }
        }
    }
    iv
}

/// The intervals partitioned into prefixes, each with the mask of the
/// groups it belongs to: `v.peers` and `v.ports` of direction `dir`.
fn emit(dir: u8, iv: Intervals, v: &mut PodVerdicts) {
    for (lo, hi, groups) in partition(&iv.v4, u128::from(u32::MAX)) {
        for (a, plen) in prefixes(lo, hi, 32) {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(a as u32));
            v.peers.push((dir, ip, plen, mask(&groups)));
        }
    }
    for (lo, hi, groups) in partition(&iv.v6, u128::MAX) {
        for (a, plen) in prefixes(lo, hi, 128) {
            v.peers.push((
                dir,
                IpAddr::from(std::net::Ipv6Addr::from(a)),
                plen,
                mask(&groups),
            ));
        }
    }
    for (proto, mut per) in iv.by_proto {
        for rs in &mut per {
            rs.sort_unstable();
            merge(rs);
        }
        for (lo, hi, groups) in partition(&per, u128::from(u16::MAX)) {
            for (a, plen) in prefixes(lo, hi, 16) {
                v.ports.push((dir, proto, a as u16, plen, mask(&groups)));
            }
        }
    }
}

/// Merges the overlapping and adjacent ranges of sorted `v`.
fn merge(v: &mut Vec<(u128, u128)>) {
    let mut out: Vec<(u128, u128)> = Vec::with_capacity(v.len());
    for &(lo, hi) in v.iter() {
        match out.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    *v = out;
}

/// What one direction's rules allow, cut into pieces that never overlap:
/// the elements of the table's per-pod sets (nftables refuses overlapping
/// elements in an interval set), from the same groups as the datapath's
/// verdicts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allowed {
    /// Peers allowed on every protocol and port: disjoint inclusive
    /// ranges, `[IPv4, IPv6]`.
    pub any_port: [Vec<(u128, u128)>; 2],
    /// Peers allowed on some ports, `[IPv4, IPv6]`: disjoint address
    /// ranges, each with its ports (disjoint per protocol).
    pub by_port: [Vec<(u128, u128, Vec<PortRange>)>; 2],
    /// Named ports resolved on the peer: exact (peer, protocol, port).
    pub named: Vec<(IpAddr, Proto, u16)>,
}

/// The ranges of `set` in family `v6`, as numbers.
fn ranges_of(set: &AddrSet, v6: bool) -> Vec<(u128, u128)> {
    if v6 {
        set.v6()
            .map(|(a, b)| (u128::from(a), u128::from(b)))
            .collect()
    } else {
        set.v4()
            .map(|(a, b)| (u128::from(u32::from(a)), u128::from(u32::from(b))))
            .collect()
    }
}

/// The largest address of a family.
fn family_max(v6: bool) -> u128 {
    if v6 {
        u128::MAX
    } else {
        u128::from(u32::MAX)
    }
}

/// What `rules` (one direction's) allow; `sets` are the model's peer sets.
/// Rules with the same ports form a group; the address space is cut where
/// any group's peers begin or end, and each piece gets the union of its
/// groups' ports, merged per protocol.
pub fn allowed(rules: &[Rule], sets: &BTreeMap<String, AddrSet>) -> Allowed {
    let mut out = Allowed::default();
    let mut any_port = AddrSet::new();
    let mut any_port_any_peer = false;
    // Ports as written -> (any peer, peers).
    let mut groups: BTreeMap<&[PortRange], (bool, AddrSet)> = BTreeMap::new();
    for rule in rules {
        let (any_peer, peers) = match &rule.peers {
            Peers::Any => (true, None),
            Peers::Set(name) => (false, sets.get(name)),
        };
        let numeric = match &rule.ports {
            Ports::Any => {
                any_port_any_peer |= any_peer;
                if let Some(p) = peers {
                    any_port.extend(p);
                }
                continue;
            }
            Ports::Only { numeric, named } => {
                out.named.extend(named.iter().copied());
                numeric
            }
        };
        if numeric.is_empty() {
            continue;
        }
        let group = groups.entry(numeric.as_slice()).or_default();
        group.0 |= any_peer;
        if let Some(p) = peers {
            group.1.extend(p);
        }
    }
    any_port.normalize();
    for v6 in [false, true] {
        let f = usize::from(v6);
        let max = family_max(v6);
        out.any_port[f] = if any_port_any_peer {
            vec![(0, max)]
        } else {
            ranges_of(&any_port, v6)
        };
        let ranges: Vec<Vec<(u128, u128)>> = groups
            .values_mut()
            .map(|(any_peer, peers)| {
                if *any_peer {
                    vec![(0, max)]
                } else {
                    peers.normalize();
                    ranges_of(peers, v6)
                }
            })
            .collect();
        let ports: Vec<&[PortRange]> = groups.keys().copied().collect();
        for (lo, hi, held) in partition(&ranges, max) {
            out.by_port[f].push((lo, hi, merged_ports(held.iter().map(|g| ports[*g]))));
        }
    }
    out.named.sort_unstable();
    out.named.dedup();
    out
}

/// The union of `groups`' ports, merged per protocol (sorted, disjoint).
fn merged_ports<'a>(groups: impl Iterator<Item = &'a [PortRange]>) -> Vec<PortRange> {
    let mut all: Vec<PortRange> = groups.flatten().copied().collect();
    all.sort_unstable();
    let mut out: Vec<PortRange> = Vec::with_capacity(all.len());
    for r in all {
        match out.last_mut() {
            Some(last) if last.proto == r.proto && u32::from(r.lo) <= u32::from(last.hi) + 1 => {
                last.hi = last.hi.max(r.hi);
            }
            _ => out.push(r),
        }
    }
    out
}

/// The verdicts of one isolated pod's `rules`; `sets` are the model's peer
/// sets.
pub fn compile_pod(
    rules: &PodRules,
    sets: &BTreeMap<String, AddrSet>,
) -> Result<PodVerdicts, NotCompiled> {
    let mut v = PodVerdicts::default();
    if let Some(r) = &rules.ingress {
        v.flags |= POL_ISOLATED_IN;
        direction(r, POL_INGRESS, sets, &mut v)?;
    }
    if let Some(r) = &rules.egress {
        v.flags |= POL_ISOLATED_OUT;
        direction(r, POL_EGRESS, sets, &mut v)?;
    }
    v.named.sort_unstable();
    v.named.dedup();
    Ok(v)
}

/// The verdicts of every isolated pod of `e`, or why a pod has none.
pub fn compile(
    e: &Enforcement,
) -> BTreeMap<crate::records::PodKey, Result<PodVerdicts, NotCompiled>> {
    e.pods
        .iter()
        .map(|(k, rules)| (k.clone(), compile_pod(rules, &e.peer_sets)))
        .collect()
}

#[cfg(test)]
mod tests;
