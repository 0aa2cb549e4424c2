//! The node's datapath and the agent's one writer of it, shared by the
//! standalone and the Kubernetes modes. The datapath owner
//! ([`crate::owner`]) holds the [`Reconciler`] on its thread and runs each
//! task's work on it, one job at a time; no other part of the agent can
//! reach it (`ebpf/tests/one_writer.rs` checks it). Who writes what, by
//! capability, each a module here asked by one task:
//!
//! | capability | what it writes | module | asked by |
//! | --- | --- | --- | --- |
//! | pods | a pod's hold, mode, endpoint records, links (through `crate::apply`) | `pods.rs` | the pod reconciles (`kube`, `standalone`) |
//! | the node | collection, NAT'd ports, the pins re-created | here | the node work (`daemon/node_work.rs`) |
//! | NetworkPolicy | the policy gate, the verdicts (`pol_*`) | `policy.rs` | the policy task (`kube/policies`) |
//! | Services | the socket programs, their maps and lease | `services.rs` | the Service task (`kube/services.rs`) |
//! | nets between nodes | `remote_nets`, the uplink programs | `remote.rs` | the routing pass (`routes/fast.rs`) |
//!
//! Synchronous: every method runs on the owner's thread.

mod pods;
mod policy;
mod remote;
mod services;

pub use policy::PolicyWant;
pub use remote::RemoteDone;
pub use services::ServicesSynced;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use tracing::{info, warn};
use xdpcni_ebpf::{Datapath, L4Proto, Services};
use xdpcni_host::{pod::XdpMode, state::Record};

use crate::{
    records::{link_exists, pod_key, Annotations, PodKey},
    status::Why,
    wish::{Problem, Wish},
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
    /// Devices the uplink program runs on for the fast path between nodes
    /// (the routes' pass; `None` until it has said) and for north-south
    /// Services (the Service writer's): it runs on their union.
    remote_uplinks: Option<Vec<u32>>,
    north_south_uplinks: Vec<u32>,
}

/// What the datapath a [`Reconciler::open`] found or made is: for the
/// log, the metrics and the status.
#[derive(Clone, Debug)]
pub struct Opened {
    /// Its build (the programs' tag).
    pub build: String,
    /// Whether this start moved the links to another build's programs.
    pub upgraded: bool,
    /// The migration from the previous layout this start made, if any.
    pub migration: Option<xdpcni_ebpf::Migration>,
    /// Each program's name and id.
    pub programs: Vec<(&'static str, u32)>,
}

impl Reconciler {
    /// Opens (or takes over, upgrades or migrates) the datapath pinned
    /// under `pin_dir`, a reconciler over it (see [`Reconciler::new`]), and
    /// what it is.
    pub fn open(
        pin_dir: &std::path::Path,
        defaults: Wish,
        online: u64,
        state_dir: std::path::PathBuf,
    ) -> Result<(Self, Opened), xdpcni_ebpf::Error> {
        let dp = Datapath::open_with(
            pin_dir,
            xdpcni_ebpf::DATAPATH_OBJECT,
            &mut xdpcni_host::hook::stop_point,
        )?;
        let build = dp.build().unwrap_or_default();
        info!(
            pin_dir = %pin_dir.display(),
            layout = xdpcni_ebpf::abi::LAYOUT,
            build,
            upgraded = dp.upgraded(),
            migrated_from = dp.migration().map(|m| m.from),
            program = dp.from_pod_program_id().unwrap_or(0),
            "datapath ready"
        );
        let opened = Opened {
            build,
            upgraded: dp.upgraded(),
            migration: dp.migration().cloned(),
            programs: dp.program_ids().unwrap_or_default(),
        };
        Ok((Self::new(dp, defaults, online, state_dir), opened))
    }

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
            remote_uplinks: None,
            north_south_uplinks: Vec::new(),
        }
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

#[cfg(test)]
mod tests;
