//! NetworkPolicy enforcement for the pods of this node: [`model`] says what
//! the policies mean for each local pod; [`nft`] turns that into the
//! nftables ruleset of the kernel path, which [`Enforcer`] keeps in force
//! with atomic `nft -j -f -` transactions (after the first, each writes
//! only what changed) and whose drop counters it reads back; [`compile`]
//! turns the same rules into the verdicts the datapath checks.
//!
//! The fast path carries an isolated pod's flows only where the datapath
//! holds its verdicts (the pod flagged `EP_POLICY`); every other isolated
//! pod is kernel-only (both directions take the kernel path, where these
//! rules are), and the CNI holds every new pod a policy may select until
//! the agent has classified it (see `xdpcni_host::gate`).

pub mod addrs;
pub mod compile;
pub mod conntrack;
pub mod model;
pub mod nft;
pub mod ports;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    process::Command,
    time::{Duration, Instant},
};

use tracing::{debug, info};

use conntrack::Entry;

use self::{
    model::Enforcement,
    nft::{Before, Objects, Ruleset, Switching},
};
use crate::records::PodKey;

/// Failures applying or reading the ruleset.
#[derive(Debug, thiserror::Error)]
pub enum NetpolError {
    /// `nft` failed or could not be run.
    #[error("nft: {0}")]
    Nft(#[from] nftables::helper::NftablesError),
    /// The conntrack table could not be listed or changed.
    #[error("conntrack netlink: {0}")]
    Conntrack(std::io::Error),
    /// `nft` printed something that is not the JSON it should.
    #[error("reading `nft -j {what}`: {why}")]
    Listing {
        /// The listing asked for.
        what: &'static str,
        /// Why it could not be read.
        why: String,
    },
}

/// What one [`Enforcer::apply`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    /// Whether a transaction ran (the ruleset in force was another).
    pub changed: bool,
    /// Rules in the ruleset in force (base chains and pod chains).
    pub rules: usize,
    /// How long the transaction took, in seconds (0 when unchanged).
    pub seconds: f64,
    /// Pods isolated now that the ruleset before did not isolate at all,
    /// or that leave the datapath's check for the rules: their connections
    /// so far may have run on the fast path, unseen by conntrack (see
    /// [`forget_connections`]).
    pub newly_isolated: Vec<PodKey>,
}

/// How long a newly isolated pod's window stays open (see
/// [`nft::Switching`]): longer than a UDP server takes to answer a request
/// the fast path delivered just before the switch.
pub const SWITCH_WINDOW: Duration = Duration::from_secs(2);

/// Applies rulesets and remembers the one in force.
#[derive(Debug, Default)]
pub struct Enforcer {
    /// The objects of the ruleset in force; `None`: read them from the
    /// kernel first (after a start, or a failed transaction).
    objects: Option<Objects>,
    /// The enforcement in force, its windows, and the ruleset that holds
    /// them (what the next transaction writes only the changes to).
    in_force: Option<(Enforcement, Switching, Ruleset)>,
    /// Addresses of newly isolated pods, and when their window closes.
    windows: BTreeMap<IpAddr, Instant>,
}

/// Runs `nft -j <args>` and parses its JSON; `Ok(None)` when the table
/// does not exist.
fn list(args: &[&str], what: &'static str) -> Result<Option<serde_json::Value>, NetpolError> {
    let out = Command::new("nft")
        .arg("-j")
        .args(args)
        .output()
        .map_err(|e| NetpolError::Listing {
            what,
            why: format!("running nft: {e}"),
        })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No such file or directory") {
            return Ok(None);
        }
        return Err(NetpolError::Listing {
            what,
            why: err.trim().to_string(),
        });
    }
    serde_json::from_slice(&out.stdout)
        .map(Some)
        .map_err(|e| NetpolError::Listing {
            what,
            why: e.to_string(),
        })
}

/// Runs the transaction `doc`: how many commands it has, and how long it
/// took.
fn run(doc: &nftables::schema::Nftables<'_>) -> Result<(usize, f64), NetpolError> {
    let started = Instant::now();
    nftables::helper::apply_ruleset(doc)?;
    Ok((doc.objects.len(), started.elapsed().as_secs_f64()))
}

impl Enforcer {
    /// An enforcer that reads the table in the kernel before its first
    /// transaction (rules from an earlier agent stay in force until then).
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the table enforce `e`, in one transaction; `local` are the
    /// addresses of every pod of the node; `leaving` the isolated pods that
    /// leave the datapath's check for these rules (their flows so far ran
    /// on the fast path, unseen by conntrack: they are switched as a pod
    /// isolated anew is). Nothing runs when `e` is what is in force already
    /// and no window opened or closed.
    pub fn apply(
        &mut self,
        e: &Enforcement,
        local: &BTreeSet<IpAddr>,
        leaving: &BTreeSet<PodKey>,
    ) -> Result<Applied, NetpolError> {
        let before = self.objects_in_kernel()?;
        let newly_isolated = newly_isolated(e, &before, leaving);
        let switching = self.open_windows(e, &newly_isolated, local);
        if let Some((have, open, r)) = &self.in_force {
            if have == e && *open == switching {
                return Ok(Applied {
                    changed: false,
                    rules: r.rules(),
                    seconds: 0.0,
                    newly_isolated,
                });
            }
        }
        let (now, whole) = self.next_ruleset(e, &switching, before.generation)?;
        let batch = match self.in_force.as_ref().map(|(_, _, r)| r) {
            Some(r) if !whole => nft::transaction(&now, &Before::InForce(r)),
            _ => nft::transaction(&now, &Before::Listed(&before)),
        };
        let (commands, seconds) = match run(&batch.to_nftables()) {
            Ok(done) => done,
            Err(err) => {
                // What is in the kernel is not known for sure now: read it
                // again before the next transaction. The windows stay: the
                // next transaction opens them.
                self.objects = None;
                self.in_force = None;
                return Err(err);
            }
        };
        let rules = now.rules();
        info!(
            pods = e.pods.len(),
            rules,
            commands,
            whole,
            ms = seconds * 1e3,
            "NetworkPolicy rules applied"
        );
        self.objects = Some(now.objects());
        self.in_force = Some((e.clone(), switching, now));
        Ok(Applied {
            changed: true,
            rules,
            seconds,
            newly_isolated,
        })
    }

    /// What the table holds: as this enforcer last wrote it, or listed.
    fn objects_in_kernel(&self) -> Result<Objects, NetpolError> {
        Ok(match &self.objects {
            Some(o) => o.clone(),
            None => list(&["list", "table", "inet", nft::TABLE], "list table")?
                .map(|l| nft::objects_of(&l))
                .unwrap_or_default(),
        })
    }

    /// The ruleset that enforces `e` after the table's generation `was`,
    /// and whether it must be written whole: the first one, or one whose
    /// contents clash with the rules in force under a name (then everything
    /// anew, under a new epoch). A new table, or a wrapped generation, first
    /// clears conntrack's marks of earlier rulesets.
    fn next_ruleset(
        &self,
        e: &Enforcement,
        switching: &Switching,
        was: u16,
    ) -> Result<(Ruleset, bool), NetpolError> {
        let generation = nft::next_generation(was);
        if generation == 1 {
            // A new table, or the generation wrapped: no connection may
            // carry a generation from before.
            let cleared = forget_generations()?;
            info!(cleared, "conntrack marks of earlier rulesets cleared");
        }
        let in_force = self.in_force.as_ref().map(|(_, _, r)| r);
        let now = nft::ruleset(
            e,
            switching,
            generation,
            in_force.map_or(generation, |r| r.epoch),
        );
        Ok(match in_force {
            Some(r) if !now.clashes_with(r) => (now, false),
            Some(_) => (nft::ruleset(e, switching, generation, generation), true),
            None => (now, true),
        })
    }

    /// The switching windows in force after opening one for each address
    /// of the `newly_isolated` pods of `e` (and closing those past their
    /// time); `local` are the node's pod addresses.
    fn open_windows(
        &mut self,
        e: &Enforcement,
        newly_isolated: &[PodKey],
        local: &BTreeSet<IpAddr>,
    ) -> Switching {
        let now = Instant::now();
        self.windows.retain(|_, until| *until > now);
        for k in newly_isolated {
            for ip in e
                .pods
                .get(k)
                .map(|p| p.addrs.as_slice())
                .unwrap_or_default()
            {
                self.windows.entry(*ip).or_insert(now + SWITCH_WINDOW);
            }
        }
        if self.windows.is_empty() {
            Switching::default()
        } else {
            Switching {
                pods: self.windows.keys().copied().collect(),
                local: local.clone(),
            }
        }
    }

    /// Closes every switching window now: the next [`Enforcer::apply`]
    /// writes the table without them (how a test sees the steady state
    /// without waiting for [`SWITCH_WINDOW`]).
    pub fn close_windows(&mut self) {
        self.windows.clear();
    }

    /// The enforcement in force, if a transaction has succeeded.
    pub fn in_force(&self) -> Option<&Enforcement> {
        self.in_force.as_ref().map(|(e, _, _)| e)
    }

    /// The named counters of the table: name -> (packets, bytes).
    pub fn counters() -> Result<BTreeMap<String, (u64, u64)>, NetpolError> {
        let listing = list(
            &["list", "counters", "table", "inet", nft::TABLE],
            "list counters",
        )?;
        debug!(present = listing.is_some(), "read the policy counters");
        Ok(listing.map(|l| nft::counters_of(&l)).unwrap_or_default())
    }
}

/// The conntrack entries the fast path may have left wrong for pods just
/// isolated: of a connection between two pods of this node (the only
/// traffic the fast path carries), untranslated (the fast path translates
/// nothing: a Service's connections were tracked from their first packet),
/// with an end in `isolated`.
///
/// conntrack never saw what the fast path carried, so an entry made at the
/// switch to the kernel path may have been made by the pod's reply to a
/// request it got over XDP, and take the other end for the server (letting
/// its packets in as replies). Deleted, each entry is made again by the next
/// packet that passes the rules. Entries of the pods' other connections (to
/// the node, other nodes, the world, through NAT) are kept: they were
/// tracked right from their first packet, and a NATed one would not survive.
pub fn fast_path_entries<'a>(
    entries: &'a [Entry],
    isolated: &BTreeSet<IpAddr>,
    local: &BTreeSet<IpAddr>,
) -> Vec<&'a Entry> {
    entries
        .iter()
        .filter(|e| {
            let (a, b) = e.orig;
            e.untranslated()
                && local.contains(&a)
                && local.contains(&b)
                && (isolated.contains(&a) || isolated.contains(&b))
        })
        .collect()
}

/// Clears the generation (the bits [`nft::MARK_MASK`]) from the mark of
/// every conntrack entry of both families; how many had one. Run before the
/// first transaction of generation 1 (a table made anew, or the 16-bit
/// generation starting over): an entry marked by a ruleset of the same
/// number 65,535 transactions ago, or by a table since deleted, would pass
/// as allowed by the new ruleset without being checked.
pub fn forget_generations() -> Result<u64, NetpolError> {
    let mut cleared = 0;
    for v6 in [false, true] {
        let all = conntrack::entries(v6).map_err(NetpolError::Conntrack)?;
        let marked: Vec<&Entry> = all
            .iter()
            .filter(|e| e.mark & nft::MARK_MASK != 0)
            .collect();
        cleared +=
            conntrack::clear_mark(&marked, nft::MARK_MASK).map_err(NetpolError::Conntrack)?;
    }
    Ok(cleared)
}

/// Deletes the [`fast_path_entries`] of `isolated` among the pods `local`
/// of this node, over ctnetlink; how many went. Called for pods a policy
/// has just isolated, once their fast-path traffic has drained. TCP
/// connections picked up again mid-stream must be allowed from both ends
/// (see `nft`).
pub fn forget_connections(
    isolated: &BTreeSet<IpAddr>,
    local: &BTreeSet<IpAddr>,
) -> Result<u64, NetpolError> {
    let mut deleted = 0;
    for v6 in [false, true] {
        if !isolated.iter().any(|ip| ip.is_ipv6() == v6) {
            continue;
        }
        let all = conntrack::entries(v6).map_err(NetpolError::Conntrack)?;
        let gone = fast_path_entries(&all, isolated, local);
        deleted += conntrack::delete(&gone).map_err(NetpolError::Conntrack)?;
    }
    Ok(deleted)
}

/// The pods of `e` that the ruleset in force (`before`) does not isolate
/// at all, and those `leaving` the datapath's check: their flows so far may
/// have run on the fast path, unseen by conntrack.
fn newly_isolated(e: &Enforcement, before: &Objects, leaving: &BTreeSet<PodKey>) -> Vec<PodKey> {
    e.pods
        .iter()
        .filter(|(k, _)| {
            [model::Direction::Ingress, model::Direction::Egress]
                .into_iter()
                .all(|d| !before.chains.contains(&nft::chain_name(k, d, false)))
                || leaving.contains(*k)
        })
        .map(|(k, _)| k.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A connection from `c` to `s` as conntrack has it, the server
    /// answering from `server` to `client`.
    fn entry(c: &str, s: &str, server: &str, client: &str) -> Entry {
        Entry::new((ip(c), ip(s)), (ip(server), ip(client)))
    }

    #[test]
    fn only_untranslated_entries_between_local_pods_with_an_isolated_end_go() {
        let local: BTreeSet<IpAddr> = [
            "10.244.0.2",
            "10.244.0.3",
            "10.244.0.4",
            "fd00::2",
            "fd00::3",
        ]
        .iter()
        .map(|s| ip(s))
        .collect();
        let isolated: BTreeSet<IpAddr> = [ip("10.244.0.2"), ip("fd00::2")].into();
        let entries = vec![
            // Pod to pod with the isolated pod at either end: go.
            entry("10.244.0.2", "10.244.0.3", "10.244.0.3", "10.244.0.2"),
            entry("10.244.0.4", "10.244.0.2", "10.244.0.2", "10.244.0.4"),
            entry("fd00::3", "fd00::2", "fd00::2", "fd00::3"),
            // Pod to pod, neither isolated: stays.
            entry("10.244.0.3", "10.244.0.4", "10.244.0.4", "10.244.0.3"),
            // Through a Service (DNAT to the isolated pod): tracked from its
            // first packet, stays.
            entry("10.244.0.3", "10.96.0.10", "10.244.0.2", "10.244.0.3"),
            // To the world, masqueraded: stays.
            entry("10.244.0.2", "1.1.1.1", "1.1.1.1", "192.168.1.5"),
            // To the node, to another node's pod: stay.
            entry("10.244.0.2", "192.168.1.5", "192.168.1.5", "10.244.0.2"),
            entry("10.244.1.7", "10.244.0.2", "10.244.0.2", "10.244.1.7"),
        ];
        let gone: Vec<(IpAddr, IpAddr)> = fast_path_entries(&entries, &isolated, &local)
            .iter()
            .map(|e| e.orig)
            .collect();
        assert_eq!(
            gone,
            vec![
                (ip("10.244.0.2"), ip("10.244.0.3")),
                (ip("10.244.0.4"), ip("10.244.0.2")),
                (ip("fd00::3"), ip("fd00::2")),
            ]
        );
        assert!(fast_path_entries(&entries, &BTreeSet::new(), &local).is_empty());
    }
}
