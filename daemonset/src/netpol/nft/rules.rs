//! A pod chain's allow rules and the sets they look up.
//!
//! What a pod may receive (or send) lives in sets of its own, one per
//! direction, family and kind, filled from [`Allowed`] (the pieces the
//! datapath's verdicts are cut from too): the chain is a few lookups and a
//! counted drop whatever the number of policies. A set is named after its
//! content, so a change makes new sets only where the content changed, and
//! the transaction that makes them rewrites only the chains that use them:
//! its size follows the change, not the table.
//!
//! Not elements deleted from the set in place: nf_tables makes a
//! transaction's rules visible before it commits an interval set's element
//! changes, so a packet in between is checked by the new generation's rules
//! against the old elements. A deleted element then lets a flow through once,
//! and the flow is marked with the new generation: it passes from then on
//! (measured: a UDP echo kept its answers after its allow policy went). A new
//! set is empty until committed: the same moment refuses, fail closed.

use nftables::{
    expr::{self, Expression},
    schema::{self, SetFlag, SetType, SetTypeValue},
    stmt::Statement,
};

use super::{exprs::*, fnv, nft_name, Flow, FAMILY, FNV_OFFSET, TABLE};
use crate::netpol::{compile::Allowed, model::Direction};

/// What a set holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SetKind {
    /// Peers allowed on every port: addresses (intervals).
    AnyPort,
    /// Peers allowed on some ports: address . protocol . port (intervals).
    Ports,
    /// Named ports resolved on the peer: address . protocol . port, exact.
    Named,
}

impl SetKind {
    fn letter(self) -> char {
        match self {
            Self::AnyPort => 'a',
            Self::Ports => 'p',
            Self::Named => 'n',
        }
    }
}

/// One set of a pod chain: its kind, family and elements.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct SetSpec {
    pub kind: SetKind,
    pub v6: bool,
    pub elements: Vec<Expression<'static>>,
}

impl SetSpec {
    /// The set, without its elements.
    pub fn schema(&self, name: &str) -> schema::Set<'static> {
        let a = if self.v6 {
            SetType::Ipv6Addr
        } else {
            SetType::Ipv4Addr
        };
        let (set_type, interval) = match self.kind {
            SetKind::AnyPort => (SetTypeValue::Single(a), true),
            SetKind::Ports => (
                SetTypeValue::Concatenated(
                    vec![a, SetType::InetProto, SetType::InetService].into(),
                ),
                true,
            ),
            SetKind::Named => (
                SetTypeValue::Concatenated(
                    vec![a, SetType::InetProto, SetType::InetService].into(),
                ),
                false,
            ),
        };
        schema::Set {
            family: FAMILY,
            table: TABLE.into(),
            name: name.to_string().into(),
            set_type,
            flags: interval.then(|| [SetFlag::Interval].into()),
            ..schema::Set::default()
        }
    }
}

/// The sets of one pod's direction (`prefix`: `in_ns/pod` or
/// `eg_ns/pod`): name -> set, each named after `epoch` and its content.
pub(super) fn pod_sets(prefix: &str, allowed: &Allowed, epoch: u16) -> Vec<(String, SetSpec)> {
    let mut out = Vec::new();
    for v6 in [false, true] {
        let f = usize::from(v6);
        let any: Vec<Expression<'static>> = allowed.any_port[f]
            .iter()
            .map(|&(lo, hi)| addr_element(v6, lo, hi))
            .collect();
        let ports: Vec<Expression<'static>> = allowed.by_port[f]
            .iter()
            .flat_map(|(lo, hi, ports)| {
                ports.iter().map(move |p| {
                    concat(vec![
                        addr_element(v6, *lo, *hi),
                        s(p.proto.nft()),
                        port_element(p.lo, p.hi),
                    ])
                })
            })
            .collect();
        let named: Vec<Expression<'static>> = allowed
            .named
            .iter()
            .filter(|(ip, _, _)| ip.is_ipv6() == v6)
            .map(|(ip, proto, port)| {
                concat(vec![
                    s(&ip.to_string()),
                    s(proto.nft()),
                    Expression::Number(u32::from(*port)),
                ])
            })
            .collect();
        for (kind, elements) in [
            (SetKind::AnyPort, any),
            (SetKind::Ports, ports),
            (SetKind::Named, named),
        ] {
            if elements.is_empty() {
                continue;
            }
            let spec = SetSpec { kind, v6, elements };
            let h = fnv(
                fnv(FNV_OFFSET, &epoch.to_le_bytes()),
                format!("{spec:?}").as_bytes(),
            );
            let family = if v6 { 6 } else { 4 };
            let name = nft_name(&format!("{prefix}_{}{family}.{h:016x}", kind.letter()));
            out.push((name, spec));
        }
    }
    out
}

/// The rules of a pod chain of `direction` and `flow` that look up `sets`
/// (the direction's, from [`pod_sets`]), then its counted drop `drops`.
/// The peer is the client for ingress and the server for egress; the port
/// is the server's. Original flow: client = saddr, server = daddr, port =
/// dport; reply flow: the other way round, and sport.
pub(super) fn chain_rules(
    sets: &[(String, SetSpec)],
    direction: Direction,
    flow: Flow,
    drops: &str,
) -> Vec<Vec<Statement<'static>>> {
    let original = flow == Flow::Original;
    let peer_is_src = match direction {
        Direction::Ingress => original,
        Direction::Egress => !original,
    };
    let port = field("th", if original { "dport" } else { "sport" });
    let mut out: Vec<Vec<Statement<'static>>> = sets
        .iter()
        .map(|(name, set)| {
            let peer = addr(set.v6, peer_is_src);
            let key = match set.kind {
                SetKind::AnyPort => peer,
                SetKind::Ports | SetKind::Named => {
                    concat(vec![peer, meta(expr::MetaKey::L4proto), port.clone()])
                }
            };
            vec![is(key, set_ref(name)), Statement::Return(None)]
        })
        .collect();
    out.push(vec![named_counter(drops), Statement::Drop(None)]);
    out
}
