//! Kubernetes mode: a controller (kube-runtime's `Controller`) reconciles
//! each Pod bound to this node when it changes, when its NetworkPolicy
//! isolation changes (kernel-only when a policy isolates it), and when the
//! CNI writes its record; it reports refused values as Events on the pod.
//! The policy task ([`policies`]) enforces NetworkPolicies. A node task
//! (`node_task.rs`) does the node-wide work every `intervalMs`: routes to
//! the other nodes' pod CIDRs (host-gateway or through the VXLAN device,
//! [`crate::routes`]) and this node's published VTEP, the NAT'd ports, the
//! records no pod claims, collection. The Service task (`services.rs`)
//! keeps the Service maps the socket programs translate with. Nothing is
//! decided from a cache before its first complete list.
//!
//! How a pod's CNI ADD reaches the datapath, hop by hop:
//!
//! 1. The plugin holds the new pod and writes its record
//!    (`cni-plugin/src/plugin/add.rs`; `xdpcni_host::state`).
//! 2. inotify on the records directory wakes `feed_records` here
//!    (`crate::daemon::cni_records`), which hands the controller the pod of
//!    each record it has not seen.
//! 3. The controller runs `reconcile` here: once the policies are known,
//!    each record of the pod gets its input ([`Core::pod_input`]: its
//!    annotations, kernel-only, its hold from the policy facts).
//! 4. [`Core::reconcile_pod`] sends it to the datapath owner
//!    (`crate::owner`), whose thread runs `Reconciler::reconcile`
//!    (`crate::reconciler`): the hold released when the policy task
//!    classified the pod, then `crate::apply` writes its state through the
//!    datapath crate's verbs.
//!
//! Records no Pod object claims skip the controller: the node task
//! reconciles them with the node defaults.

mod node_task;
pub mod policies;
mod services;

use std::{collections::HashSet, net::IpAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Endpoints, Pod};
use kube::{
    runtime::{
        controller::{Action, Controller},
        events::{Event, EventType, Recorder, Reporter},
        reflector::{self, ObjectRef, Store},
        watcher, WatchStreamExt,
    },
    Api, Client, Resource, ResourceExt,
};
use tokio::sync::{mpsc, Notify};
use tracing::{debug, info, warn};
use xdpcni_host::state::Record;

use crate::{
    config::Config,
    daemon::{Core, NatWant, ReconcileError, Shutdown, RESYNC},
    metrics::Stage,
    records::{is_live, pod_key, PodKey},
};

use self::{
    node_task::{NodeTask, REPORTER},
    policies::PolicyTask,
    services::ServiceTask,
};

/// How soon a pod whose reconcile failed is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// The NAT'd ports: every Endpoints address with each port of its subset
/// (a Service backend: replies to a ClusterIP client must be un-DNATed),
/// a local pod's as `local`, any other's (with `remote`: the fast path
/// between nodes receives other nodes' backends' replies) as `others`; and
/// every container port of a local pod published as a hostPort.
pub fn nat_ports(
    records: &[xdpcni_host::state::Record],
    endpoints: &[Arc<Endpoints>],
    pods: &[Arc<Pod>],
    remote: bool,
) -> NatWant {
    let local: HashSet<IpAddr> = records.iter().flat_map(|r| r.ips.iter().copied()).collect();
    let proto = crate::services::model::proto;
    let mut want = NatWant::default();
    for ep in endpoints {
        for subset in ep.subsets.iter().flatten() {
            let addrs = subset
                .addresses
                .iter()
                .flatten()
                .chain(subset.not_ready_addresses.iter().flatten())
                .filter_map(|a| a.ip.parse::<IpAddr>().ok())
                .filter(|ip| remote || local.contains(ip));
            for ip in addrs {
                let out = if local.contains(&ip) {
                    &mut want.local
                } else {
                    &mut want.others
                };
                for port in subset.ports.iter().flatten() {
                    if let (Some(p), Ok(n)) =
                        (proto(port.protocol.as_deref()), u16::try_from(port.port))
                    {
                        out.insert((ip, p, n));
                    }
                }
            }
        }
    }
    for pod in pods {
        let ips: Vec<IpAddr> = records
            .iter()
            .filter(|r| {
                Some(r.pod_namespace.as_str()) == pod.metadata.namespace.as_deref()
                    && Some(r.pod_name.as_str()) == pod.metadata.name.as_deref()
            })
            .flat_map(|r| r.ips.iter().copied())
            .collect();
        let containers = pod.spec.iter().flat_map(|s| s.containers.iter());
        for port in containers.flat_map(|c| c.ports.iter().flatten()) {
            if port.host_port.is_none() {
                continue;
            }
            if let (Some(p), Ok(n)) = (
                proto(port.protocol.as_deref()),
                u16::try_from(port.container_port),
            ) {
                for ip in &ips {
                    want.local.insert((*ip, p, n));
                }
            }
        }
    }
    want
}

/// A reflector store of every object of kind `K`, fed by a watch in a task
/// of its own; each change wakes `changed`. Managed fields are dropped:
/// nothing reads them.
fn watch_all<K>(client: &Client, changed: &Arc<Notify>) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    drive(
        Api::<K>::all(client.clone()),
        watcher::Config::default(),
        Arc::clone(changed),
    )
}

/// A reflector store fed by a watch of `api` in a task of its own; each
/// change wakes `changed`. Managed fields are dropped: nothing reads them.
fn drive<K>(api: Api<K>, cfg: watcher::Config, changed: Arc<Notify>) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(api, cfg).modify(|o| o.managed_fields_mut().clear()),
    )
    .default_backoff();
    tokio::spawn(async move {
        stream
            .for_each(|ev| {
                match ev {
                    Ok(_) => changed.notify_one(),
                    Err(e) => warn!(error = %e, "watch error (retrying)"),
                }
                futures::future::ready(())
            })
            .await;
    });
    reader
}

/// The first hop of a pod's ADD into the agent: woken by inotify when the
/// CNI writes a record (`written`), hands the pod controller the pod of
/// each live record it has not seen yet. Runs until the controller stops.
async fn feed_records(
    core: Arc<Core>,
    written: Arc<Notify>,
    trigger: mpsc::Sender<ObjectRef<Pod>>,
) {
    let mut seen: HashSet<String> = HashSet::new();
    loop {
        written.notified().await;
        let records = core.records();
        for rec in records
            .iter()
            .filter(|r| is_live(r) && !r.pod_name.is_empty())
        {
            if !seen.insert(rec.container_id.clone()) {
                continue;
            }
            let pod = ObjectRef::new(&rec.pod_name).within(&rec.pod_namespace);
            if trigger.send(pod).await.is_err() {
                return;
            }
        }
        seen.retain(|id| records.iter().any(|r| &r.container_id == id));
    }
}

/// What every task of the Kubernetes mode gets (controller-rs's context):
/// the API client, the Event recorder, and the core (the datapath owner,
/// the records, the policy facts, the metrics and status).
pub(crate) struct Ctx {
    client: Client,
    recorder: Recorder,
    core: Arc<Core>,
}

/// A pod reconcile that failed (retried after [`RETRY`]).
#[derive(Debug, thiserror::Error)]
enum PodError {
    #[error(transparent)]
    Reconcile(#[from] ReconcileError),
}

/// One pod: its records' policy from its annotations and its NetworkPolicy
/// isolation, applied; refused values as an Event.
#[tracing::instrument(name = "reconcile", skip_all, fields(namespace = %pod.namespace().unwrap_or_default(), pod = %pod.name_any()))]
async fn reconcile(pod: Arc<Pod>, ctx: Arc<Ctx>) -> Result<Action, PodError> {
    let key: PodKey = (pod.namespace().unwrap_or_default(), pod.name_any());
    // Kernel-only is decided once the policies were put in force.
    ctx.core.policies_known().await;
    let records: Vec<Record> = ctx
        .core
        .records()
        .iter()
        .filter(|r| is_live(r) && pod_key(r) == key)
        .cloned()
        .collect();
    if records.is_empty() {
        // No network yet: the node task triggers this pod when the CNI
        // writes its record.
        return Ok(Action::await_change());
    }
    let mut next = RESYNC;
    for rec in records {
        let input = ctx.core.pod_input(&rec, pod.annotations().clone());
        let outcome = ctx.core.reconcile_pod(rec, input).await?;
        if !outcome.new_problems.is_empty() {
            publish_problems(&ctx.recorder, &ctx.core, &pod, &outcome.new_problems).await;
        }
        if outcome.map_full {
            // Room may come back at any time: look again soon.
            next = RETRY;
        }
    }
    Ok(Action::requeue(next))
}

/// A failed pod reconcile: counted by kind, retried after [`RETRY`].
fn error_policy(_pod: Arc<Pod>, error: &PodError, ctx: Arc<Ctx>) -> Action {
    let PodError::Reconcile(e) = error;
    ctx.core.metrics.retry(e.kind());
    warn!(%error, "pod reconcile failed; retrying");
    Action::requeue(RETRY)
}

/// The refused values and kernel refusals of a reconcile, as one
/// `XdpcniFallback` Event on the pod.
async fn publish_problems(
    recorder: &Recorder,
    core: &Core,
    pod: &Pod,
    problems: &[crate::wish::Problem],
) {
    let note = problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    publish(recorder, core, pod, "XdpcniFallback", &note).await;
}

/// Publishes a Warning Event about `pod` (notes cut to the API's 1000
/// characters); a failure is logged and counted, never fatal.
async fn publish(recorder: &Recorder, core: &Core, pod: &Pod, reason: &str, note: &str) {
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: "ApplyXdpPolicy".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &pod.object_ref(&())).await {
        warn!(error = %e, "could not publish the Event");
        core.metrics.error(Stage::Event);
    }
}

/// Runs the agent against the API server until SIGTERM/SIGINT.
pub async fn run(cfg: Config) -> Result<()> {
    let shutdown = Shutdown::on_signals()?;
    let node = cfg
        .node_name()
        .context("the node name: set nodeName in the config or NODE_NAME (downward API)")?;
    let routing = cfg.routing()?;
    info!(mode = %routing.mode, vni = routing.vni, port = routing.port, "routing between nodes");
    let client = Client::try_default()
        .await
        .context("connecting to the API server (in-cluster or KUBECONFIG)")?;
    let core = Core::open(cfg).await?;
    core.set_agent_mode("kubernetes", Some(node.clone()));
    core.serve(shutdown.clone()).await?;
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: REPORTER.into(),
            instance: Some(node.clone()),
        },
    );
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        recorder,
        core: Arc::clone(&core),
    });
    let controller = Controller::new(
        Api::<Pod>::all(client),
        watcher::Config::default().fields(&format!("spec.nodeName={node}")),
    );
    let (trigger, triggered) = mpsc::channel(1024);
    let (node_changed, policy_changed, written, services_changed) = (
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
    );
    // A CNI record written or removed wakes the record feed, the policy
    // task, the node task and the Service task at once.
    core.watch_records(vec![
        Arc::clone(&written),
        Arc::clone(&policy_changed),
        Arc::clone(&node_changed),
        Arc::clone(&services_changed),
    ])?;
    tokio::spawn(feed_records(Arc::clone(&core), written, trigger.clone()));
    let policy_task = PolicyTask::new(&ctx, trigger.clone(), policy_changed);
    let service_task = if core.config().services.translate {
        Some(ServiceTask::new(&ctx, node.clone(), services_changed))
    } else {
        core.services_off(None);
        None
    };
    let node_task = NodeTask::new(&ctx, node, controller.store(), trigger, node_changed);
    info!("watching this node's pods, network policies, namespaces, all pods, nodes, endpoints and services");
    let controller = controller
        .reconcile_on(tokio_stream::wrappers::ReceiverStream::new(triggered))
        .graceful_shutdown_on(shutdown.clone().wait())
        .run(reconcile, error_policy, ctx)
        .for_each(|done| async move {
            if let Err(e) = done {
                debug!(error = %e, "controller");
            }
        });
    let policy_shutdown = shutdown.clone();
    let policy = async move {
        if let Err(e) = policy_task.run(policy_shutdown).await {
            warn!(error = %e, "the NetworkPolicy task stopped");
        }
    };
    let services_shutdown = shutdown.clone();
    let services = async move {
        if let Some(task) = service_task {
            task.run(services_shutdown).await;
        }
    };
    let (_, _, _, node_result) =
        tokio::join!(controller, policy, services, node_task.run(shutdown));
    info!("stopping; the datapath stays attached");
    node_result
}

#[cfg(test)]
mod tests {
    use xdpcni_ebpf::L4Proto;

    use super::*;

    #[test]
    fn nat_ports_from_endpoints_and_host_ports() {
        let rec = |ns: &str, name: &str, ip: &str| {
            crate::records::test_record(ns, name, name, vec![ip.parse().unwrap()])
        };
        let records = vec![
            rec("default", "a", "10.1.0.2"),
            rec("default", "b", "10.1.0.3"),
        ];
        let eps: Vec<Arc<Endpoints>> = vec![Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": "svc", "namespace": "default" },
                "subsets": [{
                    "addresses": [{ "ip": "10.1.0.2" }, { "ip": "10.9.9.9" }],
                    "ports": [{ "port": 8080 }, { "port": 53, "protocol": "UDP" }, { "port": 9, "protocol": "SCTP" }],
                }],
            }))
            .unwrap(),
        )];
        let pods: Vec<Arc<Pod>> = vec![Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": "b", "namespace": "default" },
                "spec": { "containers": [{ "name": "c", "ports": [
                    { "containerPort": 80, "hostPort": 8000 },
                    { "containerPort": 81 },
                ] }] },
            }))
            .unwrap(),
        )];
        let got: Vec<_> = nat_ports(&records, &eps, &pods, false)
            .local
            .into_iter()
            .collect();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            got,
            vec![
                (ip("10.1.0.2"), L4Proto::Tcp, 8080),
                (ip("10.1.0.2"), L4Proto::Udp, 53),
                (ip("10.1.0.3"), L4Proto::Tcp, 80),
            ]
        );
        // With the fast path between nodes, other nodes' backends too.
        let all = nat_ports(&records, &eps, &pods, true);
        assert_eq!(all.local.len(), 3, "{all:?}");
        assert_eq!(all.others.len(), 2, "{all:?}");
        assert!(all.others.contains(&(ip("10.9.9.9"), L4Proto::Tcp, 8080)));
        assert!(all.others.contains(&(ip("10.9.9.9"), L4Proto::Udp, 53)));
        assert!(nat_ports(&records, &eps, &pods, false).others.is_empty());
    }
}
