//! The NetworkPolicy task of the Kubernetes mode: on every change of a
//! NetworkPolicy, a Namespace, a Pod anywhere in the cluster, or a CNI
//! record of this node, it works out what the policies mean for this
//! node's pods (`netpol::model`) and, in this order:
//!
//! 1. writes the policy gate (the namespaces with policies), so that from
//!    then on every new pod a policy may select is held at its ADD;
//! 2. writes the new verdicts of the pods the datapath checks already and
//!    will still check (the `pol_*` maps, compiled from the same model): a
//!    change reaches their fast-path flows without waiting for the rules;
//! 3. puts the rules in force (one nftables transaction);
//! 4. writes the verdicts of every isolated pod whose verdicts fit the
//!    datapath: those entering the check (after the rules, which hold their
//!    flows meanwhile) get theirs, those leaving it lose theirs;
//! 5. publishes the facts pod reconciles read ([`PolicyFacts`]: which pods
//!    policies isolate, which of them the datapath enforces, which are
//!    classified, whether the rules are in force); a failure is an Event on
//!    each policy involved;
//! 6. reconciles at once the pods whose isolation or hold the facts change
//!    (a newly isolated pod is flagged for the datapath's check, or goes
//!    kernel-only where its verdicts do not fit, a classified one's hold goes,
//!    a pod whose rules failed is held: fail closed), and hands the pod
//!    controller those whose reconcile failed, to retry. The task writes
//!    node-wide maps only (the gate, the verdicts: steps 1, 2 and 4, through
//!    the datapath owner, `reconciler/policy.rs`), never a pod's state: each
//!    pod's reconcile turns the facts into its hold, mode and records;
//! 7. deletes the conntrack entries of pods isolated anew, once their fast
//!    path traffic has drained (conntrack never saw what XDP carried).

mod early;
mod times;

pub use early::VerdictsOf;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use k8s_openapi::api::{
    core::v1::{Namespace, Pod},
    networking::v1::NetworkPolicy,
};
use kube::{
    runtime::{
        events::{Event, EventType, Recorder},
        reflector::{ObjectRef, Store},
    },
    Resource, ResourceExt,
};
use tokio::sync::{mpsc, Notify};
use tracing::{debug, info, warn};
use xdpcni_ebpf::is_held;
use xdpcni_host::state::Record;

use early::before_rules;
use times::{PassTimes, Step};

use crate::{
    daemon::{Core, Shutdown},
    metrics::Stage,
    netpol::{
        compile, forget_connections,
        model::{self, Cluster, LocalPod},
        Applied, Enforcer, NetpolError, SWITCH_WINDOW,
    },
    reconciler::{Hold, PolicyFacts},
    records::{is_live, pod_key, PodKey},
};

/// How long a packet the fast path took before a pod became kernel-only may
/// still be on its way (queued in a veth, a backlog, a cpumap): its
/// conntrack entries are deleted after that.
const FAST_PATH_DRAIN: Duration = Duration::from_millis(200);

/// What the policy task needs.
pub struct PolicyTask {
    /// The agent's core.
    pub core: Arc<Core>,
    /// Publishes Events.
    pub recorder: Recorder,
    /// Every NetworkPolicy.
    pub policies: Store<NetworkPolicy>,
    /// Every Namespace.
    pub namespaces: Store<Namespace>,
    /// Every Pod of the cluster.
    pub pods: Store<Pod>,
    /// Reconciles a pod of this node.
    pub trigger: mpsc::Sender<ObjectRef<Pod>>,
    /// Woken by the watches and by the CNI's records.
    pub changed: Arc<Notify>,
    /// The nftables table: the task's own, nothing else writes it.
    pub enforcer: Enforcer,
    /// Pods isolated anew while on the fast path, and when (CLOCK_MONOTONIC
    /// ns) their window closes in the datapath's check.
    pub windows: BTreeMap<PodKey, u64>,
    /// The pods whose verdicts the last pass put in the datapath.
    pub in_datapath: BTreeSet<PodKey>,
    /// What the datapath's verdict maps hold, pod by pod, as the last
    /// write left them; `None` when not known (before the first write,
    /// after a failed one).
    pub synced: Option<BTreeMap<PodKey, VerdictsOf>>,
}

impl PolicyTask {
    /// The task of `ctx`'s agent: watches of every NetworkPolicy, Namespace
    /// and Pod (peers are selected by labels anywhere) wake `changed`, as
    /// the CNI's records do; pods whose reconcile fails go to `trigger`.
    pub(super) fn new(
        ctx: &super::Ctx,
        trigger: mpsc::Sender<ObjectRef<Pod>>,
        changed: Arc<Notify>,
    ) -> Self {
        Self {
            core: Arc::clone(&ctx.core),
            recorder: ctx.recorder.clone(),
            policies: super::watch_all(&ctx.client, &changed),
            namespaces: super::watch_all(&ctx.client, &changed),
            pods: super::watch_all(&ctx.client, &changed),
            trigger,
            changed,
            enforcer: Enforcer::new(),
            windows: BTreeMap::new(),
            in_datapath: BTreeSet::new(),
            synced: None,
        }
    }

    /// Runs until `shutdown`, once the three watches have listed.
    pub async fn run(mut self, shutdown: Shutdown) -> Result<()> {
        let lists = async {
            self.policies.wait_until_ready().await?;
            self.namespaces.wait_until_ready().await?;
            self.pods.wait_until_ready().await
        };
        tokio::select! {
            listed = lists => listed.context("a policy watch closed before its first list")?,
            _ = shutdown.clone().wait() => return Ok(()),
        }
        info!("first lists complete: network policies, namespaces, pods");
        self.in_datapath = checked_before(&self.core);
        let interval = Duration::from_millis(self.core.config().interval_ms);
        // Policies whose failure was reported, so each failure is told once.
        let mut reported: HashSet<String> = HashSet::new();
        while !shutdown.is_set() {
            self.pass(&mut reported).await;
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = self.changed.notified() => {}
                _ = shutdown.clone().wait() => {}
            }
        }
        Ok(())
    }

    /// One pass: the steps of the module doc, in order.
    async fn pass(&mut self, reported: &mut HashSet<String>) {
        let core = &self.core;
        let records: Vec<Record> = core
            .records()
            .iter()
            .filter(|r| is_live(r))
            .cloned()
            .collect();
        let pods = self.pods.state();
        let mut times = PassTimes::start();
        let e = self.compute(&records, &pods);
        times.lap(Step::Model);
        // 1. New ADDs in these namespaces are held from here on.
        let _ = core.write_gate(e.namespaces.clone()).await;
        let local_ips: BTreeSet<IpAddr> =
            records.iter().flat_map(|r| r.ips.iter().copied()).collect();
        let compiled = self.compile(&e, &pods);
        times.lap(Step::Compile);
        // 2. The pods the datapath checks: their new verdicts at once.
        self.verdicts_before_rules(&e, &compiled).await;
        // 3. The rules.
        // Isolated pods the datapath checked that it will not any more.
        let leaving: BTreeSet<PodKey> = self
            .in_datapath
            .iter()
            .filter(|k| e.pods.contains_key(*k) && !compiled.iter().any(|(c, _)| c == *k))
            .cloned()
            .collect();
        let applied = self.enforce(&e, local_ips.clone(), leaving).await;
        times.lap(Step::Rules);
        // 4. Every isolated pod's verdicts, once the rules are in force.
        let in_datapath = match &applied {
            Ok(a) => self.datapath_verdicts(&e, a, compiled).await,
            Err(_) => BTreeSet::new(),
        };
        times.lap(Step::Datapath);
        let wrote = applied.as_ref().is_ok_and(|a| a.changed) || in_datapath != self.in_datapath;
        self.in_datapath.clone_from(&in_datapath);
        let core = &self.core;
        // 5. The facts every pod reconcile reads.
        let changed =
            core.set_policy_facts(facts(&e, &records, applied.is_ok(), in_datapath), &records);
        match &applied {
            Ok(_) => reported.clear(),
            Err(err) => self.report_failure(&e, &err.to_string(), reported).await,
        }
        // 6. The pods those facts change, reconciled at once.
        let failed = self.reconcile_changed(&records, &pods, changed).await;
        times.lap(Step::Reconcile);
        if wrote {
            times.log(e.pods.len());
        }
        // 7. Pods isolated anew: their conntrack entries, once drained.
        if let Ok(a) = &applied {
            let ips: BTreeSet<IpAddr> = records
                .iter()
                .filter(|r| a.newly_isolated.contains(&pod_key(r)))
                .flat_map(|r| r.ips.iter().copied())
                .collect();
            forget_after_drain(core, ips, local_ips);
        }
        for key in failed {
            if self
                .trigger
                .send(ObjectRef::new(&key.1).within(&key.0))
                .await
                .is_err()
            {
                return;
            }
        }
    }

    /// The verdicts of the isolated pods of `e` that the datapath may
    /// check: all that compile and whose mode (annotation or node default,
    /// `pods` the Pod objects) is a fast path, unless `policyDatapath` is
    /// off.
    fn compile(
        &self,
        e: &model::Enforcement,
        pods: &[Arc<Pod>],
    ) -> Vec<(PodKey, xdpcni_ebpf::PodVerdicts)> {
        let cfg = self.core.config();
        let online = xdpcni_host::pod::online_cpus();
        let Ok(defaults) = cfg.defaults(online) else {
            return Vec::new();
        };
        if !cfg.policy_datapath {
            return Vec::new();
        }
        let fast = |key: &PodKey| {
            let annotations = pods
                .iter()
                .find(|p| p.namespace().as_deref() == Some(key.0.as_str()) && p.name_any() == key.1)
                .map(|p| p.annotations().clone())
                .unwrap_or_default();
            crate::wish::resolve(&annotations, &defaults, online).0.mode
                != xdpcni_host::pod::XdpMode::Off
        };
        compile::compile(e)
            .into_iter()
            .filter(|(key, _)| fast(key))
            .filter_map(|(key, v)| match v {
                Ok(v) => Some((key, v)),
                Err(why) => {
                    debug!(pod = %format!("{}/{}", key.0, key.1), %why, "kernel path: verdicts do not fit");
                    None
                }
            })
            .collect()
    }

    /// Writes the `compiled` verdicts of the pods of `e` into the datapath
    /// (the others' go) and returns those pods: the datapath enforces their
    /// policies from the next reconcile. A pod isolated anew (`a`) gets a
    /// window: its flows so far ran unchecked on the fast path, so for
    /// [`SWITCH_WINDOW`] a new UDP flow of it must be allowed whichever end
    /// began it.
    async fn datapath_verdicts(
        &mut self,
        e: &model::Enforcement,
        a: &Applied,
        compiled: Vec<(PodKey, xdpcni_ebpf::PodVerdicts)>,
    ) -> BTreeSet<PodKey> {
        let now = xdpcni_ebpf::monotonic_ns().unwrap_or(0);
        let window = u64::try_from(SWITCH_WINDOW.as_nanos()).unwrap_or(u64::MAX);
        for k in &a.newly_isolated {
            self.windows.insert(k.clone(), now.saturating_add(window));
        }
        self.windows
            .retain(|k, until| *until > now && e.pods.contains_key(k));
        let want: Vec<(PodKey, VerdictsOf)> = compiled
            .into_iter()
            .map(|(key, v)| {
                let until = self.windows.get(&key).copied().unwrap_or(0);
                let addrs = e.pods[&key].addrs.clone();
                (key, (addrs, v, until))
            })
            .collect();
        let written = self.write_verdicts(want).await;
        written.map(|w| w.into_keys().collect()).unwrap_or_default()
    }

    /// Step 2: the new verdicts of the pods the datapath checks and will
    /// still check (in the last pass's check, compiled now, same
    /// addresses), before the rules change: their fast-path flows follow
    /// the change without waiting for the nftables transaction. Each path
    /// enforces a version of the policies at every moment: the datapath
    /// the new one a transaction earlier. Every other pod keeps what the
    /// maps hold (a pod entering or leaving the check is switched after the
    /// rules, step 4). Nothing is written when what the maps hold is not
    /// known, or nothing changed.
    async fn verdicts_before_rules(
        &mut self,
        e: &model::Enforcement,
        compiled: &[(PodKey, xdpcni_ebpf::PodVerdicts)],
    ) {
        let Some(synced) = &self.synced else { return };
        if let Some(want) = before_rules(synced, &self.in_datapath, e, compiled) {
            let _ = self.write_verdicts(want).await;
        }
    }

    /// Makes the datapath's verdicts `want` and keeps what the maps then
    /// hold ([`Self::synced`]): the pods written, without those a full map
    /// refused. `None` when the write failed.
    async fn write_verdicts(
        &mut self,
        want: Vec<(PodKey, VerdictsOf)>,
    ) -> Option<BTreeMap<PodKey, VerdictsOf>> {
        let entries: Vec<VerdictsOf> = want.iter().map(|(_, v)| v.clone()).collect();
        let Ok(done) = self.core.sync_policy(entries).await else {
            self.synced = None;
            return None;
        };
        let failed: BTreeSet<&IpAddr> = done.failed.iter().flat_map(|(a, _)| a).collect();
        let held: BTreeMap<PodKey, VerdictsOf> = want
            .into_iter()
            .filter(|(_, (addrs, _, _))| !addrs.iter().any(|ip| failed.contains(ip)))
            .collect();
        self.synced = Some(held.clone());
        Some(held)
    }

    /// What the policies mean for this node's pods of `records`.
    fn compute(&self, records: &[Record], pods: &[Arc<Pod>]) -> model::Enforcement {
        let local: Vec<LocalPod> = records
            .iter()
            .filter(|r| !r.pod_name.is_empty())
            .map(|r| LocalPod {
                key: pod_key(r),
                ips: r.ips.clone(),
            })
            .collect();
        let (policies, namespaces) = (self.policies.state(), self.namespaces.state());
        model::compute(
            &Cluster {
                policies: &policies,
                namespaces: &namespaces,
                pods,
            },
            &local,
        )
    }

    /// Reconciles at once the pods of `records` in `changed` (their
    /// isolation or hold moved) and the held pods whose hold the facts now
    /// decide: a pod isolated anew leaves the fast path before its conntrack
    /// entries go, one whose rules failed is held, a classified one
    /// released. Returns the pods whose reconcile failed: the controller
    /// retries them.
    async fn reconcile_changed(
        &self,
        records: &[Record],
        pods: &[Arc<Pod>],
        changed: BTreeSet<PodKey>,
    ) -> BTreeSet<PodKey> {
        let core = &self.core;
        let pin_dir = &core.config().pin_dir;
        let due: Vec<&Record> = records
            .iter()
            .filter(|r| {
                changed.contains(&pod_key(r))
                    || (is_held(pin_dir, r.host_ifindex) && core.hold_of(r) != Hold::Keep)
            })
            .collect();
        let mut failed = BTreeSet::new();
        for rec in due {
            let key = pod_key(rec);
            let pod = pods.iter().find(|p| {
                p.namespace().as_deref() == Some(key.0.as_str()) && p.name_any() == key.1
            });
            let annotations = pod.map(|p| p.annotations().clone()).unwrap_or_default();
            let input = core.pod_input(rec, annotations);
            // A failure is counted by the core; the pod's controller retries.
            match core.reconcile_pod(rec.clone(), input).await {
                Ok(outcome) => {
                    if let (Some(pod), false) = (pod, outcome.new_problems.is_empty()) {
                        super::publish_problems(&self.recorder, core, pod, &outcome.new_problems)
                            .await;
                    }
                }
                Err(_) => {
                    failed.insert(key);
                }
            }
        }
        failed
    }

    /// Puts `e` in force (one nftables transaction, on a blocking thread),
    /// timed and counted; `local` are the addresses of the node's pods.
    async fn enforce(
        &mut self,
        e: &model::Enforcement,
        local: BTreeSet<IpAddr>,
        leaving: BTreeSet<PodKey>,
    ) -> Result<Applied, NetpolError> {
        let mut enforcer = std::mem::take(&mut self.enforcer);
        let want = e.clone();
        let done = tokio::task::spawn_blocking(move || {
            let applied = enforcer.apply(&want, &local, &leaving);
            (enforcer, applied)
        })
        .await;
        let applied = match done {
            Ok((enforcer, applied)) => {
                self.enforcer = enforcer;
                applied
            }
            // A fresh enforcer reads the table in force again first.
            Err(err) => Err(NetpolError::Listing {
                what: "apply",
                why: format!("the apply task failed: {err}"),
            }),
        };
        match &applied {
            Ok(a) => self.core.policy_applied(e, a),
            Err(err) => {
                warn!(error = %err, "NetworkPolicy rules not applied");
                self.core.metrics.error(Stage::Netpol);
            }
        }
        applied
    }

    /// An Event on each policy that selects a pod of this node, once per
    /// failure: its rules could not be put in force, and its pods are held.
    async fn report_failure(
        &self,
        e: &model::Enforcement,
        error: &str,
        reported: &mut HashSet<String>,
    ) {
        let names: BTreeSet<&String> = e.pods.values().flat_map(|p| &p.policies).collect();
        for np in self.policies.state() {
            let key = format!("{}/{}", np.namespace().unwrap_or_default(), np.name_any());
            if !names.contains(&key) || !reported.insert(key) {
                continue;
            }
            let held: Vec<String> = e
                .pods
                .iter()
                .filter(|(_, p)| {
                    p.policies.contains(&format!(
                        "{}/{}",
                        np.namespace().unwrap_or_default(),
                        np.name_any()
                    ))
                })
                .map(|(k, _)| k.1.clone())
                .collect();
            let note = format!(
                "the rules of this policy could not be put in force on node {}: {error}; the pods \
                 it selects there are held (no traffic) until they are: {}",
                self.core.config().node_name().unwrap_or_default(),
                held.join(", ")
            );
            let event = Event {
                type_: EventType::Warning,
                reason: "XdpcniPolicyFailed".into(),
                note: Some(note.chars().take(1000).collect()),
                action: "EnforceNetworkPolicy".into(),
                secondary: None,
            };
            if let Err(err) = self.recorder.publish(&event, &np.object_ref(&())).await {
                warn!(error = %err, "could not publish the Event");
                self.core.metrics.error(Stage::Event);
            }
        }
    }
}

/// The facts of a pass over `records` whose rules are `in_force` or not:
/// who is isolated (and by which policies), which records are classified.
fn facts(
    e: &model::Enforcement,
    records: &[Record],
    in_force: bool,
    in_datapath: BTreeSet<PodKey>,
) -> PolicyFacts {
    PolicyFacts {
        isolated: e
            .pods
            .iter()
            .map(|(k, p)| (k.clone(), p.policies.iter().cloned().collect()))
            .collect(),
        classified: records
            .iter()
            .filter(|r| !r.pod_name.is_empty() && !e.unknown.contains(&pod_key(r)))
            .map(|r| r.container_id.clone())
            .collect(),
        in_force,
        all_classified: false,
        in_datapath,
    }
}

/// The live pods whose endpoint records in the pinned datapath carry
/// `EP_POLICY`: those the datapath checked before this agent started. The
/// set of pods in the datapath's check starts from them, so that a pod
/// leaving the check in the first pass (its mode changed while the agent
/// was down) is switched as a pod isolated anew: its window, its conntrack
/// entries forgotten. Unreadable maps give an empty set (as before).
fn checked_before(core: &Core) -> BTreeSet<PodKey> {
    let flagged: BTreeSet<IpAddr> = xdpcni_ebpf::Maps::open_pinned(&core.config().pin_dir)
        .and_then(|m| m.endpoints())
        .map(|eps| {
            eps.into_iter()
                .filter(|(_, info)| info.flags & xdpcni_ebpf::abi::EP_POLICY != 0)
                .map(|(ip, _)| ip)
                .collect()
        })
        .unwrap_or_default();
    core.records()
        .iter()
        .filter(|r| is_live(r) && r.ips.iter().any(|ip| flagged.contains(ip)))
        .map(pod_key)
        .collect()
}

/// Deletes the conntrack entries of `ips` (pods isolated anew) once what
/// the fast path carried for them has drained: made anew by their next
/// packet through the rules (see netpol::forget_connections).
fn forget_after_drain(core: &Arc<Core>, ips: BTreeSet<IpAddr>, local: BTreeSet<IpAddr>) {
    if ips.is_empty() {
        return;
    }
    let core = Arc::clone(core);
    tokio::spawn(async move {
        tokio::time::sleep(FAST_PATH_DRAIN).await;
        let ips2 = ips.clone();
        match tokio::task::spawn_blocking(move || forget_connections(&ips2, &local)).await {
            Ok(Ok(n)) => info!(
                ?ips,
                deleted = n,
                "conntrack entries the fast path left for newly isolated pods deleted"
            ),
            Ok(Err(e)) => {
                warn!(error = %e, "deleting the conntrack entries of newly isolated pods");
                core.metrics.error(Stage::Netpol);
            }
            Err(e) => warn!(error = %e, "the conntrack task failed"),
        }
    });
}
