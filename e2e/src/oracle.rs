//! kube-proxy as the oracle of xdpcni's Services: a real kube-proxy 1.20.2
//! (iptables mode) beside the agent on a [`KubeNode`], both reading the same
//! Services and Endpoints, and the probes that run the same client once
//! translated by the agent's programs (inside the test cgroup they are
//! attached to) and once through kube-proxy's rules alone (outside it). The
//! `kpr` tests and `service_equiv` compare what each side saw.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use k8s_openapi::api::core::v1::{Endpoints, Service};
use kube::{
    api::{Patch, PatchParams, PostParams},
    Api,
};
use serde_json::{json, Value};

use crate::{
    cgroup::TestCgroup,
    cluster::{KubeNode, LISTEN, NODE},
    cni::{http_get, NodeProcess},
    kube::k8s_binary,
    netns::{run_out, Netns},
};

/// The address of a pod of "another node": a namespace behind a link of
/// the node, in the cluster's pod range (kube-proxy's clusterCIDR), not in
/// this node's.
pub const REMOTE4: &str = "10.78.1.10";
/// Its IPv6 address.
pub const REMOTE6: &str = "fd78:0:0:1::10";

/// kube-proxy 1.20.2 in iptables mode in the node's namespace, reading
/// Endpoints (as the agent does on this API server), both families; killed
/// by its PID on Drop. Its rules go with the node's namespace.
pub fn kube_proxy(node: &KubeNode) -> Result<NodeProcess> {
    let dir = node.net.dir.path();
    let config = dir.join("kube-proxy.yaml");
    std::fs::write(
        &config,
        format!(
            r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: "{}"}}
mode: iptables
clusterCIDR: "10.78.0.0/16,fd78::/48"
hostnameOverride: {NODE}
featureGates: {{IPv6DualStack: true, EndpointSliceProxying: false}}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
iptables: {{minSyncPeriod: 0s}}
# Leave the host-wide conntrack settings alone.
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"#,
            node.api.kubeconfig.display()
        ),
    )?;
    NodeProcess::spawn(
        &node.net.node,
        &k8s_binary("kube-proxy")?,
        &[&format!("--config={}", config.display())],
        &dir.join("kube-proxy.log"),
    )
}

/// "Another node's pod": `podtool serve` as `remote/r1` in a namespace
/// linked to the node, routed both ways.
pub struct Remote {
    _server: NodeProcess,
    netns: Netns,
}

impl Remote {
    /// Its namespace (a benchmark's servers run there too).
    pub fn netns(&self) -> &Netns {
        &self.netns
    }
}

/// Makes [`Remote`], and gives the node a default route through it (a
/// cluster IP with no rule for it is routed, so kube-proxy's REJECT
/// answers, not the routing lookup) and unlimited ICMP errors (each
/// refusal is seen).
pub fn remote(node: &KubeNode) -> Result<Remote> {
    remote_on(node, &crate::unique_name("xr"))
}

/// [`remote`] behind the node's link `host` (a name the caller chose, e.g.
/// for the agent's config before the link exists).
pub fn remote_on(node: &KubeNode, host: &str) -> Result<Remote> {
    let netns = Netns::new("xr")?;
    let host = host.to_string();
    let n = &node.net.node;
    n.add_veth(&host, "eth0", Some(&netns))?;
    n.ip(&["addr", "add", "10.78.1.1/24", "dev", &host])?;
    n.ip(&["addr", "add", "fd78:0:0:1::1/64", "dev", &host, "nodad"])?;
    n.ip(&["link", "set", &host, "up"])?;
    n.ip(&["route", "add", "default", "via", REMOTE4])?;
    n.ip(&["-6", "route", "add", "default", "via", REMOTE6])?;
    n.sysctl("net.ipv4.icmp_ratelimit", "0")?;
    n.sysctl("net.ipv6.icmp.ratelimit", "0")?;
    netns.ip(&["addr", "add", &format!("{REMOTE4}/24"), "dev", "eth0"])?;
    netns.ip(&[
        "addr",
        "add",
        &format!("{REMOTE6}/64"),
        "dev",
        "eth0",
        "nodad",
    ])?;
    netns.ip(&["link", "set", "eth0", "up"])?;
    netns.ip(&["route", "add", "default", "via", "10.78.1.1"])?;
    netns.ip(&["-6", "route", "add", "default", "via", "fd78:0:0:1::1"])?;
    let server = NodeProcess::spawn_env(
        &netns,
        &crate::cluster::podtool()?,
        &["serve", "80", "81"],
        &[("PODTOOL_NAME", "remote/r1")],
        &node.net.dir.path().join("serve-remote.log"),
    )?;
    Ok(Remote {
        _server: server,
        netns,
    })
}

/// A client outside the node: a namespace behind a link of the node (an
/// uplink: `device` in the node's namespace), both families, its default
/// routes through the node (so externalIPs and LoadBalancer IPs are
/// routed to it, as a router in front of a cluster does).
pub struct Outside {
    /// The client's namespace.
    pub netns: Netns,
    /// The uplink's name in the node's namespace.
    pub device: String,
    /// The client's addresses (IPv4, IPv6).
    pub client: [IpAddr; 2],
    /// The node's addresses on the uplink (IPv4, IPv6).
    pub node: [IpAddr; 2],
}

/// Makes an [`Outside`] whose uplink is `device` (a name the caller chose,
/// e.g. for the agent's config before the link exists), in subnets
/// 192.0.2.0/24 + 2001:db8:N::/64 for `n` 0 and 198.18.N.0/24 for others.
pub fn outside(node: &KubeNode, device: &str, n: u8) -> Result<Outside> {
    let netns = Netns::new("xo")?;
    let (v4, v6) = if n == 0 {
        ("192.0.2".to_string(), format!("2001:db8:{n}"))
    } else {
        (format!("198.18.{n}"), format!("2001:db8:{n}"))
    };
    let nn = &node.net.node;
    nn.add_veth(device, "eth0", Some(&netns))?;
    nn.ip(&["addr", "add", &format!("{v4}.1/24"), "dev", device])?;
    nn.ip(&[
        "addr",
        "add",
        &format!("{v6}::1/64"),
        "dev",
        device,
        "nodad",
    ])?;
    nn.ip(&["link", "set", device, "up"])?;
    netns.ip(&["addr", "add", &format!("{v4}.10/24"), "dev", "eth0"])?;
    netns.ip(&[
        "addr",
        "add",
        &format!("{v6}::10/64"),
        "dev",
        "eth0",
        "nodad",
    ])?;
    netns.ip(&["link", "set", "eth0", "up"])?;
    netns.ip(&["route", "add", "default", "via", &format!("{v4}.1")])?;
    netns.ip(&["-6", "route", "add", "default", "via", &format!("{v6}::1")])?;
    let ip = |s: String| -> Result<IpAddr> { Ok(s.parse()?) };
    Ok(Outside {
        client: [ip(format!("{v4}.10"))?, ip(format!("{v6}::10"))?],
        node: [ip(format!("{v4}.1"))?, ip(format!("{v6}::1"))?],
        device: device.to_string(),
        netns,
    })
}

/// The agent's status, as JSON.
pub fn status(node: &KubeNode) -> Result<Value> {
    let (code, body) = http_get(&node.net.node, LISTEN, "/v1/status")?;
    ensure!(code == 200, "status {code}: {body}");
    Ok(serde_json::from_str(&body)?)
}

/// The calls the programs translated so far.
pub fn translated(node: &KubeNode) -> Result<u64> {
    status(node)?["services"]["translated"]
        .as_u64()
        .context("no services.translated in the status")
}

/// Waits until `f` holds, polling every 50 ms, for at most `within`.
pub fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    while !f() {
        if start.elapsed() >= within {
            bail!("{what}: not within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A Service of the test: its name, labels, extra spec, families ("IPv4",
/// "IPv6" or both, IPv4 first), and the addresses of its Endpoints (ready
/// and not ready), which both the agent and kube-proxy read.
pub struct Shape {
    /// Its name (in namespace `default`).
    pub name: String,
    /// Its labels.
    pub labels: Value,
    /// Spec fields beyond the families (and the ports, unless it names
    /// them: `http` 8080/TCP, `dns` 8080/UDP, `alt` 8081/TCP).
    pub spec: Value,
    /// Its IP families.
    pub families: &'static [&'static str],
    /// Ready endpoint addresses.
    pub ready: Vec<IpAddr>,
    /// Endpoint addresses not ready.
    pub not_ready: Vec<IpAddr>,
}

impl Shape {
    /// The addresses a connect to a cluster IP of family `v6` may reach:
    /// those of the Endpoints' family (its first address's; kube-proxy
    /// ignores the others, and so does the agent).
    pub fn reachable(&self, v6: bool) -> Vec<IpAddr> {
        let first = self.ready.iter().chain(&self.not_ready).next();
        if first.is_some_and(|f| f.is_ipv6() != v6) {
            return Vec::new();
        }
        self.ready
            .iter()
            .copied()
            .filter(|ip| ip.is_ipv6() == v6)
            .collect()
    }
}

/// The Service ports of every shape, by name: TCP and UDP to port 80 by
/// number, and TCP to 81 by the name `alt` (only the Endpoints resolve it).
pub const PORT_NAMES: [&str; 3] = ["http", "dns", "alt"];

fn ports() -> Value {
    json!([
        { "name": "http", "port": 8080, "targetPort": 80 },
        { "name": "dns", "port": 8080, "protocol": "UDP", "targetPort": 80 },
        { "name": "alt", "port": 8081, "targetPort": "alt" },
    ])
}

/// The node an endpoint address is on: [`REMOTE4`] and [`REMOTE6`]
/// another's (`node-b`), every other address this node's.
fn node_of(ip: &IpAddr) -> &'static str {
    if ip.to_string() == REMOTE4 || ip.to_string() == REMOTE6 {
        "node-b"
    } else {
        NODE
    }
}

fn subsets(ready: &[IpAddr], not_ready: &[IpAddr]) -> Value {
    let addrs = |ips: &[IpAddr]| -> Vec<Value> {
        ips.iter()
            .map(|ip| json!({ "ip": ip.to_string(), "nodeName": node_of(ip) }))
            .collect()
    };
    json!([{
        "addresses": addrs(ready),
        "notReadyAddresses": addrs(not_ready),
        "ports": [
            { "name": "http", "port": 80 },
            { "name": "dns", "port": 80, "protocol": "UDP" },
            { "name": "alt", "port": 81 },
        ],
    }])
}

/// Creates the Endpoints and the Service of `shape`: its cluster IPs.
pub fn create(node: &KubeNode, shape: &Shape) -> Result<Vec<IpAddr>> {
    let eps = json!({
        "metadata": { "name": shape.name, "labels": shape.labels },
        "subsets": subsets(&shape.ready, &shape.not_ready),
    });
    let mut spec = shape.spec.clone();
    if spec.get("ports").is_none() {
        spec["ports"] = ports();
    }
    spec["ipFamilies"] = json!(shape.families);
    spec["ipFamilyPolicy"] = json!(if shape.families.len() == 2 {
        "RequireDualStack"
    } else {
        "SingleStack"
    });
    let svc = json!({
        "metadata": { "name": shape.name, "labels": shape.labels },
        "spec": spec,
    });
    node.client(move |c| async move {
        Api::<Endpoints>::namespaced(c.clone(), "default")
            .create(&PostParams::default(), &serde_json::from_value(eps)?)
            .await?;
        let svc = Api::<Service>::namespaced(c, "default")
            .create(&PostParams::default(), &serde_json::from_value(svc)?)
            .await?;
        let ips = svc.spec.and_then(|s| s.cluster_ips).unwrap_or_default();
        Ok(ips
            .iter()
            .map(|i| i.parse())
            .collect::<Result<Vec<_>, _>>()?)
    })
}

/// Service `name`'s node ports, by port name.
pub fn node_ports(node: &KubeNode, name: &str) -> Result<BTreeMap<String, u16>> {
    let name = name.to_string();
    node.client(move |c| async move {
        let svc = Api::<Service>::namespaced(c, "default").get(&name).await?;
        Ok(svc
            .spec
            .and_then(|s| s.ports)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| Some((p.name?, u16::try_from(p.node_port?).ok()?)))
            .collect())
    })
}

/// Gives LoadBalancer Service `name` the ingress IPs `ips` (its status, as
/// a cloud's controller writes it).
pub fn set_balancer(node: &KubeNode, name: &str, ips: &[IpAddr]) -> Result<()> {
    let ingress: Vec<Value> = ips
        .iter()
        .map(|ip| json!({ "ip": ip.to_string() }))
        .collect();
    let patch = json!({ "status": { "loadBalancer": { "ingress": ingress } } });
    let name = name.to_string();
    node.client(move |c| async move {
        Api::<Service>::namespaced(c, "default")
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    })
}

/// Makes `ready` the ready addresses of Service `name`'s Endpoints.
pub fn set_ready(node: &KubeNode, name: &str, ready: &[IpAddr]) -> Result<()> {
    let patch = json!({ "subsets": subsets(ready, &[]) });
    let name = name.to_string();
    node.client(move |c| async move {
        Api::<Endpoints>::namespaced(c, "default")
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    })
}

/// The node's iptables and ip6tables rules.
pub fn rules(node: &KubeNode) -> (String, String) {
    let save = |tool: &str| {
        run_out(&["ip", "netns", "exec", node.net.node.name(), tool]).unwrap_or_default()
    };
    (save("iptables-save"), save("ip6tables-save"))
}

/// Waits until kube-proxy has a rule for every port of every Service of
/// `shapes` (a comment names each Service port).
pub fn wait_rules(node: &KubeNode, shapes: &[&Shape]) -> Result<()> {
    wait_for("kube-proxy's rules", Duration::from_secs(60), || {
        let (v4, v6) = rules(node);
        shapes.iter().all(|s| {
            let names: Vec<&str> = match s.spec.get("ports").and_then(Value::as_array) {
                Some(ports) => ports.iter().filter_map(|p| p["name"].as_str()).collect(),
                None => PORT_NAMES.to_vec(),
            };
            s.families.iter().all(|f| {
                let r = if *f == "IPv6" { &v6 } else { &v4 };
                names
                    .iter()
                    .all(|p| r.contains(&format!("default/{}:{p}", s.name)))
            })
        })
    })
}

/// One probe's result: each distinct answer ("BACKEND SOURCE" or "error
/// KIND") with its count.
pub type Seen = BTreeMap<String, u32>;

/// `podtool who PROTO ADDR PORT N` from network namespace `client`,
/// translated (`inside` the test cgroup) or not.
pub fn probe(
    cg: &TestCgroup,
    client: &str,
    inside: bool,
    proto: &str,
    to: (IpAddr, u16),
    n: u32,
) -> Result<Seen> {
    let args = [
        "who".to_string(),
        proto.to_string(),
        to.0.to_string(),
        to.1.to_string(),
        n.to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = cg
        .podtool(inside, client, &args)
        .with_context(|| format!("{proto} {to:?}"))?;
    Ok(counted(&out)?.into_iter().collect())
}

/// podtool's "ANSWER COUNT" lines, in order.
fn counted(out: &str) -> Result<Vec<(String, u32)>> {
    out.lines()
        .map(|l| {
            let (what, count) = l.rsplit_once(' ').context("a line without a count")?;
            Ok((what.to_string(), count.parse()?))
        })
        .collect()
}

/// `podtool follow ADDR PORT SECS`: the runs of equal answers one connected
/// UDP socket got, in order.
pub fn follow(
    cg: &TestCgroup,
    client: &str,
    inside: bool,
    to: (IpAddr, u16),
    secs: f64,
) -> Result<Vec<(String, u32)>> {
    let (ip, port, secs) = (to.0.to_string(), to.1.to_string(), secs.to_string());
    counted(&cg.podtool(inside, client, &["follow", &ip, &port, &secs])?)
}
