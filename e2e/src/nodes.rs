//! Several nodes in one test: each node a network namespace with its own
//! pin directory, CNI network and xdpcni-agent in Kubernetes mode against
//! one real API server (a Node object per node with its pod CIDRs and
//! InternalIPs), pods made through the real CNI. How the nodes are wired
//! (one L2 wire, subnets behind a router) is the test's.

use std::{
    net::IpAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use xdpcni_ebpf::Maps;

use crate::{
    agent::LISTEN,
    cni::{agent_binary, result_ips, wait_ready, Call, Network, NodeProcess},
    kube::ApiServer,
    netns::Netns,
    PinDir,
};

/// One node.
pub struct TestNode {
    /// Its Node object's name.
    pub name: String,
    /// Its datapath pins.
    pub pins: PinDir,
    /// Its namespace and CNI network.
    pub net: Network,
    /// Its InternalIPs, in the order its Node lists them (the first is its
    /// VTEP address).
    pub internal: Vec<IpAddr>,
    /// Its pod CIDRs (IPv4, IPv6).
    pub pod4: String,
    /// IPv6 pod CIDR.
    pub pod6: String,
}

impl TestNode {
    /// A node with pod CIDRs `pod4`, `pod6` and InternalIPs `internal` (the
    /// test puts them on its interfaces).
    pub fn new(name: &str, pod4: &str, pod6: &str, internal: &[&str]) -> Result<Self> {
        let pins = PinDir::new("xm")?;
        let net = Network::new(
            pins.path(),
            "1.1.0",
            json!([[{ "subnet": pod4 }], [{ "subnet": pod6 }]]),
        )?;
        Ok(Self {
            name: name.into(),
            pins,
            net,
            internal: internal
                .iter()
                .map(|a| a.parse().context("an InternalIP"))
                .collect::<Result<_>>()?,
            pod4: pod4.into(),
            pod6: pod6.into(),
        })
    }

    /// The first InternalIP of the family of `v6`.
    pub fn ip(&self, v6: bool) -> Option<IpAddr> {
        self.internal.iter().copied().find(|a| a.is_ipv6() == v6)
    }

    /// The pod MTU its conflist gives new pods (what install-cni writes).
    pub fn set_pod_mtu(&mut self, mtu: u32) {
        self.net.conf["mtu"] = json!(mtu);
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
            let nodes: Api<Node> = Api::all(c);
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
            Api::<Node>::all(c)
                .delete(&name, &Default::default())
                .await?;
            Ok(())
        })
    }

    /// Starts its agent with `extra` merged into the config (e.g. its
    /// `routing`), and waits until it serves.
    pub fn agent(&self, kubeconfig: &Path, extra: Value) -> Result<NodeProcess> {
        let cfg = self.net.dir.path().join("agent.json");
        let mut body = json!({
            "pinDir": self.pins.path(), "stateDir": self.net.dir.path().join("state"),
            "xdpMode": "native", "redirect": "devmap", "intervalMs": 300,
        });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        std::fs::write(&cfg, body.to_string())?;
        let log = self.net.dir.path().join("agent.log");
        let kc = kubeconfig.to_str().context("kubeconfig path")?;
        let agent = NodeProcess::spawn_env(
            &self.net.node,
            &agent_binary()?,
            &["run", "--config", cfg.to_str().context("config path")?],
            &[("NODE_NAME", self.name.as_str()), ("KUBECONFIG", kc)],
            &log,
        )?;
        wait_ready(&self.net.node, LISTEN, Duration::from_secs(30), || {
            format!("{} agent: {}", self.name, self.agent_log())
        })?;
        Ok(agent)
    }

    /// Its agent's log so far (all its runs).
    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.net.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// ADDs pod `name` through the CNI, as the runtime of this node would.
    pub fn add_pod(&self, name: &str) -> Result<(Netns, Value)> {
        let ns = Netns::new("xp")?;
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}");
        let path = ns.path();
        let mut call = Call::new("ADD", name, Some(&path));
        call.args = &args;
        let out = self.net.call(&call, &json!({}))?;
        anyhow::ensure!(out.status == 0, "ADD {name}: {:?}", out.json);
        Ok((ns, out.json))
    }

    /// DELs pod `name`.
    pub fn del_pod(&self, name: &str, ns: &Netns) -> Result<()> {
        let path = ns.path();
        let out = self
            .net
            .call(&Call::new("DEL", name, Some(&path)), &json!({}))?;
        anyhow::ensure!(out.status == 0, "DEL {name}: {:?}", out.json);
        Ok(())
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
