//! Standalone mode: no Kubernetes. Each pod's annotations come from a local
//! JSON file (`podsFile`), read every `intervalMs` and whenever the CNI
//! writes or removes a record; every live record is reconciled through the
//! core, then the node-wide work runs. There are no NetworkPolicies: the
//! policy gate lists no namespace, and a pod held at ADD (before the gate
//! was written) is released at once. Used by the demo and by runtimes
//! without Kubernetes.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use tracing::{info, warn, Instrument};

use crate::{
    config::{read_pods_file, Config},
    daemon::{Core, Shutdown},
    reconciler::{is_live, pod_key},
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
    // No NetworkPolicies without Kubernetes: no pod is isolated.
    core.set_isolated(Default::default());
    let records_changed = Arc::new(tokio::sync::Notify::new());
    core.watch_records(vec![Arc::clone(&records_changed)])?;
    let mut pods = HashMap::new();
    while !shutdown.is_set() {
        match read_pods_file(&pods_file) {
            Ok(p) => pods = p,
            Err(e) => warn!(error = %e, "pods file unreadable; keeping the last good one"),
        }
        core.ensure_pinned().await;
        // No policies here: new pods need no hold, and held ones are
        // classified already. (A failure is counted; the next pass retries.)
        let _ = core.write_gate(BTreeMap::new()).await;
        let records = core.records();
        let live: Vec<_> = records.iter().filter(|r| is_live(r)).cloned().collect();
        core.release(live).await;
        core.scan_forward(&records).await;
        let mut failed = false;
        for rec in records.iter().filter(|r| is_live(r)) {
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
            // Standalone has no Events: the log and the counter carry problems.
            let span = tracing::info_span!("reconcile", namespace = %ns, pod = %name);
            failed |= core
                .reconcile_pod(rec.clone(), input)
                .instrument(span)
                .await
                .is_err();
        }
        let converged = !failed && core.all_converged(&records);
        core.node_work(records, None).await;
        if converged {
            core.set_ready()?;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = records_changed.notified() => {}
            _ = shutdown.clone().wait() => {}
        }
    }
    info!("stopping; the datapath stays attached");
    Ok(())
}
