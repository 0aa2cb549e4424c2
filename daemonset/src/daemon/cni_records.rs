//! The CNI's records as the core reads them: from disk only when the state
//! directory changed, each unreadable file reported once, and inotify on the
//! directory to wake the modes at once.

use std::sync::{atomic::Ordering, Arc, PoisonError};

use anyhow::{Context, Result};
use tracing::warn;
use xdpcni_host::state::{self, Record};

use super::Core;
use crate::metrics::Stage;

impl Core {
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
}
