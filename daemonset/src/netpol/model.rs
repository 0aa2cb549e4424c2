//! What the NetworkPolicies of the cluster mean for the pods of this node:
//! which pods are isolated, in which direction, and what each may still
//! send or receive. Pure: Kubernetes objects in, [`Enforcement`] out, so
//! the translation is tested without a kernel (`nft/` turns it into an
//! nftables ruleset).
//!
//! Semantics (networking.k8s.io/v1):
//! - A pod is isolated for ingress (egress) when a policy of its namespace
//!   selects it and has `Ingress` (`Egress`) in `policyTypes`; absent
//!   `policyTypes` means `Ingress`, plus `Egress` when the policy has egress
//!   rules. Then only the union of those policies' rules is allowed.
//! - A rule with no peers allows every peer, with no ports every port. A
//!   peer is an `ipBlock` (a CIDR minus its `except`s, matched against any
//!   address, pods' and nodes' included), or pods: a `podSelector` alone
//!   selects in the policy's namespace, a `namespaceSelector` alone selects
//!   every pod of the namespaces it selects, both together pods matching
//!   the first in namespaces matching the second. hostNetwork pods are
//!   never selected as peers (they have their node's address: an `ipBlock`
//!   matches them), nor are pods that have ended.
//! - Named ports are resolved on the destination pod: for ingress on the
//!   isolated pod itself, for egress on each peer pod (an `ipBlock` peer, or
//!   a destination that is no pod, has no named ports). `endPort` makes a
//!   range. TCP (the default), UDP and SCTP.
//! - A namespace carries the label `kubernetes.io/metadata.name` with its
//!   name, as API servers from 1.21 add it (1.20 does not: it is implied).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use k8s_openapi::{
    api::{
        core::v1::{Namespace, Pod},
        networking::v1::{NetworkPolicy, NetworkPolicyPeer},
    },
    apimachinery::pkg::apis::meta::v1::LabelSelector,
};
use kube::ResourceExt;

pub use super::ports::{resolve_named_port, PortRange, Proto};
use super::{
    addrs::AddrSet,
    ports::{port_specs, PortSpec},
};
use crate::records::PodKey;

/// The label every namespace carries with its own name.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Which peers a rule allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peers {
    /// Every source (ingress) or destination (egress).
    Any,
    /// The addresses of [`Enforcement::peer_sets`] under this name.
    Set(String),
}

/// Which ports a rule allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ports {
    /// Every port of every protocol (ICMP included).
    Any,
    /// These ports only.
    Only {
        /// By number, for every peer of the rule.
        numeric: Vec<PortRange>,
        /// Named ports resolved per destination pod (egress): that pod's
        /// address with its number for the name.
        named: Vec<(IpAddr, Proto, u16)>,
    },
}

/// One allow rule of an isolated pod, in one direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The peers.
    pub peers: Peers,
    /// The ports (on the destination: the isolated pod for ingress, the
    /// peer for egress).
    pub ports: Ports,
    /// The policy it comes from, `namespace/name`.
    pub policy: String,
}

/// What an isolated local pod may receive and send.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRules {
    /// Its addresses.
    pub addrs: Vec<IpAddr>,
    /// Isolated for ingress: only these are allowed in.
    pub ingress: Option<Vec<Rule>>,
    /// Isolated for egress: only these are allowed out.
    pub egress: Option<Vec<Rule>>,
    /// The policies that select it, `namespace/name`.
    pub policies: BTreeSet<String>,
}

/// What the policies mean for this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Enforcement {
    /// Every namespace with policies, and how many (the CNI's gate).
    pub namespaces: BTreeMap<String, u32>,
    /// The local pods some policy isolates.
    pub pods: BTreeMap<PodKey, PodRules>,
    /// The address sets rules refer to by name.
    pub peer_sets: BTreeMap<String, AddrSet>,
    /// Local pods whose Pod object is not known: not classified yet.
    pub unknown: BTreeSet<PodKey>,
}

/// A pod of this node, as its CNI record gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalPod {
    /// Its namespace and name.
    pub key: PodKey,
    /// Its addresses.
    pub ips: Vec<IpAddr>,
}

/// Ingress or egress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    /// Traffic to the pod.
    Ingress,
    /// Traffic from the pod.
    Egress,
}

impl Direction {
    /// `ingress` or `egress`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
        }
    }
}

/// Whether `selector` selects `labels` (an empty selector selects all), by
/// kube's `Selector`. A selector kube cannot read (an unknown operator, `In`
/// without values: the API server refuses those) selects nothing.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    use kube::core::SelectorExt;
    kube::core::Selector::try_from(selector.clone()).is_ok_and(|s| s.matches(labels))
}

/// (ingress, egress): the directions a policy isolates the pods it selects in.
pub fn policy_types(np: &NetworkPolicy) -> (bool, bool) {
    let Some(spec) = &np.spec else {
        return (false, false);
    };
    match spec.policy_types.as_deref() {
        Some(types) if !types.is_empty() => (
            types.iter().any(|t| t == "Ingress"),
            types.iter().any(|t| t == "Egress"),
        ),
        _ => (true, spec.egress.as_ref().is_some_and(|e| !e.is_empty())),
    }
}

/// Whether `np` selects a pod of namespace `ns` with `labels`.
pub fn policy_selects(np: &NetworkPolicy, ns: &str, labels: &BTreeMap<String, String>) -> bool {
    np.namespace().as_deref() == Some(ns)
        && np
            .spec
            .as_ref()
            .is_some_and(|spec| selects(&spec.pod_selector.clone().unwrap_or_default(), labels))
}

/// A pod as a possible peer: its namespace, labels, addresses, and named
/// container ports.
struct PeerPod<'a> {
    ns: String,
    labels: &'a BTreeMap<String, String>,
    ips: Vec<IpAddr>,
    pod: &'a Pod,
}

/// The address of a pod, from its status (and, for this node's pods, its
/// CNI record, which the status may trail).
fn status_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(st) = &pod.status else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = st
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|p| p.ip.parse().ok())
        .collect();
    if let Some(ip) = st.pod_ip.as_deref().and_then(|s| s.parse().ok()) {
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    ips
}

fn is_host_network(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
}

fn has_ended(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The name of the address set of rule `index` in `direction` of policy
/// `ns/name`.
fn set_name(ns: &str, name: &str, direction: Direction, index: usize) -> String {
    format!("{}_{ns}/{name}_{index}", direction.as_str())
}

/// The cluster as the policy translation needs it.
pub struct Cluster<'a> {
    /// Every NetworkPolicy.
    pub policies: &'a [Arc<NetworkPolicy>],
    /// Every Namespace.
    pub namespaces: &'a [Arc<Namespace>],
    /// Every Pod of the cluster.
    pub pods: &'a [Arc<Pod>],
}

/// A policy rule, resolved once for every pod it applies to: its peers,
/// its ports as written, and the peer pods (indexes into the peer list) its
/// egress named ports are resolved on.
struct RuleSpec {
    peers: Peers,
    ports: Option<Vec<PortSpec>>,
    peer_pods: Vec<usize>,
}

/// (policy `namespace/name`, direction, rule index).
type RuleKey = (String, Direction, usize);

/// Every namespace's labels, with the implied name label.
fn namespace_labels(namespaces: &[Arc<Namespace>]) -> HashMap<String, BTreeMap<String, String>> {
    namespaces
        .iter()
        .map(|n| {
            let mut labels = n.labels().clone();
            labels.insert(NAMESPACE_NAME_LABEL.into(), n.name_any());
            (n.name_any(), labels)
        })
        .collect()
}

/// The pods that can be peers, with their addresses (the status's, and for
/// this node's pods their records').
fn peer_pods<'a>(pods: &'a [Arc<Pod>], local: &[LocalPod]) -> Vec<PeerPod<'a>> {
    let local_ips: HashMap<&PodKey, &Vec<IpAddr>> =
        local.iter().map(|p| (&p.key, &p.ips)).collect();
    pods.iter()
        .filter(|p| !is_host_network(p) && !has_ended(p))
        .map(|p| {
            let key = (p.namespace().unwrap_or_default(), p.name_any());
            let mut ips = status_ips(p);
            for ip in local_ips.get(&key).map(|v| v.iter()).into_iter().flatten() {
                if !ips.contains(ip) {
                    ips.push(*ip);
                }
            }
            PeerPod {
                ns: key.0,
                labels: p.labels(),
                ips,
                pod: p,
            }
        })
        .filter(|p| !p.ips.is_empty())
        .collect()
}

/// The peers of `peer` in a policy of namespace `policy_ns` (indexes into
/// `peers`); none for an `ipBlock` (handled apart) or an empty peer (the
/// API server refuses one).
fn selected_peers(
    peer: &NetworkPolicyPeer,
    policy_ns: &str,
    peers: &[PeerPod<'_>],
    ns_labels: &HashMap<String, BTreeMap<String, String>>,
) -> Vec<usize> {
    if peer.ip_block.is_some() {
        return Vec::new();
    }
    let (pod_sel, ns_sel) = (&peer.pod_selector, &peer.namespace_selector);
    if pod_sel.is_none() && ns_sel.is_none() {
        return Vec::new();
    }
    let labels_of_ns = |ns: &str| -> BTreeMap<String, String> {
        ns_labels
            .get(ns)
            .cloned()
            .unwrap_or_else(|| [(NAMESPACE_NAME_LABEL.to_string(), ns.to_string())].into())
    };
    peers
        .iter()
        .enumerate()
        .filter(|(_, p)| match ns_sel {
            Some(sel) => selects(sel, &labels_of_ns(&p.ns)),
            None => p.ns == policy_ns,
        })
        .filter(|(_, p)| pod_sel.as_ref().is_none_or(|sel| selects(sel, p.labels)))
        .map(|(i, _)| i)
        .collect()
}

/// The addresses of an `ipBlock`: its CIDR minus its excepts.
fn block_addrs(block: &k8s_openapi::api::networking::v1::IPBlock) -> AddrSet {
    let mut b = AddrSet::new();
    if let Ok(cidr) = block.cidr.parse::<IpNet>() {
        b.add_net(&cidr);
        for e in block.except.iter().flatten() {
            if let Ok(e) = e.parse::<IpNet>() {
                b.remove_net(&e);
            }
        }
    }
    b
}

/// Every rule of every policy, resolved once; their peer sets go into
/// `peer_sets`.
fn rule_specs(
    policies: &[Arc<NetworkPolicy>],
    peers: &[PeerPod<'_>],
    ns_labels: &HashMap<String, BTreeMap<String, String>>,
    peer_sets: &mut BTreeMap<String, AddrSet>,
) -> HashMap<RuleKey, RuleSpec> {
    let mut out = HashMap::new();
    for np in policies {
        let (Some(ns), Some(spec)) = (np.namespace(), &np.spec) else {
            continue;
        };
        let name = np.name_any();
        let ingress = spec.ingress.iter().flatten().map(|r| (&r.from, &r.ports));
        let egress = spec.egress.iter().flatten().map(|r| (&r.to, &r.ports));
        let all = ingress
            .enumerate()
            .map(|(i, r)| (Direction::Ingress, i, r))
            .chain(egress.enumerate().map(|(i, r)| (Direction::Egress, i, r)));
        for (direction, i, (peer_list, ports)) in all {
            let (peer_spec, members) = match peer_list.as_ref().filter(|l| !l.is_empty()) {
                None => (Peers::Any, (0..peers.len()).collect()),
                Some(list) => {
                    let mut set = AddrSet::new();
                    let mut members = Vec::new();
                    for peer in list {
                        if let Some(block) = &peer.ip_block {
                            set.extend(&block_addrs(block));
                        }
                        for p in selected_peers(peer, &ns, peers, ns_labels) {
                            for ip in &peers[p].ips {
                                set.add_ip(*ip);
                            }
                            members.push(p);
                        }
                    }
                    set.normalize();
                    let set_key = set_name(&ns, &name, direction, i);
                    peer_sets.insert(set_key.clone(), set);
                    (Peers::Set(set_key), members)
                }
            };
            out.insert(
                (format!("{ns}/{name}"), direction, i),
                RuleSpec {
                    peers: peer_spec,
                    ports: port_specs(ports.as_ref()),
                    peer_pods: members,
                },
            );
        }
    }
    out
}

/// The ports of `rule` for the isolated pod `pod` in `direction`: named
/// ports resolved on the destination (`pod` itself for ingress, each peer
/// pod for egress).
fn resolve_ports(rule: &RuleSpec, direction: Direction, pod: &Pod, peers: &[PeerPod<'_>]) -> Ports {
    let Some(specs) = &rule.ports else {
        return Ports::Any;
    };
    let mut numeric = Vec::new();
    let mut named = BTreeSet::new();
    for spec in specs {
        match spec {
            PortSpec::Range(r) => numeric.push(*r),
            PortSpec::Named(n, proto) if direction == Direction::Ingress => {
                if let Some(port) = resolve_named_port(pod, n, *proto) {
                    numeric.push(PortRange {
                        proto: *proto,
                        lo: port,
                        hi: port,
                    });
                }
            }
            PortSpec::Named(n, proto) => {
                for peer in rule.peer_pods.iter().map(|p| &peers[*p]) {
                    if let Some(port) = resolve_named_port(peer.pod, n, *proto) {
                        for ip in &peer.ips {
                            named.insert((*ip, *proto, port));
                        }
                    }
                }
            }
        }
    }
    Ports::Only {
        numeric: merge_ranges(numeric),
        named: named.into_iter().collect(),
    }
}

/// `ranges` sorted, with the overlapping and adjacent ranges of a protocol
/// merged: an nftables interval set refuses overlapping elements (the
/// whole transaction fails with EEXIST), and `port: 80` beside `port: 80,
/// endPort: 81` is a valid policy.
fn merge_ranges(mut ranges: Vec<PortRange>) -> Vec<PortRange> {
    ranges.sort_unstable();
    let mut out: Vec<PortRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.proto == r.proto && u32::from(r.lo) <= u32::from(last.hi) + 1 => {
                last.hi = last.hi.max(r.hi);
            }
            _ => out.push(r),
        }
    }
    out
}

/// What the policies of `policies` mean for the local pod `lp` (its Pod
/// object `pod`): `None` when none isolates it.
fn pod_rules(
    lp: &LocalPod,
    pod: &Pod,
    policies: &[Arc<NetworkPolicy>],
    specs: &HashMap<RuleKey, RuleSpec>,
    peers: &[PeerPod<'_>],
) -> Option<PodRules> {
    let mut out = PodRules {
        addrs: lp.ips.clone(),
        ..PodRules::default()
    };
    for np in policies {
        if !policy_selects(np, &lp.key.0, pod.labels()) {
            continue;
        }
        let (ingress, egress) = policy_types(np);
        let key = format!("{}/{}", lp.key.0, np.name_any());
        out.policies.insert(key.clone());
        let spec = np.spec.as_ref();
        let count = |d: Direction| match d {
            Direction::Ingress => spec.and_then(|s| s.ingress.as_ref()).map_or(0, Vec::len),
            Direction::Egress => spec.and_then(|s| s.egress.as_ref()).map_or(0, Vec::len),
        };
        for (direction, isolated) in [(Direction::Ingress, ingress), (Direction::Egress, egress)] {
            if !isolated {
                continue;
            }
            // Isolated even when the policy allows nothing in this direction.
            let list = match direction {
                Direction::Ingress => out.ingress.get_or_insert_with(Vec::new),
                Direction::Egress => out.egress.get_or_insert_with(Vec::new),
            };
            for i in 0..count(direction) {
                let Some(rule) = specs.get(&(key.clone(), direction, i)) else {
                    continue;
                };
                list.push(Rule {
                    peers: rule.peers.clone(),
                    ports: resolve_ports(rule, direction, pod, peers),
                    policy: key.clone(),
                });
            }
        }
    }
    (out.ingress.is_some() || out.egress.is_some()).then_some(out)
}

/// What the policies of `cluster` mean for `local`, the pods of this node.
/// Policies are taken by namespace and name (a pod's rules in that order),
/// whatever order the watch cache gives them in: the same cluster makes the
/// same ruleset.
pub fn compute(cluster: &Cluster<'_>, local: &[LocalPod]) -> Enforcement {
    let mut policies = cluster.policies.to_vec();
    policies.sort_by_key(|np| (np.namespace(), np.name_any()));
    let cluster = &Cluster {
        policies: &policies,
        ..*cluster
    };
    let mut out = Enforcement::default();
    for np in cluster.policies {
        if let Some(ns) = np.namespace() {
            *out.namespaces.entry(ns).or_default() += 1;
        }
    }
    let ns_labels = namespace_labels(cluster.namespaces);
    let peers = peer_pods(cluster.pods, local);
    let specs = rule_specs(cluster.policies, &peers, &ns_labels, &mut out.peer_sets);
    let by_key: HashMap<PodKey, &Pod> = cluster
        .pods
        .iter()
        .map(|p| ((p.namespace().unwrap_or_default(), p.name_any()), &**p))
        .collect();
    for lp in local {
        let Some(pod) = by_key.get(&lp.key) else {
            out.unknown.insert(lp.key.clone());
            continue;
        };
        if let Some(rules) = pod_rules(lp, pod, cluster.policies, &specs, &peers) {
            out.pods.insert(lp.key.clone(), rules);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
    use serde_json::{json, Value};

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn policy(ns: &str, name: &str, spec: Value) -> Arc<NetworkPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": ns },
                "spec": spec,
            }))
            .unwrap(),
        )
    }

    /// A pod with `labels`, addresses `ips` and container ports `ports`
    /// (name, number, protocol).
    fn pod(ns: &str, name: &str, l: &[(&str, &str)], ips: &[&str], ports: Value) -> Arc<Pod> {
        let ip_list: Vec<Value> = ips.iter().map(|i| json!({ "ip": i })).collect();
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": ns, "labels": labels(l) },
                "spec": { "containers": [{ "name": "c", "ports": ports }] },
                "status": { "phase": "Running", "podIPs": ip_list },
            }))
            .unwrap(),
        )
    }

    fn namespace(name: &str, l: &[(&str, &str)]) -> Arc<Namespace> {
        Arc::new(
            serde_json::from_value(json!({ "metadata": { "name": name, "labels": labels(l) } }))
                .unwrap(),
        )
    }

    fn local(ns: &str, name: &str, ips: &[&str]) -> LocalPod {
        LocalPod {
            key: (ns.into(), name.into()),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn key(ns: &str, name: &str) -> PodKey {
        (ns.into(), name.into())
    }

    fn tcp(lo: u16, hi: u16) -> PortRange {
        PortRange {
            proto: Proto::Tcp,
            lo,
            hi,
        }
    }

    /// The cluster of most cases: namespaces x (team=a) and y (team=b);
    /// x/web (app=web, port http=8080), x/db (app=db), y/cli (app=cli, port
    /// dns=5353/UDP), and a hostNetwork pod on the node's address.
    fn cluster() -> (Vec<Arc<Namespace>>, Vec<Arc<Pod>>) {
        let mut host: Pod =
            (*pod("y", "hostnet", &[("app", "cli")], &["192.0.2.2"], json!([]))).clone();
        host.spec.as_mut().unwrap().host_network = Some(true);
        let mut ended: Pod =
            (*pod("y", "done", &[("app", "cli")], &["10.0.1.9"], json!([]))).clone();
        ended.status.as_mut().unwrap().phase = Some("Succeeded".into());
        (
            vec![
                namespace("x", &[("team", "a")]),
                namespace("y", &[("team", "b")]),
            ],
            vec![
                pod(
                    "x",
                    "web",
                    &[("app", "web")],
                    &["10.0.0.2", "fd00::2"],
                    json!([{ "name": "http", "containerPort": 8080 }]),
                ),
                pod("x", "db", &[("app", "db")], &["10.0.0.3"], json!([])),
                pod(
                    "y",
                    "cli",
                    &[("app", "cli")],
                    &["10.0.1.2", "fd00:1::2"],
                    json!([{ "name": "dns", "containerPort": 5353, "protocol": "UDP" }]),
                ),
                Arc::new(host),
                Arc::new(ended),
            ],
        )
    }

    fn run(policies: &[Arc<NetworkPolicy>], locals: &[LocalPod]) -> Enforcement {
        let (namespaces, pods) = cluster();
        compute(
            &Cluster {
                policies,
                namespaces: &namespaces,
                pods: &pods,
            },
            locals,
        )
    }

    fn web() -> LocalPod {
        local("x", "web", &["10.0.0.2", "fd00::2"])
    }

    /// The peer set a rule names, as (v4 ranges, v6 ranges) text.
    fn peers_of(e: &Enforcement, rule: &Rule) -> (Vec<String>, Vec<String>) {
        let Peers::Set(name) = &rule.peers else {
            panic!("a peer set: {rule:?}")
        };
        let set = &e.peer_sets[name];
        (
            set.v4().map(|(a, b)| format!("{a}-{b}")).collect(),
            set.v6().map(|(a, b)| format!("{a}-{b}")).collect(),
        )
    }

    #[test]
    fn label_selectors() {
        let empty = LabelSelector::default();
        assert!(selects(&empty, &labels(&[])), "empty selects all");
        let ml = LabelSelector {
            match_labels: Some(labels(&[("app", "b")])),
            ..Default::default()
        };
        assert!(selects(&ml, &labels(&[("app", "b"), ("x", "y")])));
        assert!(!selects(&ml, &labels(&[("app", "a")])));
        let expr = |op: &str, values: Option<Vec<&str>>| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "tier".into(),
                operator: op.into(),
                values: values.map(|v| v.into_iter().map(String::from).collect()),
            }]),
            ..Default::default()
        };
        let web = labels(&[("tier", "web")]);
        assert!(selects(&expr("In", Some(vec!["web", "db"])), &web));
        assert!(!selects(&expr("NotIn", Some(vec!["web"])), &web));
        assert!(selects(&expr("NotIn", Some(vec!["web"])), &labels(&[])));
        assert!(selects(&expr("Exists", None), &web));
        assert!(!selects(&expr("DoesNotExist", None), &web));
        assert!(!selects(&expr("Bogus", None), &web));
    }

    #[test]
    fn policy_types_default_as_the_api_says() {
        let t = |spec: Value| policy_types(&policy("x", "p", spec));
        assert_eq!(t(json!({ "podSelector": {} })), (true, false));
        assert_eq!(
            t(json!({ "podSelector": {}, "egress": [{}] })),
            (true, true)
        );
        assert_eq!(t(json!({ "podSelector": {}, "egress": [] })), (true, false));
        assert_eq!(
            t(json!({ "podSelector": {}, "policyTypes": [] })),
            (true, false)
        );
        assert_eq!(
            t(json!({ "podSelector": {}, "policyTypes": ["Egress"], "ingress": [{}] })),
            (false, true)
        );
        assert_eq!(
            t(json!({ "podSelector": {}, "policyTypes": ["Ingress", "Egress"] })),
            (true, true)
        );
    }

    #[test]
    fn deny_all_selects_every_pod_of_its_namespace_only() {
        let p = [policy("x", "deny", json!({ "podSelector": {} }))];
        let e = run(
            &p,
            &[
                web(),
                local("x", "db", &["10.0.0.3"]),
                local("y", "cli", &["10.0.1.2"]),
            ],
        );
        assert_eq!(e.namespaces, [("x".to_string(), 1)].into());
        assert_eq!(
            e.pods.keys().cloned().collect::<Vec<_>>(),
            vec![key("x", "db"), key("x", "web")]
        );
        let w = &e.pods[&key("x", "web")];
        assert_eq!(
            w.ingress.as_deref(),
            Some(&[][..]),
            "isolated, nothing allowed"
        );
        assert_eq!(w.egress, None, "egress not isolated");
        assert_eq!(w.policies, ["x/deny".to_string()].into());
        assert_eq!(w.addrs, vec![ip("10.0.0.2"), ip("fd00::2")]);
    }

    #[test]
    fn peers_by_pod_namespace_both_and_ip_block() {
        let p = [policy(
            "x",
            "allow",
            json!({
                "podSelector": { "matchLabels": { "app": "web" } },
                "ingress": [
                    // Pods of the policy's namespace only.
                    { "from": [{ "podSelector": { "matchLabels": { "app": "cli" } } }] },
                    // Every pod of the namespaces selected.
                    { "from": [{ "namespaceSelector": { "matchLabels": { "team": "b" } } }] },
                    // Both in one peer: cli pods in team=b namespaces.
                    { "from": [{
                        "namespaceSelector": { "matchLabels": { "team": "b" } },
                        "podSelector": { "matchLabels": { "app": "cli" } },
                    }] },
                    // A CIDR minus its except, and by namespace name.
                    { "from": [
                        { "ipBlock": { "cidr": "10.0.0.0/24", "except": ["10.0.0.0/30"] } },
                        { "namespaceSelector": { "matchLabels": { NAMESPACE_NAME_LABEL: "x" } } },
                    ] },
                ],
            }),
        )];
        let e = run(&p, &[web()]);
        let rules = e.pods[&key("x", "web")].ingress.clone().unwrap();
        assert_eq!(rules.len(), 4);
        // x has no app=cli pod: an empty set (allows nothing).
        assert_eq!(peers_of(&e, &rules[0]), (vec![], vec![]));
        // y's pods, but not its hostNetwork pod or the one that ended.
        assert_eq!(
            peers_of(&e, &rules[1]),
            (
                vec!["10.0.1.2-10.0.1.2".into()],
                vec!["fd00:1::2-fd00:1::2".into()]
            )
        );
        assert_eq!(peers_of(&e, &rules[2]), peers_of(&e, &rules[1]));
        // 10.0.0.4-.255 from the block, plus x's pods 10.0.0.2 and .3
        // (merged with it), and web's IPv6.
        assert_eq!(
            peers_of(&e, &rules[3]),
            (
                vec!["10.0.0.2-10.0.0.255".into()],
                vec!["fd00::2-fd00::2".into()]
            )
        );
        assert!(rules
            .iter()
            .all(|r| r.ports == Ports::Any && r.policy == "x/allow"));
    }

    #[test]
    fn ports_by_number_range_name_and_protocol() {
        let p = [policy(
            "x",
            "ports",
            json!({
                "podSelector": { "matchLabels": { "app": "web" } },
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{ "ports": [
                    { "port": 80 },
                    { "port": 8000, "endPort": 8100 },
                    { "port": "http" },
                    { "port": "nope" },
                    { "protocol": "UDP", "port": 53 },
                    { "protocol": "SCTP" },
                ] }],
                "egress": [{
                    "to": [{ "namespaceSelector": {} }],
                    "ports": [{ "protocol": "UDP", "port": "dns" }, { "port": 443 }],
                }],
            }),
        )];
        let e = run(&p, &[web()]);
        let w = &e.pods[&key("x", "web")];
        let ing = w.ingress.as_ref().unwrap();
        assert_eq!(ing[0].peers, Peers::Any);
        // "http" is web's own 8080 (inside 8000-8100: merged into it);
        // "nope" names no port of web: nothing.
        assert_eq!(
            ing[0].ports,
            Ports::Only {
                numeric: vec![
                    tcp(80, 80),
                    tcp(8000, 8100),
                    PortRange {
                        proto: Proto::Udp,
                        lo: 53,
                        hi: 53
                    },
                    PortRange {
                        proto: Proto::Sctp,
                        lo: 0,
                        hi: u16::MAX
                    },
                ],
                named: vec![],
            }
        );
        // Egress "dns" is resolved on each destination pod: only y/cli has
        // it (5353/UDP), on both its addresses.
        let eg = w.egress.as_ref().unwrap();
        assert_eq!(
            eg[0].ports,
            Ports::Only {
                numeric: vec![tcp(443, 443)],
                named: vec![
                    (ip("10.0.1.2"), Proto::Udp, 5353),
                    (ip("fd00:1::2"), Proto::Udp, 5353),
                ],
            }
        );
    }

    #[test]
    fn overlapping_ports_are_merged() {
        let p = [policy(
            "x",
            "overlap",
            json!({ "podSelector": {}, "ingress": [{ "ports": [
                { "port": 80 }, { "port": 80, "endPort": 81 }, { "port": 82 },
                { "port": 90 }, { "protocol": "UDP", "port": 81 },
            ] }] }),
        )];
        let e = run(&p, &[web()]);
        let rule = &e.pods[&key("x", "web")].ingress.as_ref().unwrap()[0];
        assert_eq!(
            rule.ports,
            Ports::Only {
                numeric: vec![
                    tcp(80, 82),
                    tcp(90, 90),
                    PortRange {
                        proto: Proto::Udp,
                        lo: 81,
                        hi: 81
                    },
                ],
                named: vec![],
            },
            "an nftables interval set refuses overlapping elements"
        );
    }

    #[test]
    fn several_policies_are_a_union_and_unknown_pods_are_unclassified() {
        let p = [
            policy(
                "x",
                "a",
                json!({ "podSelector": {}, "ingress": [{ "ports": [{ "port": 1 }] }] }),
            ),
            policy(
                "x",
                "b",
                json!({ "podSelector": { "matchLabels": { "app": "web" } }, "ingress": [{ "ports": [{ "port": 2 }] }] }),
            ),
            policy(
                "y",
                "c",
                json!({ "podSelector": {}, "policyTypes": ["Egress"] }),
            ),
        ];
        let e = run(&p, &[web(), local("x", "ghost", &["10.0.0.9"])]);
        assert_eq!(
            e.namespaces,
            [("x".to_string(), 2), ("y".to_string(), 1)].into()
        );
        let w = &e.pods[&key("x", "web")];
        assert_eq!(w.policies, ["x/a".to_string(), "x/b".to_string()].into());
        let ports: Vec<_> = w
            .ingress
            .as_ref()
            .unwrap()
            .iter()
            .map(|r| r.ports.clone())
            .collect();
        assert_eq!(
            ports,
            vec![
                Ports::Only {
                    numeric: vec![tcp(1, 1)],
                    named: vec![]
                },
                Ports::Only {
                    numeric: vec![tcp(2, 2)],
                    named: vec![]
                },
            ]
        );
        // No Pod object: neither isolated nor free, not classified.
        assert!(!e.pods.contains_key(&key("x", "ghost")));
        assert_eq!(e.unknown, [key("x", "ghost")].into());
    }

    #[test]
    fn a_relabelled_pod_leaves_and_joins_selectors() {
        let p = [policy(
            "x",
            "only-web",
            json!({ "podSelector": { "matchLabels": { "app": "web" } }, "ingress": [{ "from": [
                { "podSelector": { "matchLabels": { "role": "friend" } } }
            ] }] }),
        )];
        let (namespaces, mut pods) = cluster();
        let e = compute(
            &Cluster {
                policies: &p,
                namespaces: &namespaces,
                pods: &pods,
            },
            &[web(), local("x", "db", &["10.0.0.3"])],
        );
        assert!(e.pods.contains_key(&key("x", "web")));
        assert!(!e.pods.contains_key(&key("x", "db")));
        let rule = &e.pods[&key("x", "web")].ingress.as_ref().unwrap()[0];
        assert_eq!(peers_of(&e, rule), (vec![], vec![]));
        // web relabelled out of the policy, db into its peers.
        let mut w = (*pods[0]).clone();
        w.metadata.labels = Some(labels(&[("app", "other")]));
        pods[0] = Arc::new(w);
        let mut d = (*pods[1]).clone();
        d.metadata.labels = Some(labels(&[("app", "web"), ("role", "friend")]));
        pods[1] = Arc::new(d);
        let e = compute(
            &Cluster {
                policies: &p,
                namespaces: &namespaces,
                pods: &pods,
            },
            &[web(), local("x", "db", &["10.0.0.3"])],
        );
        assert!(
            !e.pods.contains_key(&key("x", "web")),
            "web left the selector"
        );
        let rule = &e.pods[&key("x", "db")].ingress.as_ref().unwrap()[0];
        assert_eq!(
            peers_of(&e, rule),
            (vec!["10.0.0.3-10.0.0.3".into()], vec![])
        );
    }

    #[test]
    fn a_local_pod_counts_as_a_peer_before_its_status_has_an_address() {
        let p = [policy(
            "y",
            "from-x",
            json!({ "podSelector": {}, "ingress": [{ "from": [{ "namespaceSelector": { "matchLabels": { "team": "a" } } }] }] }),
        )];
        let (namespaces, mut pods) = cluster();
        // x/new runs on this node: its record has 10.0.0.7, its status none.
        pods.push(pod("x", "new", &[], &[], json!([])));
        let e = compute(
            &Cluster {
                policies: &p,
                namespaces: &namespaces,
                pods: &pods,
            },
            &[
                local("y", "cli", &["10.0.1.2"]),
                local("x", "new", &["10.0.0.7"]),
            ],
        );
        let rule = &e.pods[&key("y", "cli")].ingress.as_ref().unwrap()[0];
        assert_eq!(
            peers_of(&e, rule).0,
            vec!["10.0.0.2-10.0.0.3".to_string(), "10.0.0.7-10.0.0.7".into()]
        );
    }
}
