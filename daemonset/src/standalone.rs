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

use crate::{
    config::{read_pods_file, Config},
    daemon::{Core, PassChecks, Shutdown, RESYNC},
    reconciler::{PodInput, PolicyFacts},
    records::{is_live, pod_key, veth_present},
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
    core.serve(shutdown.clone()).await?;
    // No NetworkPolicies without Kubernetes: no pod is isolated, every pod
    // is classified (a pod held at ADD, before the gate was written, is
    // released by its reconcile).
    core.set_policy_facts(PolicyFacts::none(), &[]);
    let records_changed = Arc::new(tokio::sync::Notify::new());
    core.watch_records(vec![Arc::clone(&records_changed)])?;
    let mut pods = HashMap::new();
    // Each record's last good reconcile: the record and input it had, when.
    let mut done: HashMap<String, (xdpcni_host::state::Record, PodInput, Instant)> = HashMap::new();
    let mut gated_generation = None;
    // The records' generation of the last pass that left every pod done.
    let mut settled: Option<(u64, Instant)> = None;
    while !shutdown.is_set() {
        let mut pods_changed = false;
        match read_pods_file(&pods_file) {
            Ok(p) => {
                pods_changed = p != pods;
                pods = p;
            }
            Err(e) => warn!(error = %e, "pods file unreadable; keeping the last good one"),
        }
        let reloaded = core.ensure_pinned().await;
        if reloaded {
            // A fresh datapath: every pod is attached again, the gate too.
            done.clear();
            gated_generation = None;
        }
        let listing = core.listing();
        let records = Arc::clone(&listing.records);
        // Nothing changed since a pass that left every pod done, every veth
        // is there and no FORWARD rule changed: no per-pod work this pass.
        let vanished = records.iter().any(|r| is_live(r) && !veth_present(r));
        let forward = core.scan_forward(&records).await;
        let quiet = PassChecks {
            woken: pods_changed,
            reloaded,
            vanished,
            forward: &forward,
            generation: listing.generation,
            settled,
        }
        .quiet();
        if quiet {
            core.idle_pass();
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = records_changed.notified() => {}
                _ = shutdown.clone().wait() => {}
            }
            continue;
        }
        let live: Vec<_> = records.iter().filter(|r| is_live(r)).cloned().collect();
        if gated_generation != Some(listing.generation) {
            // No policies here: new pods need no hold (one held before the
            // gate was written is released by its reconcile). A failure is
            // counted; the next pass retries.
            if core.write_gate(BTreeMap::new()).await.is_ok() {
                gated_generation = Some(listing.generation);
            }
        }
        let (mut failed, mut reconciled) = (false, false);
        done.retain(|id, _| live.iter().any(|r| &r.container_id == id));
        for rec in &live {
            let (ns, name) = pod_key(rec);
            let key = if ns.is_empty() {
                name.clone()
            } else {
                format!("{ns}/{name}")
            };
            let input = core.pod_input(
                &(ns.clone(), name.clone()),
                pods.get(&key).cloned().unwrap_or_default(),
            );
            if done.get(&rec.container_id).is_some_and(|(r, i, at)| {
                r == rec && *i == input && at.elapsed() < RESYNC && veth_present(rec)
            }) {
                continue;
            }
            // Standalone has no Events: the log and the counter carry problems.
            reconciled = true;
            let span = tracing::info_span!("reconcile", namespace = %ns, pod = %name);
            match core
                .reconcile_pod(rec.clone(), input.clone())
                .instrument(span)
                .await
            {
                Ok(outcome) if !outcome.map_full => {
                    done.insert(
                        rec.container_id.clone(),
                        (rec.clone(), input, Instant::now()),
                    );
                }
                Ok(_) => {
                    done.remove(&rec.container_id);
                }
                Err(_) => {
                    done.remove(&rec.container_id);
                    failed = true;
                }
            }
        }
        let converged = !failed && core.all_converged(&records);
        core.node_work(&listing, None, reconciled || vanished).await;
        if converged {
            core.set_ready()?;
        }
        settled =
            (converged && done.len() == live.len()).then(|| (listing.generation, Instant::now()));
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = records_changed.notified() => {}
            _ = shutdown.clone().wait() => {}
        }
    }
    info!("stopping; the datapath stays attached");
    Ok(())
}
