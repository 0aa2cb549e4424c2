//! Kubernetes mode: watches the Pods bound to this node (field selector on
//! `spec.nodeName`) and every NetworkPolicy, turns each pod's `xdpcni.io/`
//! annotations into its datapath policy, marks pods selected by any
//! NetworkPolicy kernel-only, and reports refused values as Events on the pod.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
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
use xdpcni_plugin::state;

use crate::{
    node::{PodInput, Reconciler},
    routes,
    standalone::{install_signal_handlers, online_cpus, open_reconciler, stopping, Config, Shared},
};

/// Whether `selector` selects a pod with `labels` (an empty selector selects
/// every pod of the namespace).
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    if let Some(ml) = &selector.match_labels {
        if ml.iter().any(|(k, v)| labels.get(k) != Some(v)) {
            return false;
        }
    }
    for e in selector.match_expressions.iter().flatten() {
        let have = labels.get(&e.key);
        let values = e.values.as_deref().unwrap_or_default();
        let ok = match e.operator.as_str() {
            "In" => have.is_some_and(|v| values.contains(v)),
            "NotIn" => have.is_none_or(|v| !values.contains(v)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    true
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
        let (back, pass) = tokio::task::spawn_blocking(move || {
            let pass = rec.pass(&records, |ns, name| {
                inputs.get(&(ns.to_string(), name.to_string())).cloned()
            });
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
