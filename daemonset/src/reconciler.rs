//! The node's datapath state and the two kinds of work on it, shared by the
//! standalone and the Kubernetes modes: reconciling one pod (its record from
//! the CNI, its policy, applied), and the node-wide work (NAT'd ports,
//! collecting what deleted pods left). Synchronous: callers run it on a
//! blocking thread, one at a time (the core holds it behind a mutex).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use tracing::{info, warn};
use xdpcni_ebpf::{Datapath, L4Proto};
use xdpcni_host::{
    pod::XdpMode,
    state::{self, Record},
};

use crate::{
    apply::{apply, Applied, ApplyError},
    policy::{resolve, Policy, Problem, ANNOTATION_MODE},
    status::{Why, WhyCode},
};

/// Annotations of a pod.
pub type Annotations = BTreeMap<String, String>;

/// (namespace, name) of a pod; ("", container ID) for a record without one.
pub type PodKey = (String, String);

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

/// (namespace, name) of a record: the pod's, or ("", container ID).
pub fn pod_key(rec: &Record) -> PodKey {
    if rec.pod_name.is_empty() {
        (String::new(), rec.container_id.clone())
    } else {
        (rec.pod_namespace.clone(), rec.pod_name.clone())
    }
}

/// The records no listed pod claims, which get the node defaults. `listed`
/// is None until the first complete list of pods has arrived: before it, a
/// record's pod may simply not be known yet, and the defaults would undo the
/// mode its annotations chose (after an agent restart, say), so none is an
/// orphan yet.
pub fn orphans<'a>(records: &'a [Record], listed: Option<&HashSet<PodKey>>) -> Vec<&'a Record> {
    let Some(listed) = listed else {
        return Vec::new();
    };
    records
        .iter()
        .filter(|r| !listed.contains(&pod_key(r)))
        .collect()
}

/// Whether a record's pod is still there: its DEL has not started and its
/// netns exists. A pod whose netns is gone is being deleted; its DEL cleans
/// up.
pub fn is_live(rec: &Record) -> bool {
    !rec.deleting && std::path::Path::new(&rec.netns).exists()
}

/// The name of the device with `ifindex` in this network namespace, if any.
fn link_name(ifindex: u32) -> Option<Vec<u8>> {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `name` has IF_NAMESIZE bytes, as if_indextoname requires.
    if unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) }.is_null() {
        return None;
    }
    // SAFETY: if_indextoname NUL-terminated what it wrote into `name`.
    Some(
        unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_bytes()
            .to_vec(),
    )
}

/// Whether the record's pod is being deleted: its DEL marked the record,
/// or already removed it (read again from disk: the caller's copy may
/// predate the DEL).
fn being_deleted(state_dir: &std::path::Path, rec: &Record) -> bool {
    match state::load(state_dir, &rec.container_id, &rec.ifname) {
        Ok(Some(now)) => now.deleting,
        Ok(None) => true,
        Err(_) => false,
    }
}

/// Whether the record's host veth is still there (its ifindex still names
/// it): one ioctl, so standalone mode can skip a pod that did not change
/// and still learn at once of a veth deleted behind the CNI's back.
pub fn veth_present(rec: &Record) -> bool {
    link_name(rec.host_ifindex).is_some_and(|n| n == rec.host_veth.as_bytes())
}

/// Whether a device with `ifindex` exists in this network namespace.
fn link_exists(ifindex: u32) -> bool {
    link_name(ifindex).is_some()
}

/// The outcome of reconciling one pod.
#[derive(Clone, Debug)]
pub struct PodOutcome {
    /// The mode in force now.
    pub mode: XdpMode,
    /// The policy asked for (annotations over the node defaults).
    pub policy: Policy,
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
    policy: &Policy,
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
            Some(v) if XdpMode::parse(v.trim()) == Some(policy.mode) => (
                WhyCode::Annotation,
                format!("annotation {ANNOTATION_MODE}={}", v.trim()),
            ),
            Some(v) => (
                WhyCode::NodeDefault,
                format!(
                    "node default {} ({ANNOTATION_MODE}={v:?} refused)",
                    policy.mode.as_str()
                ),
            ),
            None => (
                WhyCode::NodeDefault,
                format!("node default {}", policy.mode.as_str()),
            ),
        }
    };
    Why { code, text }
}

/// The datapath and what the agent remembers between reconciles.
pub struct Reconciler {
    dp: Datapath,
    defaults: Policy,
    online: u64,
    state_dir: std::path::PathBuf,
    reported: HashMap<PodKey, String>,
}

impl Reconciler {
    /// A reconciler over `dp` with node `defaults`; `online` is the mask of
    /// online CPUs that CPU lists are checked against; the CNI's records
    /// are in `state_dir`.
    pub fn new(dp: Datapath, defaults: Policy, online: u64, state_dir: std::path::PathBuf) -> Self {
        Self {
            dp,
            defaults,
            online,
            state_dir,
            reported: HashMap::new(),
        }
    }

    /// Applies the policy of `pod` (annotations over the node defaults) to
    /// the pod of `rec`. A held pod (see [`Reconciler::release`]) is kept on
    /// kernel routing with kernel-only records whatever its input: the fast
    /// path would carry its frames past the hold.
    pub fn reconcile(&mut self, rec: &Record, pod: &PodInput) -> Result<PodOutcome, ApplyError> {
        let key = pod_key(rec);
        let (policy, mut problems) = resolve(&pod.annotations, &self.defaults, self.online);
        if !veth_present(rec) {
            if being_deleted(&self.state_dir, rec) {
                // Its DEL removed the veth and is removing the record: the
                // normal end of a pod, nothing to report.
                return Ok(self.deleted(key, policy));
            }
            // Deleted outside the CNI: nothing to attach to. Its leftovers
            // in the datapath go at its DEL (or collection once it has no
            // record); reported once, not retried as a failure.
            let why = Why {
                code: WhyCode::VethGone,
                text: "no network: the host veth was deleted outside the CNI".into(),
            };
            let problem = Problem::veth_gone(&rec.host_veth);
            return Ok(self.outcome(key, policy, why, Applied::nothing(), vec![problem]));
        }
        let held = self.dp.is_held(rec.host_ifindex);
        let kernel_only = pod.kernel_only.is_some() || held;
        let applied = match apply(&mut self.dp, rec, &policy, kernel_only) {
            Ok(a) => a,
            // Its DEL took the veth away meanwhile: the normal end of a
            // pod, not a failure to retry or report.
            Err(_) if being_deleted(&self.state_dir, rec) => return Ok(self.deleted(key, policy)),
            Err(e) => return Err(e),
        };
        if applied.changed {
            info!(mode = applied.mode.as_str(), kernel_only, held, "applied");
        }
        let why = why(
            &policy,
            &pod.annotations,
            held,
            pod.kernel_only.as_ref(),
            &applied,
        );
        problems.extend(applied.problems.iter().cloned());
        Ok(self.outcome(key, policy, why, applied, problems))
    }

    /// The outcome for a pod whose CNI DEL runs: off, nothing to report.
    fn deleted(&mut self, key: PodKey, policy: Policy) -> PodOutcome {
        let why = Why {
            code: WhyCode::VethGone,
            text: "being deleted (its CNI DEL removed the host veth)".into(),
        };
        self.outcome(key, policy, why, Applied::nothing(), Vec::new())
    }

    /// The outcome of a reconcile, with `problems` reported (logged and
    /// returned) only when they differ from the pod's last ones.
    fn outcome(
        &mut self,
        key: PodKey,
        policy: Policy,
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
            warn!(problem = %text, "policy refused, fallback in use");
            problems.clone()
        } else {
            Vec::new()
        };
        self.reported.insert(key, text);
        PodOutcome {
            mode: applied.mode,
            policy,
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
        let released = self.dp.release(rec.host_ifindex)?;
        if released {
            info!(host_veth = %rec.host_veth, "hold released: the pod is classified");
        }
        Ok(released)
    }

    /// Flags the endpoint records of `rec` kernel-only at once (a policy now
    /// isolates the pod: the fast path must stop carrying its frames before
    /// its reconcile detaches XDP).
    pub fn flag_kernel_only(&mut self, rec: &Record) -> Result<(), xdpcni_ebpf::Error> {
        for ip in &rec.ips {
            self.dp.maps_mut().flag_kernel_only(*ip)?;
        }
        Ok(())
    }

    /// Holds the pod of `rec` (drops every IP packet to and from it), as the
    /// CNI does at ADD: for a pod whose policies cannot be put in force. Its
    /// endpoint records are flagged kernel-only first: the fast path would
    /// carry its frames past the hold (its reconcile then detaches XDP).
    pub fn hold(&mut self, rec: &Record) -> Result<bool, xdpcni_ebpf::Error> {
        if !veth_present(rec) {
            return Ok(false);
        }
        self.flag_kernel_only(rec)?;
        self.dp.maps_mut().claim_slot(rec.host_ifindex)?;
        self.dp.hold(rec.host_ifindex, &rec.host_veth)
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
        let maps = self.dp.maps_mut();
        let gate = maps.policy_gate()?;
        if gate.complete == 1 && maps.policy_namespaces()? == *namespaces {
            return Ok(false);
        }
        maps.write_policy_gate(namespaces)?;
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
        let mut n = 0;
        for ifindex in self.dp.gc_links()? {
            info!(ifindex, "collected the link pin of a deleted veth");
            n += 1;
        }
        for (ip, ep) in self.dp.maps().endpoints()? {
            if records.iter().any(|r| r.host_ifindex == ep.ifindex) || link_exists(ep.ifindex) {
                continue;
            }
            info!(%ip, ifindex = ep.ifindex, "removing the endpoint of a vanished veth");
            self.dp.maps_mut().remove_endpoint(ip)?;
            self.dp.maps_mut().remove_tx_port(ep.ifindex)?;
            self.dp.maps_mut().remove_counters(ep.ifindex)?;
            n += 1;
        }
        let keys: HashSet<PodKey> = records.iter().map(pod_key).collect();
        self.reported.retain(|k, _| keys.contains(k));
        Ok(n)
    }

    /// Makes the datapath's NAT'd ports equal `want`: the (address, protocol,
    /// port) of local pods that are Service backends or hostPort targets,
    /// whose replies conntrack must translate, and every endpoint's no-NAT
    /// flag agree with them. Returns (added, removed).
    pub fn sync_nat_ports(
        &mut self,
        want: &BTreeSet<(IpAddr, L4Proto, u16)>,
    ) -> Result<(usize, usize), xdpcni_ebpf::Error> {
        let have: BTreeSet<_> = self.dp.maps().nat_ports()?.into_iter().collect();
        let (mut added, mut removed) = (0, 0);
        for (ip, proto, port) in want.difference(&have) {
            self.dp.maps_mut().add_nat_port(*ip, *proto, *port)?;
            added += 1;
        }
        for (ip, proto, port) in have.difference(want) {
            self.dp.maps_mut().remove_nat_port(*ip, *proto, *port)?;
            removed += 1;
        }
        // add/remove keep each endpoint's no-NAT flag; this repairs a record
        // written by a CNI ADD that raced a change here.
        let repaired = self.dp.maps_mut().refresh_nat_flags()?;
        if repaired > 0 {
            info!(repaired, "endpoint NAT flags repaired");
        }
        Ok((added, removed))
    }
}

/// A record of pod `ns/name` (container `id`) with `ips`, for unit tests.
#[cfg(test)]
pub(crate) fn test_record(ns: &str, name: &str, id: &str, ips: Vec<IpAddr>) -> Record {
    Record {
        container_id: id.into(),
        ifname: "eth0".into(),
        netns: String::new(),
        host_veth: String::new(),
        host_ifindex: 1,
        host_mac: Default::default(),
        pod_mac: Default::default(),
        ips,
        mtu: 1500,
        headroom_requested: 256,
        headroom_effective: None,
        pod_namespace: ns.into(),
        pod_name: name.into(),
        deleting: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ns: &str, name: &str, id: &str) -> Record {
        test_record(ns, name, id, vec![])
    }

    #[test]
    fn no_record_is_an_orphan_before_the_first_complete_list() {
        let records = vec![rec("default", "a", "c1"), rec("", "", "c2")];
        assert!(orphans(&records, None).is_empty(), "nothing is known yet");
        let listed: HashSet<PodKey> = [("default".to_string(), "a".to_string())].into();
        let got: Vec<_> = orphans(&records, Some(&listed))
            .iter()
            .map(|r| r.container_id.clone())
            .collect();
        assert_eq!(got, vec!["c2"], "only the record no listed pod claims");
        assert_eq!(orphans(&records, Some(&HashSet::new())).len(), 2);
    }

    #[test]
    fn records_are_keyed_by_pod_or_container() {
        assert_eq!(
            pod_key(&rec("ns", "p", "c")),
            ("ns".to_string(), "p".to_string())
        );
        assert_eq!(pod_key(&rec("", "", "c")), (String::new(), "c".to_string()));
    }
}
