//! The node task of the Kubernetes mode: the node-wide work once every cache
//! has its first complete list (new records trigger their pods, records no
//! pod claims get the node defaults, NAT'd ports, collection, routes to the
//! other nodes and their Events, readiness), and the Events about this Node.

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Endpoints, Node, Pod};
use kube::{
    runtime::reflector::{ObjectRef, Store},
    Api, Client, Resource, ResourceExt,
};
use tokio::sync::{mpsc, Notify};
use tracing::{debug, info, warn, Instrument};
use xdpcni_host::state::Record;

use super::{nat_ports, publish, Ctx};
use crate::{
    daemon::{BlockedChange, PassChecks, Shutdown, NODE_RESYNC},
    metrics::Stage,
    records::{is_live, orphans, pod_key, veth_present, PodKey},
    routes,
};

/// How many refused host-gateway routes of one pass become an Event each.
const UNREACHABLE_EVENTS: usize = 10;

/// Who the agent's Events say reported them.
pub(super) const REPORTER: &str = "xdpcni-agent";

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
pub(super) struct NodeTask {
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
    /// The task of `ctx`'s agent on node `node`, over the pod controller's
    /// store of this node's `pods`: watches of every Node and Endpoints wake
    /// `changed`, as the CNI's records do; pods to reconcile go to
    /// `trigger`.
    pub(super) fn new(
        ctx: &Arc<Ctx>,
        node: String,
        pods: Store<Pod>,
        trigger: mpsc::Sender<ObjectRef<Pod>>,
        changed: Arc<Notify>,
    ) -> Self {
        Self {
            ctx: Arc::clone(ctx),
            client: ctx.client.clone(),
            node,
            pods,
            nodes: super::watch_all(&ctx.client, &changed),
            endpoints: super::watch_all(&ctx.client, &changed),
            trigger,
            changed,
        }
    }

    pub(super) async fn run(self, shutdown: Shutdown) -> Result<()> {
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
        let interval = Duration::from_millis(self.ctx.core.config().interval_ms);
        let mut router = routes::Router::new(
            self.ctx.core.config().routing()?,
            Some(self.ctx.core.owner().clone()),
        );
        let mut full: Option<(u64, Instant)> = None;
        let mut woken = true;
        while !shutdown.is_set() {
            self.pass(&mut router, &mut full, woken).await?;
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
    async fn routed(&self, o: &routes::Routed) {
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
        if let Some(f) = &o.fast_path {
            core.set_cross_node(cross_node_status(o.fast_path_off, f));
        }
        for w in &o.warnings {
            warn!("{w}");
        }
        let Some(node) = self.nodes.get(&ObjectRef::new(&self.node)) else {
            return;
        };
        self.publish_vtep(&node, o.vtep).await;
        let bad = routes::bad_annotation(&self.node);
        if o.warnings.contains(&bad) {
            if let Err(e) =
                publish_node_event(&self.client, &node, "XdpcniBadAnnotation", &bad).await
            {
                warn!(error = %e, "could not publish the Event");
                core.metrics.error(Stage::Event);
            }
        }
        for note in refusal_notes(&o.new_unreachable) {
            if let Err(e) =
                publish_node_event(&self.client, &node, "XdpcniUnreachableNextHop", &note).await
            {
                warn!(error = %e, "could not publish the Event");
                core.metrics.error(Stage::Event);
            }
        }
    }

    /// The pods a FORWARD rule newly names get an Event saying why they
    /// are kernel-only; those and the pods no rule names any more are
    /// reconciled.
    async fn forward_changed(&self, change: &BlockedChange, pods: &[Arc<Pod>]) {
        for (key, rule) in &change.added {
            let Some(pod) = pods.iter().find(|p| {
                p.namespace().as_deref() == Some(key.0.as_str()) && p.name_any() == key.1
            }) else {
                continue;
            };
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
        for key in change.added.iter().map(|(k, _)| k).chain(&change.removed) {
            if !key.0.is_empty() {
                let _ = self
                    .trigger
                    .send(ObjectRef::new(&key.1).within(&key.0))
                    .await;
            }
        }
    }

    /// Triggers the pod of each live record not reconciled yet. The
    /// records' own feed (inotify, kube/mod.rs) triggers a new record's pod
    /// at once; this catches what it could not (its watch stopped, the pod
    /// was not listed yet, a fresh datapath that forgot every reconcile).
    async fn trigger_unreconciled(&self, live: &[Record]) {
        let core = &self.ctx.core;
        for rec in live
            .iter()
            .filter(|r| !r.pod_name.is_empty() && !core.reconciled(&r.container_id))
        {
            let pod = ObjectRef::new(&rec.pod_name).within(&rec.pod_namespace);
            if self.trigger.send(pod).await.is_err() {
                debug!("the controller stopped");
            }
        }
    }

    /// Reconciles with the node defaults each live record no listed pod
    /// claims (no Pod object: the controller cannot).
    async fn reconcile_orphans(&self, live: &[Record], pods: &[Arc<Pod>]) {
        let core = &self.ctx.core;
        let listed: HashSet<PodKey> = pods
            .iter()
            .map(|p| (p.namespace().unwrap_or_default(), p.name_any()))
            .collect();
        for rec in orphans(live, Some(&listed)) {
            let (ns, name) = pod_key(rec);
            let span =
                tracing::info_span!("reconcile", namespace = %ns, pod = %name, orphan = true);
            // Errors are counted and logged by the core; the next pass retries.
            let input = core.pod_input(rec, Default::default());
            let _ = core
                .reconcile_pod(rec.clone(), input)
                .instrument(span)
                .await;
        }
    }

    /// A routing pass over the Nodes (on a blocking thread); whether it left
    /// every route in place.
    async fn route(&self, router: &mut routes::Router) -> bool {
        let nodes = self.nodes.state();
        let fresh = router.fresh();
        let taken = std::mem::replace(router, fresh);
        let nat_synced = self.ctx.core.nat_synced();
        let (back, routed) = taken
            .pass_blocking(nodes, self.node.clone(), NODE_RESYNC, nat_synced)
            .await;
        *router = back;
        match routed {
            Ok(o) => {
                self.routed(&o).await;
                true
            }
            Err(e) => {
                warn!(error = %e, "node routes");
                self.ctx.core.metrics.error(Stage::Routes);
                router.invalidate();
                false
            }
        }
    }

    /// Publishes this node's VTEP `vtep` on its Node `node` (or takes it
    /// off) when the Node says otherwise.
    async fn publish_vtep(&self, node: &Node, vtep: Option<xdpcni_host::overlay::Vtep>) {
        if routes::published_vtep(node).and_then(Result::ok) == vtep {
            return;
        }
        let value = vtep.map(|v| v.to_annotation());
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
            Ok(_) => info!(?vtep, "published this node's VXLAN endpoint"),
            Err(e) => {
                warn!(error = %e, "could not publish this node's VXLAN endpoint");
                self.ctx.core.metrics.error(Stage::Routes);
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
        router: &mut routes::Router,
        full: &mut Option<(u64, Instant)>,
        woken: bool,
    ) -> Result<()> {
        let core = &self.ctx.core;
        // A fresh datapath forgets every reconcile: each pod is triggered
        // below and attached again.
        let reloaded = core.ensure_pinned().await;
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
        self.forward_changed(&change, &pod_list).await;
        self.trigger_unreconciled(&live).await;
        self.reconcile_orphans(&live, &pod_list).await;
        let remote = self.ctx.core.config().routing.fast_path;
        let nat = nat_ports(&records, &self.endpoints.state(), &pod_list, remote);
        core.node_work(&listing, Some(nat), vanished).await;
        let synced = self.route(router).await;
        let converged = core.all_converged(&records);
        if converged {
            core.set_ready()?;
        }
        // Only a pass that left everything in place makes the next quiet.
        *full = (converged && synced).then(|| (listing.generation, Instant::now()));
        Ok(())
    }
}

/// The status of the fast path between nodes after a pass that wrote it
/// (`off`: why it is off).
fn cross_node_status(
    off: Option<routes::FastPathOff>,
    done: &crate::reconciler::RemoteDone,
) -> crate::status::CrossNodeStatus {
    crate::status::CrossNodeStatus {
        on: off.is_none(),
        off: off.map(|w| w.as_str().into()),
        destinations: done.entries,
        uplinks: done
            .uplinks
            .iter()
            .map(|&ifindex| crate::status::UplinkStatus {
                interface: crate::records::link_name(ifindex)
                    .unwrap_or_else(|| format!("ifindex {ifindex}")),
                ifindex,
                counters: None,
            })
            .collect(),
    }
}

/// The Events of newly refused host-gateway routes, each logged: every
/// refusal of the first [`UNREACHABLE_EVENTS`] its own, the rest one that
/// counts them (a cluster that is not one L2 segment would otherwise file
/// one per node). A peer this tunnelling node waits for (not publishing its
/// VTEP yet: starting, or a roll between modes) is a log line only: the
/// Event is for what the user must change.
fn refusal_notes(new: &[routes::Unreachable]) -> Vec<String> {
    for u in new {
        warn!(node = %u.node, via = %u.via, "{u}");
    }
    let refused: Vec<&routes::Unreachable> = new.iter().filter(|u| !u.awaiting_vtep).collect();
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
    notes
}
