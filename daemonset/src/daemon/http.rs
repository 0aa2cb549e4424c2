//! The core's HTTP side: `/metrics`, `/healthz`, `/readyz` and `/v1/status`
//! (axum), and what `/v1/status` answers.

use std::sync::{Arc, PoisonError};

use anyhow::{Context, Result};
use axum::{
    extract::State,
    http::{header, StatusCode},
    response::IntoResponse,
    routing::get,
    Router,
};
use tracing::warn;
use xdpcni_host::pod::online_cpus;

use super::{Core, Shutdown};
use crate::{
    metrics::CONTENT_TYPE,
    status::{self, Status},
};

impl Core {
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
