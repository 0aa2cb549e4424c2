//! Several nodes in one test: each a [`Node`] (namespace, pins, CNI
//! network, agent config) whose xdpcni-agent runs in Kubernetes mode against
//! one real API server (a Node object per node with its pod CIDRs and
//! InternalIPs), pods made through the real CNI. How the nodes are wired
//! (one L2 wire, subnets behind a router) is the test's.

use std::{
    net::IpAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use xdpcni_ebpf::Maps;

use crate::{
    cni::{result_ips, NodeProcess},
    kube::ApiServer,
    netns::Netns,
    node::{AgentConfig, Node},
};

/// One node of several sharing an API server: a [`Node`] with a Node
/// object (pod CIDRs, InternalIPs) and an agent in Kubernetes mode.
pub struct ClusterNode {
    /// Its Node object's name.
    pub name: String,
    /// The node itself (namespace, pins, CNI network, agent config).
    pub node: Node,
    /// Its InternalIPs, in the order its Node lists them (the first is its
    /// VTEP address).
    pub internal: Vec<IpAddr>,
    /// Its pod CIDRs (IPv4, IPv6).
    pub pod4: String,
    /// IPv6 pod CIDR.
    pub pod6: String,
    starts: u32,
}

impl std::ops::Deref for ClusterNode {
    type Target = Node;
    fn deref(&self) -> &Node {
        &self.node
    }
}

impl std::ops::DerefMut for ClusterNode {
    fn deref_mut(&mut self) -> &mut Node {
        &mut self.node
    }
}

impl ClusterNode {
    /// A node with pod CIDRs `pod4`, `pod6` and InternalIPs `internal` (the
    /// test puts them on its interfaces). Its agent: native XDP, devmap,
    /// node-wide work every 300 ms.
    pub fn new(name: &str, pod4: &str, pod6: &str, internal: &[&str]) -> Result<Self> {
        let mut node = Node::builder().pins("xm").pod_cidrs(pod4, pod6).build()?;
        node.config.node_name = Some(name.into());
        node.config.xdp_mode = "native".into();
        node.config.redirect = "devmap".into();
        node.config.interval_ms = 300;
        Ok(Self {
            name: name.into(),
            node,
            internal: internal
                .iter()
                .map(|a| a.parse().context("an InternalIP"))
                .collect::<Result<_>>()?,
            pod4: pod4.into(),
            pod6: pod6.into(),
            starts: 0,
        })
    }

    /// The first InternalIP of the family of `v6`.
    pub fn ip(&self, v6: bool) -> Option<IpAddr> {
        self.internal.iter().copied().find(|a| a.is_ipv6() == v6)
    }

    /// The pod MTU its conflist gives new pods (what install-cni writes).
    pub fn set_pod_mtu(&mut self, mtu: u32) {
        self.node.net.conf.mtu = mtu;
    }

    /// The Node object (without status) and its status patch.
    pub fn object(&self) -> (Value, Value) {
        let addresses: Vec<Value> = self
            .internal
            .iter()
            .map(|a| json!({ "type": "InternalIP", "address": a.to_string() }))
            .collect();
        (
            json!({
                "metadata": { "name": self.name },
                "spec": { "podCIDR": self.pod4, "podCIDRs": [self.pod4, self.pod6] },
            }),
            json!({ "status": { "addresses": addresses } }),
        )
    }

    /// Creates its Node object through `api` (reached from namespace `from`).
    pub fn create_object(&self, api: &ApiServer, from: &Netns) -> Result<()> {
        let (obj, status) = self.object();
        let name = self.name.clone();
        api.with_client(from, |c| async move {
            let nodes: Api<NodeObject> = Api::all(c);
            nodes
                .create(&PostParams::default(), &serde_json::from_value(obj)?)
                .await?;
            nodes
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                .await?;
            Ok(())
        })
    }

    /// Deletes its Node object.
    pub fn delete_object(&self, api: &ApiServer, from: &Netns) -> Result<()> {
        let name = self.name.clone();
        api.with_client(from, |c| async move {
            Api::<NodeObject>::all(c)
                .delete(&name, &Default::default())
                .await?;
            Ok(())
        })
    }

    /// Its agent's `/v1/status`.
    pub fn status(&self) -> Result<xdpcni_agent::status::Status> {
        let (code, body) =
            crate::cni::http_get(&self.net.node, crate::agent::LISTEN, "/v1/status")?;
        anyhow::ensure!(code == 200, "/v1/status: {code} {body}");
        Ok(serde_json::from_str(&body)?)
    }

    /// The id of its datapath's program `name`, as its agent's status lists
    /// it (the kernel truncates program names: the id tells them apart).
    pub fn program_id(&self, name: &str) -> Result<u32> {
        self.status()?
            .datapath
            .programs
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.id)
            .with_context(|| format!("no program {name} in the status"))
    }

    /// Sets (or, `None`, removes) annotation `key` on its Node object.
    pub fn annotate(
        &self,
        api: &ApiServer,
        from: &Netns,
        key: &str,
        value: Option<&str>,
    ) -> Result<()> {
        let name = self.name.clone();
        let patch = json!({ "metadata": { "annotations": { key: value } } });
        api.with_client(from, |c| async move {
            Api::<NodeObject>::all(c)
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await?;
            Ok(())
        })
    }

    /// The notes of the Events with `reason` about its Node (the agent
    /// files them in kube-system).
    pub fn events(&self, api: &ApiServer, from: &Netns, reason: &str) -> Result<Vec<String>> {
        let name = self.name.clone();
        let reason = reason.to_string();
        api.with_client(from, |c| async move {
            let evs = Api::<k8s_openapi::api::events::v1::Event>::namespaced(c, "kube-system")
                .list(&Default::default())
                .await?;
            Ok(evs
                .items
                .into_iter()
                .filter(|e| {
                    e.reason.as_deref() == Some(reason.as_str())
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                            == Some(name.as_str())
                })
                .filter_map(|e| e.note)
                .collect())
        })
    }

    /// Starts its agent against the API server of `kubeconfig`, with
    /// `config` changing its config first (e.g. its `routing`), and waits
    /// until it serves. Each start logs to a file of its own.
    pub fn agent(
        &mut self,
        kubeconfig: &Path,
        config: impl FnOnce(&mut AgentConfig),
    ) -> Result<NodeProcess> {
        config(&mut self.node.config);
        self.node.kubeconfig = Some(kubeconfig.to_path_buf());
        self.starts += 1;
        let log = format!("agent{}.log", self.starts);
        self.node
            .start_agent(&log)
            .with_context(|| format!("{} agent", self.name))
    }

    /// Its agents' logs so far (all their runs).
    pub fn agent_log(&self) -> String {
        (1..=self.starts)
            .map(|n| self.node.log(&format!("agent{n}.log")))
            .collect()
    }

    /// ADDs pod `name` of `default` through the CNI, as the runtime of this
    /// node would.
    pub fn add_pod(&self, name: &str) -> Result<(Netns, Value)> {
        self.node.add_pod("default", name)
    }

    /// The routes the agent owns (`proto 90`), as `ip route` prints them.
    pub fn agent_routes(&self) -> String {
        let v4 = self
            .net
            .node
            .ip(&["route", "show", "proto", "90"])
            .unwrap_or_default();
        let v6 = self
            .net
            .node
            .ip(&["-6", "route", "show", "proto", "90"])
            .unwrap_or_default();
        format!("{v4}{v6}")
    }

    /// Packets pod `res`'s host veth sent on through the fast path.
    pub fn forwarded(&self, res: &Value) -> Result<u64> {
        let host = res["interfaces"][0]["name"]
            .as_str()
            .context("the result's host interface")?;
        let ifindex = self.net.node.ifindex(host)?;
        Ok(Maps::open_pinned(self.pins.path())?
            .counters(ifindex)?
            .forwarded())
    }

    /// Whether the agent has put pod `res` on the fast path (every address
    /// of it in the endpoint map). ADD records a pod no policy may select
    /// and returns; the agent alone writes its endpoint, a moment later.
    pub fn on_fast_path(&self, res: &Value) -> Result<bool> {
        let maps = Maps::open_pinned(self.pins.path())?;
        for ip in result_ips(res) {
            if maps.endpoint(ip)?.is_none() {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Creates pods `(name, node)` in `default` (a pause container each, bound).
pub fn create_pods(api: &ApiServer, from: &Netns, pods: &[(&str, &str)]) -> Result<()> {
    let pods: Vec<(String, String)> = pods
        .iter()
        .map(|(p, n)| (p.to_string(), n.to_string()))
        .collect();
    api.with_client(from, |c| async move {
        let api: Api<Pod> = Api::namespaced(c, "default");
        for (name, node) in pods {
            api.create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": name },
                    "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "pause" }] },
                }))?,
            )
            .await?;
        }
        Ok(())
    })
}

/// Waits until `f` holds; how long it took (fails after `within`).
pub fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Result<Duration> {
    let start = Instant::now();
    while !f() {
        anyhow::ensure!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(start.elapsed())
}

/// The address of family `v6` of a CNI result.
pub fn addr(res: &Value, v6: bool) -> Result<IpAddr> {
    result_ips(res)
        .into_iter()
        .find(|i| i.is_ipv6() == v6)
        .context("the result has no address of that family")
}
