//! What the fast path does not see, detected: an administrator's DROP or
//! REJECT rule in the node's `filter` table, reachable from FORWARD, that
//! names a pod's address (`-s` or `-d`). XDP runs before netfilter, so such
//! a rule would stop kernel routing but not the fast path; the pods it names
//! are made kernel-only (both ways) while it is there, and told so by an
//! Event and the `xdpcni_forward_rule_pods` gauge.
//!
//! Read with `iptables-save -t filter` and `ip6tables-save -t filter`.
//! Not seen (the README lists them): rules without an address match (ports,
//! interfaces, marks, conntrack state), negated address matches, a FORWARD
//! policy of DROP, and rules of another backend than the image's iptables
//! (nft) when the node uses iptables-legacy.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    process::Command,
    str::FromStr,
};

use ipnet::IpNet;
use xdpcni_host::source_check::find_tool;

use crate::records::PodKey;

/// A rule that makes pods kernel-only, as `iptables-save` prints it.
pub type Rule = String;

/// Pods named by blocking FORWARD rules, each with the first such rule.
pub fn blocked<'a>(
    save: &str,
    pods: impl IntoIterator<Item = (&'a PodKey, &'a [IpAddr])>,
) -> BTreeMap<PodKey, Rule> {
    // Rules per chain of the filter table, in order.
    let mut chains: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut in_filter = false;
    for line in save.lines() {
        let line = line.trim();
        if let Some(table) = line.strip_prefix('*') {
            in_filter = table == "filter";
        } else if in_filter {
            if let Some(rest) = line.strip_prefix("-A ") {
                if let Some(chain) = rest.split_whitespace().next() {
                    chains.entry(chain).or_default().push(line);
                }
            }
        }
    }
    // Chains reachable from FORWARD through jumps and gotos.
    let mut reachable: HashSet<&str> = HashSet::new();
    let mut todo = vec!["FORWARD"];
    while let Some(chain) = todo.pop() {
        if !reachable.insert(chain) {
            continue;
        }
        for rule in chains.get(chain).into_iter().flatten() {
            if let Some(target) = target_of(rule) {
                if chains.contains_key(target) {
                    todo.push(target);
                }
            }
        }
    }
    let nets: Vec<(IpNet, &str)> = reachable
        .iter()
        .flat_map(|c| chains.get(c).into_iter().flatten())
        .filter(|rule| matches!(target_of(rule), Some("DROP" | "REJECT")))
        .flat_map(|rule| addresses(rule).into_iter().map(move |n| (n, *rule)))
        .collect();
    let mut out = BTreeMap::new();
    for (key, ips) in pods {
        if let Some((_, rule)) = nets
            .iter()
            .find(|(net, _)| ips.iter().any(|ip| net.contains(ip)))
        {
            out.insert(key.clone(), (*rule).to_string());
        }
    }
    out
}

/// The `-j`/`-g` target of a rule.
fn target_of(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            return words.next();
        }
    }
    None
}

/// The addresses of a rule's non-negated `-s`/`-d` matches.
fn addresses(rule: &str) -> Vec<IpNet> {
    let words: Vec<&str> = rule.split_whitespace().collect();
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if (*w == "-s" || *w == "-d") && (i == 0 || words[i - 1] != "!") {
            for a in words.get(i + 1).map(|v| v.split(',')).into_iter().flatten() {
                if let Ok(n) = IpNet::from_str(a).or_else(|_| IpAddr::from_str(a).map(IpNet::from))
                {
                    out.push(n);
                }
            }
        }
    }
    out
}

/// Failures reading the node's rules.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// Neither save command is installed.
    #[error("neither iptables-save nor ip6tables-save is installed: FORWARD rules are not seen")]
    NoTools,
    /// A save command failed.
    #[error("{0}")]
    Failed(String),
}

/// The node's filter tables, IPv4 then IPv6, as `*-save` prints them.
pub fn scan() -> Result<String, ScanError> {
    let mut out = String::new();
    let mut found = false;
    for tool in ["iptables-save", "ip6tables-save"] {
        let Some(bin) = find_tool(tool) else { continue };
        found = true;
        let res = Command::new(&bin)
            .args(["-t", "filter"])
            .output()
            .map_err(|e| ScanError::Failed(format!("{}: {e}", bin.display())))?;
        if !res.status.success() {
            return Err(ScanError::Failed(format!(
                "{}: {} {}",
                bin.display(),
                res.status,
                String::from_utf8_lossy(&res.stderr).trim()
            )));
        }
        out.push_str(&String::from_utf8_lossy(&res.stdout));
    }
    if found {
        Ok(out)
    } else {
        Err(ScanError::NoTools)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVE: &str = "\
*nat
:PREROUTING ACCEPT [0:0]
-A PREROUTING -d 10.78.0.2/32 -j DROP
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:KUBE-FORWARD - [0:0]
:ADMIN - [0:0]
:UNUSED - [0:0]
-A INPUT -s 10.78.0.5/32 -j DROP
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A FORWARD -s 10.78.0.2/32 -d 10.78.0.3/32 -p udp -j DROP
-A FORWARD -j ADMIN
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -s 10.78.0.0/24 -j ACCEPT
-A ADMIN ! -s 10.78.0.6/32 -d 10.78.0.9/32 -j ACCEPT
-A ADMIN -d 10.78.0.7/32,10.78.0.8/32 -j REJECT --reject-with icmp-port-unreachable
-A ADMIN ! -d 10.78.0.10/32 -j DROP
-A UNUSED -s 10.78.0.11/32 -j DROP
-A FORWARD -s fd78::4/128 -j DROP
COMMIT
";

    fn key(n: &str) -> PodKey {
        ("default".into(), n.into())
    }

    #[test]
    fn drop_and_reject_rules_reachable_from_forward_name_pods() {
        let pods: Vec<(PodKey, Vec<IpAddr>)> = [
            ("a", "10.78.0.2"),
            ("b", "10.78.0.3"),
            ("input-only", "10.78.0.5"),
            ("accepted", "10.78.0.9"),
            ("rejected", "10.78.0.8"),
            ("negated", "10.78.0.10"),
            ("unreachable-chain", "10.78.0.11"),
            ("nat-only", "10.78.0.2"),
            ("v6", "fd78::4"),
            ("untouched", "10.78.0.20"),
        ]
        .iter()
        .map(|(n, ip)| (key(n), vec![ip.parse().unwrap()]))
        .collect();
        let got = blocked(SAVE, pods.iter().map(|(k, v)| (k, v.as_slice())));
        let names: Vec<&str> = got.keys().map(|k| k.1.as_str()).collect();
        assert_eq!(names, vec!["a", "b", "nat-only", "rejected", "v6"]);
        assert!(got[&key("a")].contains("-s 10.78.0.2/32 -d 10.78.0.3/32"));
        assert!(got[&key("rejected")].contains("REJECT"));
    }

    #[test]
    fn kube_proxy_rules_alone_block_nothing() {
        let save = "*filter\n:FORWARD ACCEPT [0:0]\n:KUBE-FORWARD - [0:0]\n\
                    -A FORWARD -j KUBE-FORWARD\n\
                    -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
                    -A KUBE-FORWARD -s 10.78.0.0/24 -j ACCEPT\nCOMMIT\n";
        let k = key("a");
        let ips = vec!["10.78.0.2".parse().unwrap()];
        assert!(blocked(save, [(&k, ips.as_slice())]).is_empty());
    }
}
