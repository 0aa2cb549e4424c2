//! Kubernetes mode: watches the Pods bound to this node (field selector on
//! `spec.nodeName`) and every NetworkPolicy, turns each pod's `xdpcni.io/`
//! annotations into its datapath policy, marks pods selected by any
//! NetworkPolicy kernel-only, and reports refused values as Events on the pod.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
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
        events::{Event, EventType, Recorder, Reporter},
        reflector::{self, Store},
        watcher, WatchStreamExt,
    },
    Api, Client, Resource,
};
use tracing::{info, warn};
use xdpcni_ebpf::L4Proto;
use xdpcni_node::{pod::online_cpus, state};

use crate::{
    node::{PodInput, Reconciler},
    routes,
    standalone::{install_signal_handlers, open_reconciler, stopping, Config, Shared},
};

/// Whether `selector` selects a pod with `labels` (an empty selector selects
/// every pod of the namespace), by kube's `Selector`. A selector kube cannot
/// read (an unknown operator, `In` without values: the API server refuses
/// those) selects nothing.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    use kube::core::SelectorExt;
    kube::core::Selector::try_from(selector.clone()).is_ok_and(|s| s.matches(labels))
}

/// (namespace, name) of the pods selected by any NetworkPolicy.
pub fn policy_selected(
    pods: &[Arc<Pod>],
    policies: &[Arc<NetworkPolicy>],
) -> HashSet<(String, String)> {
    let mut out = HashSet::new();
    for np in policies {
        let ns = np.metadata.namespace.clone().unwrap_or_default();
        let Some(spec) = &np.spec else { continue };
        for pod in pods {
            if pod.metadata.namespace.as_deref() != Some(ns.as_str()) {
                continue;
            }
            let labels = pod.metadata.labels.clone().unwrap_or_default();
            // An absent podSelector selects every pod of the namespace.
            let selector = spec.pod_selector.clone().unwrap_or_default();
            if selects(&selector, &labels) {
                out.insert((ns.clone(), pod.metadata.name.clone().unwrap_or_default()));
            }
        }
    }
    out
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

fn drive<K>(api: Api<K>, cfg: watcher::Config) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, cfg)).default_backoff();
    tokio::spawn(async move {
        stream
            .for_each(|ev| async move {
                if let Err(e) = ev {
                    warn!(error = %e, "watch error (retrying)");
                }
            })
            .await;
    });
    reader
}

/// Runs the agent against the API server until SIGTERM/SIGINT.
pub async fn run(cfg: Config) -> Result<()> {
    install_signal_handlers();
    let node = cfg
        .node_name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok())
        .context("the node name: set nodeName in the config or NODE_NAME (downward API)")?;
    let client = Client::try_default()
        .await
        .context("connecting to the API server (in-cluster or KUBECONFIG)")?;
    let pods = drive(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields(&format!("spec.nodeName={node}")),
    );
    let policies = drive(
        Api::<NetworkPolicy>::all(client.clone()),
        watcher::Config::default(),
    );
    let nodes = drive(Api::<Node>::all(client.clone()), watcher::Config::default());
    let endpoints = drive(
        Api::<Endpoints>::all(client.clone()),
        watcher::Config::default(),
    );
    let (conn, netlink, _) = rtnetlink::new_connection().context("rtnetlink socket")?;
    tokio::spawn(conn);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "xdpcni-agent".into(),
            instance: Some(node.clone()),
        },
    );
    let online = online_cpus();
    let cfg2 = cfg.clone();
    let mut rec: Reconciler =
        tokio::task::spawn_blocking(move || open_reconciler(&cfg2, online)).await??;
    let shared = Shared::serve(&cfg.listen)?;
    // Wait for the first lists: applying defaults to pods whose annotations
    // are not known yet would undo their modes after a restart.
    let _ = tokio::time::timeout(Duration::from_secs(30), pods.wait_until_ready()).await;
    let _ = tokio::time::timeout(Duration::from_secs(30), policies.wait_until_ready()).await;
    let _ = tokio::time::timeout(Duration::from_secs(30), nodes.wait_until_ready()).await;
    let _ = tokio::time::timeout(Duration::from_secs(30), endpoints.wait_until_ready()).await;
    info!(node = %node, "watching pods and network policies");
    while !stopping() {
        let pod_list = pods.state();
        let selected = policy_selected(&pod_list, &policies.state());
        let inputs: HashMap<(String, String), PodInput> = pod_list
            .iter()
            .map(|p| {
                let key = (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.name.clone().unwrap_or_default(),
                );
                let input = PodInput {
                    annotations: p.metadata.annotations.clone().unwrap_or_default(),
                    kernel_only: selected.contains(&key),
                };
                (key, input)
            })
            .collect();
        let records = state::list(&cfg.state_dir).unwrap_or_default();
        let nat = nat_ports(&records, &endpoints.state(), &pod_list);
        let (back, pass) = tokio::task::spawn_blocking(move || {
            let pass = rec.pass(&records, |ns, name| {
                inputs.get(&(ns.to_string(), name.to_string())).cloned()
            });
            match rec.sync_nat_ports(&nat) {
                Ok((0, 0)) => {}
                Ok((added, removed)) => info!(added, removed, "NAT'd ports updated"),
                Err(e) => warn!(error = %e, "NAT'd ports"),
            }
            (rec, pass)
        })
        .await?;
        rec = back;
        for np in &pass.new_problems {
            let Some(pod) = pod_list.iter().find(|p| {
                p.metadata.namespace.as_deref() == Some(np.namespace.as_str())
                    && p.metadata.name.as_deref() == Some(np.name.as_str())
            }) else {
                continue;
            };
            let note = np
                .problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            let event = Event {
                type_: EventType::Warning,
                reason: "XdpcniFallback".into(),
                note: Some(note.chars().take(1000).collect()),
                action: "ApplyXdpPolicy".into(),
                secondary: None,
            };
            if let Err(e) = recorder.publish(&event, &pod.object_ref(&())).await {
                warn!(pod = %np.name, error = %e, "could not publish the Event");
            }
        }
        // Host-gateway routes to the other nodes' pod CIDRs.
        match routes::sync(&netlink, &routes::desired(&nodes.state(), &node)).await {
            Ok((0, 0)) => {}
            Ok((added, removed)) => info!(added, removed, "node routes updated"),
            Err(e) => warn!(error = %e, "node routes"),
        }
        shared.publish(&cfg, &mut rec, &pass)?;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(cfg.interval_ms);
        while tokio::time::Instant::now() < deadline && !stopping() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    info!("stopping; the datapath stays attached");
    Ok(())
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
        let rec = |ns: &str, name: &str, ip: &str| xdpcni_node::state::Record {
            container_id: name.into(),
            ifname: "eth0".into(),
            netns: String::new(),
            host_veth: String::new(),
            host_ifindex: 1,
            host_mac: String::new(),
            pod_mac: String::new(),
            ips: vec![ip.parse().unwrap()],
            mtu: 1500,
            headroom_requested: 256,
            headroom_effective: None,
            xdp_mode: "native".into(),
            redirect: "devmap".into(),
            pod_namespace: ns.into(),
            pod_name: name.into(),
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
