//! The ruleset that enforces an [`Enforcement`](crate::netpol::model::Enforcement) ([`Ruleset`]),
//! and the transaction that makes the table hold it: the whole table after
//! a start or a failure, and otherwise only what differs from the ruleset in
//! force.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use nftables::{
    batch::Batch,
    expr::{self, Expression, SetItem},
    schema::{self, FlushObject, NfCmd, NfListObject},
    stmt::{self, Statement},
    types::{NfChainPolicy, NfChainType, NfHook},
};

use super::{
    chain_name, counter_name,
    exprs::*,
    rules::{chain_rules, pod_sets, SetSpec},
    Flow, Objects, Switching, DROP_INVALID, FAMILY, MARK_MASK, MARK_SHIFT, TABLE,
};
use crate::netpol::{
    compile::allowed,
    model::{Direction, Enforcement},
};

/// A rule: its statements.
type Rule = Vec<Statement<'static>>;

/// Everything the table holds for one enforcement: what a transaction
/// writes, and what the next one is compared with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ruleset {
    /// Its generation (what its conntrack marks say).
    pub generation: u16,
    /// What its sets' names are derived from with their content: the
    /// generation of the last whole-table transaction.
    pub epoch: u16,
    /// The pod chains' sets, by name.
    sets: BTreeMap<String, SetSpec>,
    /// The pod chains and their rules.
    chains: BTreeMap<String, Vec<Rule>>,
    /// The named counters.
    counters: BTreeSet<String>,
    /// The rules of `forward` and of `input`.
    base: [Vec<Rule>; 2],
}

impl Ruleset {
    /// How many rules it has (base chains and pod chains).
    pub fn rules(&self) -> usize {
        self.chains.values().map(Vec::len).sum::<usize>()
            + self.base.iter().map(Vec::len).sum::<usize>()
    }

    /// The names of its objects.
    pub fn objects(&self) -> Objects {
        Objects {
            chains: self.chains.keys().cloned().collect(),
            sets: self.sets.keys().cloned().collect(),
            counters: self.counters.clone(),
            generation: self.generation,
        }
    }

    /// Whether `other` has a set of one of this one's names with other
    /// elements (two contents with one hash): then only a whole-table
    /// transaction, under a new epoch, is safe.
    pub fn clashes_with(&self, other: &Ruleset) -> bool {
        self.sets
            .iter()
            .any(|(n, s)| other.sets.get(n).is_some_and(|o| o != s))
    }
}

/// The ruleset that enforces `e` with the windows of `switching` open,
/// under `generation`, its sets named in `epoch`.
pub fn ruleset(e: &Enforcement, switching: &Switching, generation: u16, epoch: u16) -> Ruleset {
    let mut r = Ruleset {
        generation,
        epoch,
        ..Ruleset::default()
    };
    r.counters.insert(DROP_INVALID.into());
    let pods = pod_chains(&mut r, e);
    let mark = GenerationMark::new(generation);
    r.base = [Base::Forward, Base::Input].map(|base| base_rules(base, &pods, &mark, switching));
    r
}

/// What the table holds before a transaction.
pub enum Before<'a> {
    /// Not known rule for rule (after a start, or a failed transaction):
    /// the names the kernel lists. The transaction writes the whole table.
    Listed(&'a Objects),
    /// The ruleset the last transaction wrote: only what differs is written.
    InForce(&'a Ruleset),
}

/// The transaction that makes the table hold `now`. In steps: the table
/// (emptied of rules, for a whole-table transaction: in the same
/// transaction, so no packet sees it empty) and its base chains, the
/// counters, the sets that are new, the pod chains that are new or changed
/// (after the sets they look up, before the base chains' verdict maps that
/// jump to them), the base chains' rules, then the objects no rule refers
/// to any more.
pub fn transaction(now: &Ruleset, before: &Before<'_>) -> Batch<'static> {
    let mut b = Batch::new();
    b.add(NfListObject::Table(table()));
    let (old, in_force) = match before {
        Before::Listed(o) => ((*o).clone(), None),
        Before::InForce(r) => (r.objects(), Some(*r)),
    };
    if in_force.is_none() {
        b.add_cmd(NfCmd::Flush(FlushObject::Table(table())));
    }
    for base in [Base::Forward, Base::Input] {
        b.add(NfListObject::Chain(schema::Chain {
            _type: Some(NfChainType::Filter),
            hook: Some(base.hook()),
            prio: Some(0),
            policy: Some(NfChainPolicy::Accept),
            ..chain(base.name())
        }));
    }
    for c in now.counters.difference(&old.counters) {
        b.add(counter(c));
    }
    for (name, set) in &now.sets {
        if in_force.is_some() && old.sets.contains(name) {
            continue;
        }
        b.add(NfListObject::Set(Box::new(set.schema(name))));
        if old.sets.contains(name) {
            // Listed by the kernel under this name: its content is not
            // known for sure.
            b.add_cmd(NfCmd::Flush(FlushObject::Set(Box::new(set.schema(name)))));
        }
        b.add(elements(name, set.elements.clone()));
    }
    for (name, rules) in &now.chains {
        if in_force.is_some_and(|f| f.chains.get(name) == Some(rules)) {
            continue;
        }
        b.add(NfListObject::Chain(chain(name)));
        if in_force.is_some() {
            b.add_cmd(NfCmd::Flush(FlushObject::Chain(chain(name))));
        }
        for r in rules {
            b.add(rule(name, r.clone()));
        }
    }
    for (base, rules) in [Base::Forward, Base::Input].iter().zip(&now.base) {
        if in_force.is_some() {
            b.add_cmd(NfCmd::Flush(FlushObject::Chain(chain(base.name()))));
        }
        for r in rules {
            b.add(rule(base.name(), r.clone()));
        }
    }
    delete_gone(&mut b, &old, &now.objects());
    b
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

fn rule(chain: &str, expr: Rule) -> NfListObject<'static> {
    NfListObject::Rule(schema::Rule {
        family: FAMILY,
        table: TABLE.into(),
        chain: chain.to_string().into(),
        expr: expr.into(),
        ..schema::Rule::default()
    })
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

/// A base chain's verdict map: (direction, flow, IPv6) -> its items.
type MapKey = (Direction, Flow, bool);

/// What the pod chains give the base chains.
struct PodChains {
    /// The verdict maps that jump to the pod chains.
    maps: BTreeMap<MapKey, Vec<SetItem<'static>>>,
    /// The isolated pods' addresses, IPv4 then IPv6.
    isolated: [Vec<Expression<'static>>; 2],
}

/// A chain per isolated pod, direction and flow: lookups in the pod's sets
/// for the direction, then a counted drop; and the verdict-map items that
/// jump there.
fn pod_chains(r: &mut Ruleset, e: &Enforcement) -> PodChains {
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
            let sets = pod_sets(
                &chain_name(key, direction, false),
                &allowed(rules, &e.peer_sets),
                r.epoch,
            );
            for flow in [Flow::Original, Flow::Reply] {
                let c = chain_name(key, direction, flow == Flow::Reply);
                r.chains
                    .insert(c.clone(), chain_rules(&sets, direction, flow, &drops));
                for ip in &pod.addrs {
                    let verdict = Expression::Verdict(expr::Verdict::Jump(stmt::JumpTarget {
                        target: c.clone().into(),
                    }));
                    out.maps
                        .entry((direction, flow, ip.is_ipv6()))
                        .or_default()
                        .push(SetItem::Mapping(s(&ip.to_string()), verdict));
                }
            }
            r.sets.extend(sets);
            r.counters.insert(drops);
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
    base: Base,
    pods: &PodChains,
    mark: &GenerationMark,
    switching: &Switching,
) -> Vec<Rule> {
    let mut b: Vec<Rule> = vec![neighbour_discovery()];
    let ends = isolated_ends(base, &pods.isolated);
    for end in &ends {
        b.push(vec![
            ct_state(&["invalid", "untracked"]),
            end.clone(),
            named_counter(DROP_INVALID),
            Statement::Drop(None),
        ]);
    }
    b.push(vec![
        ct_state(&["related"]),
        is(
            meta(expr::MetaKey::L4proto),
            anon_set(vec![s("icmp"), s("ipv6-icmp")]),
        ),
        Statement::Accept(None),
    ]);
    // Allowed already by this ruleset.
    b.push(vec![mark.marked.clone(), Statement::Accept(None)]);
    for v6 in [false, true] {
        for &(direction, flow, src, dir) in base.lookups() {
            let Some(items) = pods.maps.get(&(direction, flow, v6)) else {
                continue;
            };
            b.push(vec![
                is(ct("direction"), s(dir)),
                vmap(addr(v6, src), items.clone()),
            ]);
        }
        if base == Base::Forward {
            mid_stream_rules(&mut b, &pods.maps, v6, switching);
        }
    }
    // Past the pod chains: allowed. Remembered on the connection.
    for end in ends {
        b.push(vec![end, mark.set_mark.clone()]);
    }
    b
}

/// Neighbour discovery accepted: it is what the node resolves pods with
/// (the IPv6 ARP), and conntrack does not track it.
fn neighbour_discovery() -> Rule {
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
    b: &mut Vec<Rule>,
    maps: &BTreeMap<MapKey, Vec<SetItem<'static>>>,
    v6: bool,
    switching: &Switching,
) {
    for (direction, src) in [(Direction::Egress, false), (Direction::Ingress, true)] {
        let Some(items) = maps.get(&(direction, Flow::Reply, v6)) else {
            continue;
        };
        b.push(vec![
            ct_state(&["new"]),
            mid_stream_tcp(),
            vmap(addr(v6, src), items.clone()),
        ]);
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
            b.push(vec![
                ct_state(&["new"]),
                is(
                    meta(expr::MetaKey::L4proto),
                    anon_set(vec![s("udp"), s("udplite")]),
                ),
                not_dnat(),
                is(addr(v6, switching_end), anon_set(open.clone())),
                is(addr(v6, !switching_end), anon_set(local.clone())),
                vmap(addr(v6, src), items.clone()),
            ]);
        }
    }
}

/// What the ruleset before had and this one has not (no rule refers to them
/// any more: the chains that did are flushed, rewritten or deleted first).
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
