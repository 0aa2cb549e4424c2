//! The agent's core, shared by the standalone and the Kubernetes modes: the
//! context every task of the agent gets, made of parts with one job each.
//! A mode decides *when* to reconcile what (watch events, a file); the core
//! does the reconciling and reports it.
//!
//! | part | job | file |
//! | --- | --- | --- |
//! | `owner` | the datapath's one writer: a thread that alone holds the reconciler and runs the jobs tasks send it (`Owner::run`) | `crate::owner` |
//! | `records` | the CNI's records: cached, unreadable ones reported, inotify wakes the tasks | `cni_records.rs` |
//! | `policy_facts` | what the NetworkPolicy state says of the local pods, as the policy task last published it | here |
//! | `forward` | the pods FORWARD rules name | `node_work.rs` |
//! | `view` | what /metrics and /v1/status show: the book, readiness | `http.rs` |
//! | `metrics` | the Prometheus registry | `crate::metrics` |
//!
//! The core writes no map itself: each of its datapath calls is one job for
//! the owner, whose answer it turns into the metrics and the status. The
//! node-wide work (collection, NAT'd ports, the quiet-pass test) is in
//! `node_work.rs`; the Services (the socket programs, their maps, the
//! status's Services part) in `services.rs`; the HTTP side (/metrics,
//! /healthz, /readyz, /v1/status) in `http.rs`.

mod cni_records;
mod health_checks;
mod http;
mod node_work;
mod services;

use cni_records::CniRecords;
pub use http::View;
pub use node_work::{BlockedChange, NatWant, PassChecks};
use node_work::{ForwardScan, NodeMemo};

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use tokio::sync::watch;
use tracing::{info, warn};
use xdpcni_ebpf::Maps;
use xdpcni_host::{
    pod::online_cpus,
    state::{self, Record},
};

use crate::{
    apply::ApplyError,
    config::Config,
    metrics::{DatapathReader, Metrics, Stage},
    netpol::{model::Enforcement, Applied, Enforcer},
    owner::{Owner, OwnerGone},
    reconciler::{Hold, KernelOnly, PodInput, PodOutcome, PolicyFacts, Reconciler},
    records::{pod_key, Annotations, PodKey},
    status::{self, Book, PodStatus, PolicyStatus},
};

/// How often a converged pod is reconciled again without a change to it (a
/// watch event, a record, a pods-file entry): repairs drift (a program
/// detached by hand, a map entry removed). Both modes.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How often the node-wide work reads the datapath and the routes again
/// when nothing it depends on changed (records, NAT'd ports, Nodes).
pub const NODE_RESYNC: Duration = Duration::from_secs(30);

/// Set once SIGTERM or SIGINT arrived.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// Listens for SIGTERM and SIGINT (tokio::signal).
    pub fn on_signals() -> Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => info!("SIGTERM"),
                _ = int.recv() => info!("SIGINT"),
            }
            let _ = tx.send(true);
        });
        Ok(Self(rx))
    }

    /// Resolves once the signal came.
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    /// Whether the signal came.
    pub fn is_set(&self) -> bool {
        *self.0.borrow()
    }
}

/// The shared core: the agent's context (see the module doc).
pub struct Core {
    cfg: Config,
    /// The datapath owner: the thread that alone holds the reconciler.
    owner: Owner,
    /// The CNI's records.
    records: CniRecords,
    /// What the NetworkPolicy state says of the local pods (isolation,
    /// classification, whether the rules are in force), as the policy task
    /// last published it; `None` until the policies were first listed and
    /// applied (pod reconciles wait for it: kernel-only and holds are never
    /// decided from half a picture).
    policy_facts: watch::Sender<Option<PolicyFacts>>,
    /// The pods FORWARD rules name.
    forward: ForwardScan,
    /// What the node-wide work last ran over without an error.
    node_memo: Mutex<Option<NodeMemo>>,
    /// The last write of the NAT'd ports went through whole: the fast path
    /// between nodes, whose receiving side trusts them for other nodes'
    /// Service backends, may be on.
    nat_synced: std::sync::atomic::AtomicBool,
    /// What the health check node ports answer (`services.healthCheckNodePorts`).
    health_checks: health_checks::Published,
    /// What /metrics and /v1/status show.
    view: View,
    /// The metrics.
    pub metrics: Metrics,
}

/// A pod that could not be reconciled.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Applying its policy failed (it is retried).
    #[error("{0}")]
    Apply(#[from] ApplyError),
    /// The datapath owner's thread is gone.
    #[error(transparent)]
    Owner(#[from] OwnerGone),
}

impl ReconcileError {
    /// The `kind` label of `xdpcni_reconcile_retries_total`.
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Apply(e) => e.kind(),
            // The label of the blocking task that ran reconciles before
            // the datapath owner did, kept for dashboards and alerts.
            Self::Owner(_) => "task",
        }
    }
}

impl Core {
    /// Opens (or takes over) the datapath at the config's pin directory.
    pub async fn open(cfg: Config) -> Result<Arc<Self>> {
        tokio::task::spawn_blocking(move || Self::open_blocking(cfg)).await?
    }

    fn open_blocking(cfg: Config) -> Result<Arc<Self>> {
        let records_dir = cfg.state_dir.clone();
        let online = online_cpus();
        let defaults = cfg.defaults(online)?;
        // The north-south NAT table at its configured size, before either
        // object that uses it is loaded (both reuse its pin).
        let nat = xdpcni_ebpf::make_nat_table(&cfg.pin_dir, cfg.services.nat_capacity)
            .with_context(|| {
                format!(
                    "making the north-south NAT table (services.natCapacity) under {}",
                    cfg.pin_dir.display()
                )
            })?;
        if nat != cfg.services.nat_capacity {
            warn!(
                configured = cfg.services.nat_capacity,
                size = nat,
                "the north-south NAT table was made with another size and keeps it (and its flows): services.natCapacity applies once it is made again (after xdpcni-agent uninstall)"
            );
        }
        let (reconciler, opened) =
            Reconciler::open(&cfg.pin_dir, defaults, online, cfg.state_dir.clone())
                .with_context(|| format!("opening the datapath at {}", cfg.pin_dir.display()))?;
        let build = opened.build.clone();
        // The scrape reads the counters through its own handle on the pins,
        // never waiting for a reconcile.
        let maps: Arc<dyn DatapathReader> = Arc::new(
            Maps::open_pinned(&cfg.pin_dir)
                .with_context(|| format!("opening the maps at {}", cfg.pin_dir.display()))?,
        );
        let book = Arc::new(Book::default());
        let metrics = Metrics::new(
            Arc::clone(&maps),
            Arc::clone(&book),
            Box::new(|| Enforcer::counters().unwrap_or_default()),
            {
                let pin_dir = cfg.pin_dir.clone();
                Box::new(move || xdpcni_ebpf::PolicyStats::read_pinned(&pin_dir).ok())
            },
            {
                let pin_dir = cfg.pin_dir.clone();
                Box::new(move || {
                    xdpcni_ebpf::ServiceStats::read_pinned(&pin_dir)
                        .ok()
                        .flatten()
                })
            },
        );
        metrics.set_datapath(xdpcni_ebpf::abi::LAYOUT, &build);
        let migration_seconds = opened
            .migration
            .as_ref()
            .map_or(0.0, |m| m.duration.as_secs_f64());
        metrics.migration.set(migration_seconds);
        let datapath = status::DatapathStatus {
            pin_dir: cfg.pin_dir.display().to_string(),
            layout: xdpcni_ebpf::abi::LAYOUT,
            build,
            programs: opened
                .programs
                .into_iter()
                .map(|(name, id)| status::ProgramStatus {
                    name: name.into(),
                    id,
                })
                .collect(),
            maps: Vec::new(),
            migration_seconds,
        };
        Ok(Arc::new(Self {
            owner: Owner::start(reconciler).context("starting the datapath owner's thread")?,
            records: CniRecords::new(&records_dir),
            policy_facts: watch::channel(None).0,
            forward: ForwardScan::default(),
            node_memo: Mutex::new(None),
            nat_synced: std::sync::atomic::AtomicBool::new(false),
            health_checks: watch::channel(Default::default()).0,
            view: View::new(book, maps, datapath),
            metrics,
            cfg,
        }))
    }

    /// Records that the NetworkPolicy rules of `e` were applied (`a`):
    /// the policy metrics and status follow what is in force.
    pub fn policy_applied(&self, e: &Enforcement, a: &Applied) {
        if a.changed {
            self.metrics.policy_apply.observe(a.seconds);
        }
        self.view.book.set_policy(PolicyStatus::of(e, a.rules));
    }

    /// Publishes what the NetworkPolicy state says of the local pods (what
    /// pod reconciles read); returns the pods of `records` whose isolation,
    /// isolating policies or hold changed.
    pub fn set_policy_facts(&self, now: PolicyFacts, records: &[Record]) -> BTreeSet<PodKey> {
        let ids: Vec<(PodKey, String)> = records
            .iter()
            .map(|r| (pod_key(r), r.container_id.clone()))
            .collect();
        let mut changed = BTreeSet::new();
        self.policy_facts.send_modify(|cur| {
            let before = cur.take().unwrap_or_default();
            changed = before.changed(&now, &ids);
            *cur = Some(now);
        });
        changed
    }

    /// What the policy facts say of the hold of the pod of `rec`.
    pub fn hold_of(&self, rec: &Record) -> Hold {
        self.policy_facts
            .borrow()
            .as_ref()
            .map_or(Hold::Keep, |f| f.hold(&pod_key(rec), &rec.container_id))
    }

    /// Says which mode the agent runs in (for /v1/status).
    pub fn set_agent_mode(&self, mode: &'static str, node: Option<String>) {
        self.view.set_agent_mode(mode, node);
    }

    /// What a reconcile of the pod of `rec` needs beyond the record: its
    /// `annotations`, whether (and why) it is kernel-only, and its hold. The
    /// one place the input is put together, for both modes.
    pub fn pod_input(&self, rec: &Record, annotations: Annotations) -> PodInput {
        let key = pod_key(rec);
        PodInput {
            annotations,
            kernel_only: self.kernel_only(&key),
            policy_in_datapath: self.policy_in_datapath(&key),
            hold: self.hold_of(rec),
        }
    }

    /// Waits until the policies were first put in force (at once in
    /// standalone mode, which has none).
    pub async fn policies_known(&self) {
        let mut rx = self.policy_facts.subscribe();
        let _ = rx.wait_for(Option::is_some).await;
    }

    /// Whether (and why) the pod must take the kernel path both ways: a
    /// NetworkPolicy isolates it, or a FORWARD rule names it.
    pub fn kernel_only(&self, key: &PodKey) -> Option<KernelOnly> {
        if let Some(names) = self
            .policy_facts
            .borrow()
            .as_ref()
            .filter(|f| !f.in_datapath(key))
            .and_then(|f| f.isolating(key))
        {
            return Some(KernelOnly::Policies(names.clone()));
        }
        self.forward.rule_of(key).map(KernelOnly::ForwardRule)
    }

    /// The policies isolating the pod `key` when the datapath enforces them.
    pub fn policy_in_datapath(&self, key: &PodKey) -> Option<Vec<String>> {
        self.policy_facts
            .borrow()
            .as_ref()
            .filter(|f| f.in_datapath(key))
            .and_then(|f| f.isolating(key))
            .cloned()
    }

    /// The datapath owner (the routing pass writes the fast path between
    /// nodes through it).
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Whether the last write of the NAT'd ports went through whole.
    pub fn nat_synced(&self) -> bool {
        self.nat_synced.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records what the last routing pass left of the fast path between
    /// nodes (status and metrics read it).
    pub fn set_cross_node(&self, s: crate::status::CrossNodeStatus) {
        self.view.book.set_cross_node(s);
    }

    /// The agent's config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Reconciles one pod's record with `input` (the datapath owner runs
    /// it): its wish applied, the status view updated, problems counted.
    pub async fn reconcile_pod(
        &self,
        rec: Record,
        input: PodInput,
    ) -> Result<PodOutcome, ReconcileError> {
        let started = Instant::now();
        let id = rec.container_id.clone();
        let job = rec.clone();
        let result = self.owner.run(move |r| r.reconcile(&job, &input)).await?;
        self.metrics.observe("pod", started.elapsed().as_secs_f64());
        self.view.converged(id, result.is_ok());
        match result {
            Ok(outcome) => {
                self.view.book.set_pod(pod_status(&rec, &outcome));
                self.metrics
                    .policy_problems
                    .inc_by(outcome.new_problems.len() as u64);
                Ok(outcome)
            }
            Err(e) => {
                warn!(error = %e, "apply failed");
                self.metrics.error(Stage::Apply);
                Err(e.into())
            }
        }
    }

    /// Writes the policy gate the CNI reads (the namespaces that hold
    /// NetworkPolicies); a failure is counted, logged and returned.
    pub async fn write_gate(&self, namespaces: BTreeMap<String, u32>) -> Result<()> {
        let written = self.owner.run(move |r| r.write_gate(&namespaces)).await?;
        if let Err(e) = &written {
            warn!(error = %e, "writing the policy gate: every new pod is held until it works");
            self.metrics.error(Stage::Gate);
        }
        written.map(drop).map_err(Into::into)
    }

    /// Makes the datapath's NetworkPolicy verdicts `want`; a failure is
    /// counted, logged and returned (the pods then stay on the kernel path).
    pub async fn sync_policy(
        &self,
        want: crate::reconciler::PolicyWant,
    ) -> Result<xdpcni_ebpf::PolicySynced> {
        let done = self.owner.run(move |r| r.sync_policy(&want)).await?;
        if let Err(e) = &done {
            warn!(error = %e, "writing the NetworkPolicy verdicts: their pods take the kernel path");
            self.metrics.error(Stage::Netpol);
        }
        done.map_err(Into::into)
    }

    /// Re-creates the datapath if its pins were removed; whether it did
    /// (every pod must then be reconciled). A failure is counted and
    /// retried at the next pass.
    pub async fn ensure_pinned(&self) -> bool {
        let failed = |e: &dyn std::fmt::Display| {
            warn!(error = %e, "re-creating the datapath");
            self.metrics.error(Stage::Pins);
            false
        };
        match self.owner.run(Reconciler::ensure_pinned).await {
            Ok(Ok(true)) => {
                self.metrics.reloads.inc();
                *self
                    .node_memo
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = None;
                self.view.forget_converged();
                true
            }
            Ok(Ok(false)) => false,
            Ok(Err(e)) => failed(&e),
            Err(e) => failed(&e),
        }
    }

    /// Whether every live record has been reconciled successfully.
    pub fn all_converged(&self, records: &[Record]) -> bool {
        self.view.all_converged(records)
    }

    /// Whether the record `container_id` was reconciled (well or not) since
    /// the datapath was opened or made anew.
    pub fn reconciled(&self, container_id: &str) -> bool {
        self.view.reconciled(container_id)
    }

    /// Marks the node ready (once): /readyz answers 200, `xdpcni_ready` is 1
    /// and the CNI's ready file is written.
    pub fn set_ready(&self) -> Result<()> {
        if !self.view.set_ready() {
            return Ok(());
        }
        self.metrics.ready.set(1);
        if let Some(f) = &self.cfg.ready_file {
            if let Some(dir) = f.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(f, b"ready\n").with_context(|| format!("writing {}", f.display()))?;
        }
        info!("node reconciled: ready");
        Ok(())
    }

    /// The CNI's records, read from disk only when they changed.
    pub fn records(&self) -> Arc<Vec<Record>> {
        self.records.records(&self.metrics)
    }

    /// The CNI's records with their generation, which moves when they do.
    pub fn listing(&self) -> state::Listing {
        self.records.listing(&self.metrics)
    }

    /// The unreadable record files first seen since the last call.
    pub fn newly_unreadable(&self) -> Vec<String> {
        self.records.newly_unreadable()
    }

    /// Wakes each of `targets` when the CNI writes or removes a record.
    pub fn watch_records(&self, targets: Vec<Arc<tokio::sync::Notify>>) -> Result<()> {
        self.records.watch(targets)
    }

    /// Reads the FORWARD rules when `forwardScanMs` passed since the last
    /// read: which pods they newly name or no longer name.
    pub async fn scan_forward(&self, records: &[Record]) -> BlockedChange {
        self.forward
            .scan(self.cfg.forward_scan_ms, records, &self.metrics)
            .await
    }
}

/// A datapath owner's answer as one result: its error, or that it stopped.
pub(super) fn answered<T>(
    r: Result<Result<T, xdpcni_ebpf::Error>, OwnerGone>,
) -> Result<T, String> {
    r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())
}

/// The status view of a pod's record after a reconcile.
fn pod_status(rec: &Record, outcome: &PodOutcome) -> PodStatus {
    let (namespace, name) = pod_key(rec);
    PodStatus {
        namespace,
        name,
        container_id: rec.container_id.clone(),
        ips: rec.ips.clone(),
        host_veth: rec.host_veth.clone(),
        ifindex: rec.host_ifindex,
        mode: outcome.mode.as_str().into(),
        wanted: outcome.wish.mode.as_str().into(),
        why: outcome.why.clone(),
        redirect: outcome.wish.redirect.as_str().into(),
        cpus: xdpcni_host::pod::format_cpu_list(outcome.wish.cpu_mask),
        problems: outcome.problems.iter().map(ToString::to_string).collect(),
        reconciled_at: status::now(),
        counters: None,
    }
}
