//! The nftables ruleset that enforces an [`Enforcement`](crate::netpol::model::Enforcement), built with the
//! `nftables` crate's types and applied through `nft -j -f -` as one atomic
//! transaction: no userspace on the packet path, and no moment where a
//! packet sees half a change. After the first, a transaction writes only
//! what changed: the sets whose content changed (under new names), the pod
//! chains that look them up, and the base chains.
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
//! chain in_<ns>/<pod>   ip saddr @in_<ns>/<pod>_a4.<h> return   (any port)
//!                       ip saddr . meta l4proto . th dport @..._p4.<h> return
//!                       (the same in IPv6), counter drop
//! chain inr_<ns>/<pod>  the reply direction: ip daddr, th sport, same sets
//! chain eg_<ns>/<pod>, egr_..: the same for egress, and named ports
//!                       ip daddr . meta l4proto . th dport @..._n4.<h>
//! set in_<ns>/<pod>_a4|6.<h>  peers allowed on any port (interval)
//! set in_<ns>/<pod>_p4|6.<h>  peer . protocol . port (interval): the
//!                       pieces of compile::Allowed, that never overlap
//!   (<h>: a hash of the content and of the epoch, the generation of the
//!   last whole-table transaction: a changed set is a new set)
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

mod exprs;
mod rules;
mod transaction;

pub use transaction::{ruleset, transaction, Before, Ruleset};

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use nftables::types::NfFamily;

use super::model::Direction;
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

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a of `bytes`, from `h` (a name's hash: stable across runs).
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A name nftables accepts (at most 255 bytes): long ones are cut and end
/// with a hash of the whole, so distinct names stay distinct.
pub fn nft_name(s: &str) -> String {
    const MAX: usize = 240;
    if s.len() <= MAX {
        return s.to_string();
    }
    let h = fnv(FNV_OFFSET, s.as_bytes());
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
    use crate::netpol::{
        addrs::AddrSet,
        model::{Enforcement, Peers, PodRules, PortRange, Ports, Proto, Rule},
    };

    fn key(ns: &str, name: &str) -> PodKey {
        (ns.into(), name.into())
    }

    /// The commands of a whole-table transaction as JSON values.
    fn commands(e: &Enforcement, before: &Objects) -> (Vec<Value>, Ruleset) {
        let now = ruleset(
            e,
            &Switching::default(),
            next_generation(before.generation),
            1,
        );
        (json_of(transaction(&now, &Before::Listed(before))), now)
    }

    fn json_of(b: nftables::batch::Batch<'_>) -> Vec<Value> {
        let doc = serde_json::to_value(b.to_nftables()).unwrap();
        doc["nftables"].as_array().unwrap().clone()
    }

    /// The rules added to `chain`, each as its `expr` list.
    fn rules_of(cmds: &[Value], chain: &str) -> Vec<Value> {
        cmds.iter()
            .filter_map(|c| c.get("add")?.get("rule"))
            .filter(|r| r["chain"] == chain)
            .map(|r| r["expr"].clone())
            .collect()
    }

    /// The sets a transaction adds: name -> its elements.
    fn sets_of(cmds: &[Value]) -> BTreeMap<String, Value> {
        cmds.iter()
            .filter_map(|c| c.get("add")?.get("element"))
            .map(|e| (e["name"].as_str().unwrap().to_string(), e["elem"].clone()))
            .collect()
    }

    /// What a transaction does besides adding rules and elements, as
    /// "verb kind name" lines.
    fn verbs(cmds: &[Value]) -> Vec<String> {
        cmds.iter()
            .flat_map(|c| c.as_object().unwrap().iter())
            .filter_map(|(verb, o)| {
                let (kind, v) = o.as_object().unwrap().iter().next().unwrap();
                (!matches!(kind.as_str(), "rule" | "element" | "table"))
                    .then(|| format!("{verb} {kind} {}", v["name"].as_str().unwrap_or("")))
            })
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

    /// The one set of `cmds` whose name starts with `prefix`.
    fn set_named(cmds: &[Value], prefix: &str) -> (String, Value) {
        let mut found: Vec<(String, Value)> = sets_of(cmds)
            .into_iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .collect();
        assert_eq!(found.len(), 1, "{prefix}: {found:?}");
        found.remove(0)
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
        // The peers and ports allowed in are the pod's set: peer, protocol
        // and port, one element per piece.
        let (set, elements) = set_named(&cmds, "in_x/web_p4.");
        assert_eq!(elements, json!([{ "concat": ["10.0.1.2", "tcp", 80] }]));
        let key = |addr: &str, port: &str| {
            json!({ "concat": [
                { "payload": { "protocol": "ip", "field": addr } },
                { "meta": { "key": "l4proto" } },
                { "payload": { "protocol": "th", "field": port } },
            ] })
        };
        // Original direction: the client is the source, the port the
        // destination port.
        assert_eq!(
            rules_of(&cmds, "in_x/web")[0],
            json!([
                { "match": { "op": "==", "left": key("saddr", "dport"), "right": format!("@{set}") } },
                { "return": null },
            ])
        );
        // Reply direction (the server answers): the client is the
        // destination, the server's port the source port; the same set.
        assert_eq!(
            rules_of(&cmds, "inr_x/web")[0],
            json!([
                { "match": { "op": "==", "left": key("daddr", "sport"), "right": format!("@{set}") } },
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
        // No IPv6 peer, no peer on any port: one lookup.
        assert_eq!(rules_of(&cmds, "in_x/web").len(), 2);
        let forward = rules_of(&cmds, "forward");
        let text = serde_json::to_string(&forward).unwrap();
        assert!(text.contains(r#"{"jump":{"target":"in_x/web"}}"#), "{text}");
        assert!(
            text.contains(r#"{"jump":{"target":"inr_x/web"}}"#),
            "{text}"
        );
        assert!(!text.contains("eg_x/web"), "egress is not isolated: {text}");
        let o = now.objects();
        assert_eq!(
            o.chains,
            ["in_x/web".to_string(), "inr_x/web".to_string()].into()
        );
        assert_eq!(o.sets, [set].into());
        assert_eq!(
            o.counters,
            [DROP_INVALID.to_string(), "drop_in_x/web".to_string()].into()
        );
        assert_eq!(
            now.rules(),
            4 + forward.len() + rules_of(&cmds, "input").len()
        );
    }

    #[test]
    fn overlapping_rules_become_pieces_that_never_overlap() {
        // Any port from 10.0.1.0/24; TCP 80-81 from 10.0.0.0/16 and UDP
        // 53 from 10.0.0.128/25 (overlapping peers, other ports), and a
        // rule with both families.
        let mut e = web_isolated();
        let mut wide = AddrSet::new();
        wide.add_net(&"10.0.0.0/16".parse().unwrap());
        wide.add_net(&"fd00::/64".parse().unwrap());
        let mut narrow = AddrSet::new();
        narrow.add_net(&"10.0.0.128/25".parse().unwrap());
        let mut any = AddrSet::new();
        any.add_net(&"10.0.1.0/24".parse().unwrap());
        for s in [&mut wide, &mut narrow, &mut any] {
            s.normalize();
        }
        e.peer_sets = [
            ("w".to_string(), wide),
            ("n".to_string(), narrow),
            ("a".to_string(), any),
        ]
        .into();
        let only = |proto, lo, hi| Ports::Only {
            numeric: vec![PortRange { proto, lo, hi }],
            named: vec![],
        };
        let rule = |set: &str, ports| Rule {
            peers: Peers::Set(set.into()),
            ports,
            policy: "x/p".into(),
        };
        e.pods.get_mut(&key("x", "web")).unwrap().ingress = Some(vec![
            rule("w", only(Proto::Tcp, 80, 81)),
            rule("n", only(Proto::Udp, 53, 53)),
            rule("a", Ports::Any),
        ]);
        let (cmds, _) = commands(&e, &Objects::default());
        assert_eq!(
            set_named(&cmds, "in_x/web_p4.").1,
            json!([
                { "concat": [{ "range": ["10.0.0.0", "10.0.0.127"] }, "tcp", { "range": [80, 81] }] },
                { "concat": [{ "range": ["10.0.0.128", "10.0.0.255"] }, "tcp", { "range": [80, 81] }] },
                { "concat": [{ "range": ["10.0.0.128", "10.0.0.255"] }, "udp", 53] },
                { "concat": [{ "range": ["10.0.1.0", "10.0.255.255"] }, "tcp", { "range": [80, 81] }] },
            ])
        );
        assert_eq!(
            set_named(&cmds, "in_x/web_a4.").1,
            json!([{ "range": ["10.0.1.0", "10.0.1.255"] }])
        );
        assert_eq!(
            set_named(&cmds, "in_x/web_p6.").1,
            json!([{ "concat": [{ "range": ["fd00::", "fd00::ffff:ffff:ffff:ffff"] }, "tcp", { "range": [80, 81] }] }])
        );
        // Any port first, then the ports, per family: 3 lookups and a drop.
        assert_eq!(rules_of(&cmds, "in_x/web").len(), 4);
    }

    #[test]
    fn an_open_window_checks_new_udp_between_local_pods_as_a_reply_too() {
        let window = |sw: &Switching| {
            let now = ruleset(&web_isolated(), sw, 1, 1);
            rules_of(
                &json_of(transaction(&now, &Before::Listed(&Objects::default()))),
                "forward",
            )
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
    fn a_whole_table_transaction_flushes_rebuilds_and_deletes_what_is_gone() {
        let (_, first) = commands(&web_isolated(), &Objects::default());
        let (cmds, now) = commands(&Enforcement::default(), &first.objects());
        assert_eq!(
            cmds[0],
            json!({ "add": { "table": { "family": "inet", "name": "xdpcni" } } })
        );
        assert_eq!(
            cmds[1],
            json!({ "flush": { "table": { "family": "inet", "name": "xdpcni" } } })
        );
        let set = first.objects().sets.into_iter().next().unwrap();
        let deleted: Vec<String> = verbs(&cmds)
            .into_iter()
            .filter(|v| v.starts_with("delete"))
            .collect();
        assert_eq!(
            deleted,
            vec![
                "delete chain in_x/web".to_string(),
                "delete chain inr_x/web".to_string(),
                format!("delete set {set}"),
                "delete counter drop_in_x/web".to_string(),
            ]
        );
        assert_eq!(now.objects().counters, [DROP_INVALID.to_string()].into());
        // With nothing isolated the base chains have only the ND, ICMP and
        // allowed-already rules.
        assert_eq!(rules_of(&cmds, "forward").len(), 3);
        assert_eq!(rules_of(&cmds, "input").len(), 3);
        assert_eq!((first.generation, now.generation), (1, 2));
    }

    #[test]
    fn after_the_first_a_transaction_writes_only_what_changed() {
        // web and db isolated; then db's peer changes.
        let mut e = web_isolated();
        let db = e.pods[&key("x", "web")].clone();
        e.pods.insert(
            key("x", "db"),
            PodRules {
                addrs: vec!["10.0.0.3".parse().unwrap()],
                ..db
            },
        );
        let first = ruleset(&e, &Switching::default(), 1, 1);
        let mut changed = e.clone();
        let mut other = AddrSet::new();
        other.add_ip("10.0.1.9".parse().unwrap());
        changed.peer_sets.insert("ingress_x/other_0".into(), other);
        changed
            .pods
            .get_mut(&key("x", "db"))
            .unwrap()
            .ingress
            .as_mut()
            .unwrap()[0]
            .peers = Peers::Set("ingress_x/other_0".into());
        let now = ruleset(&changed, &Switching::default(), 2, first.epoch);
        assert!(!now.clashes_with(&first));
        let cmds = json_of(transaction(&now, &Before::InForce(&first)));
        let old_db = set_named(
            &json_of(transaction(&first, &Before::Listed(&Objects::default()))),
            "in_x/db_p4.",
        )
        .0;
        let (new_db, elements) = set_named(&cmds, "in_x/db_p4.");
        assert_ne!(old_db, new_db, "a changed set is a new set");
        assert_eq!(elements, json!([{ "concat": ["10.0.1.9", "tcp", 80] }]));
        // web's set and chains are left as they are; db's chains are
        // rewritten to the new set, the base chains (the generation) too,
        // and db's old set goes once nothing looks it up.
        assert_eq!(
            verbs(&cmds),
            vec![
                "add chain forward".to_string(),
                "add chain input".to_string(),
                format!("add set {new_db}"),
                "add chain in_x/db".to_string(),
                "flush chain in_x/db".to_string(),
                "add chain inr_x/db".to_string(),
                "flush chain inr_x/db".to_string(),
                "flush chain forward".to_string(),
                "flush chain input".to_string(),
                format!("delete set {old_db}"),
            ]
        );
        assert!(rules_of(&cmds, "in_x/web").is_empty());
        assert_eq!(rules_of(&cmds, "in_x/db").len(), 2);
        // Nothing changed but the generation: only the base chains.
        let again = ruleset(&changed, &Switching::default(), 3, first.epoch);
        let cmds = json_of(transaction(&again, &Before::InForce(&now)));
        assert_eq!(
            verbs(&cmds),
            vec![
                "add chain forward",
                "add chain input",
                "flush chain forward",
                "flush chain input"
            ]
        );
        // Another epoch names every set anew.
        let other_epoch = ruleset(&changed, &Switching::default(), 3, 3);
        assert!(other_epoch.objects().sets.is_disjoint(&now.objects().sets));
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
