//! The one test node: a node namespace with its CNI network (the real
//! plugin over Debian's reference plugins), its datapath pin directory and
//! its agent's typed config, from which any number of agent processes are
//! started, one after another, as a node's DaemonSet pod would be. Every
//! node of the tests and the benchmarks is built here
//! ([`Node::builder`]); the kinds of node a test needs add what they need
//! around it: [`crate::cluster::KubeNode`] its own API server,
//! [`crate::nodes::ClusterNode`] a Node object among others', and the
//! tests of the agent and of upgrades use it as it is.
//!
//! Unlike a [`crate::topo::WiredNode`] (namespaces wired by hand, no CNI,
//! no agent: the datapath's own tests), its pods are made by CNI ADDs.

use std::{net::IpAddr, path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use xdpcni_ebpf::Maps;

use crate::{
    cni::{agent_binary, result_ips, wait_ready, Call, Network, NodeProcess},
    netns::Netns,
    PinDir,
};

pub use crate::agent::AgentConfig;

/// How a [`Node`] is made.
#[derive(Debug)]
pub struct NodeBuilder {
    pin_prefix: &'static str,
    version: String,
    ranges: Value,
    ready_file: bool,
    pods: Option<Value>,
}

impl NodeBuilder {
    /// The prefix of its pin directory's unique name (each test file has
    /// its own, so a leftover says which test left it).
    pub fn pins(mut self, prefix: &'static str) -> Self {
        self.pin_prefix = prefix;
        self
    }

    /// Its host-local ranges (default [`Network::dual_stack`]).
    pub fn ranges(mut self, ranges: Value) -> Self {
        self.ranges = ranges;
        self
    }

    /// Its pod CIDRs, IPv4 and IPv6.
    pub fn pod_cidrs(self, v4: &str, v6: &str) -> Self {
        self.ranges(json!([[{ "subnet": v4 }], [{ "subnet": v6 }]]))
    }

    /// A ready file the agent creates and the CNI's STATUS requires
    /// (`readyFile` / `agentReadyFile`, as the chart sets both).
    pub fn ready_file(mut self) -> Self {
        self.ready_file = true;
        self
    }

    /// A standalone agent's pods file with `pods` in it
    /// (`{"ns/name" | "container-id": {annotations}}`).
    pub fn pods_file(mut self, pods: Value) -> Self {
        self.pods = Some(pods);
        self
    }

    /// Makes the namespace, pins and network, and the agent's config (not
    /// yet written: [`Node::spawn_agent`] writes it).
    pub fn build(self) -> Result<Node> {
        let pins = PinDir::new(self.pin_prefix)?;
        let mut net = Network::new(pins.path(), &self.version, self.ranges)?;
        let dir = net.dir.path().to_path_buf();
        let mut config = AgentConfig::new(pins.path().to_path_buf(), dir.join("state"));
        if self.ready_file {
            let ready = dir.join("agent-ready");
            net.conf.agent_ready_file = Some(ready.clone());
            config.ready_file = Some(ready);
        }
        if let Some(pods) = self.pods {
            let file = dir.join("pods.json");
            std::fs::write(&file, pods.to_string()).context("writing the pods file")?;
            config.pods_file = Some(file);
        }
        Ok(Node {
            net,
            pins,
            config,
            kubeconfig: None,
        })
    }
}

/// One node (see the module doc).
#[derive(Debug)]
pub struct Node {
    /// Its namespace and CNI network (dropped before the pins).
    pub net: Network,
    /// Its datapath pins.
    pub pins: PinDir,
    /// The config of its agent's next start.
    pub config: AgentConfig,
    /// The API server its agent's next start talks to (`run`); none: the
    /// agent runs `standalone` over its pods file.
    pub kubeconfig: Option<PathBuf>,
}

impl Node {
    /// The standalone node of the agent's tests: a ready file, an empty
    /// pods file, native XDP and devmap as the node defaults, node-wide work
    /// every 200 ms, the agent's default address; pins `prefix*`.
    pub fn standalone(prefix: &'static str) -> Result<Self> {
        let mut node = Self::builder()
            .pins(prefix)
            .ready_file()
            .pods_file(json!({}))
            .build()?;
        node.config.xdp_mode = "native".into();
        node.config.redirect = "devmap".into();
        node.config.interval_ms = 200;
        Ok(node)
    }

    /// A node with the defaults: pins `xn*`, CNI 1.1.0, dual-stack ranges,
    /// no ready file, no pods file.
    pub fn builder() -> NodeBuilder {
        NodeBuilder {
            pin_prefix: "xn",
            version: "1.1.0".into(),
            ranges: Network::dual_stack(),
            ready_file: false,
            pods: None,
        }
    }

    /// Where the agent's config is written.
    pub fn config_path(&self) -> PathBuf {
        self.net.dir.path().join("agent.json")
    }

    /// The pods file, when the node has one.
    pub fn pods_file(&self) -> Option<&std::path::Path> {
        self.config.pods_file.as_deref()
    }

    /// Rewrites the pods file (a standalone agent reads it on change).
    pub fn set_pods(&self, pods: &Value) -> Result<()> {
        let file = self.pods_file().context("the node has no pods file")?;
        std::fs::write(file, pods.to_string()).context("writing the pods file")
    }

    /// Writes the config and starts the agent binary `bin` (this build's:
    /// [`agent_binary`]; an upgrade test's: the previous release's) with
    /// `env`, its stderr to the file `log` of the node's directory. Does
    /// not wait for it.
    pub fn spawn_agent(
        &self,
        bin: &std::path::Path,
        log: &str,
        env: &[(&str, &str)],
    ) -> Result<NodeProcess> {
        let path = self.config_path();
        let text = serde_json::to_string(&self.config).context("serializing the agent config")?;
        std::fs::write(&path, text).context("writing the agent config")?;
        let config = path.to_str().context("config path")?;
        let kubeconfig = self.kubeconfig.as_deref().map(|k| k.to_string_lossy());
        let mut env: Vec<(&str, &str)> = env.to_vec();
        let command = match &kubeconfig {
            Some(k) => {
                env.push(("KUBECONFIG", k));
                "run"
            }
            None => "standalone",
        };
        NodeProcess::spawn_env(
            &self.net.node,
            bin,
            &[command, "--config", config],
            &env,
            &self.net.dir.path().join(log),
        )
    }

    /// Starts this build's agent (see [`Node::spawn_agent`]) and waits until
    /// it answers `/readyz`.
    pub fn start_agent(&self, log: &str) -> Result<NodeProcess> {
        self.start_agent_env(log, &[])
    }

    /// [`Node::start_agent`] with extra environment.
    pub fn start_agent_env(&self, log: &str, env: &[(&str, &str)]) -> Result<NodeProcess> {
        let agent = self.spawn_agent(&agent_binary()?, log, env)?;
        self.wait_agent_ready(log)?;
        Ok(agent)
    }

    /// Waits until the agent answers `/readyz` on its config's address;
    /// the error carries its log `log`.
    pub fn wait_agent_ready(&self, log: &str) -> Result<Duration> {
        wait_ready(
            &self.net.node,
            &self.config.listen,
            Duration::from_secs(30),
            || self.log(log),
        )
    }

    /// The file `name` of the node's directory (an agent's log), or "".
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.net.dir.path().join(name)).unwrap_or_default()
    }

    /// ADDs pod `namespace/name` through the CNI as a runtime would
    /// (container ID `name`, `K8S_POD_*` set): its namespace and the result.
    pub fn add_pod(&self, namespace: &str, name: &str) -> Result<(Netns, Value)> {
        let ns = Netns::new("xp")?;
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        let path = ns.path();
        let mut call = Call::new("ADD", name, Some(&path));
        call.args = &args;
        let out = self.net.call(&call, &json!({}))?;
        anyhow::ensure!(out.status == 0, "ADD {namespace}/{name}: {}", out.json);
        Ok((ns, out.json))
    }

    /// Pods `default/a` and `default/b` through the CNI.
    pub fn pair(&self) -> Result<PodPair> {
        let (pa, ra) = self.add_pod("default", "a")?;
        let (pb, rb) = self.add_pod("default", "b")?;
        Ok(PodPair {
            ha: host_veth(&ra)?,
            hb: host_veth(&rb)?,
            b_ip: result_ips(&rb)
                .into_iter()
                .find(IpAddr::is_ipv4)
                .context("b's IPv4")?,
            pa,
            ra,
            pb,
            rb,
        })
    }

    /// [`Node::pair`], then waits until the agent has attached both pods in
    /// `mode` (as [`crate::agent::mode_of`] names it). Each pod's first
    /// endpoint write waits a grace period of its own, so a test that looks
    /// at the node after seeing only `a` attached can see `b` arrive.
    pub fn pair_attached(&self, mode: &str, within: Duration) -> Result<PodPair> {
        let pair = self.pair()?;
        for host in [&pair.ha, &pair.hb] {
            crate::agent::wait_mode(&self.net.node, host, mode, within)
                .with_context(|| format!("agent log: {}", self.log("agent.log")))?;
        }
        Ok(pair)
    }

    /// Everything of the node an outsider could change, as text to compare
    /// before and after: the datapath's maps and link pins, the XDP attached
    /// to each of `hosts`, the CNI's records.
    pub fn state(&self, hosts: &[&str]) -> Result<String> {
        let maps = Maps::open_pinned(self.pins.path())?;
        let names = |dir: PathBuf| -> Result<Vec<std::ffi::OsString>> {
            let mut v: Vec<_> = std::fs::read_dir(dir)?
                .flatten()
                .map(|e| e.file_name())
                .collect();
            v.sort();
            Ok(v)
        };
        let links = names(self.pins.path().join("links"))?;
        let xdp = hosts
            .iter()
            .map(|h| self.net.node.xdp_attached(h))
            .collect::<Result<Vec<_>>>()?;
        let mut records = std::fs::read_dir(self.net.dir.path().join("state"))?
            .flatten()
            .map(|e| std::fs::read_to_string(e.path()))
            .collect::<std::io::Result<Vec<_>>>()?;
        records.sort();
        Ok(format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{links:?}\n{xdp:?}\n{records:?}",
            maps.endpoints()?,
            maps.tx_port_list()?,
            maps.slot_owner_list()?,
            maps.nat_ports()?,
        ))
    }

    /// DELs pod `name` (container ID `name`) in `ns`.
    pub fn del_pod(&self, name: &str, ns: &Netns) -> Result<()> {
        let path = ns.path();
        let out = self
            .net
            .call(&Call::new("DEL", name, Some(&path)), &json!({}))?;
        anyhow::ensure!(out.status == 0, "DEL {name}: {}", out.json);
        Ok(())
    }
}

/// Pods a and b of a node: namespaces, ADD results, host veths, b's IPv4.
#[derive(Debug)]
pub struct PodPair {
    /// a's namespace.
    pub pa: Netns,
    /// a's ADD result.
    pub ra: Value,
    /// b's namespace.
    pub pb: Netns,
    /// b's ADD result.
    pub rb: Value,
    /// a's host veth.
    pub ha: String,
    /// b's host veth.
    pub hb: String,
    /// b's IPv4 address.
    pub b_ip: IpAddr,
}

/// The host veth of a CNI result.
pub fn host_veth(res: &Value) -> Result<String> {
    Ok(res["interfaces"][0]["name"]
        .as_str()
        .context("the result names no host interface")?
        .to_string())
}
