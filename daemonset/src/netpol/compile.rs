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

/// `ranges[g]`: group g's sorted, disjoint inclusive ranges. The
/// intervals between every range end, merged where neighbours have the
/// same groups, with their nonzero group masks.
fn partition(ranges: &[Vec<(u128, u128)>], max: u128) -> Vec<(u128, u128, u64)> {
    let mut points: Vec<u128> = Vec::new();
    for (lo, hi) in ranges.iter().flatten() {
        points.push(*lo);
        if *hi < max {
            points.push(hi + 1);
        }
    }
    points.sort_unstable();
    points.dedup();
    let mut out: Vec<(u128, u128, u64)> = Vec::new();
    for (i, start) in points.iter().enumerate() {
        let end = points.get(i + 1).map_or(max, |n| n - 1);
        let mut mask = 0u64;
        for (g, rs) in ranges.iter().enumerate() {
            let idx = rs.partition_point(|(_, hi)| hi < start);
            if rs.get(idx).is_some_and(|(lo, _)| lo <= start) {
                mask |= 1 << g;
            }
        }
        if mask == 0 {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.2 == mask && last.1.checked_add(1) == Some(*start) => last.1 = end,
            _ => out.push((*start, end, mask)),
        }
    }
    out
}

/// One group: rules with the same ports.
#[derive(Default)]
struct Group {
    any_peer: bool,
    peers: AddrSet,
}

/// The entries of one direction's `rules` into `v` (`dir` its index).
fn direction(
    rules: &[Rule],
    dir: u8,
    sets: &BTreeMap<String, AddrSet>,
    v: &mut PodVerdicts,
) -> Result<(), NotCompiled> {
    // Ports as written (None: any) -> group.
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
    if groups.len() > POL_MAX_GROUPS as usize {
        return Err(NotCompiled::TooManyGroups(groups.len()));
    }
    let d = usize::from(dir);
    let mut v4: Vec<Vec<(u128, u128)>> = Vec::new();
    let mut v6: Vec<Vec<(u128, u128)>> = Vec::new();
    let mut by_proto: BTreeMap<u8, Vec<Vec<(u128, u128)>>> = BTreeMap::new();
    for (g, (ports, mut group)) in groups.into_iter().enumerate() {
        let bit = 1u64 << g;
        group.peers.normalize();
        if group.any_peer {
            v.any_peer[d] |= bit;
            v4.push(Vec::new());
            v6.push(Vec::new());
        } else {
            v4.push(
                group
                    .peers
                    .v4()
                    .map(|(a, b)| (u128::from(u32::from(a)), u128::from(u32::from(b))))
                    .collect(),
            );
            v6.push(
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
                    let per = by_proto.entry(p).or_default();
                    per.resize(g + 1, Vec::new());
                    per[g].push((u128::from(r.lo), u128::from(r.hi)));
                }
            }
        }
    }
    for (lo, hi, mask) in partition(&v4, u128::from(u32::MAX)) {
        for (a, plen) in prefixes(lo, hi, 32) {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(a as u32));
            v.peers.push((dir, ip, plen, mask));
        }
    }
    for (lo, hi, mask) in partition(&v6, u128::MAX) {
        for (a, plen) in prefixes(lo, hi, 128) {
            v.peers
                .push((dir, IpAddr::from(std::net::Ipv6Addr::from(a)), plen, mask));
        }
    }
    for (proto, mut per) in by_proto {
        for rs in &mut per {
            rs.sort_unstable();
            merge(rs);
        }
        for (lo, hi, mask) in partition(&per, u128::from(u16::MAX)) {
            for (a, plen) in prefixes(lo, hi, 16) {
                v.ports.push((dir, proto, a as u16, plen, mask));
            }
        }
    }
    Ok(())
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
