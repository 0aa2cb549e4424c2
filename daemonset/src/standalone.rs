//! Standalone mode: no Kubernetes. Each pod's annotations come from a local
//! JSON file (`podsFile`), read every `intervalMs` and whenever the CNI
//! writes or removes a record. A pass does per-pod work only when the file,
//! the records, a veth or a FORWARD rule changed, or [`NODE_RESYNC`](crate::daemon::NODE_RESYNC) after
//! the last full pass; then a live record is reconciled through the core
//! when it or its input (annotations, kernel-only) changed since its last
//! good reconcile, its veth is gone, a full map left it on kernel routing,
//! or [`RESYNC`] after it, and the node-wide work runs. There are no NetworkPolicies: the
//! policy gate lists no namespace, and a pod held at ADD (before the gate
//! was written) is released by its reconcile. Used by the demo and by runtimes
//! without Kubernetes.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use tracing::{info, warn, Instrument};
use xdpcni_host::state::Record;

use crate::{
    config::{read_pods_file, Config},
    daemon::{Core, PassChecks, Shutdown, RESYNC},
    reconciler::{PodInput, PolicyFacts},
    records::{is_live, pod_key, veth_present, Annotations},
};

/// Runs the standalone agent until SIGTERM/SIGINT. The datapath stays attached.
pub async fn run(cfg: Config) -> Result<()> {
    let shutdown = Shutdown::on_signals()?;
    let pods_file = cfg
        .pods_file
        .clone()
        .context("standalone mode needs podsFile")?;
    let interval = Duration::from_millis(cfg.interval_ms);
    let core = Core::open(cfg).await?;
    core.set_agent_mode("standalone", None);
    core.services_off(Some("standalone mode: no API server to read Services from"));
    core.serve(shutdown.clone()).await?;
    // No NetworkPolicies without Kubernetes: no pod is isolated, every pod
    // is classified (a pod held at ADD, before the gate was written, is
    // released by its reconcile).
    core.set_policy_facts(PolicyFacts::none(), &[]);
    let records_changed = Arc::new(tokio::sync::Notify::new());
    core.watch_records(vec![Arc::clone(&records_changed)])?;
    let mut node = Standalone {
        core,
        pods_file,
        pods: HashMap::new(),
        done: HashMap::new(),
        gated_generation: None,
        settled: None,
    };
    while !shutdown.is_set() {
        node.pass().await?;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = records_changed.notified() => {}
            _ = shutdown.clone().wait() => {}
        }
    }
    info!("stopping; the datapath stays attached");
    Ok(())
}

/// The standalone loop's state between passes.
struct Standalone {
    core: Arc<Core>,
    pods_file: std::path::PathBuf,
    /// The pods file as last read well: annotations by `ns/name` (or
    /// container ID).
    pods: HashMap<String, Annotations>,
    /// Each record's last good reconcile: the record and input it had, when.
    done: HashMap<String, (Record, PodInput, Instant)>,
    /// The records' generation the empty policy gate was written for.
    gated_generation: Option<u64>,
    /// The records' generation of the last pass that left every pod done.
    settled: Option<(u64, Instant)>,
}

impl Standalone {
    /// One pass: the checks, then (unless the pass is quiet) the gate, each
    /// pod that needs it, the node-wide work and readiness.
    async fn pass(&mut self) -> Result<()> {
        let pods_changed = self.read_pods();
        let core = Arc::clone(&self.core);
        let reloaded = core.ensure_pinned().await;
        if reloaded {
            // A fresh datapath: every pod is attached again, the gate too.
            self.done.clear();
            self.gated_generation = None;
        }
        let listing = core.listing();
        let records = Arc::clone(&listing.records);
        let vanished = records.iter().any(|r| is_live(r) && !veth_present(r));
        let forward = core.scan_forward(&records).await;
        let quiet = PassChecks {
            woken: pods_changed,
            reloaded,
            vanished,
            forward: &forward,
            generation: listing.generation,
            settled: self.settled,
        }
        .quiet();
        if quiet {
            core.idle_pass();
            return Ok(());
        }
        let live: Vec<Record> = records.iter().filter(|r| is_live(r)).cloned().collect();
        if self.gated_generation != Some(listing.generation) {
            // No policies here: new pods need no hold (one held before the
            // gate was written is released by its reconcile). A failure is
            // counted; the next pass retries.
            if core.write_gate(BTreeMap::new()).await.is_ok() {
                self.gated_generation = Some(listing.generation);
            }
        }
        let (failed, reconciled) = self.reconcile_pods(&live).await;
        let converged = !failed && core.all_converged(&records);
        core.node_work(&listing, None, reconciled || vanished).await;
        if converged {
            core.set_ready()?;
        }
        self.settled = (converged && self.done.len() == live.len())
            .then(|| (listing.generation, Instant::now()));
        Ok(())
    }

    /// Reads the pods file; whether it changed. An unreadable one keeps the
    /// last good one.
    fn read_pods(&mut self) -> bool {
        match read_pods_file(&self.pods_file) {
            Ok(p) => {
                let changed = p != self.pods;
                self.pods = p;
                changed
            }
            Err(e) => {
                warn!(error = %e, "pods file unreadable; keeping the last good one");
                false
            }
        }
    }

    /// Reconciles each live record whose record or input changed since its
    /// last good reconcile, whose veth is gone, that a full map left on
    /// kernel routing, or that [`RESYNC`] passed for. Returns (a reconcile
    /// failed, anything was reconciled).
    async fn reconcile_pods(&mut self, live: &[Record]) -> (bool, bool) {
        let (mut failed, mut reconciled) = (false, false);
        self.done
            .retain(|id, _| live.iter().any(|r| &r.container_id == id));
        for rec in live {
            let (ns, name) = pod_key(rec);
            let key = if ns.is_empty() {
                name.clone()
            } else {
                format!("{ns}/{name}")
            };
            let input = self
                .core
                .pod_input(rec, self.pods.get(&key).cloned().unwrap_or_default());
            if self.done.get(&rec.container_id).is_some_and(|(r, i, at)| {
                r == rec && *i == input && at.elapsed() < RESYNC && veth_present(rec)
            }) {
                continue;
            }
            // Standalone has no Events: the log and the counter carry problems.
            reconciled = true;
            let span = tracing::info_span!("reconcile", namespace = %ns, pod = %name);
            match self
                .core
                .reconcile_pod(rec.clone(), input.clone())
                .instrument(span)
                .await
            {
                Ok(outcome) if !outcome.map_full => {
                    self.done.insert(
                        rec.container_id.clone(),
                        (rec.clone(), input, Instant::now()),
                    );
                }
                Ok(_) => {
                    self.done.remove(&rec.container_id);
                }
                Err(_) => {
                    self.done.remove(&rec.container_id);
                    failed = true;
                }
            }
        }
        (failed, reconciled)
    }
}
