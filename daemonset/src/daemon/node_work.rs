//! The node-wide work of both modes: collection and the NAT'd ports (run
//! only when their input changed, or at [`NODE_RESYNC`]), the FORWARD rule
//! scan, and the one quiet-pass test.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::{atomic::Ordering, Arc, Mutex, PoisonError},
    time::Instant,
};

use tracing::{info, warn};
use xdpcni_ebpf::L4Proto;
use xdpcni_host::state::{self, Record};

use super::{Core, NODE_RESYNC};
use crate::{
    forward,
    metrics::{Metrics, Stage},
    records::{is_live, pod_key, PodKey},
};

/// The NAT'd ports the node-wide work writes: this node's pods' (Service
/// backends, hostPorts), which same-node traffic needs, and other nodes'
/// Service backends, which only the fast path between nodes needs (their
/// replies arrive from other nodes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatWant {
    /// This node's pods'.
    pub local: BTreeSet<(IpAddr, L4Proto, u16)>,
    /// Other nodes' Service backends.
    pub others: BTreeSet<(IpAddr, L4Proto, u16)>,
}

/// The input of the node-wide work's last run, and when.
pub(super) struct NodeMemo {
    generation: u64,
    nat: Option<NatWant>,
    at: Instant,
}

impl NodeMemo {
    fn same_input(&self, other: &Self) -> bool {
        self.generation == other.generation && self.nat == other.nat
    }
}

/// The pods FORWARD rules name (kernel-only while they do), and when the
/// rules were last read: the FORWARD scan's state, behind its own lock.
#[derive(Default)]
pub struct ForwardScan(Mutex<Blocked>);

#[derive(Default)]
struct Blocked {
    pods: BTreeMap<PodKey, forward::Rule>,
    scanned: Option<Instant>,
    warned: bool,
}

/// What a FORWARD scan changed.
#[derive(Debug, Default)]
pub struct BlockedChange {
    /// Pods now named by a rule, with the rule.
    pub added: Vec<(PodKey, forward::Rule)>,
    /// Pods no rule names any more.
    pub removed: Vec<PodKey>,
}

impl BlockedChange {
    /// Whether no pod changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

/// What a pass of the node loop (either mode) found before any per-pod work.
#[derive(Debug)]
pub struct PassChecks<'a> {
    /// Something asked for the pass: a watch event, a record written, the
    /// pods file changed, routes being retired.
    pub woken: bool,
    /// The datapath's pins were gone and it was made anew.
    pub reloaded: bool,
    /// A live record's veth is gone.
    pub vanished: bool,
    /// What the FORWARD scan changed.
    pub forward: &'a BlockedChange,
    /// The records' generation now.
    pub generation: u64,
    /// The records' generation of the last full pass that left everything
    /// in place, and when it ran.
    pub settled: Option<(u64, Instant)>,
}

impl PassChecks<'_> {
    /// Whether the pass may stop after its checks: nothing woke it, nothing
    /// vanished or reloaded, no FORWARD rule changed, and the last full pass
    /// saw these records less than [`NODE_RESYNC`] ago. The one quiet-pass
    /// test of both modes: an idle node does no per-pod work each
    /// `intervalMs`, and a full pass runs at least every [`NODE_RESYNC`].
    pub fn quiet(&self) -> bool {
        !self.woken
            && !self.reloaded
            && !self.vanished
            && self.forward.is_empty()
            && self.settled.is_some_and(|(generation, at)| {
                generation == self.generation && at.elapsed() < NODE_RESYNC
            })
    }
}

impl Core {
    /// The node-wide work over the records of `listing`: collection, and
    /// the NAT'd ports when `nat` is given. Forgets pods without a live
    /// record. What reads the datapath (collection, the NAT'd ports) runs
    /// only when the records, `nat` or `force` (a pod reconciled this
    /// pass: its veth may be gone) say something changed, or
    /// [`NODE_RESYNC`] after it last ran: an idle node reads no map.
    pub async fn node_work(&self, listing: &state::Listing, nat: Option<NatWant>, force: bool) {
        let records = Arc::clone(&listing.records);
        let memo = NodeMemo {
            generation: listing.generation,
            nat: nat.clone(),
            at: Instant::now(),
        };
        let due = force
            || self
                .node_memo
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .is_none_or(|m| !m.same_input(&memo) || m.at.elapsed() >= NODE_RESYNC);
        let started = Instant::now();
        let mut clean = due;
        if due && !self.collect(&records).await {
            clean = false;
        }
        if let Some(nat) = nat.filter(|_| due) {
            if !self.sync_nat(nat).await {
                clean = false;
            }
        }
        if clean {
            // Done without an error: nothing to do until the input changes.
            *self
                .node_memo
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(memo);
        }
        let live: std::collections::HashSet<&str> = records
            .iter()
            .filter(|r| is_live(r))
            .map(|r| r.container_id.as_str())
            .collect();
        self.view.book.retain_pods(|id| live.contains(id));
        self.view.book.node_pass();
        self.view.retain_converged(|id| live.contains(id));
        self.metrics
            .observe("node", started.elapsed().as_secs_f64());
    }

    /// Collects what deleted pods left behind; whether it went without an
    /// error (one is counted and logged).
    async fn collect(&self, records: &Arc<Vec<Record>>) -> bool {
        let live = Arc::clone(records);
        let error = match self.owner.run(move |r| r.collect(&live)).await {
            Ok(Ok(_)) => return true,
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        warn!(error, "collecting deleted pods' leftovers");
        self.metrics.error(Stage::Gc);
        false
    }

    /// Makes the NAT'd ports `nat`: all of them, or where they do not fit
    /// (or the write fails) this node's pods' alone, which same-node
    /// traffic needs; only the whole set lets the fast path between nodes
    /// on ([`Core::nat_synced`]). Whether the local ones went without an
    /// error.
    async fn sync_nat(&self, nat: NatWant) -> bool {
        let all: BTreeSet<_> = nat.local.union(&nat.others).copied().collect();
        let fits = all.len() <= xdpcni_ebpf::abi::MAX_NAT_PORTS as usize;
        let whole = if fits {
            self.write_nat(all).await
        } else {
            warn!(
                wanted = all.len(),
                capacity = xdpcni_ebpf::abi::MAX_NAT_PORTS,
                "the cluster's Service backends do not fit the NAT'd ports: the fast path \
                 between nodes is off on this node"
            );
            false
        };
        self.nat_synced.store(whole, Ordering::Release);
        whole || self.write_nat(nat.local).await
    }

    /// Writes the NAT'd ports `want`; whether it went without an error.
    async fn write_nat(&self, want: BTreeSet<(IpAddr, L4Proto, u16)>) -> bool {
        let error = match self.owner.run(move |r| r.sync_nat_ports(&want)).await {
            Ok(Ok((0, 0))) => return true,
            Ok(Ok((added, removed))) => {
                info!(added, removed, "NAT'd ports updated");
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        warn!(error, "NAT'd ports");
        self.metrics.error(Stage::NatPorts);
        false
    }

    /// A pass of the node task that found nothing to do: the status's last
    /// node pass moves all the same.
    pub fn idle_pass(&self) {
        self.view.book.node_pass();
    }
}

impl ForwardScan {
    /// Reads the node's FORWARD rules when `every` ms (`forwardScanMs`) have
    /// passed since the last read, and returns which pods they newly name or no longer
    /// name (the caller reconciles those).
    pub async fn scan(&self, every: u64, records: &[Record], metrics: &Metrics) -> BlockedChange {
        let due = every > 0
            && self
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .scanned
                .is_none_or(|t| t.elapsed().as_millis() >= u128::from(every));
        if !due {
            return BlockedChange::default();
        }
        let pods: Vec<(PodKey, Vec<IpAddr>)> = records
            .iter()
            .filter(|r| is_live(r))
            .map(|r| (pod_key(r), r.ips.clone()))
            .collect();
        let scanned = tokio::task::spawn_blocking(move || {
            forward::scan().map(|save| {
                forward::blocked(&save, pods.iter().map(|(k, ips)| (k, ips.as_slice())))
            })
        })
        .await;
        let mut blocked = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        blocked.scanned = Some(Instant::now());
        let now = match scanned {
            Ok(Ok(now)) => now,
            Ok(Err(e)) => {
                if !blocked.warned {
                    warn!(error = %e, "FORWARD rules not read");
                    blocked.warned = true;
                }
                return BlockedChange::default();
            }
            Err(e) => {
                warn!(error = %e, "FORWARD scan task failed");
                return BlockedChange::default();
            }
        };
        let change = BlockedChange {
            added: now
                .iter()
                .filter(|(k, _)| !blocked.pods.contains_key(*k))
                .map(|(k, r)| (k.clone(), r.clone()))
                .collect(),
            removed: blocked
                .pods
                .keys()
                .filter(|k| !now.contains_key(*k))
                .cloned()
                .collect(),
        };
        for (key, rule) in &change.added {
            info!(namespace = %key.0, pod = %key.1, %rule, "a FORWARD rule names the pod: kernel-only");
        }
        for key in &change.removed {
            info!(namespace = %key.0, pod = %key.1, "no FORWARD rule names the pod any more");
        }
        metrics
            .forward_rule_pods
            .set(i64::try_from(now.len()).unwrap_or(i64::MAX));
        blocked.pods = now;
        change
    }

    /// The rule naming pod `key`, if one does.
    pub fn rule_of(&self, key: &PodKey) -> Option<forward::Rule> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pods
            .get(key)
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_pass_is_quiet_only_when_nothing_changed_since_a_recent_full_pass() {
        let none = BlockedChange::default();
        let recent = Some((7, Instant::now()));
        let checks = |woken, reloaded, vanished, forward, generation, settled| PassChecks {
            woken,
            reloaded,
            vanished,
            forward,
            generation,
            settled,
        };
        assert!(checks(false, false, false, &none, 7, recent).quiet());
        assert!(
            !checks(true, false, false, &none, 7, recent).quiet(),
            "woken"
        );
        assert!(
            !checks(false, true, false, &none, 7, recent).quiet(),
            "reloaded"
        );
        assert!(
            !checks(false, false, true, &none, 7, recent).quiet(),
            "a veth vanished"
        );
        assert!(
            !checks(false, false, false, &none, 8, recent).quiet(),
            "new records"
        );
        assert!(
            !checks(false, false, false, &none, 7, None).quiet(),
            "no full pass yet"
        );
        let stale = Instant::now().checked_sub(NODE_RESYNC + Duration::from_secs(1));
        assert!(
            !checks(false, false, false, &none, 7, stale.map(|t| (7, t))).quiet(),
            "a full pass is due"
        );
        let named = BlockedChange {
            added: Vec::new(),
            removed: vec![("ns".into(), "p".into())],
        };
        assert!(
            !checks(false, false, false, &named, 7, recent).quiet(),
            "FORWARD changed"
        );
    }
}
