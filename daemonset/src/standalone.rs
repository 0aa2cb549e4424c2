//! Standalone mode: no Kubernetes. Each pod's annotations come from a local
//! JSON file (`podsFile`), read every `intervalMs` (there is no watch to wait
//! on); every live record is reconciled through the core, then the node-wide
//! work runs. Used by the demo and by runtimes without Kubernetes.

use std::{collections::HashMap, time::Duration};

use anyhow::{Context, Result};
use tracing::{info, warn, Instrument};

use crate::{
    config::{read_pods_file, Config},
    core::{Core, Shutdown},
    node::{is_live, pod_key, PodInput},
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
    core.serve(shutdown.clone()).await?;
    let mut pods = HashMap::new();
    while !shutdown.is_set() {
        match read_pods_file(&pods_file) {
            Ok(p) => pods = p,
            Err(e) => warn!(error = %e, "pods file unreadable; keeping the last good one"),
        }
        core.ensure_pinned().await;
        let records = core.records();
        core.scan_forward(&records).await;
        let mut failed = false;
        for rec in records.iter().filter(|r| is_live(r)) {
            let (ns, name) = pod_key(rec);
            let key = if ns.is_empty() {
                name.clone()
            } else {
                format!("{ns}/{name}")
            };
            let input = PodInput {
                annotations: pods.get(&key).cloned().unwrap_or_default(),
                kernel_only: core.is_blocked(&(ns.clone(), name.clone())),
            };
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
            _ = shutdown.clone().wait() => {}
        }
    }
    info!("stopping; the datapath stays attached");
    Ok(())
}
