//! A Kubernetes node for the NetworkPolicy tests and the benchmark: a node
//! namespace with a real kube-apiserver (and etcd), one Node object, the
//! real `xdpcni-agent` in Kubernetes mode, and pods as the kubelet would
//! make them: a Pod object bound to the node, a network namespace, the real
//! CNI plugin's ADD with the matching `K8S_POD_*`, the status with the
//! pod's addresses, and a server in the pod (`podtool serve`).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::{
    core::v1::{Namespace, Node as NodeObject, Pod},
    networking::v1::NetworkPolicy,
};
use kube::{
    api::{DeleteParams, Patch, PatchParams, PostParams},
    Api,
};
use serde_json::{json, Value};

use crate::{
    cni::{agent_binary, http_get, result_ips, Call, NodeProcess},
    kube::ApiServer,
    netns::Netns,
    node::{AgentConfig, Node},
};

/// The node's name.
pub const NODE: &str = "node-a";
/// Where the agent listens in the node namespace.
pub const LISTEN: &str = "127.0.0.1:9967";
/// The ports every test pod serves, TCP and UDP.
pub const PORTS: [u16; 2] = [80, 81];

/// A pod of the node.
#[derive(Debug)]
pub struct TestPod {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its network namespace.
    pub netns: Netns,
    /// Its addresses (IPv4 first).
    pub ips: Vec<IpAddr>,
    /// Its host veth.
    pub host: String,
    server: Option<NodeProcess>,
}

impl TestPod {
    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Its address of the family of `v6`.
    pub fn ip(&self, v6: bool) -> IpAddr {
        self.ips
            .iter()
            .copied()
            .find(|i| i.is_ipv6() == v6)
            .unwrap_or(self.ips[0])
    }
}

/// The node.
#[derive(Debug)]
pub struct KubeNode {
    /// Its agent, stopped (SIGKILL) first on Drop.
    agent: Option<NodeProcess>,
    /// The API server.
    pub api: ApiServer,
    /// The node (namespace, pins, CNI network, agent config).
    pub node: Node,
    /// Environment of the agent's next start, beside KUBECONFIG.
    pub agent_env: Vec<(String, String)>,
    starts: u32,
}

impl std::ops::Deref for KubeNode {
    type Target = Node;
    fn deref(&self) -> &Node {
        &self.node
    }
}

/// The `podtool` binary of this build.
pub fn podtool() -> Result<PathBuf> {
    let p = agent_binary()?.with_file_name("podtool");
    ensure!(p.is_file(), "{} is not built", p.display());
    Ok(p)
}

impl KubeNode {
    /// The node with its API server, Node object (pod CIDRs 10.78.0.0/24
    /// and fd78::/64) and a ready agent, its config changed by `config`
    /// (the defaults here: node-wide work every second, no FORWARD scan).
    pub fn start(config: impl FnOnce(&mut AgentConfig)) -> Result<Self> {
        let mut node = Node::builder().pins("xk").build()?;
        let api = ApiServer::start(&node.net.node)?;
        api.with_client(&node.net.node, |c| async move {
            Api::<NodeObject>::all(c)
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": { "name": NODE },
                        "spec": { "podCIDR": "10.78.0.0/24", "podCIDRs": ["10.78.0.0/24", "fd78::/64"] },
                    }))?,
                )
                .await?;
            Ok(())
        })?;
        node.kubeconfig = Some(api.kubeconfig.clone());
        node.config.listen = LISTEN.into();
        node.config.interval_ms = 1000;
        node.config.forward_scan_ms = 0;
        node.config.node_name = Some(NODE.into());
        config(&mut node.config);
        let mut node = Self {
            agent: None,
            api,
            node,
            agent_env: Vec::new(),
            starts: 0,
        };
        node.start_agent()?;
        Ok(node)
    }

    /// The log of the agent's `n`th start (from 1).
    pub fn agent_log_path(&self, n: u32) -> PathBuf {
        self.net.dir.path().join(Self::log_name(n))
    }

    fn log_name(n: u32) -> String {
        format!("agent{n}.log")
    }

    /// The current agent's log.
    pub fn agent_log(&self) -> String {
        self.node.log(&Self::log_name(self.starts))
    }

    /// Starts the agent and waits until it is ready.
    pub fn start_agent(&mut self) -> Result<()> {
        ensure!(self.agent.is_none(), "the agent runs already");
        self.starts += 1;
        let env: Vec<(&str, &str)> = self
            .agent_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        self.agent = Some(
            self.node
                .start_agent_env(&Self::log_name(self.starts), &env)?,
        );
        Ok(())
    }

    /// Stops the agent with `signal` (its rules and holds stay in force).
    pub fn stop_agent(&mut self, signal: i32) -> Result<()> {
        if let Some(a) = self.agent.take() {
            a.stop(signal)?;
        }
        Ok(())
    }

    /// The agent's PID (0 when it is stopped).
    pub fn agent_pid(&self) -> u32 {
        self.agent.as_ref().map_or(0, NodeProcess::pid)
    }

    /// Runs `f` with a client of the API server.
    pub fn client<T: Send, F, Fut>(&self, f: F) -> Result<T>
    where
        F: FnOnce(kube::Client) -> Fut + Send,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.api.with_client(&self.node.net.node, f)
    }

    /// Creates namespace `name` with `labels` (or relabels it).
    pub fn namespace(&self, name: &str, labels: Value) -> Result<()> {
        let name = name.to_string();
        self.client(|c| async move {
            let api: Api<Namespace> = Api::all(c);
            let ns: Namespace = serde_json::from_value(json!({
                "metadata": { "name": name, "labels": labels },
            }))?;
            if api.get_opt(&name).await?.is_some() {
                api.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "metadata": { "labels": ns.metadata.labels } })),
                )
                .await?;
            } else {
                api.create(&PostParams::default(), &ns).await?;
            }
            Ok(())
        })
    }

    /// Sets annotations of a pod (`null` removes one).
    pub fn annotate(&self, namespace: &str, pod: &str, annotations: Value) -> Result<()> {
        let (namespace, pod) = (namespace.to_string(), pod.to_string());
        self.client(|c| async move {
            Api::<Pod>::namespaced(c, &namespace)
                .patch(
                    &pod,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "metadata": { "annotations": annotations } })),
                )
                .await?;
            Ok(())
        })
    }

    /// Sets the labels of a namespace or a pod (`null` removes one).
    pub fn relabel(&self, namespace: &str, pod: Option<&str>, labels: Value) -> Result<()> {
        let (namespace, pod) = (namespace.to_string(), pod.map(str::to_string));
        self.client(|c| async move {
            let patch = Patch::Merge(json!({ "metadata": { "labels": labels } }));
            match pod {
                Some(p) => {
                    Api::<Pod>::namespaced(c, &namespace)
                        .patch(&p, &PatchParams::default(), &patch)
                        .await?;
                }
                None => {
                    Api::<Namespace>::all(c)
                        .patch(&namespace, &PatchParams::default(), &patch)
                        .await?;
                }
            }
            Ok(())
        })
    }

    /// The pod `namespace/name` with `labels` and the container `ports`
    /// (Kubernetes `containerPort` list) as the kubelet makes it: the Pod
    /// object, its network through the CNI, its status, and `podtool serve`
    /// on [`PORTS`].
    pub fn add_pod(
        &self,
        namespace: &str,
        name: &str,
        labels: Value,
        ports: Value,
    ) -> Result<TestPod> {
        let pod = self.create_pod_object(namespace, name, labels, ports)?;
        let netns = Netns::new("xp")?;
        self.add_network(pod, netns, &[])
    }

    /// The Pod object alone (what the API server has before the kubelet
    /// sets the pod's network up).
    pub fn create_pod_object(
        &self,
        namespace: &str,
        name: &str,
        labels: Value,
        ports: Value,
    ) -> Result<(String, String)> {
        let (ns, n) = (namespace.to_string(), name.to_string());
        self.client(|c| async move {
            Api::<Pod>::namespaced(c, &ns)
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": { "name": n, "labels": labels },
                        "spec": { "nodeName": NODE, "containers": [{ "name": "c", "image": "pause", "ports": ports }] },
                    }))?,
                )
                .await?;
            Ok(())
        })?;
        Ok((namespace.to_string(), name.to_string()))
    }

    /// The network of a pod whose object exists, in `netns`: CNI ADD (at
    /// the addresses `ips`, when given: host-local's `args.cni.ips`), the
    /// status, the server.
    pub fn add_network(
        &self,
        pod: (String, String),
        netns: Netns,
        ips: &[IpAddr],
    ) -> Result<TestPod> {
        let mut pod = self.attach(pod, netns, ips)?;
        self.serve(&mut pod)?;
        Ok(pod)
    }

    /// [`Self::add_network`] without the server: what the scale benchmark
    /// fills a node with.
    pub fn attach(
        &self,
        (namespace, name): (String, String),
        netns: Netns,
        ips: &[IpAddr],
    ) -> Result<TestPod> {
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        let patch = if ips.is_empty() {
            json!({})
        } else {
            let list: Vec<String> = ips.iter().map(ToString::to_string).collect();
            json!({ "args": { "cni": { "ips": list } } })
        };
        let path = netns.path();
        let id = container_id(&namespace, &name);
        let mut call = Call::new("ADD", &id, Some(&path));
        call.args = &args;
        let out = self.net.call(&call, &patch)?;
        ensure!(out.status == 0, "ADD {namespace}/{name}: {}", out.json);
        let ips = result_ips(&out.json);
        let host = out.json["interfaces"][0]["name"]
            .as_str()
            .context("no host veth")?
            .to_string();
        let status_ips: Vec<Value> = ips.iter().map(|i| json!({ "ip": i.to_string() })).collect();
        let (ns2, n2) = (namespace.clone(), name.clone());
        let first = ips.first().map(ToString::to_string);
        self.client(|c| async move {
            Api::<Pod>::namespaced(c, &ns2)
                .patch_status(
                    &n2,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "status": {
                        "phase": "Running", "podIP": first, "podIPs": status_ips,
                    } })),
                )
                .await?;
            Ok(())
        })?;
        Ok(TestPod {
            namespace,
            name,
            netns,
            ips,
            host,
            server: None,
        })
    }

    /// Starts `podtool serve` on [`PORTS`] in `pod`; returns once it answers.
    fn serve(&self, pod: &mut TestPod) -> Result<()> {
        let (namespace, name, netns) = (&pod.namespace, &pod.name, &pod.netns);
        let ports: Vec<String> = PORTS.iter().map(u16::to_string).collect();
        let mut argv = vec!["serve"];
        argv.extend(ports.iter().map(String::as_str));
        let server = NodeProcess::spawn_env(
            netns,
            &podtool()?,
            &argv,
            &[("PODTOOL_NAME", &format!("{namespace}/{name}"))],
            &self
                .net
                .dir
                .path()
                .join(format!("serve-{namespace}-{name}.log")),
        )?;
        // Serving once the last port it binds answers inside the pod.
        let last = PORTS[PORTS.len() - 1];
        crate::in_netns(netns, move || {
            let start = Instant::now();
            while std::net::TcpStream::connect(("127.0.0.1", last)).is_err() {
                ensure!(
                    start.elapsed() < Duration::from_secs(10),
                    "podtool serve did not start"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(())
        })?;
        pod.server = Some(server);
        Ok(())
    }

    /// DEL of the pod's network and deletion of its object.
    pub fn del_pod(&self, mut pod: TestPod) -> Result<()> {
        drop(pod.server.take());
        let id = container_id(&pod.namespace, &pod.name);
        let out = self
            .net
            .call(&Call::new("DEL", &id, Some(&pod.netns.path())), &json!({}))?;
        ensure!(out.status == 0, "DEL {}: {}", pod.id(), out.json);
        let (ns, n) = (pod.namespace.clone(), pod.name.clone());
        self.client(|c| async move {
            Api::<Pod>::namespaced(c, &ns)
                .delete(&n, &DeleteParams::default())
                .await?;
            Ok(())
        })
    }

    /// Creates a NetworkPolicy (its namespace from its metadata).
    pub fn create_policy(&self, policy: Value) -> Result<()> {
        let np: NetworkPolicy = serde_json::from_value(policy)?;
        let ns = np.metadata.namespace.clone().context("policy namespace")?;
        self.client(|c| async move {
            Api::<NetworkPolicy>::namespaced(c, &ns)
                .create(&PostParams::default(), &np)
                .await?;
            Ok(())
        })
    }

    /// Creates every policy of `policies`, 32 requests at a time.
    pub fn create_policies(&self, policies: Vec<Value>) -> Result<()> {
        use futures::{StreamExt, TryStreamExt};
        let nps: Vec<NetworkPolicy> = policies
            .into_iter()
            .map(serde_json::from_value)
            .collect::<std::result::Result<_, _>>()?;
        self.client(|c| async move {
            futures::stream::iter(nps.into_iter().map(|np| {
                let c = c.clone();
                async move {
                    let ns = np.metadata.namespace.clone().context("policy namespace")?;
                    Api::<NetworkPolicy>::namespaced(c, &ns)
                        .create(&PostParams::default(), &np)
                        .await?;
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(32)
            .try_collect::<Vec<()>>()
            .await?;
            Ok(())
        })
    }

    /// Deletes NetworkPolicy `name` of `namespace`.
    pub fn delete_policy(&self, namespace: &str, name: &str) -> Result<()> {
        let (ns, name) = (namespace.to_string(), name.to_string());
        self.client(|c| async move {
            Api::<NetworkPolicy>::namespaced(c, &ns)
                .delete(&name, &DeleteParams::default())
                .await?;
            Ok(())
        })
    }

    /// Deletes every NetworkPolicy of the cluster.
    pub fn delete_policies(&self) -> Result<()> {
        self.client(|c| async move {
            let all: Api<NetworkPolicy> = Api::all(c.clone());
            for np in all.list(&Default::default()).await?.items {
                let (Some(ns), Some(name)) = (np.metadata.namespace, np.metadata.name) else {
                    continue;
                };
                Api::<NetworkPolicy>::namespaced(c.clone(), &ns)
                    .delete(&name, &DeleteParams::default())
                    .await?;
            }
            Ok(())
        })
    }

    /// `/metrics` of the agent as (name{labels} -> value) lines.
    pub fn metrics(&self) -> Result<BTreeMap<String, f64>> {
        let (code, body) = http_get(&self.net.node, LISTEN, "/metrics")?;
        ensure!(code == 200, "/metrics: {code}");
        Ok(body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect())
    }

    /// `xdpcni-agent status ARGS` run on the node against this agent (its
    /// config names the address): exit code, stdout, stderr.
    pub fn status(&self, args: &[&str]) -> Result<(Option<i32>, String, String)> {
        let bin = agent_binary()?;
        let config = self.config_path();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        crate::in_netns(&self.net.node, move || {
            let out = std::process::Command::new(&bin)
                .arg("status")
                .arg("--config")
                .arg(&config)
                .args(&args)
                .output()?;
            Ok((
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ))
        })
    }

    /// The pin directory.
    pub fn pin_dir(&self) -> &Path {
        self.node.pins.path()
    }
}

/// The container ID of a test pod (what the runtime would pick).
pub fn container_id(namespace: &str, name: &str) -> String {
    format!("{namespace}-{name}")
}
