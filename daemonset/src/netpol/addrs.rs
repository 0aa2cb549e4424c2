//! Sets of addresses as merged inclusive ranges per family: what a peer of a
//! NetworkPolicy rule matches (pod addresses, `ipBlock` CIDRs minus their
//! `except`s), in the form an nftables interval set takes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// Addresses of both families, each a sorted list of disjoint, non-adjacent
/// inclusive ranges once [`AddrSet::normalize`]d.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddrSet {
    v4: Vec<(u32, u32)>,
    v6: Vec<(u128, u128)>,
}

/// Merges overlapping and adjacent ranges of `v` (sorted after).
fn merge<T: Copy + Ord + Succ>(v: &mut Vec<(T, T)>) {
    v.sort_unstable();
    let mut out: Vec<(T, T)> = Vec::with_capacity(v.len());
    for &(lo, hi) in v.iter() {
        match out.last_mut() {
            Some(last) if last.1.succ().is_none_or(|next| lo <= next) => {
                last.1 = last.1.max(hi);
            }
            _ => out.push((lo, hi)),
        }
    }
    *v = out;
}

/// Removes `[lo, hi]` from the merged ranges of `v`.
fn cut<T: Copy + Ord + Succ>(v: &mut Vec<(T, T)>, lo: T, hi: T) {
    let mut out = Vec::with_capacity(v.len() + 1);
    for &(a, b) in v.iter() {
        if b < lo || a > hi {
            out.push((a, b));
            continue;
        }
        if a < lo {
            if let Some(before) = lo.pred() {
                out.push((a, before));
            }
        }
        if b > hi {
            if let Some(after) = hi.succ() {
                out.push((after, b));
            }
        }
    }
    *v = out;
}

/// The neighbours of an address number.
trait Succ: Sized {
    fn succ(self) -> Option<Self>;
    fn pred(self) -> Option<Self>;
}

impl Succ for u32 {
    fn succ(self) -> Option<Self> {
        self.checked_add(1)
    }
    fn pred(self) -> Option<Self> {
        self.checked_sub(1)
    }
}

impl Succ for u128 {
    fn succ(self) -> Option<Self> {
        self.checked_add(1)
    }
    fn pred(self) -> Option<Self> {
        self.checked_sub(1)
    }
}

/// The first and last address of `net` as numbers of its family.
fn bounds(net: &IpNet) -> Bound {
    match net {
        IpNet::V4(n) => Bound::V4(u32::from(n.network()), u32::from(n.broadcast())),
        IpNet::V6(n) => Bound::V6(u128::from(n.network()), u128::from(n.broadcast())),
    }
}

enum Bound {
    V4(u32, u32),
    V6(u128, u128),
}

impl AddrSet {
    /// No address.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one address.
    pub fn add_ip(&mut self, ip: IpAddr) {
        match ip {
            IpAddr::V4(a) => self.v4.push((u32::from(a), u32::from(a))),
            IpAddr::V6(a) => self.v6.push((u128::from(a), u128::from(a))),
        }
    }

    /// Adds every address of `net` (host bits are ignored, as the API
    /// server's own parsing does).
    pub fn add_net(&mut self, net: &IpNet) {
        match bounds(net) {
            Bound::V4(lo, hi) => self.v4.push((lo, hi)),
            Bound::V6(lo, hi) => self.v6.push((lo, hi)),
        }
    }

    /// Removes every address of `net` (merges first).
    pub fn remove_net(&mut self, net: &IpNet) {
        self.normalize();
        match bounds(net) {
            Bound::V4(lo, hi) => cut(&mut self.v4, lo, hi),
            Bound::V6(lo, hi) => cut(&mut self.v6, lo, hi),
        }
    }

    /// Adds every address of `other`.
    pub fn extend(&mut self, other: &AddrSet) {
        self.v4.extend_from_slice(&other.v4);
        self.v6.extend_from_slice(&other.v6);
    }

    /// Sorts and merges the ranges.
    pub fn normalize(&mut self) {
        merge(&mut self.v4);
        merge(&mut self.v6);
    }

    /// The IPv4 ranges (after [`AddrSet::normalize`]: sorted, disjoint).
    pub fn v4(&self) -> impl Iterator<Item = (Ipv4Addr, Ipv4Addr)> + '_ {
        self.v4
            .iter()
            .map(|&(a, b)| (Ipv4Addr::from(a), Ipv4Addr::from(b)))
    }

    /// The IPv6 ranges (after [`AddrSet::normalize`]: sorted, disjoint).
    pub fn v6(&self) -> impl Iterator<Item = (Ipv6Addr, Ipv6Addr)> + '_ {
        self.v6
            .iter()
            .map(|&(a, b)| (Ipv6Addr::from(a), Ipv6Addr::from(b)))
    }

    /// Whether the set has no address of the family of `v6`.
    pub fn is_empty_in(&self, v6: bool) -> bool {
        if v6 {
            self.v6.is_empty()
        } else {
            self.v4.is_empty()
        }
    }

    /// Whether `ip` is in the set.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => {
                let n = u32::from(a);
                self.v4.iter().any(|&(lo, hi)| lo <= n && n <= hi)
            }
            IpAddr::V6(a) => {
                let n = u128::from(a);
                self.v6.iter().any(|&(lo, hi)| lo <= n && n <= hi)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_cidr_minus_its_excepts() {
        let mut s = AddrSet::new();
        s.add_net(&net("10.0.0.0/16"));
        s.remove_net(&net("10.0.1.0/24"));
        s.remove_net(&net("10.0.255.255/32"));
        let got: Vec<_> = s.v4().collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.0".parse().unwrap(), "10.0.0.255".parse().unwrap()),
                ("10.0.2.0".parse().unwrap(), "10.0.255.254".parse().unwrap()),
            ]
        );
        assert!(s.contains(ip("10.0.0.7")));
        assert!(!s.contains(ip("10.0.1.7")));
        assert!(!s.contains(ip("10.0.255.255")));
        assert!(s.is_empty_in(true));
    }

    #[test]
    fn overlapping_and_adjacent_ranges_merge() {
        let mut s = AddrSet::new();
        for a in ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.9"] {
            s.add_ip(ip(a));
        }
        s.add_net(&net("10.0.0.8/31"));
        s.add_net(&net("10.0.0.0/30"));
        s.normalize();
        let got: Vec<_> = s.v4().map(|(a, b)| format!("{a}-{b}")).collect();
        assert_eq!(got, vec!["10.0.0.0-10.0.0.3", "10.0.0.8-10.0.0.9"]);
    }

    #[test]
    fn the_edges_of_the_address_space() {
        let mut s = AddrSet::new();
        s.add_net(&net("0.0.0.0/0"));
        s.add_net(&net("::/0"));
        s.remove_net(&net("0.0.0.0/32"));
        s.remove_net(&net("255.255.255.255/32"));
        s.remove_net(&net("::/128"));
        s.remove_net(&net("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128"));
        assert!(!s.contains(ip("0.0.0.0")) && s.contains(ip("0.0.0.1")));
        assert!(!s.contains(ip("255.255.255.255")) && s.contains(ip("255.255.255.254")));
        assert!(!s.contains(ip("::")) && s.contains(ip("::1")));
        // Cutting everything leaves nothing; host bits are ignored.
        s.remove_net(&net("0.0.0.0/0"));
        assert!(s.is_empty_in(false));
        let mut t = AddrSet::new();
        t.add_net(&net("192.168.7.9/24"));
        assert!(t.contains(ip("192.168.7.0")) && t.contains(ip("192.168.7.255")));
    }

    #[test]
    fn families_stay_apart() {
        let mut s = AddrSet::new();
        s.add_net(&net("fd00::/64"));
        s.remove_net(&net("10.0.0.0/8"));
        s.normalize();
        assert!(s.is_empty_in(false));
        assert!(s.contains(ip("fd00::5")) && !s.contains(ip("fd01::5")));
    }
}
