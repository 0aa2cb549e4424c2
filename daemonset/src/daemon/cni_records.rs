//! The CNI's records as the agent reads them: from disk only when the state
//! directory changed, each unreadable file reported once, and inotify on the
//! directory to wake the agent's tasks the moment the CNI writes one.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
};

use anyhow::{Context, Result};
use tokio::sync::Notify;
use tracing::warn;
use xdpcni_host::state::{self, Record};

use crate::metrics::{Metrics, Stage};

/// The CNI's records of this node (the agent's one reader of them).
pub struct CniRecords {
    dir: PathBuf,
    cache: Mutex<state::Cache>,
    /// The generation of the listing whose unreadable files were reported.
    reported_generation: AtomicU64,
    /// Record files that could not be read, as last listed.
    unreadable: Mutex<BTreeSet<String>>,
    /// Those first seen since [`CniRecords::newly_unreadable`] was last
    /// asked (Kubernetes mode: each becomes an Event on the Node).
    newly_unreadable: Mutex<Vec<String>>,
}

impl CniRecords {
    /// The records in `dir`.
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            cache: Mutex::new(state::Cache::new(dir)),
            reported_generation: AtomicU64::new(0),
            unreadable: Mutex::new(BTreeSet::new()),
            newly_unreadable: Mutex::new(Vec::new()),
        }
    }

    /// The records (counted in `metrics` as a `records` error when the
    /// directory cannot be read, or a record in it: each unreadable file is
    /// logged once, and counted in /v1/status while it stays). Read from
    /// disk only when the state directory changed ([`state::Cache`]): every
    /// pod reconcile asks.
    pub fn records(&self, metrics: &Metrics) -> Arc<Vec<Record>> {
        self.listing(metrics).records
    }

    /// [`CniRecords::records`] with the listing's generation, which moves
    /// when the records do.
    pub fn listing(&self, metrics: &Metrics) -> state::Listing {
        let got = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get();
        match got {
            Ok(listing) => {
                let seen = self
                    .reported_generation
                    .swap(listing.generation, Ordering::Relaxed);
                if seen != listing.generation {
                    self.note_unreadable(&listing.bad, metrics);
                }
                listing
            }
            Err(e) => {
                warn!(error = %e, "reading the CNI's records");
                metrics.error(Stage::Records);
                state::Listing::default()
            }
        }
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

    /// How many record files could not be read at the last listing.
    pub fn unreadable_count(&self) -> usize {
        self.unreadable
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Logs, counts and queues (for an Event) each unreadable file not seen
    /// in the previous listing.
    fn note_unreadable(&self, bad: &[String], metrics: &Metrics) {
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
            metrics.error(Stage::Records);
            // Bounded: standalone mode never asks.
            if new.len() < 64 {
                new.push(why.clone());
            }
        }
        *unreadable = bad.iter().cloned().collect();
    }

    /// Wakes every one of `targets` when the CNI writes or removes a record
    /// (inotify), so an ADD reaches the agent at once rather than at the
    /// next `intervalMs`.
    pub fn watch(&self, targets: Vec<Arc<Notify>>) -> Result<()> {
        use futures::StreamExt;
        use inotify::{Inotify, WatchMask};
        let dir = &self.dir;
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
}
