//! The core's HTTP side: what the agent shows ([`View`]: the book,
//! readiness), `/metrics`, `/healthz`, `/readyz` and `/v1/status` (axum),
//! and what `/v1/status` answers.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError,
    },
};

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

use xdpcni_host::state::Record;

use super::{Core, Shutdown};
use crate::{
    metrics::{DatapathReader, CONTENT_TYPE},
    records::is_live,
    status::{self, Book, Status},
};

/// What /metrics and /v1/status show, beside the metrics: what is in force
/// (the book), which records were reconciled, readiness, and the pinned
/// maps read without waiting for the datapath owner.
pub struct View {
    /// What is in force, read by /metrics and /v1/status.
    pub book: Arc<Book>,
    /// The pinned maps, read by scrapes and /v1/status.
    maps: Arc<dyn DatapathReader>,
    /// The datapath's fixed facts.
    datapath: status::DatapathStatus,
    /// `kubernetes` or `standalone`, and the node name.
    agent_mode: Mutex<(&'static str, Option<String>)>,
    /// Each record's last reconcile: whether it went well.
    converged: Mutex<HashMap<String, bool>>,
    ready: AtomicBool,
}

impl View {
    pub(super) fn new(
        book: Arc<Book>,
        maps: Arc<dyn DatapathReader>,
        datapath: status::DatapathStatus,
    ) -> Self {
        Self {
            book,
            maps,
            datapath,
            agent_mode: Mutex::new(("standalone", None)),
            converged: Mutex::new(HashMap::new()),
            ready: AtomicBool::new(false),
        }
    }

    pub(super) fn set_agent_mode(&self, mode: &'static str, node: Option<String>) {
        *self
            .agent_mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = (mode, node);
    }

    /// Notes how the last reconcile of record `container_id` went.
    pub(super) fn converged(&self, container_id: String, ok: bool) {
        self.converged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(container_id, ok);
    }

    /// Forgets every reconcile (a fresh datapath: each pod is attached again).
    pub(super) fn forget_converged(&self) {
        self.converged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Forgets the records `live` does not keep.
    pub(super) fn retain_converged(&self, live: impl Fn(&str) -> bool) {
        self.converged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|id, _| live(id));
    }

    pub(super) fn reconciled(&self, container_id: &str) -> bool {
        self.converged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(container_id)
    }

    pub(super) fn all_converged(&self, records: &[Record]) -> bool {
        let converged = self
            .converged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        records
            .iter()
            .filter(|r| is_live(r))
            .all(|r| converged.get(&r.container_id) == Some(&true))
    }

    /// Marks the node ready; whether it was not yet.
    pub(super) fn set_ready(&self) -> bool {
        !self.ready.swap(true, Ordering::Relaxed)
    }

    pub(super) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}

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
        let view = &self.view;
        let mut pods = view.book.pods();
        for p in &mut pods {
            let c = view.maps.counters(p.ifindex);
            p.counters = Some(status::Counts::of(&c));
        }
        let mut datapath = view.datapath.clone();
        datapath.maps = view
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
        let (agent_mode, node) = view
            .agent_mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut policies = view.book.policy();
        policies.known = self.policy_facts.borrow().is_some();
        let mut cross_node = view.book.cross_node();
        for u in &mut cross_node.uplinks {
            u.counters = Some(status::Counts::of(&view.maps.counters(u.ifindex)));
        }
        let mut services = view.book.services();
        if services.cgroup.is_some() {
            if let Ok(Some(st)) = xdpcni_ebpf::ServiceStats::read_pinned(&self.cfg.pin_dir) {
                services.translated = st.translated;
                services.no_backend = st.no_backend;
                services.nat_entries = st.nat_entries;
                services.nat_capacity = st.nat_capacity;
                services.nat_evictions = st.nat_evictions;
            }
        }
        services.served_by = services.who_serves();
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            agent_mode: agent_mode.into(),
            node,
            ready: view.is_ready(),
            last_node_pass: view.book.last_node_pass(),
            now: status::now(),
            datapath,
            defaults,
            policies,
            services,
            cross_node,
            unreadable_records: self.records.unreadable_count(),
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
    if core.view.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
