//! The Service task of the Kubernetes mode: keeps the Service maps (the
//! socket programs' frontends and backends, and the node's pod namespaces
//! they translate for) equal to what the API says, through the datapath
//! owner (the one writer). Backends come from EndpointSlices where the
//! server serves `discovery.k8s.io/v1`, from Endpoints on older servers.
//!
//! No window: until its first complete lists the task writes nothing (a
//! frontend not in the maps is kube-proxy's, never a wrong backend); after
//! them, each watch event is in the maps one pass later
//! (`xdpcni_service_sync_seconds`), a removed backend leaving the choice in
//! that pass. A failed write is retried on the next wake or after [`RETRY`].
//!
//! The writer holds a lease on the maps (`svc_lease`, renewed every
//! [`RENEW`]): an agent gone longer than it, or rolled back to a release
//! without these programs, leaves every Service to kube-proxy instead of
//! leaving backends chosen that may have gone.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use k8s_openapi::api::{
    core::v1::{Endpoints, Service},
    discovery::v1::EndpointSlice,
};
use kube::{runtime::reflector::Store, Client, ResourceExt};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::Ctx;
use crate::{
    daemon::{Shutdown, RESYNC},
    services::{
        health::{health_check, HealthCheck},
        model::{frontends, groups_from_endpoints, groups_from_slices, served, Frontend, Group},
    },
};

/// How soon a failed write of the maps is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// How often the lease on the maps is renewed between full writes: four
/// times within the lease, so a slow pass or two never lets it run out.
const RENEW: Duration = Duration::from_secs(xdpcni_ebpf::SVC_LEASE_SECS as u64 / 4);

/// The label an EndpointSlice names its Service with.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Where a Service's backends are read from.
enum Backends {
    /// `discovery.k8s.io/v1` EndpointSlices.
    Slices(Store<EndpointSlice>),
    /// `v1` Endpoints (servers before 1.21).
    Endpoints(Store<Endpoints>),
}

impl Backends {
    async fn wait_until_ready(&self) -> Result<()> {
        match self {
            Self::Slices(s) => s.wait_until_ready().await?,
            Self::Endpoints(s) => s.wait_until_ready().await?,
        }
        Ok(())
    }

    /// Each Service's endpoint groups, by (namespace, name).
    fn groups(&self) -> HashMap<(String, String), Vec<Group>> {
        let mut out: HashMap<(String, String), Vec<Group>> = HashMap::new();
        match self {
            Self::Slices(store) => {
                let mut by_service: HashMap<(String, String), Vec<Arc<EndpointSlice>>> =
                    HashMap::new();
                for s in store.state() {
                    if let Some(svc) = s.labels().get(SERVICE_NAME_LABEL) {
                        let key = (s.namespace().unwrap_or_default(), svc.clone());
                        by_service.entry(key).or_default().push(s);
                    }
                }
                for (key, slices) in by_service {
                    out.insert(key, groups_from_slices(slices.iter().map(|s| &**s)));
                }
            }
            Self::Endpoints(store) => {
                for ep in store.state() {
                    let key = (ep.namespace().unwrap_or_default(), ep.name_any());
                    out.insert(key, groups_from_endpoints(&ep));
                }
            }
        }
        out
    }
}

/// Whether the API server serves `discovery.k8s.io/v1` (1.21 and later).
async fn serves_slices(client: &Client) -> Result<bool> {
    match client.list_api_group_resources("discovery.k8s.io/v1").await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(e) => Err(e).context("asking the API server for discovery.k8s.io/v1"),
    }
}

/// The Service task.
pub(super) struct ServiceTask {
    ctx: Arc<Ctx>,
    node: String,
    services: Store<Service>,
    changed: Arc<Notify>,
}

impl ServiceTask {
    /// Starts the watch of Services; each change, and each CNI record
    /// written (`changed`), wakes the task. The watch of their backends
    /// starts in [`ServiceTask::run`], once the API server has said which
    /// kind it serves.
    pub(super) fn new(ctx: &Arc<Ctx>, node: String, changed: Arc<Notify>) -> Self {
        Self {
            ctx: Arc::clone(ctx),
            node,
            services: super::watch_all(&ctx.client, &changed),
            changed,
        }
    }

    /// The watch of the Services' backends: EndpointSlices, or Endpoints
    /// where the server has no `discovery.k8s.io/v1`. A server that does
    /// not answer is asked again after [`RETRY`] (kube-proxy's meanwhile);
    /// `None` at shutdown.
    async fn watch_backends(&self, shutdown: &Shutdown) -> Option<Backends> {
        let client = &self.ctx.client;
        loop {
            match serves_slices(client).await {
                Ok(true) => return Some(Backends::Slices(super::watch_all(client, &self.changed))),
                Ok(false) => {
                    return Some(Backends::Endpoints(super::watch_all(client, &self.changed)))
                }
                Err(e) => {
                    warn!(error = %e, "which Service backends the API server serves; asking again")
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY) => {}
                _ = shutdown.clone().wait() => return None,
            }
        }
    }

    /// What the maps should hold now: every frontend of every Service; and
    /// what the health check node ports answer.
    fn frontends(&self, backends: &Backends) -> (Vec<Frontend>, Vec<HealthCheck>) {
        let groups = backends.groups();
        let (mut out, mut checks): (Vec<Frontend>, Vec<HealthCheck>) = Default::default();
        let proxy_name = self.ctx.core.config().services.proxy_name.as_deref();
        for svc in self
            .services
            .state()
            .iter()
            .filter(|s| served(s, proxy_name))
        {
            let key = (svc.namespace().unwrap_or_default(), svc.name_any());
            let g = groups.get(&key).map(Vec::as_slice).unwrap_or_default();
            out.extend(frontends(svc, g, &self.node));
            checks.extend(health_check(svc, g, &self.node));
        }
        out.sort();
        checks.sort();
        (out, checks)
    }

    /// Runs until shutdown: loads and attaches the programs, then after the
    /// first complete lists writes the maps on every wake.
    pub(super) async fn run(self, shutdown: Shutdown) {
        let core = &self.ctx.core;
        // Until the programs are attached, nothing is translated: retried
        // (a cgroup2 mount may come later), kube-proxy's meanwhile.
        while !core.open_services().await {
            tokio::select! {
                _ = tokio::time::sleep(RESYNC) => {}
                _ = shutdown.clone().wait() => return,
            }
        }
        let Some(backends) = self.watch_backends(&shutdown).await else {
            return;
        };
        // Node ports are served at every node address, to the node's own
        // sockets and to outside clients alike: both follow the addresses.
        let services = &core.config().services;
        if services.node_sockets || services.north_south() {
            follow_node_addresses(self.changed.clone());
        }
        if core.config().services.health_check_node_ports {
            core.serve_health_checks(shutdown.clone());
        }
        info!(
            source = match backends {
                Backends::Slices(_) => "EndpointSlices",
                Backends::Endpoints(_) => "Endpoints",
            },
            "Service backends"
        );
        let lists = async {
            self.services.wait_until_ready().await?;
            backends.wait_until_ready().await
        };
        tokio::select! {
            listed = lists => {
                if let Err(e) = listed {
                    warn!(error = %e, "a Service watch closed before its first list: translation stays as it was");
                    return;
                }
            }
            _ = shutdown.clone().wait() => return,
        }
        info!("first lists complete: Services and their backends");
        // A full write on every wake, after a failure, and every RESYNC;
        // between them the lease is renewed every RENEW.
        let (mut full, mut since, mut last_full, mut ok) =
            (true, Instant::now(), Instant::now(), true);
        while !shutdown.is_set() {
            if full {
                let (frontends, checks) = self.frontends(&backends);
                if core.config().services.health_check_node_ports {
                    core.publish_health_checks(checks);
                }
                ok = core.sync_services(frontends, since).await;
                last_full = Instant::now();
            } else {
                core.renew_services_lease().await;
            }
            tokio::select! {
                _ = tokio::time::sleep(if ok { RENEW } else { RETRY }) => {
                    full = !ok || last_full.elapsed() >= RESYNC;
                }
                _ = self.changed.notified() => full = true,
                _ = shutdown.clone().wait() => {}
            }
            since = Instant::now();
        }
    }
}

/// Wakes the writer whenever the kernel announces an address or a route
/// change in the node's namespace: node ports are served at every node
/// address, and the sources the node's calls keep are the routes'. A
/// thread of its own, blocked in the kernel; it ends with the process (or
/// when the socket fails: logged, and the 5-minute resync still follows).
fn follow_node_addresses(changed: Arc<Notify>) {
    let spawned = std::thread::Builder::new()
        .name("xdpcni-addresses".into())
        .spawn(move || {
            let mut announced = match xdpcni_host::netlink::address_and_route_announcements() {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "the node's addresses are followed at each resync only");
                    return;
                }
            };
            loop {
                if let Err(e) = announced.wait() {
                    warn!(error = %e, "the node's addresses are followed at each resync only");
                    return;
                }
                changed.notify_one();
            }
        });
    if let Err(e) = spawned {
        warn!(error = %e, "the node's addresses are followed at each resync only");
    }
}
