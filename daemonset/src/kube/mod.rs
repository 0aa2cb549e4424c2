//! Kubernetes mode: a controller (kube-runtime's `Controller`) reconciles
//! each Pod bound to this node when it changes, when its NetworkPolicy
//! isolation changes (kernel-only when a policy isolates it), and when the
//! CNI writes its record; it reports refused values as Events on the pod.
//! The policy task ([`policies`]) enforces NetworkPolicies. A node task does
//! the node-wide work every `intervalMs`: routes to the other nodes' pod
//! CIDRs (host-gateway or through the VXLAN device, [`crate::routes`]) and
//! this node's published VTEP, the NAT'd ports, the records no pod claims,
//! collection. Nothing is
//! decided from a cache before its first complete list.

pub mod policies;

use std::{
    collections::{BTreeSet, HashSet},
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::{
    core::v1::{Endpoints, Namespace, Node, Pod},
    networking::v1::NetworkPolicy,
};
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
use tracing::{debug, info, warn, Instrument};
use xdpcni_ebpf::L4Proto;
use xdpcni_host::state::Record;

use crate::{
    config::Config,
    daemon::{Core, PassChecks, ReconcileError, Shutdown, NODE_RESYNC, RESYNC},
    metrics::Stage,
    records::{is_live, orphans, pod_key, veth_present, PodKey},
    routes,
};

use self::policies::PolicyTask;

/// How many refused host-gateway routes of one pass become an Event each.
const UNREACHABLE_EVENTS: usize = 10;

/// How soon a pod whose reconcile failed is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// The NAT'd ports of this node's pods: every Endpoints address that is a
/// local pod, with each port of its subset (a Service backend: replies to a
/// ClusterIP client must be un-DNATed), and every container port published
/// as a hostPort.
pub fn nat_ports(
    records: &[xdpcni_host::state::Record],
    endpoints: &[Arc<Endpoints>],
    pods: &[Arc<Pod>],
) -> BTreeSet<(IpAddr, L4Proto, u16)> {
    let local: HashSet<IpAddr> = records.iter().flat_map(|r| r.ips.iter().copied()).collect();
    let proto = |p: Option<&str>| match p.unwrap_or("TCP") {
        "TCP" => Some(L4Proto::Tcp),
        "UDP" => Some(L4Proto::Udp),
        _ => None,
    };
    let mut out = BTreeSet::new();
    for ep in endpoints {
        for subset in ep.subsets.iter().flatten() {
            let addrs = subset
                .addresses
                .iter()
                .flatten()
                .chain(subset.not_ready_addresses.iter().flatten())
                .filter_map(|a| a.ip.parse::<IpAddr>().ok())
                .filter(|ip| local.contains(ip));
            for ip in addrs {
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
                    out.insert((*ip, p, n));
                }
            }
        }
    }
    out
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

/// What a pod reconcile needs.
struct Ctx {
    core: Arc<Core>,
    recorder: Recorder,
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
    let input = ctx.core.pod_input(&key, pod.annotations().clone());
    let mut next = RESYNC;
    for rec in records {
        let outcome = ctx.core.reconcile_pod(rec, input.clone()).await?;
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

/// Who the agent's Events say reported them.
const REPORTER: &str = "xdpcni-agent";

/// The namespace of the Events about this Node. Not through kube's
/// `Recorder`, which files a cluster-scoped object's Events in `default`:
/// API servers before 1.23 (and 1.20.12) take events.k8s.io Events about a
/// cluster-scoped object only in `kube-system`, which every version since
/// 1.19 accepts; `kubectl describe node` finds them there (it looks in
/// every namespace for an empty `regarding.namespace`).
const NODE_EVENTS_NAMESPACE: &str = "kube-system";

/// Creates a Warning Event about `node`, from this node's agent.
async fn publish_node_event(
    client: &Client,
    node: &Node,
    reason: &str,
    note: &str,
) -> kube::Result<()> {
    use k8s_openapi::{
        api::events::v1::Event as K8sEvent,
        apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
        jiff::Timestamp,
    };
    let now = Timestamp::now();
    let name = node.name_any();
    let event = K8sEvent {
        action: Some("ReadRecords".into()),
        reason: Some(reason.into()),
        note: Some(note.chars().take(1000).collect()),
        type_: Some("Warning".into()),
        event_time: Some(MicroTime(now)),
        regarding: Some(node.object_ref(&())),
        reporting_controller: Some(REPORTER.into()),
        reporting_instance: Some(name.clone()),
        metadata: ObjectMeta {
            name: Some(format!("{name}.{:x}", now.as_nanosecond())),
            namespace: Some(NODE_EVENTS_NAMESPACE.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<K8sEvent>::namespaced(client.clone(), NODE_EVENTS_NAMESPACE)
        .create(&kube::api::PostParams::default(), &event)
        .await
        .map(|_| ())
}

/// The node-wide work, once every cache has its first complete list, on each
/// change of a Node or Endpoints object and every `intervalMs` (new records,
/// resync): new records trigger their pods, records no pod claims get the
/// node defaults, then NAT'd ports, collection, routes, readiness.
struct NodeTask {
    ctx: Arc<Ctx>,
    client: Client,
    node: String,
    pods: Store<Pod>,
    nodes: Store<Node>,
    endpoints: Store<Endpoints>,
    trigger: mpsc::Sender<ObjectRef<Pod>>,
    changed: Arc<Notify>,
}

impl NodeTask {
    async fn run(self, shutdown: Shutdown) -> Result<()> {
        let lists = async {
            self.pods.wait_until_ready().await?;
            self.nodes.wait_until_ready().await?;
            self.endpoints.wait_until_ready().await
        };
        tokio::select! {
            listed = lists => listed.context("a watch cache closed before its first list")?,
            _ = shutdown.clone().wait() => return Ok(()),
        }
        self.ctx.core.policies_known().await;
        info!(node = %self.node, "first lists complete: pods, nodes, endpoints; policies in force");
        let (conn, netlink, _) = rtnetlink::new_connection().context("rtnetlink socket")?;
        tokio::spawn(conn);
        let interval = Duration::from_millis(self.ctx.core.config().interval_ms);
        let mut seen: HashSet<String> = HashSet::new();
        let mut router = routes::Router::new(self.ctx.core.config().routing()?);
        let mut full: Option<(u64, Instant)> = None;
        let mut woken = true;
        while !shutdown.is_set() {
            self.pass(&netlink, &mut seen, &mut router, &mut full, woken)
                .await?;
            woken = tokio::select! {
                _ = tokio::time::sleep(interval) => false,
                _ = self.changed.notified() => true,
                _ = shutdown.clone().wait() => false,
            };
        }
        Ok(())
    }

    /// An Event on this Node for each record file that has just become
    /// unreadable: its pod is out of the agent's view until a human looks
    /// (the file is kept, never deleted by the agent).
    async fn report_unreadable(&self) {
        let bad = self.ctx.core.newly_unreadable();
        if bad.is_empty() {
            return;
        }
        let Some(node) = self.nodes.get(&ObjectRef::new(&self.node)) else {
            warn!(node = %self.node, "no Node object to report unreadable records on");
            return;
        };
        for why in bad {
            let note = format!(
                "a CNI record of this node cannot be read, so the agent cannot reconcile \
                 its pod (mode, datapath maps) until it is fixed or the pod is deleted; \
                 the file is kept: {why}"
            );
            if let Err(e) =
                publish_node_event(&self.client, &node, "XdpcniUnreadableRecord", &note).await
            {
                warn!(error = %e, "could not publish the Event");
                self.ctx.core.metrics.error(Stage::Event);
            }
        }
    }

    /// After a routing pass: this node's VTEP published on its Node (or
    /// taken off), new warnings logged, each newly refused host-gateway
    /// route logged and reported as an Event on this Node, the gauges set.
    async fn routed(&self, o: &routes::Outcome) {
        let core = &self.ctx.core;
        core.metrics.set_node_routes(o.routes, o.unreachable);
        if let Some(r) = &o.report {
            if (r.added, r.removed) != (0, 0) {
                info!(
                    added = r.added,
                    removed = r.removed,
                    host_gateway = o.routes.0,
                    vxlan = o.routes.1,
                    "node routes updated"
                );
            }
        }
        if o.device_changed {
            info!(
                device = xdpcni_host::overlay::DEVICE,
                vtep = ?o.vtep,
                "VXLAN device {}",
                if o.vtep.is_some() { "made" } else { "removed" }
            );
        }
        for w in &o.warnings {
            warn!("{w}");
        }
        let Some(node) = self.nodes.get(&ObjectRef::new(&self.node)) else {
            return;
        };
        let published = routes::published_vtep(&node).and_then(Result::ok);
        if published != o.vtep {
            let value = o.vtep.map(|v| v.to_annotation());
            let patch = serde_json::json!({
                "metadata": { "annotations": { xdpcni_host::overlay::VTEP_ANNOTATION: value } }
            });
            match Api::<Node>::all(self.client.clone())
                .patch(
                    &self.node,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => info!(vtep = ?o.vtep, "published this node's VXLAN endpoint"),
                Err(e) => {
                    warn!(error = %e, "could not publish this node's VXLAN endpoint");
                    core.metrics.error(Stage::Routes);
                }
            }
        }
        // Every refusal is logged; the first few of a pass become Events (a
        // cluster that is not one L2 segment would otherwise file one per
        // node), the rest one Event that counts them.
        for u in &o.new_unreachable {
            warn!(node = %u.node, via = %u.via, "{u}");
        }
        // A peer this tunnelling node waits for (not publishing its VTEP
        // yet: starting, or a roll between modes) is a log line only: the
        // Event is for what the user must change.
        let refused: Vec<&routes::Unreachable> = o
            .new_unreachable
            .iter()
            .filter(|u| !u.awaiting_vtep)
            .collect();
        let mut notes: Vec<String> = refused
            .iter()
            .take(UNREACHABLE_EVENTS)
            .map(ToString::to_string)
            .collect();
        if refused.len() > UNREACHABLE_EVENTS {
            notes.push(format!(
                "and {} more host-gateway routes refused (their next hops are not on this \
                 node's L2 segment; the agent's log names each): set routing.mode to vxlan or auto",
                refused.len() - UNREACHABLE_EVENTS
            ));
        }
        for note in notes {
            if let Err(e) =
                publish_node_event(&self.client, &node, "XdpcniUnreachableNextHop", &note).await
            {
                warn!(error = %e, "could not publish the Event");
                core.metrics.error(Stage::Event);
            }
        }
    }

    /// One pass; `router` holds what the last put in place between nodes
    /// (read from the kernel again only when the Nodes ask for other
    /// entries, or [`NODE_RESYNC`] after: an entry removed by hand comes
    /// back then).
    ///
    /// A pass the timer started (`woken` false: no watch event, no record
    /// written) over the same records as the last full pass, with the pins
    /// in place, every veth there and no FORWARD rule change, ends after
    /// those checks: an idle node does no per-pod work each `intervalMs`;
    /// `full` is the records' generation and time of the last full pass,
    /// and one runs at least every [`NODE_RESYNC`].
    async fn pass(
        &self,
        netlink: &rtnetlink::Handle,
        seen: &mut HashSet<String>,
        router: &mut routes::Router,
        full: &mut Option<(u64, Instant)>,
        woken: bool,
    ) -> Result<()> {
        let core = &self.ctx.core;
        let reloaded = core.ensure_pinned().await;
        if reloaded {
            // A fresh datapath: every pod is attached again.
            seen.clear();
        }
        let listing = core.listing();
        let records = Arc::clone(&listing.records);
        // A record whose veth is gone: collect now, not at the resync.
        let vanished = records.iter().any(|r| is_live(r) && !veth_present(r));
        // FORWARD rules naming pods: reconcile the pods whose state changed,
        // and tell the newly named ones why.
        let change = core.scan_forward(&records).await;
        let quiet = PassChecks {
            woken: woken || router.retiring(),
            reloaded,
            vanished,
            forward: &change,
            generation: listing.generation,
            settled: *full,
        }
        .quiet();
        if quiet {
            core.idle_pass();
            return Ok(());
        }
        self.report_unreadable().await;
        let live: Vec<Record> = records.iter().filter(|r| is_live(r)).cloned().collect();
        let pod_list = self.pods.state();
        for (key, rule) in &change.added {
            if let Some(pod) = pod_list
                .iter()
                .find(|p| p.namespace().as_deref() == Some(key.0.as_str()) && p.name_any() == key.1)
            {
                let note = format!(
                    "the node's FORWARD rule `{rule}` names this pod: the XDP fast path \
                     would bypass it, so the pod takes kernel routing while it is there"
                );
                publish(
                    &self.ctx.recorder,
                    &self.ctx.core,
                    pod,
                    "XdpcniKernelOnly",
                    &note,
                )
                .await;
            }
        }
        for key in change.added.iter().map(|(k, _)| k).chain(&change.removed) {
            if !key.0.is_empty() {
                let _ = self
                    .trigger
                    .send(ObjectRef::new(&key.1).within(&key.0))
                    .await;
            }
        }
        for rec in &live {
            if seen.insert(rec.container_id.clone()) && !rec.pod_name.is_empty() {
                let pod = ObjectRef::new(&rec.pod_name).within(&rec.pod_namespace);
                if self.trigger.send(pod).await.is_err() {
                    debug!("the controller stopped");
                }
            }
        }
        seen.retain(|id| live.iter().any(|r| &r.container_id == id));
        let listed: HashSet<PodKey> = pod_list
            .iter()
            .map(|p| (p.namespace().unwrap_or_default(), p.name_any()))
            .collect();
        for rec in orphans(&live, Some(&listed)) {
            let (ns, name) = pod_key(rec);
            let span =
                tracing::info_span!("reconcile", namespace = %ns, pod = %name, orphan = true);
            // Errors are counted and logged by the core; the next pass retries.
            let input = core.pod_input(&(ns.clone(), name.clone()), Default::default());
            let _ = core
                .reconcile_pod(rec.clone(), input)
                .instrument(span)
                .await;
        }
        let nat = nat_ports(&records, &self.endpoints.state(), &pod_list);
        core.node_work(&listing, Some(nat), vanished).await;
        let nodes = self.nodes.state();
        let synced;
        match router.pass(netlink, &nodes, &self.node, NODE_RESYNC).await {
            Ok(o) => {
                self.routed(&o).await;
                synced = true;
            }
            Err(e) => {
                warn!(error = %e, "node routes");
                core.metrics.error(Stage::Routes);
                router.invalidate();
                synced = false;
            }
        }
        let converged = core.all_converged(&records);
        if converged {
            core.set_ready()?;
        }
        // Only a pass that left everything in place makes the next quiet.
        *full = (converged && synced).then(|| (listing.generation, Instant::now()));
        Ok(())
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

    let controller = Controller::new(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields(&format!("spec.nodeName={node}")),
    );
    let pods = controller.store();
    let (trigger, triggered) = mpsc::channel(1024);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: REPORTER.into(),
            instance: Some(node.clone()),
        },
    );
    let ctx = Arc::new(Ctx {
        core: Arc::clone(&core),
        recorder: recorder.clone(),
    });
    let changed = Arc::new(Notify::new());
    let policy_changed = Arc::new(Notify::new());
    // A CNI record written or removed wakes both tasks at once.
    core.watch_records(vec![Arc::clone(&changed), Arc::clone(&policy_changed)])?;
    let policy_task = PolicyTask {
        core: Arc::clone(&core),
        recorder,
        policies: drive(
            Api::<NetworkPolicy>::all(client.clone()),
            watcher::Config::default(),
            Arc::clone(&policy_changed),
        ),
        namespaces: drive(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
            Arc::clone(&policy_changed),
        ),
        // Every pod of the cluster: peers are selected by labels anywhere.
        pods: drive(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            Arc::clone(&policy_changed),
        ),
        trigger: trigger.clone(),
        changed: policy_changed,
    };
    let node_task = NodeTask {
        ctx: Arc::clone(&ctx),
        client: client.clone(),
        node: node.clone(),
        pods: pods.clone(),
        nodes: drive(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            Arc::clone(&changed),
        ),
        endpoints: drive(
            Api::<Endpoints>::all(client.clone()),
            watcher::Config::default(),
            Arc::clone(&changed),
        ),
        trigger,
        changed,
    };
    info!(
        node = %node,
        "watching this node's pods, network policies, namespaces, all pods, nodes and endpoints"
    );
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
    let (_, _, node_result) = tokio::join!(controller, policy, node_task.run(shutdown));
    info!("stopping; the datapath stays attached");
    node_result
}

#[cfg(test)]
mod tests {
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
        let got: Vec<_> = nat_ports(&records, &eps, &pods).into_iter().collect();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            got,
            vec![
                (ip("10.1.0.2"), L4Proto::Tcp, 8080),
                (ip("10.1.0.2"), L4Proto::Udp, 53),
                (ip("10.1.0.3"), L4Proto::Tcp, 80),
            ]
        );
    }
}
