//! NetworkPolicy enforcement for the pods of this node, in the kernel path:
//! [`model`] says what the policies mean for each local pod, [`nft`] turns
//! that into one nftables ruleset, and [`Enforcer`] applies it as one
//! atomic `nft -j -f -` transaction and reads its drop counters back.
//!
//! The fast path never carries a packet of an isolated pod: the agent flags
//! such pods kernel-only (both directions take the kernel path, where these
//! rules are), and the CNI holds every new pod a policy may select until
//! the agent has classified it (see `xdpcni_node::gate`).

pub mod addrs;
pub mod model;
pub mod nft;

use std::{collections::BTreeMap, net::IpAddr, process::Command, time::Instant};

use tracing::{debug, info};

use self::{model::Enforcement, nft::Objects};
use crate::node::PodKey;

/// Failures applying or reading the ruleset.
#[derive(Debug, thiserror::Error)]
pub enum NetpolError {
    /// `nft` failed or could not be run.
    #[error("nft: {0}")]
    Nft(#[from] nftables::helper::NftablesError),
    /// `conntrack` failed or could not be run.
    #[error("conntrack -D: {0}")]
    Conntrack(String),
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
    /// Pods isolated now that the ruleset before did not isolate at all:
    /// their connections so far may have run on the fast path, unseen by
    /// conntrack (see [`forget_connections`]).
    pub newly_isolated: Vec<PodKey>,
}

/// Applies rulesets and remembers the one in force.
#[derive(Debug, Default)]
pub struct Enforcer {
    /// The objects of the ruleset in force; `None`: read them from the
    /// kernel first (after a start, or a failed transaction).
    objects: Option<Objects>,
    /// The enforcement in force, and its rule count.
    in_force: Option<(Enforcement, usize)>,
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

impl Enforcer {
    /// An enforcer that reads the table in the kernel before its first
    /// transaction (rules from an earlier agent stay in force until then).
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the table enforce `e`, in one transaction; nothing runs when
    /// `e` is what is in force already.
    pub fn apply(&mut self, e: &Enforcement) -> Result<Applied, NetpolError> {
        if let Some((have, rules)) = &self.in_force {
            if have == e {
                return Ok(Applied {
                    changed: false,
                    rules: *rules,
                    seconds: 0.0,
                    newly_isolated: Vec::new(),
                });
            }
        }
        let before = match &self.objects {
            Some(o) => o.clone(),
            None => list(&["list", "table", "inet", nft::TABLE], "list table")?
                .map(|l| nft::objects_of(&l))
                .unwrap_or_default(),
        };
        let (batch, now) = nft::transaction(e, &before);
        let doc = batch.to_nftables();
        let rules = doc
            .objects
            .iter()
            .filter(|o| {
                matches!(
                    o,
                    nftables::schema::NfObject::CmdObject(nftables::schema::NfCmd::Add(
                        nftables::schema::NfListObject::Rule(_)
                    ))
                )
            })
            .count();
        let started = Instant::now();
        let applied = nftables::helper::apply_ruleset(&doc);
        let seconds = started.elapsed().as_secs_f64();
        match applied {
            Ok(()) => {
                info!(
                    pods = e.pods.len(),
                    rules,
                    ms = seconds * 1e3,
                    "NetworkPolicy rules applied"
                );
                let newly_isolated = e
                    .pods
                    .keys()
                    .filter(|k| {
                        [model::Direction::Ingress, model::Direction::Egress]
                            .into_iter()
                            .all(|d| !before.chains.contains(&nft::chain_name(k, d, false)))
                    })
                    .cloned()
                    .collect();
                self.objects = Some(now);
                self.in_force = Some((e.clone(), rules));
                Ok(Applied {
                    changed: true,
                    rules,
                    seconds,
                    newly_isolated,
                })
            }
            Err(err) => {
                // What is in the kernel is not known for sure now: read it
                // again before the next transaction.
                self.objects = None;
                self.in_force = None;
                Err(err.into())
            }
        }
    }

    /// The enforcement in force, if a transaction has succeeded.
    pub fn in_force(&self) -> Option<&Enforcement> {
        self.in_force.as_ref().map(|(e, _)| e)
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

/// Deletes every conntrack entry of the node with one of `ips` at either
/// end, before or after NAT (`conntrack -D`); how many went.
///
/// Called for a pod a policy has just isolated, once its fast-path traffic
/// has drained: conntrack never saw what the fast path carried, so an entry
/// made at the switch may take the pod's reply to a request it got over XDP
/// for a connection the pod began (and let the other end's packets in as
/// its replies). Deleted, each entry is made again by the next packet that
/// passes the rules: a request, since the pod has nothing left to answer.
/// TCP connections picked up again mid-stream must be allowed from both
/// ends (see `nft`).
pub fn forget_connections(ips: &[IpAddr]) -> Result<u64, NetpolError> {
    let mut deleted = 0;
    for ip in ips {
        let family = if ip.is_ipv6() { "ipv6" } else { "ipv4" };
        let ip = ip.to_string();
        for end in ["--orig-src", "--orig-dst", "--reply-src", "--reply-dst"] {
            let out = Command::new("conntrack")
                .args(["-D", "-f", family, end, &ip])
                .output()
                .map_err(|e| NetpolError::Conntrack(format!("running conntrack: {e}")))?;
            // "conntrack v1.4.7 (conntrack-tools): N flow entries have been
            // deleted." on stderr, exit 1 when N is 0.
            let err = String::from_utf8_lossy(&out.stderr);
            let n = err
                .split_whitespace()
                .zip(err.split_whitespace().skip(1))
                .find(|(_, w)| *w == "flow")
                .and_then(|(n, _)| n.parse::<u64>().ok())
                .ok_or_else(|| NetpolError::Conntrack(format!("{end} {ip}: {}", err.trim())))?;
            deleted += n;
        }
    }
    Ok(deleted)
}
