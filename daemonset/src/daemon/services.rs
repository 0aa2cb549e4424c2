//! The core's Services: the Service task (`kube/services.rs`) asks through
//! these for the socket programs to be loaded and their maps written (by the
//! datapath owner, `reconciler/services.rs`), and the status and metrics
//! follow each answer (`status/services.rs` keeps what the status says).

use std::{collections::BTreeSet, time::Instant};

use tracing::{info, warn};

use super::{answered, Core};
use xdpcni_ebpf::abi::SvcAddr;

use crate::{
    metrics::Stage, reconciler::Reconciler, services::model::Frontend, status::FrontendStatus,
};

impl Core {
    /// Loads the Service programs and attaches them to the cgroup v2 root
    /// under the config's `services.cgroup`: whether they are (if not,
    /// kube-proxy keeps every Service; the status and
    /// `xdpcni_reconcile_errors_total{stage="services"}` say so).
    pub async fn open_services(&self) -> bool {
        let opened = match xdpcni_ebpf::cgroup2_root(&self.cfg.services.cgroup) {
            Ok(root) => {
                let (pin_dir, cgroup) = (self.cfg.pin_dir.clone(), root.clone());
                answered(
                    self.owner
                        .run(move |r| r.open_services(&pin_dir, &cgroup))
                        .await,
                )
                .map(|()| root)
            }
            Err(e) => Err(e.to_string()),
        };
        let ok = match &opened {
            Ok(root) => {
                info!(cgroup = %root.display(), "Service programs attached");
                true
            }
            Err(e) => {
                warn!(error = %e, "Service translation off: every Service stays kube-proxy's");
                self.metrics.error(Stage::Services);
                false
            }
        };
        let opened = opened.map(|root| root.display().to_string());
        self.view.book.update_services(|s| s.opened(opened));
        ok
    }

    /// Says in the status that Service translation is off (the config, or
    /// a mode without an API server), and why.
    pub fn services_off(&self, why: Option<&str>) {
        let status = crate::status::ServicesStatus::off(self.cfg.services.translate, why);
        self.view.book.set_services(status);
    }

    /// Writes `frontends` into the Service maps for the sockets the
    /// config translates (`crate::services::scope`), through the datapath
    /// owner; `since` is when the change that asked for it was seen
    /// (`xdpcni_service_sync_seconds`). False if the write failed (counted,
    /// logged, in the status; retried by the caller).
    pub async fn sync_services(&self, frontends: Vec<Frontend>, since: Instant) -> bool {
        let (records, cfg) = (self.records(), self.cfg.services.clone());
        let (scope, frontends) = match tokio::task::spawn_blocking(move || {
            crate::services::scope(&records, frontends, &cfg)
        })
        .await
        {
            Ok(done) => done,
            Err(e) => {
                warn!(error = %e, "which sockets to translate");
                self.metrics.error(Stage::Services);
                return false;
            }
        };
        let (namespaces, node_sockets) = (scope.netns.len(), scope.node.is_some());
        let north_south = scope.uplinks.clone();
        // What the status will show once they are written.
        let shown: Vec<FrontendStatus> = frontends.iter().map(FrontendStatus::of).collect();
        let result = answered(
            self.owner
                .run(move |r| r.sync_services(&frontends, &scope))
                .await,
        );
        if let Ok(done) = &result {
            if !done.gone.is_empty() {
                self.close_gone_sockets(&done.gone).await;
            }
        }
        let ok = match &result {
            Ok(done) => {
                self.metrics
                    .service_sync
                    .observe(since.elapsed().as_secs_f64());
                if done.writes > 0 || done.netns != (0, 0) {
                    info!(
                        writes = done.writes,
                        netns_added = done.netns.0,
                        netns_removed = done.netns.1,
                        "Service maps updated"
                    );
                }
                true
            }
            Err(e) => {
                warn!(error = %e, "writing the Service maps failed; retrying");
                self.metrics.error(Stage::Services);
                false
            }
        };
        let synced = result.map(|_| (namespaces, node_sockets, north_south, shown));
        self.view.book.update_services(|s| s.synced(synced));
        ok
    }

    /// Closes the connected UDP sockets of this node's pods that the
    /// programs translated to a backend the maps no longer hold (`gone`:
    /// UDP frontend and backend pairs): the application sees
    /// `ECONNABORTED` and connects again, to a live backend. kube-proxy
    /// deletes the conntrack entries of such flows for the same reason: a
    /// connected socket would otherwise keep sending to the removed backend.
    async fn close_gone_sockets(&self, gone: &BTreeSet<(SvcAddr, SvcAddr)>) {
        let namespaces =
            crate::services::netns_paths(&self.records(), self.cfg.services.node_sockets);
        let backends: BTreeSet<SvcAddr> = gone.iter().map(|(_, b)| *b).collect();
        let found = match tokio::task::spawn_blocking(move || {
            crate::services::connected_to(&namespaces, &backends)
        })
        .await
        {
            Ok(found) => found,
            Err(e) => {
                warn!(error = %e, "listing the sockets a gone backend leaves");
                self.metrics.error(Stage::Services);
                return;
            }
        };
        if found.is_empty() {
            return;
        }
        let gone = gone.clone();
        let doomed = match answered(
            self.owner
                .run(move |r| r.translated_to_gone(found, &gone))
                .await,
        ) {
            Ok(d) => d,
            Err(e) => {
                warn!(error = %e, "which sockets a gone backend leaves");
                self.metrics.error(Stage::Services);
                return;
            }
        };
        let closed = match tokio::task::spawn_blocking(move || crate::services::close(doomed)).await
        {
            Ok(n) => n,
            Err(e) => {
                warn!(error = %e, "closing the sockets a gone backend leaves");
                self.metrics.error(Stage::Services);
                0
            }
        };
        if closed > 0 {
            info!(
                closed,
                "closed connected UDP sockets of gone Service backends"
            );
            self.metrics.sockets_closed.inc_by(closed as u64);
        }
    }

    /// Renews the lease on the Service maps (between full writes); a
    /// failure is logged and counted (the next full write renews it too).
    pub async fn renew_services_lease(&self) {
        if let Err(e) = answered(self.owner.run(Reconciler::renew_services_lease).await) {
            warn!(error = %e, "renewing the lease on the Service maps failed");
            self.metrics.error(Stage::Services);
        }
    }
}
