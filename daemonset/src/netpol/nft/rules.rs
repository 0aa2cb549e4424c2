//! One allow rule of a pod chain, as nftables statements.

use std::collections::BTreeMap;

use nftables::{
    expr::{self, Expression},
    stmt::Statement,
};

use super::{exprs::*, set_name, Flow};
use crate::netpol::{
    addrs::AddrSet,
    model::{Direction, Peers, PortRange, Ports, Proto, Rule},
};

/// The statements of one allow rule in a pod chain of `direction` and
/// `flow`, one list per family it can match in (none when it matches
/// nothing). The peer is the client for ingress and the server for egress;
/// the port is the server's. Original flow: client = saddr, server = daddr,
/// port = dport; reply flow: the other way round, and sport.
pub(super) fn allow_rules(
    rule: &Rule,
    direction: Direction,
    flow: Flow,
    peer_sets: &BTreeMap<String, AddrSet>,
) -> Vec<Vec<Statement<'static>>> {
    let original = flow == Flow::Original;
    // Whether the peer's address is the packet's source.
    let peer_is_src = match direction {
        Direction::Ingress => original,
        Direction::Egress => !original,
    };
    let port = field("th", if original { "dport" } else { "sport" });
    // The peer matches: in family `v6`, or (Any) in both at once.
    let peer_matches: Vec<Option<Statement<'static>>> = match &rule.peers {
        Peers::Any => vec![None],
        Peers::Set(name) => {
            let Some(set) = peer_sets.get(name) else {
                return Vec::new();
            };
            [false, true]
                .into_iter()
                .filter(|v6| !set.is_empty_in(*v6))
                .map(|v6| Some(is(addr(v6, peer_is_src), set_ref(&set_name(name, v6)))))
                .collect()
        }
    };
    let mut out = Vec::new();
    match &rule.ports {
        Ports::Any => {
            for m in peer_matches {
                out.push(m.into_iter().chain([Statement::Return(None)]).collect());
            }
        }
        Ports::Only { numeric, named } => {
            if !numeric.is_empty() {
                let port_match = numeric_ports(numeric, &port);
                for m in &peer_matches {
                    let mut v: Vec<Statement<'static>> = m.iter().cloned().collect();
                    v.extend(port_match.iter().cloned());
                    v.push(Statement::Return(None));
                    out.push(v);
                }
            }
            out.extend(named_ports(named, peer_is_src, &port));
        }
    }
    out
}

/// The match of `numeric` ports (protocol and port or range) on field
/// `port`.
fn numeric_ports(numeric: &[PortRange], port: &Expression<'static>) -> Vec<Statement<'static>> {
    let l4 = || meta(expr::MetaKey::L4proto);
    let number = |r: &PortRange| {
        if r.lo == r.hi {
            Expression::Number(u32::from(r.lo))
        } else {
            range(
                Expression::Number(u32::from(r.lo)),
                Expression::Number(u32::from(r.hi)),
            )
        }
    };
    // One protocol and port (or range), the common rule: two plain matches.
    // An anonymous set is a set of its own in the kernel, and the kernel
    // names each new one by walking the table's sets: 2000 of them (1000
    // one-port policies, both directions) made a transaction 8x slower on
    // this kernel (2.2 s against 0.26 s, `nft -j -f` of the same rules).
    match numeric {
        [one] => vec![is(l4(), s(one.proto.nft())), is(port.clone(), number(one))],
        _ => vec![is(
            concat(vec![l4(), port.clone()]),
            anon_set(
                numeric
                    .iter()
                    .map(|r| concat(vec![s(r.proto.nft()), number(r)]))
                    .collect(),
            ),
        )],
    }
}

/// The rules of named ports: (destination address, protocol, port) tuples,
/// already limited to the rule's peers, one rule per family.
fn named_ports(
    named: &[(std::net::IpAddr, Proto, u16)],
    peer_is_src: bool,
    port: &Expression<'static>,
) -> Vec<Vec<Statement<'static>>> {
    let l4 = || meta(expr::MetaKey::L4proto);
    let mut out = Vec::new();
    for v6 in [false, true] {
        let tuples: Vec<Expression<'static>> = named
            .iter()
            .filter(|(ip, _, _)| ip.is_ipv6() == v6)
            .map(|(ip, proto, p)| {
                concat(vec![
                    s(&ip.to_string()),
                    s(proto.nft()),
                    Expression::Number(u32::from(*p)),
                ])
            })
            .collect();
        if tuples.is_empty() {
            continue;
        }
        out.push(vec![
            is(
                concat(vec![addr(v6, peer_is_src), l4(), port.clone()]),
                anon_set(tuples),
            ),
            Statement::Return(None),
        ]);
    }
    out
}
