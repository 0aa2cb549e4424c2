use std::net::{Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;

use super::*;
use crate::netpol::model::PodRules;

/// What the programs compute from `v` (lib/policy.h's pol_allows, with
/// LPM lookups as the kernel's: the entries never overlap).
fn datapath_allows(v: &PodVerdicts, dir: u8, peer: IpAddr, proto: u8, port: u16) -> bool {
    let isolated = if dir == POL_EGRESS {
        POL_ISOLATED_OUT
    } else {
        POL_ISOLATED_IN
    };
    if v.flags & isolated == 0 {
        return true;
    }
    let d = usize::from(dir);
    let mut peers = v.any_peer[d];
    let hits: Vec<u64> = v
        .peers
        .iter()
        .filter(|(dd, net, plen, _)| *dd == dir && contains(*net, *plen, peer))
        .map(|e| e.3)
        .collect();
    assert!(hits.len() <= 1, "overlapping peer prefixes for {peer}");
    peers |= hits.first().copied().unwrap_or(0);
    let mut ports = v.any_port[d];
    if proto == IPPROTO_TCP || proto == IPPROTO_UDP {
        let hits: Vec<u64> = v
            .ports
            .iter()
            .filter(|(dd, p, first, plen, _)| {
                *dd == dir && *p == proto && {
                    let span = 1u32 << (16 - u32::from(*plen));
                    u32::from(port) >= u32::from(*first)
                        && u32::from(port) < u32::from(*first) + span
                }
            })
            .map(|e| e.4)
            .collect();
        assert!(hits.len() <= 1, "overlapping port prefixes for {port}");
        ports |= hits.first().copied().unwrap_or(0);
    }
    if peers & ports != 0 {
        return true;
    }
    dir == POL_EGRESS && v.named.contains(&(peer, proto, port))
}

fn contains(net: IpAddr, plen: u8, ip: IpAddr) -> bool {
    match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(i)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(plen)).unwrap_or(0);
            u32::from(n) & mask == u32::from(i) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(i)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(plen)).unwrap_or(0);
            u128::from(n) & mask == u128::from(i) & mask
        }
        _ => false,
    }
}

/// What the rules say, read one by one; `number` is a protocol's number
/// where the reader carries it (the datapath: TCP and UDP; the table: SCTP
/// too); named ports count for egress.
fn rules_allow(
    rules: &[Rule],
    sets: &BTreeMap<String, AddrSet>,
    egress: bool,
    (peer, proto, port): (IpAddr, u8, u16),
    number: fn(Proto) -> Option<u8>,
) -> bool {
    rules.iter().any(|r| {
        let peer_ok = match &r.peers {
            Peers::Any => true,
            Peers::Set(n) => sets[n].contains(peer),
        };
        let port_ok = match &r.ports {
            Ports::Any => true,
            Ports::Only { numeric, named } => {
                numeric
                    .iter()
                    .any(|pr| number(pr.proto) == Some(proto) && pr.lo <= port && port <= pr.hi)
                    || (egress
                        && named.iter().any(|(ip, p, n)| {
                            *ip == peer && number(*p) == Some(proto) && *n == port
                        }))
            }
        };
        peer_ok && port_ok
    })
}

#[test]
fn prefixes_cover_exactly() {
    assert_eq!(prefixes(0, u128::from(u32::MAX), 32), vec![(0, 0)]);
    assert_eq!(prefixes(0, u128::MAX, 128), vec![(0, 0)]);
    assert_eq!(prefixes(5, 5, 16), vec![(5, 16)]);
    // 10.0.0.4 - 10.0.0.255: /30, /29, /28, /27, /26, /25.
    let lo = u128::from(u32::from(Ipv4Addr::new(10, 0, 0, 4)));
    let p = prefixes(lo, lo + 251, 32);
    assert_eq!(
        p.iter().map(|x| x.1).collect::<Vec<_>>(),
        vec![30, 29, 28, 27, 26, 25]
    );
    assert_eq!(prefixes(1, 65534, 16).len(), 30);
}

/// `n` rules from any peer, each to one TCP port of its own: 0, `step`, ...
fn one_port_rules(n: u16, step: u16) -> Vec<Rule> {
    (0..n)
        .map(|i| Rule {
            peers: Peers::Any,
            ports: Ports::Only {
                numeric: vec![PortRange {
                    proto: Proto::Tcp,
                    lo: i * step,
                    hi: i * step,
                }],
                named: vec![],
            },
            policy: "x/p".into(),
        })
        .collect()
}

#[test]
fn too_many_port_sets_stay_in_the_kernel() {
    let rules = one_port_rules(65, 1);
    let pod = PodRules {
        ingress: Some(rules),
        ..PodRules::default()
    };
    assert_eq!(
        compile_pod(&pod, &BTreeMap::new()),
        Err(NotCompiled::TooManyGroups(65))
    );
}

/// A small address space, so that generated peers and probes meet.
fn addr() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        (0u8..4, 0u8..8).prop_map(|(a, b)| IpAddr::V4(Ipv4Addr::new(10, 0, a, b))),
        (0u16..4, 0u16..8)
            .prop_map(|(a, b)| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, a, b))),
    ]
}

fn set() -> impl Strategy<Value = AddrSet> {
    proptest::collection::vec((addr(), 0u8..4), 0..4).prop_map(|v| {
        let mut s = AddrSet::new();
        for (ip, widen) in v {
            let plen = match ip {
                IpAddr::V4(_) => 32 - widen,
                IpAddr::V6(_) => 128 - widen,
            };
            if let Ok(net) = ipnet::IpNet::new(ip, plen) {
                s.add_net(&net.trunc());
            }
        }
        s.normalize();
        s
    })
}

fn port_range() -> impl Strategy<Value = PortRange> {
    (
        prop_oneof![Just(Proto::Tcp), Just(Proto::Udp), Just(Proto::Sctp)],
        0u16..12,
        0u16..4,
    )
        .prop_map(|(proto, lo, w)| PortRange {
            proto,
            lo,
            hi: lo + w,
        })
}

fn rule(i: usize) -> impl Strategy<Value = (Rule, AddrSet)> {
    (
        any::<bool>(),
        set(),
        proptest::option::of(proptest::collection::vec(port_range(), 0..3)),
        proptest::collection::vec((addr(), 0u16..12), 0..2),
    )
        .prop_map(move |(any_peer, mut s, ports, named)| {
            // The model resolves named ports on the rule's peer pods only.
            for (ip, _) in &named {
                s.add_ip(*ip);
            }
            s.normalize();
            let ports = match ports {
                None => Ports::Any,
                Some(numeric) => Ports::Only {
                    numeric,
                    named: named
                        .into_iter()
                        .map(|(ip, p)| (ip, Proto::Udp, p))
                        .collect(),
                },
            };
            let peers = if any_peer {
                Peers::Any
            } else {
                Peers::Set(format!("s{i}"))
            };
            (
                Rule {
                    peers,
                    ports,
                    policy: "x/p".into(),
                },
                s,
            )
        })
}

fn rules() -> impl Strategy<Value = Vec<(Rule, AddrSet)>> {
    (0usize..5).prop_flat_map(|n| (0..n).map(rule).collect::<Vec<_>>())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    /// For random rules and probes, the compiled verdicts say what the rules say.
    #[test]
    fn compiled_verdicts_equal_the_rules(
        ingress in proptest::option::of(rules()),
        egress in proptest::option::of(rules()),
        probes in proptest::collection::vec(
            (addr(), prop_oneof![Just(IPPROTO_TCP), Just(IPPROTO_UDP), Just(1u8)], 0u16..16),
            40,
        ),
    ) {
        let mut sets = BTreeMap::new();
        let mut split = |v: Option<Vec<(Rule, AddrSet)>>, tag: &str| {
            v.map(|v| {
                v.into_iter()
                    .map(|(mut r, s)| {
                        if let Peers::Set(n) = &r.peers {
                            let name = format!("{tag}{n}");
                            sets.insert(name.clone(), s);
                            r.peers = Peers::Set(name);
                        }
                        r
                    })
                    .collect::<Vec<_>>()
            })
        };
        let pod = PodRules {
            ingress: split(ingress, "in"),
            egress: split(egress, "eg"),
            ..PodRules::default()
        };
        let v = compile_pod(&pod, &sets).unwrap();
        for (peer, proto, port) in probes {
            for (dir, rules) in [(POL_INGRESS, &pod.ingress), (POL_EGRESS, &pod.egress)] {
                let want = rules.as_ref().is_none_or(|r| {
                    rules_allow(r, &sets, dir == POL_EGRESS, (peer, proto, port), ipproto)
                });
                prop_assert_eq!(
                    datapath_allows(&v, dir, peer, proto, port),
                    want,
                    "dir {} peer {} proto {} port {}: {:?}",
                    dir, peer, proto, port, v
                );
            }
        }
    }
}

/// The protocol number of `p`, SCTP included (the table carries it).
fn proto_number(p: Proto) -> u8 {
    match p {
        Proto::Tcp => IPPROTO_TCP,
        Proto::Udp => IPPROTO_UDP,
        Proto::Sctp => 132,
    }
}

/// What the table's sets say (pod chains: the any-port set, the
/// peer . protocol . port set, the named set); asserts that no two pieces
/// overlap, as nftables requires of an interval set.
fn table_allows(a: &Allowed, peer: IpAddr, proto: u8, port: u16) -> bool {
    let (f, n) = match peer {
        IpAddr::V4(v) => (0, u128::from(u32::from(v))),
        IpAddr::V6(v) => (1, u128::from(v)),
    };
    let any = a.any_port[f]
        .iter()
        .filter(|(lo, hi)| (*lo..=*hi).contains(&n));
    let pieces: Vec<_> = a.by_port[f]
        .iter()
        .filter(|(lo, hi, _)| (*lo..=*hi).contains(&n))
        .collect();
    assert!(
        any.clone().count() <= 1 && pieces.len() <= 1,
        "overlapping pieces for {peer}"
    );
    let ports = pieces.first().map(|p| p.2.as_slice()).unwrap_or_default();
    for w in ports.windows(2) {
        assert!(
            w[0].proto != w[1].proto || w[0].hi < w[1].lo,
            "overlapping ports {ports:?}"
        );
    }
    any.count() == 1
        || ports
            .iter()
            .any(|r| proto_number(r.proto) == proto && r.lo <= port && port <= r.hi)
        || a.named
            .iter()
            .any(|(ip, p, n)| *ip == peer && proto_number(*p) == proto && *n == port)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    /// For random rules and probes, the table's pieces never overlap and
    /// say what the rules say.
    #[test]
    fn the_tables_pieces_equal_the_rules(
        rules in rules(),
        probes in proptest::collection::vec(
            (addr(), prop_oneof![Just(IPPROTO_TCP), Just(IPPROTO_UDP), Just(132u8), Just(1u8)], 0u16..16),
            40,
        ),
    ) {
        let mut sets = BTreeMap::new();
        let rules: Vec<Rule> = rules
            .into_iter()
            .map(|(r, s)| {
                if let Peers::Set(n) = &r.peers {
                    sets.insert(n.clone(), s);
                }
                r
            })
            .collect();
        let a = allowed(&rules, &sets);
        for (peer, proto, port) in probes {
            prop_assert_eq!(
                table_allows(&a, peer, proto, port),
                rules_allow(&rules, &sets, true, (peer, proto, port), |p| Some(proto_number(p))),
                "peer {} proto {} port {}: {:?}",
                peer, proto, port, a
            );
        }
    }
}

#[test]
fn any_number_of_port_sets_fits_the_table() {
    // 100 distinct port sets over overlapping peers: more groups than a
    // datapath mask holds, one piece per address range all the same.
    let rules = one_port_rules(100, 2);
    let a = allowed(&rules, &BTreeMap::new());
    assert_eq!(a.by_port[0].len(), 1);
    assert_eq!(a.by_port[0][0].2.len(), 100);
    assert_eq!(a.by_port[1].len(), 1);
}
