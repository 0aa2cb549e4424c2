//! The nftables ruleset that enforces an [`Enforcement`], built with the
//! `nftables` crate's types and applied through `nft -j -f -` as one atomic
//! transaction: no userspace on the packet path, and no moment where a
//! packet sees half a change.
//!
//! Layout (table `inet xdpcni`):
//!
//! ```text
//! chain forward  (hook forward, filter)   pod <-> pod, other nodes, the world
//! chain input    (hook input, filter)     pod -> the node itself
//!   IPv6 neighbour discovery: accept (untracked by conntrack; like ARP,
//!   no policy covers it)
//!   ct state invalid,untracked, to or from an isolated pod: drop
//!   ct state related ICMP/ICMPv6 (errors about a tracked connection): accept
//!   ct mark & 0xffff0000 == generation << 16: accept (allowed already, below,
//!     by this very ruleset: its packets skip the pod chains)
//!   original direction: client = ip saddr   vmap { pod: jump eg_<pod> }
//!                       server = ip daddr   vmap { pod: jump in_<pod> }
//!   reply direction:    client = ip daddr   vmap { pod: jump egr_<pod> }
//!                       server = ip saddr   vmap { pod: jump inr_<pod> }
//!   a TCP connection picked up mid-stream (new, not a SYN): the reply
//!     direction's lookups too (allowed whichever end began it)
//!   a new UDP flow, untranslated, between a pod isolated in the last
//!     2 s (its window, [`Switching`]) and another pod of the node:
//!     the reply direction's lookups too (it may answer a request the fast
//!     path carried)
//!   (the pod chains allowed it) to or from an isolated pod:
//!     ct mark set ct mark & 0x0000ffff | generation << 16
//! chain in_<ns>/<pod>, inr_..: each allow rule `return`s, then `counter drop`
//! chain eg_<ns>/<pod>, egr_..: the same for egress
//! set <direction>_<ns>/<policy>_<rule>_4|6: the peers of a rule (interval)
//! counter drop_in_<ns>/<pod>, drop_eg_<ns>/<pod>, drop_invalid
//! ```
//!
//! Every packet of a connection, not only its first, is checked against
//! the connection's own direction (its client, and its server and port
//! after DNAT), so replies of an allowed connection pass, and a connection
//! a new policy forbids stops at its next packet. What a connection was
//! allowed by is remembered in the top 16 bits of its conntrack mark: the
//! generation of the ruleset (each transaction has a new one). Its packets
//! under that same ruleset accept at once; after any change, its next
//! packet is checked again (and marked again if still allowed). The output
//! hook has no chain: what the node itself sends (the kubelet's probes,
//! hostNetwork pods of this node) is always allowed in, and its replies
//! with it.

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use nftables::{
    batch::Batch,
    expr::{self, Expression, NamedExpression, Payload, PayloadField, SetItem},
    schema::{self, FlushObject, NfCmd, NfListObject, SetFlag, SetType, SetTypeValue},
    stmt::{self, Operator, Statement},
    types::{NfChainPolicy, NfChainType, NfFamily, NfHook},
};

use super::{
    addrs::AddrSet,
    model::{Direction, Enforcement, Peers, PortRange, Ports, Rule},
};
use crate::records::PodKey;

/// The table every rule of the product lives in (family `inet`).
pub use xdpcni_host::nftable::TABLE;

/// `inet`.
const FAMILY: NfFamily = NfFamily::INet;
/// The counter of packets conntrack calls invalid, to or from isolated pods.
pub const DROP_INVALID: &str = "drop_invalid";
/// The conntrack mark bits that hold the generation of the ruleset that
/// allowed a connection (the rest of the mark is left to others).
pub const MARK_MASK: u32 = 0xffff_0000;
const MARK_SHIFT: u32 = 16;

/// Which packet fields stand for the connection's client and server in a
/// pod chain: the original direction's, or the reply's (swapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Flow {
    Original,
    Reply,
}

/// The names of everything a ruleset made, to delete what the next one no
/// longer has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Objects {
    /// Chains other than the base chains.
    pub chains: BTreeSet<String>,
    /// Named sets (peers).
    pub sets: BTreeSet<String>,
    /// Named counters.
    pub counters: BTreeSet<String>,
    /// The ruleset's generation (what its conntrack marks say).
    pub generation: u16,
}

/// Pods isolated moments ago, whose flows may have run on the fast path
/// unseen by conntrack, and the node's pods (the only other ends the fast
/// path reaches). Until a pod's window ends, a new UDP flow between it and
/// another pod of the node (untranslated: the fast path translates
/// nothing) may be a reply to a request XDP carried, whichever end it
/// comes from, so it is checked from both ends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Switching {
    /// Addresses of the pods whose window is open.
    pub pods: BTreeSet<IpAddr>,
    /// Addresses of every pod of the node.
    pub local: BTreeSet<IpAddr>,
}

/// The generation after `g`: never 0 (an unmarked connection's).
pub fn next_generation(g: u16) -> u16 {
    g.checked_add(1).unwrap_or(1).max(1)
}

/// A name nftables accepts (at most 255 bytes): long ones are cut and end
/// with a hash of the whole, so distinct names stay distinct.
pub fn nft_name(s: &str) -> String {
    const MAX: usize = 240;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut cut = 200;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}~{h:016x}", &s[..cut])
}

/// `ns/name` of a pod.
fn pod_id(key: &PodKey) -> String {
    format!("{}/{}", key.0, key.1)
}

/// The chain of `key` for `direction` and `flow`.
pub fn chain_name(key: &PodKey, direction: Direction, reply: bool) -> String {
    let kind = match (direction, reply) {
        (Direction::Ingress, false) => "in",
        (Direction::Ingress, true) => "inr",
        (Direction::Egress, false) => "eg",
        (Direction::Egress, true) => "egr",
    };
    nft_name(&format!("{kind}_{}", pod_id(key)))
}

/// The drop counter of `key` for `direction`.
pub fn counter_name(key: &PodKey, direction: Direction) -> String {
    let kind = match direction {
        Direction::Ingress => "drop_in",
        Direction::Egress => "drop_eg",
    };
    nft_name(&format!("{kind}_{}", pod_id(key)))
}

/// The nftables set of peer set `name` in one family.
fn set_name(name: &str, v6: bool) -> String {
    nft_name(&format!("{name}_{}", if v6 { 6 } else { 4 }))
}

// Expression builders: the JSON of `nft -j` through the crate's types.

fn s(v: &str) -> Expression<'static> {
    Expression::String(Cow::Owned(v.to_string()))
}

fn field(protocol: &'static str, name: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: name.into(),
        },
    )))
}

fn meta(key: expr::MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(expr::Meta { key }))
}

fn ct(key: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::CT(expr::CT {
        key: key.into(),
        family: None,
        dir: None,
    }))
}

fn concat(items: Vec<Expression<'static>>) -> Expression<'static> {
    Expression::Named(NamedExpression::Concat(items))
}

fn anon_set(items: Vec<Expression<'static>>) -> Expression<'static> {
    Expression::Named(NamedExpression::Set(
        items.into_iter().map(SetItem::Element).collect(),
    ))
}

fn range(lo: Expression<'static>, hi: Expression<'static>) -> Expression<'static> {
    Expression::Range(Box::new(expr::Range { range: [lo, hi] }))
}

fn is(left: Expression<'static>, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(stmt::Match {
        left,
        right,
        op: Operator::EQ,
    })
}

fn is_in(left: Expression<'static>, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(stmt::Match {
        left,
        right,
        op: Operator::IN,
    })
}

fn set_ref(name: &str) -> Expression<'static> {
    s(&format!("@{name}"))
}

/// `key vmap { element : verdict, ... }`, an anonymous verdict map (a hash
/// lookup; the whole ruleset is written again at each change, so the map
/// needs no name to be updated by).
fn vmap(key: Expression<'static>, items: Vec<SetItem<'static>>) -> Statement<'static> {
    Statement::VerdictMap(stmt::VerdictMap {
        key,
        data: Expression::Named(NamedExpression::Set(items)),
    })
}

fn named_counter(name: &str) -> Statement<'static> {
    Statement::Counter(stmt::Counter::Named(Cow::Owned(name.to_string())))
}

/// The address field of family `v6`: `ip saddr` or `ip6 daddr`...
fn addr(v6: bool, src: bool) -> Expression<'static> {
    field(
        if v6 { "ip6" } else { "ip" },
        if src { "saddr" } else { "daddr" },
    )
}

/// One element of an address set: an address or a range.
fn addr_elements(set: &AddrSet, v6: bool) -> Vec<Expression<'static>> {
    let one = |lo: String, hi: String| {
        if lo == hi {
            s(&lo)
        } else {
            range(s(&lo), s(&hi))
        }
    };
    if v6 {
        set.v6()
            .map(|(a, b)| one(a.to_string(), b.to_string()))
            .collect()
    } else {
        set.v4()
            .map(|(a, b)| one(a.to_string(), b.to_string()))
            .collect()
    }
}

/// The statements of one allow rule in a pod chain of `direction` and
/// `flow`, one list per family it can match in (none when it matches
/// nothing). The peer is the client for ingress and the server for egress;
/// the port is the server's. Original flow: client = saddr, server = daddr,
/// port = dport; reply flow: the other way round, and sport.
fn allow_rules(
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
    let l4 = || meta(expr::MetaKey::L4proto);
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
                // One protocol and port (or range), the common rule: two
                // plain matches. An anonymous set is a set of its own in the
                // kernel, and the kernel names each new one by walking the
                // table's sets: 2000 of them (1000 one-port policies, both
                // directions) made a transaction 8x slower on this kernel
                // (2.2 s against 0.26 s, `nft -j -f` of the same rules).
                let port_match: Vec<Statement<'static>> = match numeric.as_slice() {
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
                };
                for m in &peer_matches {
                    let mut v: Vec<Statement<'static>> = m.iter().cloned().collect();
                    v.extend(port_match.iter().cloned());
                    v.push(Statement::Return(None));
                    out.push(v);
                }
            }
            // Named ports: (destination address, protocol, port) tuples,
            // already limited to the rule's peers.
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
        }
    }
    out
}

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

fn ct_state(states: &[&str]) -> Statement<'static> {
    is_in(
        ct("state"),
        Expression::List(states.iter().map(|st| s(st)).collect()),
    )
}

/// `tcp flags & (syn | ack) != syn`: a TCP packet that opens nothing.
fn mid_stream_tcp() -> Statement<'static> {
    Statement::Match(stmt::Match {
        left: Expression::BinaryOperation(Box::new(expr::BinaryOperation::AND(
            field("tcp", "flags"),
            Expression::List(vec![s("syn"), s("ack")]),
        ))),
        right: s("syn"),
        op: Operator::NEQ,
    })
}

/// `ct status & dnat == 0`: no Service (or hostPort) in between.
fn not_dnat() -> Statement<'static> {
    Statement::Match(stmt::Match {
        left: Expression::BinaryOperation(Box::new(expr::BinaryOperation::AND(
            ct("status"),
            s("dnat"),
        ))),
        right: Expression::Number(0),
        op: Operator::EQ,
    })
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
    // Neighbour discovery is what the node resolves pods with (the IPv6
    // ARP); conntrack does not track it.
    b.add(rule(
        name,
        vec![
            is(
                field("icmpv6", "type"),
                anon_set(
                    [
                        "nd-router-solicit",
                        "nd-router-advert",
                        "nd-neighbor-solicit",
                        "nd-neighbor-advert",
                        "nd-redirect",
                    ]
                    .iter()
                    .map(|t| s(t))
                    .collect(),
                ),
            ),
            Statement::Accept(None),
        ],
    ));
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

/// The objects of `inet xdpcni` in a listing (`nft -j list table`): what
/// the next transaction deletes if it no longer has them. Read as plain
/// JSON: the crate's types would refuse a counter above 2^32.
pub fn objects_of(listing: &serde_json::Value) -> Objects {
    let mut out = Objects::default();
    for o in listing["nftables"].as_array().into_iter().flatten() {
        let of_table = |v: &serde_json::Value| v["table"] == TABLE && v["family"] == "inet";
        if let Some(c) = o
            .get("chain")
            .filter(|c| of_table(c) && c.get("hook").is_none())
        {
            if let Some(n) = c["name"].as_str() {
                out.chains.insert(n.to_string());
            }
        }
        if let Some(n) = o
            .get("set")
            .filter(|v| of_table(v))
            .and_then(|v| v["name"].as_str())
        {
            out.sets.insert(n.to_string());
        }
        if let Some(n) = o
            .get("counter")
            .filter(|v| of_table(v))
            .and_then(|v| v["name"].as_str())
        {
            out.counters.insert(n.to_string());
        }
        // The generation, from `ct mark & MASK == g << 16` (nft lists it as
        // a prefix match).
        if let Some(r) = o
            .get("rule")
            .filter(|v| of_table(v) && v["chain"] == "forward")
        {
            let matches = r["expr"].as_array().into_iter().flatten();
            for m in matches.filter_map(|e| e.get("match")) {
                let left_is_mark =
                    m["left"]["ct"]["key"] == "mark" || m["left"]["&"][0]["ct"]["key"] == "mark";
                let value = m["right"]["prefix"]["addr"]
                    .as_u64()
                    .or_else(|| m["right"].as_u64());
                if let (true, Some(v)) = (left_is_mark, value) {
                    out.generation = u16::try_from(v >> MARK_SHIFT).unwrap_or(0);
                }
            }
        }
    }
    out
}

/// The named counters of a listing (`nft -j list counters table ...`):
/// name -> (packets, bytes).
pub fn counters_of(listing: &serde_json::Value) -> BTreeMap<String, (u64, u64)> {
    listing["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("counter"))
        .filter(|c| c["table"] == TABLE)
        .filter_map(|c| {
            Some((
                c["name"].as_str()?.to_string(),
                (
                    c["packets"].as_u64().unwrap_or(0),
                    c["bytes"].as_u64().unwrap_or(0),
                ),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::netpol::model::{PodRules, PortRange, Proto};

    fn key(ns: &str, name: &str) -> PodKey {
        (ns.into(), name.into())
    }

    /// The commands of a transaction as JSON values.
    fn commands(e: &Enforcement, before: &Objects) -> (Vec<Value>, Objects) {
        let (b, now) = transaction(e, &Switching::default(), before);
        let doc = serde_json::to_value(b.to_nftables()).unwrap();
        (doc["nftables"].as_array().unwrap().clone(), now)
    }

    /// The rules added to `chain`, each as its `expr` list.
    fn rules_of(cmds: &[Value], chain: &str) -> Vec<Value> {
        cmds.iter()
            .filter_map(|c| c.get("add")?.get("rule"))
            .filter(|r| r["chain"] == chain)
            .map(|r| r["expr"].clone())
            .collect()
    }

    fn web_isolated() -> Enforcement {
        let mut peers = AddrSet::new();
        peers.add_ip("10.0.1.2".parse().unwrap());
        let rule = Rule {
            peers: Peers::Set("ingress_x/p_0".into()),
            ports: Ports::Only {
                numeric: vec![PortRange {
                    proto: Proto::Tcp,
                    lo: 80,
                    hi: 80,
                }],
                named: vec![],
            },
            policy: "x/p".into(),
        };
        Enforcement {
            namespaces: [("x".to_string(), 1)].into(),
            pods: [(
                key("x", "web"),
                PodRules {
                    addrs: vec!["10.0.0.2".parse().unwrap()],
                    ingress: Some(vec![rule]),
                    egress: None,
                    policies: ["x/p".to_string()].into(),
                },
            )]
            .into(),
            peer_sets: [("ingress_x/p_0".to_string(), peers)].into(),
            unknown: Default::default(),
        }
    }

    #[test]
    fn both_directions_of_a_connection_are_checked_from_its_own_side() {
        let (cmds, now) = commands(&web_isolated(), &Objects::default());
        // A connection allowed by this ruleset is marked with its
        // generation, and its packets accept at once after that.
        let forward = rules_of(&cmds, "forward");
        let g = json!(1u32 << 16);
        assert!(forward
            .iter()
            .any(|r| r[0]["match"]["right"] == g && r[1] == json!({ "accept": null })));
        assert!(forward.iter().any(|r| r
            .as_array()
            .unwrap()
            .iter()
            .any(|st| st["mangle"]["key"]["ct"]["key"] == "mark")));
        // Original direction: the client is the source, the port the
        // destination port.
        assert_eq!(
            rules_of(&cmds, "in_x/web")[0],
            json!([
                { "match": { "op": "==", "left": { "payload": { "protocol": "ip", "field": "saddr" } }, "right": "@ingress_x/p_0_4" } },
                { "match": { "op": "==", "left": { "meta": { "key": "l4proto" } }, "right": "tcp" } },
                { "match": { "op": "==", "left": { "payload": { "protocol": "th", "field": "dport" } }, "right": 80 } },
                { "return": null },
            ])
        );
        // Reply direction (the server answers): the client is the
        // destination, the server's port the source port.
        assert_eq!(
            rules_of(&cmds, "inr_x/web")[0],
            json!([
                { "match": { "op": "==", "left": { "payload": { "protocol": "ip", "field": "daddr" } }, "right": "@ingress_x/p_0_4" } },
                { "match": { "op": "==", "left": { "meta": { "key": "l4proto" } }, "right": "tcp" } },
                { "match": { "op": "==", "left": { "payload": { "protocol": "th", "field": "sport" } }, "right": 80 } },
                { "return": null },
            ])
        );
        // Whatever no rule allows is counted and dropped, in both.
        for c in ["in_x/web", "inr_x/web"] {
            assert_eq!(
                rules_of(&cmds, c).last().unwrap(),
                &json!([{ "counter": "drop_in_x/web" }, { "drop": null }])
            );
        }
        // No IPv6 peer: no IPv6 rule.
        assert_eq!(rules_of(&cmds, "in_x/web").len(), 2);
        let forward = rules_of(&cmds, "forward");
        let text = serde_json::to_string(&forward).unwrap();
        assert!(text.contains(r#"{"jump":{"target":"in_x/web"}}"#), "{text}");
        assert!(
            text.contains(r#"{"jump":{"target":"inr_x/web"}}"#),
            "{text}"
        );
        assert!(!text.contains("eg_x/web"), "egress is not isolated: {text}");
        assert_eq!(
            now.chains,
            ["in_x/web".to_string(), "inr_x/web".to_string()].into()
        );
        assert_eq!(now.sets, ["ingress_x/p_0_4".to_string()].into());
        assert_eq!(
            now.counters,
            [DROP_INVALID.to_string(), "drop_in_x/web".to_string()].into()
        );
    }

    #[test]
    fn an_open_window_checks_new_udp_between_local_pods_as_a_reply_too() {
        let window = |sw: &Switching| {
            let (b, _) = transaction(&web_isolated(), sw, &Objects::default());
            let doc = serde_json::to_value(b.to_nftables()).unwrap();
            rules_of(doc["nftables"].as_array().unwrap(), "forward")
                .into_iter()
                .filter(|r| serde_json::to_string(r).unwrap().contains("udplite"))
                .collect::<Vec<_>>()
        };
        assert!(window(&Switching::default()).is_empty(), "no window open");
        let sw = Switching {
            pods: ["10.0.0.2".parse().unwrap()].into(),
            local: ["10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap()].into(),
        };
        let rules = window(&sw);
        // From the pod, and to it; each through the reply-direction chain
        // (web is isolated for ingress only: inr, by source).
        assert_eq!(rules.len(), 2, "{rules:#?}");
        for (r, (open_end, other_end)) in rules.iter().zip([("saddr", "daddr"), ("daddr", "saddr")])
        {
            let r = r.as_array().unwrap();
            assert_eq!(r[0]["match"]["right"], json!(["new"]));
            assert_eq!(r[1]["match"]["right"], json!({ "set": ["udp", "udplite"] }));
            // Not through a Service: `ct status & dnat == 0`.
            assert_eq!(
                r[2]["match"],
                json!({ "op": "==", "left": { "&": [{ "ct": { "key": "status" } }, "dnat"] }, "right": 0 })
            );
            assert_eq!(r[3]["match"]["left"]["payload"]["field"], open_end);
            assert_eq!(r[3]["match"]["right"], json!({ "set": ["10.0.0.2"] }));
            assert_eq!(r[4]["match"]["left"]["payload"]["field"], other_end);
            assert_eq!(
                r[4]["match"]["right"],
                json!({ "set": ["10.0.0.2", "10.0.0.3"] })
            );
            assert_eq!(r[5]["vmap"]["key"]["payload"]["field"], "saddr");
            assert_eq!(
                r[5]["vmap"]["data"]["set"][0][1],
                json!({ "jump": { "target": "inr_x/web" } })
            );
        }
        // A window of IPv6 pods only adds nothing to IPv4 rules.
        let v6 = Switching {
            pods: ["fd00::2".parse().unwrap()].into(),
            local: ["fd00::2".parse().unwrap()].into(),
        };
        assert!(window(&v6).is_empty());
    }

    #[test]
    fn one_transaction_flushes_rebuilds_and_deletes_what_is_gone() {
        let (_, first) = commands(&web_isolated(), &Objects::default());
        let (cmds, now) = commands(&Enforcement::default(), &first);
        assert_eq!(
            cmds[0],
            json!({ "add": { "table": { "family": "inet", "name": "xdpcni" } } })
        );
        assert_eq!(
            cmds[1],
            json!({ "flush": { "table": { "family": "inet", "name": "xdpcni" } } })
        );
        let deleted: Vec<String> = cmds
            .iter()
            .filter_map(|c| c.get("delete"))
            .map(|d| {
                let (kind, v) = d.as_object().unwrap().iter().next().unwrap();
                format!("{kind} {}", v["name"].as_str().unwrap())
            })
            .collect();
        assert_eq!(
            deleted,
            vec![
                "chain in_x/web",
                "chain inr_x/web",
                "set ingress_x/p_0_4",
                "counter drop_in_x/web"
            ]
        );
        assert_eq!(now.counters, [DROP_INVALID.to_string()].into());
        // With nothing isolated the base chains have only the ND, ICMP and
        // allowed-already rules.
        assert_eq!(rules_of(&cmds, "forward").len(), 3);
        assert_eq!(rules_of(&cmds, "input").len(), 3);
        assert_eq!((first.generation, now.generation), (1, 2));
    }

    #[test]
    fn long_names_are_cut_with_a_hash_and_stay_distinct() {
        let a = format!("in_{}/{}", "n".repeat(63), "p".repeat(253));
        let b = format!("in_{}/{}q", "n".repeat(63), "p".repeat(252));
        assert!(nft_name(&a).len() <= 240 && nft_name(&b).len() <= 240);
        assert_ne!(nft_name(&a), nft_name(&b));
        assert_eq!(nft_name("in_x/web"), "in_x/web");
    }

    #[test]
    fn the_kernels_listing_gives_back_the_objects() {
        let listing = json!({ "nftables": [
            { "metainfo": { "version": "1.0.6" } },
            { "table": { "family": "inet", "name": "xdpcni" } },
            { "counter": { "family": "inet", "table": "xdpcni", "name": "drop_in_x/web", "packets": 5_000_000_000u64, "bytes": 7 } },
            { "set": { "family": "inet", "table": "xdpcni", "name": "ingress_x/p_0_4", "type": "ipv4_addr" } },
            { "chain": { "family": "inet", "table": "xdpcni", "name": "forward", "hook": "forward" } },
            { "chain": { "family": "inet", "table": "xdpcni", "name": "in_x/web" } },
            { "rule": { "family": "inet", "table": "xdpcni", "chain": "forward", "expr": [
                { "match": { "op": "==", "left": { "ct": { "key": "mark" } },
                             "right": { "prefix": { "addr": 7u64 << 16, "len": 16 } } } },
                { "accept": null } ] } },
            { "chain": { "family": "inet", "table": "other", "name": "mine" } },
        ] });
        let o = objects_of(&listing);
        assert_eq!(
            o.chains,
            ["in_x/web".to_string()].into(),
            "base chains stay"
        );
        assert_eq!(o.sets, ["ingress_x/p_0_4".to_string()].into());
        assert_eq!(o.generation, 7, "read back as nft lists it");
        assert_eq!(next_generation(o.generation), 8);
        assert_eq!(
            next_generation(u16::MAX),
            1,
            "never 0, an unmarked connection's"
        );
        assert_eq!(
            counters_of(&listing).get("drop_in_x/web"),
            Some(&(5_000_000_000, 7)),
            "counters above 2^32"
        );
    }
}
