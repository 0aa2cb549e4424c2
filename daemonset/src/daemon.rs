//! The agent's core, shared by the standalone and the Kubernetes modes: the
//! datapath behind one lock, the metrics, readiness, the HTTP endpoints
//! (/metrics, /healthz, /readyz through axum) and the shutdown signal
//! (tokio's). A mode decides *when* to reconcile what (watch events, a
//! file); the core does the reconciling and reports it.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use axum::{
    extract::State,
    http::{header, StatusCode},
    response::IntoResponse,
    routing::get,
    Router,
};
use tokio::sync::watch;
use tracing::{info, warn};
use xdpcni_ebpf::{Datapath, L4Proto, Maps};
use xdpcni_host::{
    pod::online_cpus,
    state::{self, Record},
};

use crate::{
    apply::ApplyError,
    config::Config,
    forward,
    metrics::{DatapathReader, Metrics, Stage, CONTENT_TYPE},
    netpol::{model::Enforcement, Applied, Enforcer, NetpolError},
    reconciler::{Hold, KernelOnly, PodInput, PodOutcome, PolicyFacts, Reconciler},
    records::{is_live, pod_key, Annotations, PodKey},
    status::{self, Book, PodStatus, PolicyStatus, Status},
};

/// How often a converged pod is reconciled again without a change to it (a
/// watch event, a record, a pods-file entry): repairs drift (a program
/// detached by hand, a map entry removed). Both modes.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How often the node-wide work reads the datapath and the routes again
/// when nothing it depends on changed (records, NAT'd ports, Nodes).
pub const NODE_RESYNC: Duration = Duration::from_secs(30);

/// The input of the node-wide work's last run, and when.
struct NodeMemo {
    generation: u64,
    nat: Option<BTreeSet<(IpAddr, L4Proto, u16)>>,
    at: Instant,
}

impl NodeMemo {
    fn same_input(&self, other: &Self) -> bool {
        self.generation == other.generation && self.nat == other.nat
    }
}

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

/// The shared core.
pub struct Core {
    cfg: Config,
    reconciler: Mutex<Reconciler>,
    /// The metrics.
    pub metrics: Metrics,
    /// What is in force, read by /metrics and /v1/status.
    book: Arc<Book>,
    /// The pinned maps, read by scrapes and /v1/status without the
    /// reconciler's lock.
    maps: Arc<dyn DatapathReader>,
    /// The datapath's fixed facts, for /v1/status.
    datapath: status::DatapathStatus,
    /// `kubernetes` or `standalone`, and the node name.
    agent_mode: Mutex<(&'static str, Option<String>)>,
    /// The CNI's records, read again only when the state directory changed.
    records: Mutex<state::Cache>,
    /// What the node-wide work last ran over without an error.
    node_memo: Mutex<Option<NodeMemo>>,
    /// The generation of the listing whose unreadable files were reported.
    reported_generation: std::sync::atomic::AtomicU64,
    /// Record files that could not be read, as last listed.
    unreadable: Mutex<BTreeSet<String>>,
    /// Those first seen since [`Core::newly_unreadable`] was last asked
    /// (Kubernetes mode: each becomes an Event on the Node).
    newly_unreadable: Mutex<Vec<String>>,
    converged: Mutex<HashMap<String, bool>>,
    ready: AtomicBool,
    blocked: Mutex<Blocked>,
    enforcer: Mutex<Enforcer>,
    /// What the NetworkPolicy state says of the local pods (isolation,
    /// classification, whether the rules are in force), as the policy task
    /// last published it; `None` until the policies were first listed and
    /// applied (pod reconciles wait for it: kernel-only and holds are never
    /// decided from half a picture).
    policy_facts: watch::Sender<Option<PolicyFacts>>,
}

/// Pods named by FORWARD rules, and when the rules were last read.
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

/// A pod that could not be reconciled.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Applying its policy failed (it is retried).
    #[error("{0}")]
    Apply(#[from] ApplyError),
    /// The blocking task running it died.
    #[error("the reconcile task failed: {0}")]
    Task(String),
}

impl ReconcileError {
    /// The `kind` label of `xdpcni_reconcile_retries_total`.
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Apply(e) => e.kind(),
            Self::Task(_) => "task",
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
        let dp = Datapath::open_with(
            &cfg.pin_dir,
            xdpcni_ebpf::DATAPATH_OBJECT,
            &mut xdpcni_host::hook::stop_point,
        )
        .with_context(|| format!("opening the datapath at {}", cfg.pin_dir.display()))?;
        let build = dp.build().unwrap_or_default();
        info!(
            pin_dir = %cfg.pin_dir.display(),
            layout = xdpcni_ebpf::abi::LAYOUT,
            build,
            upgraded = dp.upgraded(),
            migrated_from = dp.migration().map(|m| m.from),
            program = dp.from_pod_program_id().unwrap_or(0),
            "datapath ready"
        );
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
        );
        metrics.set_datapath(xdpcni_ebpf::abi::LAYOUT, &build);
        let migration_seconds = dp.migration().map_or(0.0, |m| m.duration.as_secs_f64());
        metrics.migration.set(migration_seconds);
        let datapath = status::DatapathStatus {
            pin_dir: cfg.pin_dir.display().to_string(),
            layout: xdpcni_ebpf::abi::LAYOUT,
            build,
            programs: dp
                .program_ids()
                .unwrap_or_default()
                .into_iter()
                .map(|(name, id)| status::ProgramStatus {
                    name: name.into(),
                    id,
                })
                .collect(),
            maps: Vec::new(),
            migration_seconds,
        };
        let state_dir = cfg.state_dir.clone();
        Ok(Arc::new(Self {
            cfg,
            reconciler: Mutex::new(Reconciler::new(dp, defaults, online, state_dir)),
            metrics,
            book,
            maps,
            datapath,
            agent_mode: Mutex::new(("standalone", None)),
            records: Mutex::new(state::Cache::new(&records_dir)),
            node_memo: Mutex::new(None),
            reported_generation: std::sync::atomic::AtomicU64::new(0),
            unreadable: Mutex::new(BTreeSet::new()),
            newly_unreadable: Mutex::new(Vec::new()),
            converged: Mutex::new(HashMap::new()),
            ready: AtomicBool::new(false),
            blocked: Mutex::new(Blocked::default()),
            enforcer: Mutex::new(Enforcer::new()),
            policy_facts: watch::channel(None).0,
        }))
    }

    /// Puts `e` in force (one nftables transaction, on a blocking thread),
    /// timed and counted; `local` are the addresses of the node's pods. The
    /// policy metrics follow what is in force.
    pub async fn enforce(
        self: &Arc<Self>,
        e: Enforcement,
        local: BTreeSet<IpAddr>,
    ) -> Result<Applied, NetpolError> {
        let core = Arc::clone(self);
        let done = tokio::task::spawn_blocking(move || {
            let applied = core
                .enforcer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .apply(&e, &local);
            if let Ok(a) = &applied {
                if a.changed {
                    core.metrics.policy_apply.observe(a.seconds);
                }
                core.book.set_policy(PolicyStatus::of(&e, a.rules));
            }
            applied
        })
        .await;
        let applied = match done {
            Ok(r) => r,
            Err(e) => Err(NetpolError::Listing {
                what: "apply",
                why: format!("the apply task failed: {e}"),
            }),
        };
        if let Err(e) = &applied {
            warn!(error = %e, "NetworkPolicy rules not applied");
            self.metrics.error(Stage::Netpol);
        }
        applied
    }

    /// Publishes what the NetworkPolicy state says of the local pods (what
    /// pod reconciles read); returns those of `keys` whose isolation,
    /// isolating policies or hold changed.
    pub fn set_policy_facts(&self, now: PolicyFacts, keys: &[PodKey]) -> BTreeSet<PodKey> {
        let mut changed = BTreeSet::new();
        self.policy_facts.send_modify(|cur| {
            let before = cur.take().unwrap_or_default();
            changed = before.changed(&now, keys);
            *cur = Some(now);
        });
        changed
    }

    /// Says which mode the agent runs in (for /v1/status).
    pub fn set_agent_mode(&self, mode: &'static str, node: Option<String>) {
        *self
            .agent_mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = (mode, node);
    }

    /// What a reconcile of pod `key` needs beyond its record: `annotations`,
    /// whether (and why) it is kernel-only, and its hold. The one place the
    /// input is put together, for both modes.
    pub fn pod_input(&self, key: &PodKey, annotations: Annotations) -> PodInput {
        PodInput {
            annotations,
            kernel_only: self.kernel_only(key),
            hold: self
                .policy_facts
                .borrow()
                .as_ref()
                .map_or(Hold::Keep, |f| f.hold(key)),
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
            .and_then(|f| f.isolating(key))
        {
            return Some(KernelOnly::Policies(names.clone()));
        }
        self.blocked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pods
            .get(key)
            .map(|rule| KernelOnly::ForwardRule(rule.to_string()))
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Serves /metrics, /healthz and /readyz on the config's address until
    /// `shutdown`. Binds before returning, so a taken port fails the start.
    pub async fn serve(self: &Arc<Self>, shutdown: Shutdown) -> Result<()> {
        let listener = tokio::net::TcpListener::bind(&self.cfg.listen)
            .await
            .with_context(|| format!("listening on {}", self.cfg.listen))?;
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route(status::PATH, get(status_json))
            .with_state(Arc::clone(self));
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.wait())
                .await;
            if let Err(e) = served {
                warn!(error = %e, "the HTTP server stopped");
            }
        });
        Ok(())
    }

    /// The unreadable record files first seen since the last call (each
    /// `path: why`), for an Event: the file is kept for a human to look at.
    pub fn newly_unreadable(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .newly_unreadable
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// The CNI's attachment records (counted as a `records` error when the
    /// directory cannot be read, or a record in it: each unreadable file is
    /// logged once, and counted in /v1/status while it stays). Read from
    /// disk only when the state directory changed ([`state::Cache`]): every
    /// pod reconcile asks.
    pub fn records(&self) -> Arc<Vec<Record>> {
        self.listing().records
    }

    /// [`Core::records`] with the listing's generation, which moves when
    /// the records do.
    pub fn listing(&self) -> state::Listing {
        let got = self
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get();
        match got {
            Ok(listing) => {
                let seen = self
                    .reported_generation
                    .swap(listing.generation, Ordering::Relaxed);
                if seen != listing.generation {
                    self.note_unreadable(&listing.bad);
                }
                listing
            }
            Err(e) => {
                warn!(error = %e, "reading the CNI's records");
                self.metrics.error(Stage::Records);
                state::Listing::default()
            }
        }
    }

    /// Logs, counts and queues (for an Event) each unreadable file not seen
    /// in the previous listing.
    fn note_unreadable(&self, bad: &[String]) {
        let mut unreadable = self
            .unreadable
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut new = self
            .newly_unreadable
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for why in bad.iter().filter(|b| !unreadable.contains(*b)) {
            warn!(record = %why, "a CNI record cannot be read: its pod is left out");
            self.metrics.error(Stage::Records);
            // Bounded: standalone mode never asks.
            if new.len() < 64 {
                new.push(why.clone());
            }
        }
        *unreadable = bad.iter().cloned().collect();
    }

    /// What `/v1/status` answers: the book, the node's facts, and each pod's
    /// counters and each map's fill read now.
    pub fn status(&self) -> Status {
        let mut pods = self.book.pods();
        for p in &mut pods {
            let c = self.maps.counters(p.ifindex);
            p.counters = Some(status::Counts::of(&c));
        }
        let mut datapath = self.datapath.clone();
        datapath.maps = self
            .maps
            .fill()
            .into_iter()
            .map(|m| status::MapStatus {
                name: m.name.into(),
                entries: m.entries,
                capacity: m.capacity,
            })
            .collect();
        let defaults = self
            .cfg
            .defaults(online_cpus())
            .map(|d| status::Defaults {
                mode: d.mode.as_str().into(),
                redirect: d.redirect.as_str().into(),
                cpus: xdpcni_host::pod::format_cpu_list(d.cpu_mask),
            })
            .unwrap_or_default();
        let (agent_mode, node) = self
            .agent_mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut policies = self.book.policy();
        policies.known = self.policy_facts.borrow().is_some();
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            agent_mode: agent_mode.into(),
            node,
            ready: self.is_ready(),
            last_node_pass: self.book.last_node_pass(),
            now: status::now(),
            datapath,
            defaults,
            policies,
            unreadable_records: self
                .unreadable
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len(),
            pods,
        }
    }

    /// Reconciles one pod's record with `input` on a blocking thread: its
    /// policy applied, the metrics view updated, problems counted.
    pub async fn reconcile_pod(
        self: &Arc<Self>,
        rec: Record,
        input: PodInput,
    ) -> Result<PodOutcome, ReconcileError> {
        let core = Arc::clone(self);
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            core.reconcile_blocking(&rec, &input)
        })
        .await
        .map_err(|e| ReconcileError::Task(e.to_string()))?
    }

    fn reconcile_blocking(
        &self,
        rec: &Record,
        input: &PodInput,
    ) -> Result<PodOutcome, ReconcileError> {
        let started = Instant::now();
        let result = self
            .reconciler
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reconcile(rec, input);
        self.metrics.observe("pod", started.elapsed().as_secs_f64());
        let ok = result.is_ok();
        self.converged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(rec.container_id.clone(), ok);
        match result {
            Ok(outcome) => {
                let (namespace, name) = pod_key(rec);
                self.book.set_pod(PodStatus {
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
                });
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

    /// Runs `f` on the reconciler, on a blocking thread (it makes syscalls).
    async fn with_reconciler<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut Reconciler) -> T + Send + 'static,
    ) -> Result<T> {
        let core = Arc::clone(self);
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            f(&mut core
                .reconciler
                .lock()
                .unwrap_or_else(PoisonError::into_inner))
        })
        .await
        .context("the reconciler task failed")
    }

    /// Writes the policy gate the CNI reads (the namespaces that hold
    /// NetworkPolicies); a failure is counted, logged and returned.
    pub async fn write_gate(self: &Arc<Self>, namespaces: BTreeMap<String, u32>) -> Result<()> {
        let written = self
            .with_reconciler(move |r| r.write_gate(&namespaces))
            .await?;
        if let Err(e) = &written {
            warn!(error = %e, "writing the policy gate: every new pod is held until it works");
            self.metrics.error(Stage::Gate);
        }
        written.map(drop).map_err(Into::into)
    }

    /// Wakes every one of `targets` when the CNI writes or removes a record
    /// in the state directory (inotify), so an ADD reaches the agent at once
    /// rather than at the next `intervalMs`.
    pub fn watch_records(&self, targets: Vec<Arc<tokio::sync::Notify>>) -> Result<()> {
        use futures::StreamExt;
        use inotify::{Inotify, WatchMask};
        let dir = &self.cfg.state_dir;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let inotify = Inotify::init().context("inotify")?;
        inotify
            .watches()
            .add(
                dir,
                WatchMask::MOVED_TO | WatchMask::DELETE | WatchMask::CLOSE_WRITE,
            )
            .with_context(|| format!("watching {}", dir.display()))?;
        let mut events = inotify
            .into_event_stream([0u8; 4096])
            .context("inotify stream")?;
        tokio::spawn(async move {
            while let Some(ev) = events.next().await {
                match ev {
                    Ok(ev)
                        if ev
                            .name
                            .as_ref()
                            .is_some_and(|n| n.to_string_lossy().ends_with(".json")) =>
                    {
                        for t in &targets {
                            t.notify_one();
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        warn!(error = %e, "watching the records stopped; intervalMs only");
                        break;
                    }
                }
            }
        });
        Ok(())
    }

    /// Re-creates the datapath if its pins were removed; whether it did
    /// (every pod must then be reconciled). A failure is counted and
    /// retried at the next pass.
    pub async fn ensure_pinned(self: &Arc<Self>) -> bool {
        let core = Arc::clone(self);
        let done = tokio::task::spawn_blocking(move || {
            core.reconciler
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .ensure_pinned()
        })
        .await;
        match done {
            Ok(Ok(reloaded)) => {
                if reloaded {
                    self.metrics.reloads.inc();
                    *self
                        .node_memo
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = None;
                    self.converged
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clear();
                }
                reloaded
            }
            Ok(Err(e)) => {
                warn!(error = %e, "re-creating the datapath");
                self.metrics.error(Stage::Pins);
                false
            }
            Err(e) => {
                warn!(error = %e, "re-creating the datapath: task failed");
                self.metrics.error(Stage::Pins);
                false
            }
        }
    }

    /// The node-wide work over the records of `listing`: collection, and
    /// the NAT'd ports when `nat` is given. Forgets pods without a live
    /// record. What reads the datapath (collection, the NAT'd ports) runs
    /// only when the records, `nat` or `force` (a pod reconciled this
    /// pass: its veth may be gone) say something changed, or
    /// [`NODE_RESYNC`] after it last ran: an idle node reads no map.
    pub async fn node_work(
        self: &Arc<Self>,
        listing: &state::Listing,
        nat: Option<BTreeSet<(IpAddr, L4Proto, u16)>>,
        force: bool,
    ) {
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
        let core = Arc::clone(self);
        let done = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let mut reconciler = core
                .reconciler
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut clean = due;
            if due {
                if let Err(e) = reconciler.collect(&records) {
                    warn!(error = %e, "collecting deleted pods' leftovers");
                    core.metrics.error(Stage::Gc);
                    clean = false;
                }
            }
            if let Some(nat) = nat.filter(|_| due) {
                match reconciler.sync_nat_ports(&nat) {
                    Ok((0, 0)) => {}
                    Ok((added, removed)) => info!(added, removed, "NAT'd ports updated"),
                    Err(e) => {
                        warn!(error = %e, "NAT'd ports");
                        core.metrics.error(Stage::NatPorts);
                        clean = false;
                    }
                }
            }
            drop(reconciler);
            if clean {
                // Done without an error: nothing to do until the input changes.
                *core
                    .node_memo
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(memo);
            }
            let live: std::collections::HashSet<&str> = records
                .iter()
                .filter(|r| is_live(r))
                .map(|r| r.container_id.as_str())
                .collect();
            core.book.retain_pods(|id| live.contains(id));
            core.book.node_pass();
            core.converged
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|id, _| live.contains(id.as_str()));
            core.metrics
                .observe("node", started.elapsed().as_secs_f64());
        })
        .await;
        if let Err(e) = done {
            warn!(error = %e, "node work task failed");
            self.metrics.error(Stage::Gc);
        }
    }

    /// A pass of the node task that found nothing to do: the status's last
    /// node pass moves all the same.
    pub fn idle_pass(&self) {
        self.book.node_pass();
    }

    /// Reads the node's FORWARD rules when `forwardScanMs` has passed since
    /// the last read, and returns which pods they newly name or no longer
    /// name (the caller reconciles those).
    pub async fn scan_forward(self: &Arc<Self>, records: &[Record]) -> BlockedChange {
        let every = self.cfg.forward_scan_ms;
        let due = every > 0
            && self
                .blocked
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
        let mut blocked = self.blocked.lock().unwrap_or_else(PoisonError::into_inner);
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
        self.metrics
            .forward_rule_pods
            .set(i64::try_from(now.len()).unwrap_or(i64::MAX));
        blocked.pods = now;
        change
    }

    /// Whether every live record has been reconciled successfully.
    pub fn all_converged(&self, records: &[Record]) -> bool {
        let converged = self
            .converged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        records
            .iter()
            .filter(|r| is_live(r))
            .all(|r| converged.get(&r.container_id) == Some(&true))
    }

    /// Marks the node ready (once): /readyz answers 200, `xdpcni_ready` is 1
    /// and the CNI's ready file is written.
    pub fn set_ready(&self) -> Result<()> {
        if self.ready.swap(true, Ordering::Relaxed) {
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

    /// Whether the node was reconciled.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}

async fn metrics(State(core): State<Arc<Core>>) -> impl IntoResponse {
    match core.metrics.render() {
        Ok(text) => (StatusCode::OK, [(header::CONTENT_TYPE, CONTENT_TYPE)], text),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            "encoding failed\n".to_string(),
        ),
    }
}

async fn status_json(State(core): State<Arc<Core>>) -> impl IntoResponse {
    let core2 = Arc::clone(&core);
    match tokio::task::spawn_blocking(move || core2.status()).await {
        Ok(s) => (StatusCode::OK, axum::Json(s)).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("status failed: {e}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(core): State<Arc<Core>>) -> impl IntoResponse {
    if core.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

#[cfg(test)]
mod tests {
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
