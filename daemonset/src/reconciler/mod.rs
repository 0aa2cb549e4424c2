//! The node's datapath state and the two kinds of work on it, shared by the
//! standalone and the Kubernetes modes: reconciling one pod (its record from
//! the CNI, its wish, applied), and the node-wide work (NAT'd ports,
//! collecting what deleted pods left). Synchronous: callers run it on a
//! blocking thread, one at a time: the datapath owner ([`crate::owner`])
//! holds it, and no other part of the agent can reach it.

mod remote;

pub use remote::RemoteDone;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use tracing::{info, warn};
use xdpcni_ebpf::{abi::SvcAddr, Datapath, L4Proto, ServiceWant, Services, SVC_LEASE_SECS};
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

/// What the NetworkPolicy state says of the hold the CNI may have put on a
/// new pod at its ADD.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Hold {
    /// Leave it as it is: the pod is not classified yet (its Pod object, or
    /// the policies, are not known).
    #[default]
    Keep,
    /// Classified: its Pod is known and every policy that selects it is in
    /// force, so a hold goes.
    Release,
    /// The rules of a policy that selects it could not be put in force: it
    /// is held (fail closed) until they are.
    Hold,
}

/// What the NetworkPolicy state says of the node's pods, as the policy task
/// last published it (standalone mode: no policies, every pod classified).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyFacts {
    /// The local pods policies isolate, with the policies (`namespace/name`)
    /// that do.
    pub isolated: BTreeMap<PodKey, Vec<String>>,
    /// The records (container IDs) of the local pods the pass classified:
    /// their Pod object is known and the records were in the pass, so the
    /// rules it put in force cover their addresses. A record that came after
    /// the pass (a new pod, or one made again under the same name) is not
    /// classified until the next one: its hold stays.
    pub classified: BTreeSet<String>,
    /// Whether the rules of every policy are in force.
    pub in_force: bool,
    /// Every pod is classified (standalone mode, where no policy can select
    /// one).
    pub all_classified: bool,
    /// The isolated pods whose verdicts are in the datapath (the `pol_*`
    /// maps): they keep the fast path, which enforces their policies.
    pub in_datapath: BTreeSet<PodKey>,
}

impl PolicyFacts {
    /// No policies at all (standalone mode).
    pub fn none() -> Self {
        Self {
            in_force: true,
            all_classified: true,
            ..Self::default()
        }
    }

    /// The policies isolating pod `key`, if any.
    pub fn isolating(&self, key: &PodKey) -> Option<&Vec<String>> {
        self.isolated.get(key)
    }

    /// Whether the datapath enforces the policies isolating pod `key`.
    pub fn in_datapath(&self, key: &PodKey) -> bool {
        self.in_datapath.contains(key)
    }

    /// What these facts say of the hold of the pod `key` whose record is
    /// `container_id`: the one decision of who is held, for both modes.
    pub fn hold(&self, key: &PodKey, container_id: &str) -> Hold {
        if !self.in_force {
            return if self.isolated.contains_key(key) {
                Hold::Hold
            } else {
                Hold::Keep
            };
        }
        if self.all_classified || self.classified.contains(container_id) {
            Hold::Release
        } else {
            Hold::Keep
        }
    }

    /// The pods whose isolation, isolating policies or hold differ between
    /// `self` and `other`; `records` are the local (pod, container ID)s.
    pub fn changed(&self, other: &Self, records: &[(PodKey, String)]) -> BTreeSet<PodKey> {
        let mut out: BTreeSet<PodKey> = self
            .isolated
            .iter()
            .filter(|(k, v)| other.isolated.get(*k) != Some(*v))
            .chain(
                other
                    .isolated
                    .iter()
                    .filter(|(k, v)| self.isolated.get(*k) != Some(*v)),
            )
            .map(|(k, _)| k.clone())
            .collect();
        out.extend(
            records
                .iter()
                .filter(|(k, id)| self.hold(k, id) != other.hold(k, id))
                .map(|(k, _)| k.clone()),
        );
        out.extend(
            self.in_datapath
                .symmetric_difference(&other.in_datapath)
                .cloned(),
        );
        out
    }
}

/// What the agent knows of a pod beyond its record: the facts its reconcile
/// turns into its datapath state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodInput {
    /// Its annotations.
    pub annotations: Annotations,
    /// Kernel routing both ways, and why.
    pub kernel_only: Option<KernelOnly>,
    /// The policies isolating it, when the datapath enforces them (it
    /// keeps the fast path, flagged `EP_POLICY`).
    pub policy_in_datapath: Option<Vec<String>>,
    /// Its hold.
    pub hold: Hold,
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
fn why(wish: &Wish, pod: &PodInput, held: bool, applied: &Applied) -> Why {
    let annotations = &pod.annotations;
    let (code, text) = if held && pod.hold == Hold::Hold {
        (
            WhyCode::Held,
            "held: the rules of a NetworkPolicy that selects it are not in force (fail closed)"
                .to_string(),
        )
    } else if held {
        (
            WhyCode::Held,
            "held since its CNI ADD until the agent classifies it against the NetworkPolicies"
                .to_string(),
        )
    } else if let Some(k) = &pod.kernel_only {
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
    let text = match &pod.policy_in_datapath {
        Some(names) if !code.is_kernel_only() => format!(
            "{text}; fast path, NetworkPolicy {} enforced in the datapath",
            names.join(", ")
        ),
        _ => text,
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
    services: Option<Services>,
    /// The Service maps were written whole once: the lease may be renewed.
    services_synced: bool,
}

/// What one pass of the Service writer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServicesSynced {
    /// Frontends written or removed.
    pub writes: usize,
    /// Pod network namespaces added to and removed from translation.
    pub netns: (usize, usize),
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
            services: None,
            services_synced: false,
        }
    }

    /// Loads the Service programs with their maps pinned under `pin_dir`
    /// and attaches them to the cgroup v2 root `cgroup` through pinned
    /// links (moved to this build's programs where an earlier agent left
    /// them). From then on [`Reconciler::sync_services`] writes their maps.
    pub fn open_services(
        &mut self,
        pin_dir: &std::path::Path,
        cgroup: &std::path::Path,
    ) -> Result<(), xdpcni_ebpf::Error> {
        let mut s = Services::open(pin_dir)?;
        s.attach_pinned(pin_dir, cgroup)?;
        self.services = Some(s);
        Ok(())
    }

    /// Makes the Service maps hold `want` (frontend -> backends) for the
    /// sockets of the network namespaces `netns` (the node's pods): the
    /// namespaces first, so a new pod is translated as soon as its Services
    /// are, then the frontends in the writer's safe order.
    pub fn sync_services(
        &mut self,
        want: &BTreeMap<SvcAddr, ServiceWant>,
        netns: &crate::services::PodNamespaces,
    ) -> Result<ServicesSynced, xdpcni_ebpf::Error> {
        let Some(s) = self.services.as_mut() else {
            return Err(xdpcni_ebpf::Error::Invalid {
                what: "services",
                why: "the Service programs are not loaded".into(),
            });
        };
        let netns = s.sync_netns(netns)?;
        let writes = s.sync(want)?;
        // The maps are what the API says: the programs may translate on.
        s.renew_lease(SVC_LEASE_SECS)?;
        self.services_synced = true;
        Ok(ServicesSynced { writes, netns })
    }

    /// Renews the lease on the Service maps, if they were written whole
    /// once (until then the programs translate nothing).
    pub fn renew_services_lease(&mut self) -> Result<bool, xdpcni_ebpf::Error> {
        match self.services.as_mut() {
            Some(s) if self.services_synced => s.renew_lease(SVC_LEASE_SECS).map(|()| true),
            _ => Ok(false),
        }
    }

    /// Applies the wish of `pod` (annotations over the node defaults) to
    /// the pod of `rec`. A held pod (see `Hold`) is kept on
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
        let held = match self.hold(rec, pod.hold) {
            Ok(held) => held,
            Err(_) if being_deleted(&self.state_dir, rec) => return Ok(self.deleted(key, wish)),
            Err(e) => return Err(e.into()),
        };
        let kernel_only = pod.kernel_only.is_some() || held;
        let policy = !kernel_only && pod.policy_in_datapath.is_some();
        let applied = match apply(&mut self.dp, rec, &wish, kernel_only, policy) {
            Ok(a) => a,
            // Its DEL took the veth away meanwhile: the normal end of a
            // pod, not a failure to retry or report.
            Err(_) if being_deleted(&self.state_dir, rec) => return Ok(self.deleted(key, wish)),
            Err(e) => return Err(e),
        };
        if applied.changed {
            info!(mode = applied.mode.as_str(), kernel_only, held, "applied");
        }
        let why = why(&wish, pod, held, &applied);
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

    /// Brings the hold of the pod of `rec` to what `want` says: a
    /// classified pod's hold (the CNI's, at ADD) goes, and the pod takes
    /// kernel routing until the rest of its reconcile attaches its mode; a
    /// pod whose policies cannot be put in force is held (its records
    /// flagged kernel-only first). Whether it is held now.
    fn hold(&mut self, rec: &Record, want: Hold) -> Result<bool, xdpcni_ebpf::Error> {
        match want {
            Hold::Keep => {}
            Hold::Release => {
                if self.dp.release_hold(rec.host_ifindex)? {
                    info!(host_veth = %rec.host_veth, "hold released: the pod is classified");
                }
            }
            Hold::Hold => {
                if self
                    .dp
                    .hold_pod(rec.host_ifindex, &rec.host_veth, &rec.ips)?
                {
                    warn!(
                        host_veth = %rec.host_veth,
                        "held: the NetworkPolicy rules that select the pod are not in force"
                    );
                }
            }
        }
        Ok(self.dp.is_held(rec.host_ifindex))
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

    /// Makes the datapath's NetworkPolicy verdicts those of `want` (each
    /// isolated pod's addresses, verdicts and window end).
    pub fn sync_policy(
        &mut self,
        want: &[(Vec<IpAddr>, xdpcni_ebpf::PodVerdicts, u64)],
    ) -> Result<xdpcni_ebpf::PolicySynced, xdpcni_ebpf::Error> {
        let started = std::time::Instant::now();
        let done = self.dp.sync_policy(want)?;
        if done.written > 0 || done.removed > 0 {
            info!(
                written = done.written,
                removed = done.removed,
                generation = done.generation,
                ms = started.elapsed().as_secs_f64() * 1e3,
                "NetworkPolicy verdicts in the datapath"
            );
        }
        Ok(done)
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

#[cfg(test)]
mod tests;
