//! The nftables ruleset that enforces an [`Enforcement`](crate::netpol::model::Enforcement), built with the
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

mod exprs;
mod rules;
mod transaction;

pub use transaction::transaction;

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
