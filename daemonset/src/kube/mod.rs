//! Kubernetes mode: a controller (kube-runtime's `Controller`) reconciles
//! each Pod bound to this node when it changes, when a NetworkPolicy of its
//! namespace changes (kernel-only when any selects it), and when the CNI
//! writes its record; it reports refused values as Events on the pod. A
//! node task does the node-wide work every `intervalMs`: routes to the other
//! nodes' pod CIDRs, the NAT'd ports, the records no pod claims, collection.
//! Nothing is decided from a cache before its first complete list.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::{
    api::{
        core::v1::{Endpoints, Node, Pod},
        networking::v1::NetworkPolicy,
    },
    apimachinery::pkg::apis::meta::v1::LabelSelector,
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
use xdpcni_node::state::Record;

use crate::{
    config::Config,
    core::{Core, ReconcileError, Shutdown},
    metrics::Stage,
    node::{is_live, orphans, pod_key, PodInput, PodKey},
    routes,
};

/// How often a converged pod is reconciled again without an event: repairs
/// drift (a program detached by hand, a map entry removed).
const RESYNC: Duration = Duration::from_secs(300);
/// How soon a pod whose reconcile failed is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// Whether `selector` selects a pod with `labels` (an empty selector selects
/// every pod of the namespace), by kube's `Selector`. A selector kube cannot
/// read (an unknown operator, `In` without values: the API server refuses
/// those) selects nothing.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    use kube::core::SelectorExt;
    kube::core::Selector::try_from(selector.clone()).is_ok_and(|s| s.matches(labels))
}

/// Whether any NetworkPolicy of the pod's namespace selects it (an absent
/// podSelector selects every pod of the namespace).
pub fn policy_selected(pod: &Pod, policies: &[Arc<NetworkPolicy>]) -> bool {
    let labels = pod.labels();
    policies.iter().any(|np| {
        np.namespace() == pod.namespace()
            && np
                .spec
                .as_ref()
                .is_some_and(|spec| selects(&spec.pod_selector.clone().unwrap_or_default(), labels))
    })
}

/// The NAT'd ports of this node's pods: every Endpoints address that is a
/// local pod, with each port of its subset (a Service backend: replies to a
/// ClusterIP client must be un-DNATed), and every container port published
/// as a hostPort.
pub fn nat_ports(
    records: &[xdpcni_node::state::Record],
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
/// change wakes `changed`.
fn drive<K>(api: Api<K>, cfg: watcher::Config, changed: Arc<Notify>) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, cfg)).default_backoff();
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
    policies: Store<NetworkPolicy>,
}

/// A pod reconcile that failed (retried after [`RETRY`]).
#[derive(Debug, thiserror::Error)]
enum PodError {
    #[error(transparent)]
    Reconcile(#[from] ReconcileError),
    #[error("the NetworkPolicy cache is gone")]
    PoliciesGone,
}

/// One pod: its records' policy from its annotations and the policies that
/// select it, applied; refused values as an Event.
async fn reconcile(pod: Arc<Pod>, ctx: Arc<Ctx>) -> Result<Action, PodError> {
    let key: PodKey = (pod.namespace().unwrap_or_default(), pod.name_any());
    let span = tracing::info_span!("reconcile", namespace = %key.0, pod = %key.1);
    async move {
        // Kernel-only is decided from the complete list of policies only.
        ctx.policies
            .wait_until_ready()
            .await
            .map_err(|_| PodError::PoliciesGone)?;
        let records: Vec<Record> = ctx
            .core
            .records()
            .into_iter()
            .filter(|r| is_live(r) && pod_key(r) == key)
            .collect();
        if records.is_empty() {
            // No network yet: the node task triggers this pod when the CNI
            // writes its record.
            return Ok(Action::await_change());
        }
        let input = PodInput {
            annotations: pod.annotations().clone(),
            kernel_only: policy_selected(&pod, &ctx.policies.state()) || ctx.core.is_blocked(&key),
        };
        for rec in records {
            let outcome = ctx.core.reconcile_pod(rec, input.clone()).await?;
            if !outcome.new_problems.is_empty() {
                publish_problems(&ctx, &pod, &outcome.new_problems).await;
            }
        }
        Ok(Action::requeue(RESYNC))
    }
    .instrument(span)
    .await
}

fn error_policy(_pod: Arc<Pod>, error: &PodError, _ctx: Arc<Ctx>) -> Action {
    warn!(%error, "pod reconcile failed; retrying");
    Action::requeue(RETRY)
}

async fn publish_problems(ctx: &Ctx, pod: &Pod, problems: &[crate::policy::Problem]) {
    let note = problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    publish(ctx, pod, "XdpcniFallback", &note).await;
}

/// Publishes a Warning Event about `pod` (notes cut to the API's 1000
/// characters); a failure is logged and counted, never fatal.
async fn publish(ctx: &Ctx, pod: &Pod, reason: &str, note: &str) {
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: "ApplyXdpPolicy".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &pod.object_ref(&())).await {
        warn!(error = %e, "could not publish the Event");
        ctx.core.metrics.error(Stage::Event);
    }
}

/// The node-wide work, once every cache has its first complete list, on each
/// change of a Node or Endpoints object and every `intervalMs` (new records,
/// resync): new records trigger their pods, records no pod claims get the
/// node defaults, then NAT'd ports, collection, routes, readiness.
struct NodeTask {
    ctx: Arc<Ctx>,
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
            self.ctx.policies.wait_until_ready().await?;
            self.nodes.wait_until_ready().await?;
            self.endpoints.wait_until_ready().await
        };
        tokio::select! {
            listed = lists => listed.context("a watch cache closed before its first list")?,
            _ = shutdown.clone().wait() => return Ok(()),
        }
        info!(node = %self.node, "first lists complete: pods, policies, nodes, endpoints");
        let (conn, netlink, _) = rtnetlink::new_connection().context("rtnetlink socket")?;
        tokio::spawn(conn);
        let interval = Duration::from_millis(self.ctx.core.config().interval_ms);
        let mut seen: HashSet<String> = HashSet::new();
        while !shutdown.is_set() {
            self.pass(&netlink, &mut seen).await?;
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = self.changed.notified() => {}
                _ = shutdown.clone().wait() => {}
            }
        }
        Ok(())
    }

    async fn pass(&self, netlink: &rtnetlink::Handle, seen: &mut HashSet<String>) -> Result<()> {
        let core = &self.ctx.core;
        if core.ensure_pinned().await {
            // A fresh datapath: every pod is attached again.
            seen.clear();
        }
        let records = core.records();
        let live: Vec<Record> = records.iter().filter(|r| is_live(r)).cloned().collect();
        // FORWARD rules naming pods: reconcile the pods whose state changed,
        // and tell the newly named ones why.
        let change = core.scan_forward(&records).await;
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
                publish(&self.ctx, pod, "XdpcniKernelOnly", &note).await;
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
            let input = PodInput {
                kernel_only: core.is_blocked(&(ns.clone(), name.clone())),
                ..PodInput::default()
            };
            let _ = core
                .reconcile_pod(rec.clone(), input)
                .instrument(span)
                .await;
        }
        let nat = nat_ports(&records, &self.endpoints.state(), &pod_list);
        core.node_work(records.clone(), Some(nat)).await;
        match routes::sync(netlink, &routes::desired(&self.nodes.state(), &self.node)).await {
            Ok((0, 0)) => {}
            Ok((added, removed)) => info!(added, removed, "node routes updated"),
            Err(e) => {
                warn!(error = %e, "node routes");
                core.metrics.error(Stage::Routes);
            }
        }
        if core.all_converged(&records) {
            core.set_ready()?;
        }
        Ok(())
    }
}

/// Runs the agent against the API server until SIGTERM/SIGINT.
pub async fn run(cfg: Config) -> Result<()> {
    let shutdown = Shutdown::on_signals()?;
    let node = cfg
        .node_name()
        .context("the node name: set nodeName in the config or NODE_NAME (downward API)")?;
    let client = Client::try_default()
        .await
        .context("connecting to the API server (in-cluster or KUBECONFIG)")?;
    let core = Core::open(cfg).await?;
    core.serve(shutdown.clone()).await?;

    let controller = Controller::new(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields(&format!("spec.nodeName={node}")),
    );
    let pods = controller.store();
    // One watch of NetworkPolicies feeds both the store reconciles read and
    // the trigger of the pods of the policy's namespace.
    let (policies, policy_writer) = reflector::store();
    let policy_events = reflector::reflector(
        policy_writer,
        watcher(
            Api::<NetworkPolicy>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .touched_objects();
    let pods_of_ns = pods.clone();
    let (trigger, triggered) = mpsc::channel(1024);
    let ctx = Arc::new(Ctx {
        core: Arc::clone(&core),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "xdpcni-agent".into(),
                instance: Some(node.clone()),
            },
        ),
        policies,
    });
    let changed = Arc::new(Notify::new());
    let node_task = NodeTask {
        ctx: Arc::clone(&ctx),
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
    info!(node = %node, "watching this node's pods, network policies, nodes and endpoints");
    let controller = controller
        .watches_stream(policy_events, move |np: NetworkPolicy| {
            let ns = np.namespace();
            pods_of_ns
                .state()
                .into_iter()
                .filter(|p| p.namespace() == ns)
                .map(|p| ObjectRef::from_obj(&*p))
                .collect::<Vec<_>>()
        })
        .reconcile_on(tokio_stream::wrappers::ReceiverStream::new(triggered))
        .graceful_shutdown_on(shutdown.clone().wait())
        .run(reconcile, error_policy, ctx)
        .for_each(|done| async move {
            if let Err(e) = done {
                debug!(error = %e, "controller");
            }
        });
    let (_, node_result) = tokio::join!(controller, node_task.run(shutdown));
    info!("stopping; the datapath stays attached");
    node_result
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn nat_ports_from_endpoints_and_host_ports() {
        let rec = |ns: &str, name: &str, ip: &str| {
            crate::node::test_record(ns, name, name, vec![ip.parse().unwrap()])
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

    #[test]
    fn label_selectors() {
        let empty = LabelSelector::default();
        assert!(selects(&empty, &labels(&[])), "empty selects all");
        let ml = LabelSelector {
            match_labels: Some(labels(&[("app", "b")])),
            ..Default::default()
        };
        assert!(selects(&ml, &labels(&[("app", "b"), ("x", "y")])));
        assert!(!selects(&ml, &labels(&[("app", "a")])));
        let expr = |op: &str, values: Option<Vec<&str>>| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "tier".into(),
                operator: op.into(),
                values: values.map(|v| v.into_iter().map(String::from).collect()),
            }]),
            ..Default::default()
        };
        let web = labels(&[("tier", "web")]);
        assert!(selects(&expr("In", Some(vec!["web", "db"])), &web));
        assert!(!selects(&expr("NotIn", Some(vec!["web"])), &web));
        assert!(selects(&expr("NotIn", Some(vec!["web"])), &labels(&[])));
        assert!(selects(&expr("Exists", None), &web));
        assert!(!selects(&expr("DoesNotExist", None), &web));
        assert!(!selects(&expr("Bogus", None), &web));
    }
}
