//! The health check node ports (`services.healthCheckNodePorts`): one HTTP
//! listener per port, on every address of the node as kube-proxy's (`[::]`,
//! which takes IPv4 too; `0.0.0.0` where the node has no IPv6), answering
//! any path as kube-proxy 1.20 answers it (`services::health`). The Service
//! task publishes what each port answers ([`Core::publish_health_checks`]);
//! a listener opens with its port's first publication and closes when its
//! Service goes. A port that cannot be bound (kube-proxy still holds it) is
//! said in the status and tried again at each publication and every
//! [`REBIND`].

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use axum::{
    extract::State,
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Router,
};
use tokio::{net::TcpListener, sync::watch};
use tracing::{info, warn};

use super::{Core, Shutdown};
use crate::{services::health::HealthCheck, status::HealthCheckStatus};

/// How often a port that could not be bound is tried again.
pub const REBIND: Duration = Duration::from_secs(10);

/// What every port answers now, by port.
pub type Published = watch::Sender<BTreeMap<u16, HealthCheck>>;

impl Core {
    /// Makes `checks` what the health check ports answer (a port in two
    /// Services, which the API server never allocates, keeps the first).
    pub fn publish_health_checks(&self, checks: Vec<HealthCheck>) {
        let mut by_port = BTreeMap::new();
        for c in checks {
            by_port.entry(c.port).or_insert(c);
        }
        self.health_checks.send_if_modified(|now| {
            let changed = *now != by_port;
            *now = by_port;
            changed
        });
    }

    /// Serves the published health checks until `shutdown`.
    pub fn serve_health_checks(self: &Arc<Self>, shutdown: Shutdown) {
        let core = Arc::clone(self);
        tokio::spawn(async move { core.health_check_listeners(shutdown).await });
    }

    async fn health_check_listeners(&self, shutdown: Shutdown) {
        let mut rx = self.health_checks.subscribe();
        let mut open: BTreeMap<u16, watch::Sender<bool>> = BTreeMap::new();
        let mut errors: BTreeMap<u16, String> = BTreeMap::new();
        loop {
            let want = rx.borrow_and_update().clone();
            open.retain(|port, stop| {
                let keep = want.contains_key(port);
                if !keep {
                    let _ = stop.send(true);
                    info!(port, "health check port closed");
                }
                keep
            });
            errors.retain(|port, _| want.contains_key(port));
            let closed: Vec<u16> = want
                .keys()
                .filter(|p| !open.contains_key(p))
                .copied()
                .collect();
            for port in closed {
                match bind(port).await {
                    Ok(listener) => {
                        info!(port, "health check port open");
                        errors.remove(&port);
                        open.insert(port, serve(listener, port, self.health_checks.subscribe()));
                    }
                    Err(e) => {
                        if errors.get(&port) != Some(&e) {
                            warn!(port, error = %e, "health check port not open; tried again");
                        }
                        errors.insert(port, e);
                    }
                }
            }
            let shown: Vec<HealthCheckStatus> = want
                .values()
                .map(|c| HealthCheckStatus::of(c, errors.get(&c.port).cloned()))
                .collect();
            self.view
                .book
                .update_services(|s| s.health_checks = Some(shown));
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { break },
                _ = tokio::time::sleep(REBIND), if !errors.is_empty() => {}
                _ = shutdown.clone().wait() => break,
            }
        }
        for stop in open.values() {
            let _ = stop.send(true);
        }
    }
}

/// A listener on `port` at every address: `[::]` (both families), else
/// `0.0.0.0`.
async fn bind(port: u16) -> Result<TcpListener, String> {
    match TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))).await {
        Ok(l) => Ok(l),
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
                .await
                .map_err(|e| format!("binding 0.0.0.0:{port}: {e}"))
        }
        Err(e) => Err(format!("binding [::]:{port}: {e}")),
    }
}

/// Serves `port` until the returned sender says stop.
fn serve(
    listener: TcpListener,
    port: u16,
    checks: watch::Receiver<BTreeMap<u16, HealthCheck>>,
) -> watch::Sender<bool> {
    let (stop, mut stopped) = watch::channel(false);
    let app = Router::new().fallback(answer).with_state((port, checks));
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = served {
            warn!(port, error = %e, "a health check port stopped");
        }
    });
    stop
}

/// Any request to a health check port: its Service's answer now.
async fn answer(
    State((port, checks)): State<(u16, watch::Receiver<BTreeMap<u16, HealthCheck>>)>,
) -> Response {
    let Some(check) = checks.borrow().get(&port).cloned() else {
        // Its Service went; the listener is closing.
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let status = StatusCode::from_u16(check.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    (
        status,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        check.body(),
    )
        .into_response()
}
