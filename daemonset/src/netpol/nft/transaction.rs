//! The transaction that makes the table enforce an [`Enforcement`](crate::netpol::model::Enforcement), in named
//! steps.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use nftables::{
    batch::Batch,
    expr::{self, Expression, SetItem},
    schema::{self, FlushObject, NfCmd, NfListObject, SetFlag, SetType, SetTypeValue},
    stmt::{self, Statement},
    types::{NfChainPolicy, NfChainType, NfHook},
};

use super::{
    chain_name, counter_name, exprs::*, next_generation, rules::allow_rules, set_name, Flow,
    Objects, Switching, DROP_INVALID, FAMILY, MARK_MASK, MARK_SHIFT, TABLE,
};
use crate::netpol::model::{Direction, Enforcement};

/// The transaction that makes the table enforce `e`, with the windows of
/// `switching` open, deleting what `before` (the objects of the ruleset in
/// force) has that `e` does not, with the generation after `before`'s.
/// Returns the commands and the objects of the new ruleset. In steps: the
/// table emptied of rules (in the same transaction, so no packet sees it
/// empty) with its base chains, the peer sets, the pod chains (before the
/// base chains' verdict maps that jump to them), the base chains' rules,
/// then the objects no rule refers to any more.
pub fn transaction(
    e: &Enforcement,
    switching: &Switching,
    before: &Objects,
) -> (Batch<'static>, Objects) {
    let mut b = Batch::new();
    let mut now = Objects {
        generation: next_generation(before.generation),
        ..Objects::default()
    };
    base_table(&mut b);
    now.counters.insert(DROP_INVALID.into());
    b.add(counter(DROP_INVALID));
    peer_sets(&mut b, &mut now, e);
    let pods = pod_chains(&mut b, &mut now, e);
    let mark = GenerationMark::new(now.generation);
    for base in [Base::Forward, Base::Input] {
        base_rules(&mut b, base, &pods, &mark, switching);
    }
    delete_gone(&mut b, before, &now);
    (b, now)
}

fn table() -> schema::Table<'static> {
    schema::Table {
        family: FAMILY,
        name: TABLE.into(),
        handle: None,
    }
}

fn chain(name: &str) -> schema::Chain<'static> {
    schema::Chain {
        family: FAMILY,
        table: TABLE.into(),
        name: name.to_string().into(),
        ..schema::Chain::default()
    }
}

fn rule(chain: &str, expr: Vec<Statement<'static>>) -> NfListObject<'static> {
    NfListObject::Rule(schema::Rule {
        family: FAMILY,
        table: TABLE.into(),
        chain: chain.to_string().into(),
        expr: expr.into(),
        ..schema::Rule::default()
    })
}

fn set(name: &str, v6: bool, interval: bool) -> schema::Set<'static> {
    schema::Set {
        family: FAMILY,
        table: TABLE.into(),
        name: name.to_string().into(),
        set_type: SetTypeValue::Single(if v6 {
            SetType::Ipv6Addr
        } else {
            SetType::Ipv4Addr
        }),
        flags: interval.then(|| [SetFlag::Interval].into()),
        ..schema::Set::default()
    }
}

fn counter(name: &str) -> NfListObject<'static> {
    NfListObject::Counter(schema::Counter {
        family: FAMILY,
        table: TABLE.into(),
        name: name.to_string().into(),
        handle: None,
        packets: None,
        bytes: None,
    })
}

fn elements(name: &str, elem: Vec<Expression<'static>>) -> NfListObject<'static> {
    NfListObject::Element(schema::Element {
        family: FAMILY,
        table: TABLE.into(),
        name: name.to_string().into(),
        elem: elem.into(),
    })
}

/// The table, emptied of rules, and its two base chains.
fn base_table(b: &mut Batch<'static>) {
    b.add(NfListObject::Table(table()));
    b.add_cmd(NfCmd::Flush(FlushObject::Table(table())));
    for base in [Base::Forward, Base::Input] {
        b.add(NfListObject::Chain(schema::Chain {
            _type: Some(NfChainType::Filter),
            hook: Some(base.hook()),
            prio: Some(0),
            policy: Some(NfChainPolicy::Accept),
            ..chain(base.name())
        }));
    }
}

/// Every peer set of `e`, one per family that has addresses, filled anew.
fn peer_sets(b: &mut Batch<'static>, now: &mut Objects, e: &Enforcement) {
    for (name, peers) in &e.peer_sets {
        for v6 in [false, true] {
            if peers.is_empty_in(v6) {
                continue;
            }
            let n = set_name(name, v6);
            b.add(NfListObject::Set(Box::new(set(&n, v6, true))));
            b.add_cmd(NfCmd::Flush(FlushObject::Set(Box::new(set(&n, v6, true)))));
            b.add(elements(&n, addr_elements(peers, v6)));
            now.sets.insert(n);
        }
    }
}

/// A base chain's verdict map: (direction, flow, IPv6) -> its items.
type MapKey = (Direction, Flow, bool);

/// What the pod chains give the base chains.
struct PodChains {
    /// The verdict maps that jump to the pod chains.
    maps: BTreeMap<MapKey, Vec<SetItem<'static>>>,
    /// The isolated pods' addresses, IPv4 then IPv6.
    isolated: [Vec<Expression<'static>>; 2],
}

/// A chain per isolated pod, direction and flow: its allow rules, then a
/// counted drop; and the verdict-map items that jump there.
fn pod_chains(b: &mut Batch<'static>, now: &mut Objects, e: &Enforcement) -> PodChains {
    let mut out = PodChains {
        maps: BTreeMap::new(),
        isolated: [Vec::new(), Vec::new()],
    };
    for (key, pod) in &e.pods {
        for ip in &pod.addrs {
            out.isolated[usize::from(ip.is_ipv6())].push(s(&ip.to_string()));
        }
        for (direction, rules) in [
            (Direction::Ingress, &pod.ingress),
            (Direction::Egress, &pod.egress),
        ] {
            let Some(rules) = rules else { continue };
            let drops = counter_name(key, direction);
            b.add(counter(&drops));
            now.counters.insert(drops.clone());
            for flow in [Flow::Original, Flow::Reply] {
                let c = chain_name(key, direction, flow == Flow::Reply);
                b.add(NfListObject::Chain(chain(&c)));
                for r in rules {
                    for statements in allow_rules(r, direction, flow, &e.peer_sets) {
                        b.add(rule(&c, statements));
                    }
                }
                b.add(rule(&c, vec![named_counter(&drops), Statement::Drop(None)]));
                for ip in &pod.addrs {
                    let verdict = Expression::Verdict(expr::Verdict::Jump(stmt::JumpTarget {
                        target: c.clone().into(),
                    }));
                    out.maps
                        .entry((direction, flow, ip.is_ipv6()))
                        .or_default()
                        .push(SetItem::Mapping(s(&ip.to_string()), verdict));
                }
                now.chains.insert(c);
            }
        }
    }
    out
}

/// A base chain: `forward` sees pods at both ends, `input` only as sources
/// (their own connections to the node).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Base {
    Forward,
    Input,
}

impl Base {
    fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Input => "input",
        }
    }

    fn hook(self) -> NfHook {
        match self {
            Self::Forward => NfHook::Forward,
            Self::Input => NfHook::Input,
        }
    }

    /// Which ends of a packet an isolated pod may be: (source?) each.
    fn ends(self) -> &'static [bool] {
        match self {
            Self::Forward => &[true, false],
            Self::Input => &[true],
        }
    }

    /// The verdict maps this chain looks up, with the end they key on and
    /// conntrack's direction. Original direction: the client is the source,
    /// the server the destination; reply direction the other way round.
    /// The node's input sees only pods' own connections to it, as clients
    /// (replies to the node's connections are the node's, allowed).
    fn lookups(self) -> &'static [(Direction, Flow, bool, &'static str)] {
        match self {
            Self::Input => &[(Direction::Egress, Flow::Original, true, "original")],
            Self::Forward => &[
                (Direction::Egress, Flow::Original, true, "original"),
                (Direction::Ingress, Flow::Original, false, "original"),
                (Direction::Egress, Flow::Reply, false, "reply"),
                (Direction::Ingress, Flow::Reply, true, "reply"),
            ],
        }
    }
}

/// The ruleset's generation on a connection's ct mark: the match of a
/// connection this ruleset allowed already, and the mark that says so.
struct GenerationMark {
    marked: Statement<'static>,
    set_mark: Statement<'static>,
}

impl GenerationMark {
    fn new(generation: u16) -> Self {
        let bits = Expression::Number(u32::from(generation) << MARK_SHIFT);
        let marked = is(
            Expression::BinaryOperation(Box::new(expr::BinaryOperation::AND(
                ct("mark"),
                Expression::Number(MARK_MASK),
            ))),
            bits.clone(),
        );
        let set_mark = Statement::Mangle(stmt::Mangle {
            key: ct("mark"),
            value: Expression::BinaryOperation(Box::new(expr::BinaryOperation::OR(vec![
                Expression::BinaryOperation(Box::new(expr::BinaryOperation::AND(
                    ct("mark"),
                    Expression::Number(!MARK_MASK),
                ))),
                bits,
            ]))),
        });
        Self { marked, set_mark }
    }
}

/// The rules of base chain `base`, in order: neighbour discovery accepted,
/// invalid packets of isolated pods dropped, related ICMP accepted,
/// connections this ruleset allowed accepted, the verdict maps into the pod
/// chains (and, on `forward`, the checks of connections picked up
/// mid-stream), then what passed them marked with the generation.
fn base_rules(
    b: &mut Batch<'static>,
    base: Base,
    pods: &PodChains,
    mark: &GenerationMark,
    switching: &Switching,
) {
    let name = base.name();
    b.add(rule(name, neighbour_discovery()));
    let ends = isolated_ends(base, &pods.isolated);
    for end in &ends {
        b.add(rule(
            name,
            vec![
                ct_state(&["invalid", "untracked"]),
                end.clone(),
                named_counter(DROP_INVALID),
                Statement::Drop(None),
            ],
        ));
    }
    b.add(rule(
        name,
        vec![
            ct_state(&["related"]),
            is(
                meta(expr::MetaKey::L4proto),
                anon_set(vec![s("icmp"), s("ipv6-icmp")]),
            ),
            Statement::Accept(None),
        ],
    ));
    // Allowed already by this ruleset.
    b.add(rule(
        name,
        vec![mark.marked.clone(), Statement::Accept(None)],
    ));
    for v6 in [false, true] {
        for &(direction, flow, src, dir) in base.lookups() {
            let Some(items) = pods.maps.get(&(direction, flow, v6)) else {
                continue;
            };
            b.add(rule(
                name,
                vec![
                    is(ct("direction"), s(dir)),
                    vmap(addr(v6, src), items.clone()),
                ],
            ));
        }
        if base == Base::Forward {
            mid_stream_rules(b, &pods.maps, v6, switching);
        }
    }
    // Past the pod chains: allowed. Remembered on the connection.
    for end in ends {
        b.add(rule(name, vec![end, mark.set_mark.clone()]));
    }
}

/// Neighbour discovery accepted: it is what the node resolves pods with
/// (the IPv6 ARP), and conntrack does not track it.
fn neighbour_discovery() -> Vec<Statement<'static>> {
    let types = [
        "nd-router-solicit",
        "nd-router-advert",
        "nd-neighbor-solicit",
        "nd-neighbor-advert",
        "nd-redirect",
    ];
    vec![
        is(
            field("icmpv6", "type"),
            anon_set(types.iter().map(|t| s(t)).collect()),
        ),
        Statement::Accept(None),
    ]
}

/// `ip saddr|daddr { isolated pods }`, per family and end of `base`.
fn isolated_ends(base: Base, isolated: &[Vec<Expression<'static>>; 2]) -> Vec<Statement<'static>> {
    [false, true]
        .into_iter()
        .filter(|v6| !isolated[usize::from(*v6)].is_empty())
        .flat_map(|v6| {
            base.ends()
                .iter()
                .map(move |&src| is(addr(v6, src), anon_set(isolated[usize::from(v6)].clone())))
        })
        .collect()
}

/// A connection conntrack picks up in the middle may have begun at either
/// end: a TCP one (its first packet here is no SYN: it began on the fast
/// path, or its entry was flushed), and a new UDP flow between a pod whose
/// window is open and another pod of the node (UDP has no SYN to tell), are
/// checked as a reply too: allowed whichever side started them.
fn mid_stream_rules(
    b: &mut Batch<'static>,
    maps: &BTreeMap<MapKey, Vec<SetItem<'static>>>,
    v6: bool,
    switching: &Switching,
) {
    for (direction, src) in [(Direction::Egress, false), (Direction::Ingress, true)] {
        let Some(items) = maps.get(&(direction, Flow::Reply, v6)) else {
            continue;
        };
        b.add(rule(
            "forward",
            vec![
                ct_state(&["new"]),
                mid_stream_tcp(),
                vmap(addr(v6, src), items.clone()),
            ],
        ));
        let of = |set: &BTreeSet<IpAddr>| -> Vec<Expression<'static>> {
            set.iter()
                .filter(|ip| ip.is_ipv6() == v6)
                .map(|ip| s(&ip.to_string()))
                .collect()
        };
        let (open, local) = (of(&switching.pods), of(&switching.local));
        if open.is_empty() || local.is_empty() {
            continue;
        }
        for switching_end in [true, false] {
            b.add(rule(
                "forward",
                vec![
                    ct_state(&["new"]),
                    is(
                        meta(expr::MetaKey::L4proto),
                        anon_set(vec![s("udp"), s("udplite")]),
                    ),
                    not_dnat(),
                    is(addr(v6, switching_end), anon_set(open.clone())),
                    is(addr(v6, !switching_end), anon_set(local.clone())),
                    vmap(addr(v6, src), items.clone()),
                ],
            ));
        }
    }
}

/// What the ruleset before had and this one has not (no rule refers to them
/// any more: the table's flush took every rule and map element).
fn delete_gone(b: &mut Batch<'static>, before: &Objects, now: &Objects) {
    for c in before.chains.difference(&now.chains) {
        b.delete(NfListObject::Chain(chain(c)));
    }
    for n in before.sets.difference(&now.sets) {
        b.delete(NfListObject::Set(Box::new(schema::Set {
            name: n.clone().into(),
            family: FAMILY,
            table: TABLE.into(),
            ..schema::Set::default()
        })));
    }
    for n in before.counters.difference(&now.counters) {
        b.delete(counter(n));
    }
}
