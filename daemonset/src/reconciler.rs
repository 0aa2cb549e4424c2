//! The node's datapath state and the two kinds of work on it, shared by the
//! standalone and the Kubernetes modes: reconciling one pod (its record from
//! the CNI, its wish, applied), and the node-wide work (NAT'd ports,
//! collecting what deleted pods left). Synchronous: callers run it on a
//! blocking thread, one at a time (the core holds it behind a mutex).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use tracing::{info, warn};
use xdpcni_ebpf::{Datapath, L4Proto};
use xdpcni_host::{pod::XdpMode, state::Record};

use crate::{
    apply::{apply, Applied, ApplyError},
    records::{being_deleted, link_exists, pod_key, veth_present, Annotations, PodKey},
    status::{Why, WhyCode},
    wish::{resolve, Problem, Wish, ANNOTATION_MODE},
};

/// Why a pod must take the kernel path both ways.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelOnly {
    /// These NetworkPolicies (`namespace/name`) isolate it.
    Policies(Vec<String>),
    /// This DROP/REJECT rule reachable from FORWARD names it.
    ForwardRule(String),
}

/// What the agent knows of a pod beyond its record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodInput {
    /// Its annotations.
    pub annotations: Annotations,
    /// Kernel routing both ways, and why.
    pub kernel_only: Option<KernelOnly>,
}

/// The outcome of reconciling one pod.
#[derive(Clone, Debug)]
pub struct PodOutcome {
    /// The mode in force now.
    pub mode: XdpMode,
    /// What the pod asks for (annotations over the node defaults).
    pub wish: Wish,
    /// Why `mode` is in force.
    pub why: Why,
    /// Whether anything changed.
    pub changed: bool,
    /// On kernel routing because a datapath map is full.
    pub map_full: bool,
    /// Every problem of this reconcile.
    pub problems: Vec<Problem>,
    /// The problems, when they differ from the last ones reported for this
    /// pod (to report once per change); empty otherwise.
    pub new_problems: Vec<Problem>,
}

/// Why a pod is in its mode: the first that applies of a vanished veth, a
/// hold, kernel-only, a full map, a kernel refusal, the annotation, the
/// node default.
fn why(
    wish: &Wish,
    annotations: &Annotations,
    held: bool,
    kernel_only: Option<&KernelOnly>,
    applied: &Applied,
) -> Why {
    let (code, text) = if held {
        (
            WhyCode::Held,
            "held since its CNI ADD until the agent classifies it against the NetworkPolicies"
                .to_string(),
        )
    } else if let Some(k) = kernel_only {
        match k {
            KernelOnly::Policies(names) => (
                WhyCode::NetworkPolicy,
                format!(
                    "kernel-only: NetworkPolicy {} isolates it",
                    names.join(", ")
                ),
            ),
            KernelOnly::ForwardRule(rule) => (
                WhyCode::ForwardRule,
                format!("kernel-only: the FORWARD rule `{rule}` names it"),
            ),
        }
    } else if let Some(full) = &applied.map_full {
        (
            WhyCode::MapFull,
            format!("kernel routing: a datapath map is full ({full})"),
        )
    } else if let Some((from, err)) = &applied.refused {
        (
            WhyCode::Fallback,
            format!(
                "fallback from {} to {}: the kernel refused {}: {err}",
                from.as_str(),
                applied.mode.as_str(),
                from.as_str()
            ),
        )
    } else {
        match annotations.get(ANNOTATION_MODE) {
            Some(v) if XdpMode::parse(v.trim()) == Some(wish.mode) => (
                WhyCode::Annotation,
                format!("annotation {ANNOTATION_MODE}={}", v.trim()),
            ),
            Some(v) => (
                WhyCode::NodeDefault,
                format!(
                    "node default {} ({ANNOTATION_MODE}={v:?} refused)",
                    wish.mode.as_str()
                ),
            ),
            None => (
                WhyCode::NodeDefault,
                format!("node default {}", wish.mode.as_str()),
            ),
        }
    };
    Why { code, text }
}

/// The datapath and what the agent remembers between reconciles.
pub struct Reconciler {
    dp: Datapath,
    defaults: Wish,
    online: u64,
    state_dir: std::path::PathBuf,
    reported: HashMap<PodKey, String>,
}

impl Reconciler {
    /// A reconciler over `dp` with node `defaults`; `online` is the mask of
    /// online CPUs that CPU lists are checked against; the CNI's records
    /// are in `state_dir`.
    pub fn new(dp: Datapath, defaults: Wish, online: u64, state_dir: std::path::PathBuf) -> Self {
        Self {
            dp,
            defaults,
            online,
            state_dir,
            reported: HashMap::new(),
        }
    }

    /// Applies the wish of `pod` (annotations over the node defaults) to
    /// the pod of `rec`. A held pod (see [`Reconciler::release`]) is kept on
    /// kernel routing with kernel-only records whatever its input: the fast
    /// path would carry its frames past the hold.
    pub fn reconcile(&mut self, rec: &Record, pod: &PodInput) -> Result<PodOutcome, ApplyError> {
        let key = pod_key(rec);
        let (wish, mut problems) = resolve(&pod.annotations, &self.defaults, self.online);
        if !veth_present(rec) {
            if being_deleted(&self.state_dir, rec) {
                // Its DEL removed the veth and is removing the record: the
                // normal end of a pod, nothing to report.
                return Ok(self.deleted(key, wish));
            }
            // Deleted outside the CNI: nothing to attach to. Its leftovers
            // in the datapath go at its DEL (or collection once it has no
            // record); reported once, not retried as a failure.
            let why = Why {
                code: WhyCode::VethGone,
                text: "no network: the host veth was deleted outside the CNI".into(),
            };
            let problem = Problem::veth_gone(&rec.host_veth);
            return Ok(self.outcome(key, wish, why, Applied::nothing(), vec![problem]));
        }
        let held = self.dp.is_held(rec.host_ifindex);
        let kernel_only = pod.kernel_only.is_some() || held;
        let applied = match apply(&mut self.dp, rec, &wish, kernel_only) {
            Ok(a) => a,
            // Its DEL took the veth away meanwhile: the normal end of a
            // pod, not a failure to retry or report.
            Err(_) if being_deleted(&self.state_dir, rec) => return Ok(self.deleted(key, wish)),
            Err(e) => return Err(e),
        };
        if applied.changed {
            info!(mode = applied.mode.as_str(), kernel_only, held, "applied");
        }
        let why = why(
            &wish,
            &pod.annotations,
            held,
            pod.kernel_only.as_ref(),
            &applied,
        );
        problems.extend(applied.problems.iter().cloned());
        Ok(self.outcome(key, wish, why, applied, problems))
    }

    /// The outcome for a pod whose CNI DEL runs: off, nothing to report.
    fn deleted(&mut self, key: PodKey, wish: Wish) -> PodOutcome {
        let why = Why {
            code: WhyCode::VethGone,
            text: "being deleted (its CNI DEL removed the host veth)".into(),
        };
        self.outcome(key, wish, why, Applied::nothing(), Vec::new())
    }

    /// The outcome of a reconcile, with `problems` reported (logged and
    /// returned) only when they differ from the pod's last ones.
    fn outcome(
        &mut self,
        key: PodKey,
        wish: Wish,
        why: Why,
        applied: Applied,
        problems: Vec<Problem>,
    ) -> PodOutcome {
        let text = problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let new_problems = if !text.is_empty() && self.reported.get(&key) != Some(&text) {
            warn!(problem = %text, "wish refused, fallback in use");
            problems.clone()
        } else {
            Vec::new()
        };
        self.reported.insert(key, text);
        PodOutcome {
            mode: applied.mode,
            wish,
            why,
            changed: applied.changed,
            map_full: applied.map_full.is_some(),
            problems,
            new_problems,
        }
    }

    /// Ends the hold the CNI put on the pod of `rec` at ADD (its namespace
    /// may have NetworkPolicies): called once the pod is classified (its
    /// policies are known and, if any selects it, their rules are in the
    /// kernel). The pod is on kernel routing after; its next reconcile
    /// attaches its mode. Whether it was held.
    pub fn release(&mut self, rec: &Record) -> Result<bool, xdpcni_ebpf::Error> {
        if !veth_present(rec) {
            return Ok(false);
        }
        let released = self.dp.release_hold(rec.host_ifindex)?;
        if released {
            info!(host_veth = %rec.host_veth, "hold released: the pod is classified");
        }
        Ok(released)
    }

    /// Flags the endpoint records of `rec` kernel-only at once (a policy now
    /// isolates the pod: the fast path must stop carrying its frames before
    /// its reconcile detaches XDP).
    pub fn flag_kernel_only(&mut self, rec: &Record) -> Result<(), xdpcni_ebpf::Error> {
        self.dp.flag_kernel_only(&rec.ips)
    }

    /// Holds the pod of `rec` (drops every IP packet to and from it), as the
    /// CNI does at ADD: for a pod whose policies cannot be put in force. Its
    /// endpoint records are flagged kernel-only first (the datapath's
    /// `hold_pod`); its reconcile then detaches XDP.
    pub fn hold(&mut self, rec: &Record) -> Result<bool, xdpcni_ebpf::Error> {
        if !veth_present(rec) {
            return Ok(false);
        }
        self.dp.hold_pod(rec.host_ifindex, &rec.host_veth, &rec.ips)
    }

    /// Whether the pod of `rec` is held.
    pub fn is_held(&self, rec: &Record) -> bool {
        self.dp.is_held(rec.host_ifindex)
    }

    /// Writes the policy gate the CNI reads at ADD: the namespaces that hold
    /// NetworkPolicies (name -> how many), complete.
    pub fn write_gate(
        &mut self,
        namespaces: &BTreeMap<String, u32>,
    ) -> Result<bool, xdpcni_ebpf::Error> {
        if !self.dp.set_policy_namespaces(namespaces)? {
            return Ok(false);
        }
        info!(namespaces = namespaces.len(), "policy gate written");
        Ok(true)
    }

    /// Re-creates the datapath when its pins were removed from under it
    /// (by hand, or a bpffs remount): what is left is uninstalled and a
    /// fresh datapath pinned; every pod must then be reconciled again (its
    /// records and links are gone; counters restart). `Ok(false)` when all
    /// pins are there.
    pub fn ensure_pinned(&mut self) -> Result<bool, xdpcni_ebpf::Error> {
        let dir = self.dp.pin_dir().to_path_buf();
        let missing = Datapath::missing_pins(&dir);
        if missing.is_empty() {
            return Ok(false);
        }
        warn!(
            pin_dir = %dir.display(),
            missing = ?missing,
            "datapath pins removed: reloading and re-pinning; every pod is re-attached"
        );
        Datapath::uninstall(&dir)?;
        self.dp = Datapath::open(&dir)?;
        self.reported.clear();
        Ok(true)
    }

    /// Node-wide collection: link pins of deleted veths, endpoint records
    /// (with their devmap entries and counters) whose veth is gone and that
    /// no record claims (pods whose DEL never came), and what was remembered
    /// of pods without a record. Returns how many things were collected.
    pub fn collect(&mut self, records: &[Record]) -> Result<usize, xdpcni_ebpf::Error> {
        let claimed: HashSet<u32> = records.iter().map(|r| r.host_ifindex).collect();
        let collected = self.dp.collect(&claimed, &link_exists)?;
        for ifindex in &collected.links {
            info!(ifindex, "collected the link pin of a deleted veth");
        }
        let keys: HashSet<PodKey> = records.iter().map(pod_key).collect();
        self.reported.retain(|k, _| keys.contains(k));
        Ok(collected.len())
    }

    /// Makes the datapath's NAT'd ports equal `want`: the (address, protocol,
    /// port) of local pods that are Service backends or hostPort targets,
    /// whose replies conntrack must translate, and every endpoint's no-NAT
    /// flag agree with them. Returns (added, removed).
    pub fn sync_nat_ports(
        &mut self,
        want: &BTreeSet<(IpAddr, L4Proto, u16)>,
    ) -> Result<(usize, usize), xdpcni_ebpf::Error> {
        let done = self.dp.sync_nat_ports(want)?;
        if done.repaired > 0 {
            info!(repaired = done.repaired, "endpoint NAT flags repaired");
        }
        Ok((done.added, done.removed))
    }
}
