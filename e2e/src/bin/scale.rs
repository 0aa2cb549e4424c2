//! The scale benchmark: what xdpcni costs on a full node of a large
//! cluster, against Debian's reference `ptp` plugin where it applies.
//!
//! - CNI ADD and DEL p50/p99 as the node fills 0 -> 50 -> 110 -> 250 pods
//!   (the agent in Kubernetes mode against a real kube-apiserver, every pod
//!   a Pod object and a network namespace made by the real plugin), and
//!   ptp at the same fill;
//! - with 250 pods: the agent's idle CPU and RSS, its pod reconcile p99,
//!   and an annotation PATCH until the pod's veth is in the new mode;
//! - 1000 Node objects (1000 host-gateway routes): time until one Node
//!   added or removed is a route added or removed;
//! - 5000 Services and their Endpoints, each a port of a local pod: the
//!   NAT'd ports, the node task's duration, idle CPU and RSS;
//! - 1000 NetworkPolicies selecting one pod: a policy update until it is
//!   in force, and that pod's forwarding rate with them against none;
//! - the XDP program's run time per packet (bpf_stats) with 64k endpoints
//!   in the maps against 2;
//! - standalone mode with 250 pods: idle CPU and RSS.
//!
//! Every figure is measured `--reps` times and the table gives the median;
//! `--quick` (CI) runs each once with short windows, at the same sizes.
//! Writes scale.md, scale.json and scale.png (python3 + matplotlib) under
//! `--out`. Build with `cargo build --release --workspace --bins`, run as
//! root.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Endpoints, Node, Service};
use kube::{
    api::{Patch, PatchParams, PostParams},
    Api,
};
use serde::Serialize;
use serde_json::{json, Value};
use xdpcni_e2e::{
    agent::StandaloneAgent,
    cluster::{KubeNode, TestPod, LISTEN, NODE},
    cni::{http_get, Call, Network, REFERENCE_PLUGINS},
    measure::{
        frame_between, median, percentile, process_cpu_percent, process_rss_mib, raw_sink_rate,
        report_tail, write_report, BpfStats, Op, Target,
    },
    netns::Netns,
    traffic::udp_flood,
    PinDir,
};
use xdpcni_ebpf::Maps;

static INTERRUPTED: std::sync::LazyLock<Arc<AtomicBool>> =
    std::sync::LazyLock::new(|| Arc::new(AtomicBool::new(false)));

fn check_interrupt() -> Result<()> {
    ensure!(!INTERRUPTED.load(Ordering::Relaxed), "interrupted");
    Ok(())
}

/// What the node is filled to.
const FILLS: [usize; 4] = [0, 50, 110, 250];
/// The full node.
const FULL: usize = 250;
/// Other nodes of the cluster.
const NODES: usize = 1000;
/// Services, each with an Endpoints object naming a port of a local pod.
const SERVICES: usize = 5000;
/// NetworkPolicies selecting one pod.
const POLICIES: usize = 1000;
/// Endpoints in the maps for the per-packet figure (endpoints4's size).
const ENDPOINTS: usize = 65536;
/// How many API writes are in flight at once while filling.
const API_CONCURRENCY: usize = 32;

const XDPCNI: &str = "xdpcni";
const PTP: &str = "ptp";

/// The scale benchmark. Run as root.
#[derive(clap::Parser, Debug)]
#[command(version, about)]
struct Opts {
    /// CI smoke test: one repetition of each figure, short windows, the
    /// same sizes (checks that every figure runs, not the numbers).
    #[arg(long)]
    quick: bool,
    /// Repetitions of each figure.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    reps: u64,
    /// Where scale.md, scale.json and scale.png go.
    #[arg(long, default_value = "target/scale")]
    out: PathBuf,
}

impl Opts {
    fn reps(&self) -> usize {
        if self.quick {
            1
        } else {
            self.reps as usize
        }
    }
    /// ADD/DEL probes per repetition and fill.
    fn probes(&self) -> usize {
        if self.quick {
            10
        } else {
            40
        }
    }
    /// The idle CPU window.
    fn idle_window(&self) -> Duration {
        Duration::from_secs(if self.quick { 3 } else { 10 })
    }
    /// Annotation and route samples per repetition.
    fn changes(&self) -> usize {
        if self.quick {
            3
        } else {
            20
        }
    }
    /// Policy updates per repetition (each ~2.5 s with 1000 policies).
    fn policy_changes(&self) -> usize {
        if self.quick {
            2
        } else {
            5
        }
    }
    fn flood(&self) -> Duration {
        Duration::from_secs(if self.quick { 1 } else { 3 })
    }
}

#[derive(Serialize, Clone)]
struct Sample {
    figure: String,
    path: String,
    rep: usize,
    value: f64,
}

#[derive(Default)]
struct Run {
    samples: Vec<Sample>,
    notes: Vec<String>,
    /// (figure, unit) in table order.
    figures: Vec<(String, &'static str)>,
}

impl Run {
    fn push(&mut self, figure: &str, unit: &'static str, path: &str, rep: usize, value: f64) {
        if !self.figures.iter().any(|(f, _)| f == figure) {
            self.figures.push((figure.to_string(), unit));
        }
        self.samples.push(Sample {
            figure: figure.into(),
            path: path.into(),
            rep,
            value,
        });
    }

    fn median_of(&self, figure: &str, path: &str) -> Option<f64> {
        let mut v: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.figure == figure && s.path == path)
            .map(|s| s.value)
            .collect();
        (!v.is_empty()).then(|| median(&mut v))
    }
}

fn add_figure(stat: &str, op: &str, fill: usize) -> String {
    format!("CNI {op} {stat} at {fill} pods")
}

const F_IDLE_CPU: &str = "agent idle CPU, 250 pods (Kubernetes mode)";
const F_RSS: &str = "agent RSS, 250 pods";
const F_RECONCILE: &str = "pod reconcile p99, 250 pods (histogram bucket)";
const F_ANNOTATION_P50: &str = "annotation PATCH -> mode applied p50, 250 pods";
const F_ANNOTATION_P99: &str = "annotation PATCH -> mode applied p99, 250 pods";
const F_NODES_LIST: &str = "1000 Nodes created -> 1000 routes";
const F_ROUTE_P50: &str = "Node added/removed -> route p50, 1000 nodes";
const F_ROUTE_P99: &str = "Node added/removed -> route p99, 1000 nodes";
const F_IDLE_CPU_NODES: &str = "agent idle CPU, 250 pods, 1000 nodes";
const F_SERVICES_NAT: &str = "5000 Services created -> NAT'd ports in the map";
const F_NAT_PORTS: &str = "NAT'd ports in the map, 5000 Services";
const F_NODE_TASK_P50: &str = "node task p50, 250 pods, 1000 nodes, 5000 Services";
const F_NODE_TASK_P99: &str = "node task p99, 250 pods, 1000 nodes, 5000 Services";
const F_IDLE_CPU_ALL: &str = "agent idle CPU, 250 pods, 1000 nodes, 5000 Services";
const F_RSS_ALL: &str = "agent RSS, 250 pods, 1000 nodes, 5000 Services";
const F_POLICY_P50: &str = "policy created -> in force p50, 1000 policies";
const F_POLICY_P99: &str = "policy created -> in force p99, 1000 policies";
const F_POLICY_TX: &str = "nftables transaction, 1000 policies (mean)";
const F_POLICY_FWD: &str = "forwarding 64-byte to a selected pod, kernel path";
const F_PROG_NS: &str = "XDP program per packet (bpf_stats)";
const F_STANDALONE_CPU: &str = "agent idle CPU, 250 pods (standalone mode)";
const F_STANDALONE_RSS: &str = "agent RSS, 250 pods (standalone mode)";

fn main() -> Result<()> {
    // What a node runs: the product binaries, not the tests' hooked builds.
    xdpcni_e2e::cni::use_product_binaries();
    let o = <Opts as clap::Parser>::parse();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&INTERRUPTED))
            .with_context(|| format!("handling signal {sig}"))?;
    }
    let mut run = Run::default();
    cluster_section(&o, &mut run).context("the Kubernetes-mode node")?;
    endpoints_section(&o, &mut run).context("the per-packet cost with 64k endpoints")?;
    standalone_section(&o, &mut run).context("standalone mode")?;
    report(&o, &run)
}

/// A node of pods made by a CNI plugin, to fill and probe.
trait Filled {
    /// Adds the `i`th background pod.
    fn fill_one(&mut self, i: usize) -> Result<()>;
    /// One probe pod's ADD and DEL, timed (ms); its object and namespace
    /// are made before and removed after the timing.
    fn probe(&mut self, i: usize) -> Result<(f64, f64)>;
    /// Waits until the node is done with what the fill started.
    fn settle(&self) -> Result<()>;
    fn filled(&self) -> usize;
}

/// A pod's network namespace without IPv6 duplicate address detection:
/// ptp waits until its addresses leave the tentative state (DAD: ~1.8 s
/// here), which would measure the kernel's DAD timer, not the plugin.
/// Both plugins get the same namespaces.
fn pod_netns(prefix: &str) -> Result<Netns> {
    let ns = Netns::new(prefix)?;
    no_dad(&ns)?;
    Ok(ns)
}

fn no_dad(ns: &Netns) -> Result<()> {
    ns.exec(&[
        "sysctl",
        "-qw",
        "net.ipv6.conf.all.accept_dad=0",
        "net.ipv6.conf.default.accept_dad=0",
    ])
    .map(drop)
}

/// The xdpcni node: a real API server and agent, pods with Pod objects.
struct XdpcniFill {
    node: KubeNode,
    pods: Vec<TestPod>,
}

const FILL_NS: &str = "scale";

impl Filled for XdpcniFill {
    fn fill_one(&mut self, i: usize) -> Result<()> {
        let obj = self.node.create_pod_object(
            FILL_NS,
            &format!("fill-{i:03}"),
            json!({ "app": "fill" }),
            json!([]),
        )?;
        let pod = self.node.attach(obj, pod_netns("xs")?, &[])?;
        self.pods.push(pod);
        Ok(())
    }

    fn probe(&mut self, i: usize) -> Result<(f64, f64)> {
        let name = format!("probe-{i:04}");
        self.node
            .create_pod_object(FILL_NS, &name, json!({ "app": "probe" }), json!([]))?;
        let netns = pod_netns("xq")?;
        let id = xdpcni_e2e::cluster::container_id(FILL_NS, &name);
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={FILL_NS};K8S_POD_NAME={name}");
        let path = netns.path();
        let timed = |command| -> Result<f64> {
            let mut call = Call::new(command, &id, Some(&path));
            call.args = &args;
            let t = Instant::now();
            let out = self.node.net.call(&call, &json!({}))?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            ensure!(out.status == 0, "{command} {name}: {}", out.json);
            Ok(ms)
        };
        let add = timed("ADD")?;
        let del = timed("DEL")?;
        self.node.client(|c| async move {
            Api::<k8s_openapi::api::core::v1::Pod>::namespaced(c, FILL_NS)
                .delete(&name, &Default::default())
                .await?;
            Ok(())
        })?;
        Ok((add, del))
    }

    fn settle(&self) -> Result<()> {
        wait_converged(
            &self.node.net.node,
            LISTEN,
            self.pods.len(),
            xdpcni_host::pod::DEFAULT_MODE.as_str(),
        )
    }

    fn filled(&self) -> usize {
        self.pods.len()
    }
}

/// The ptp node: Debian's reference plugin with host-local, no agent.
struct PtpFill {
    net: Network,
    _pins: PinDir,
    pods: Vec<Netns>,
}

impl PtpFill {
    fn new() -> Result<Self> {
        let pins = PinDir::new("xz")?;
        // Debian's plugins speak CNI 1.0.0 at most.
        let mut net = Network::new(pins.path(), "1.0.0", Network::dual_stack())?;
        net.plugin = Path::new(REFERENCE_PLUGINS).join("ptp");
        net.conf.plugin_type = "ptp".into();
        no_dad(&net.node)?;
        Ok(Self {
            net,
            _pins: pins,
            pods: Vec::new(),
        })
    }

    fn add(&self, id: &str, netns: &Netns) -> Result<()> {
        let out = self
            .net
            .call(&Call::new("ADD", id, Some(&netns.path())), &json!({}))?;
        ensure!(out.status == 0, "ptp ADD {id}: {}", out.json);
        Ok(())
    }
}

impl Filled for PtpFill {
    fn fill_one(&mut self, i: usize) -> Result<()> {
        let netns = pod_netns("xs")?;
        self.add(&format!("fill-{i:03}"), &netns)?;
        self.pods.push(netns);
        Ok(())
    }

    fn probe(&mut self, i: usize) -> Result<(f64, f64)> {
        let netns = pod_netns("xq")?;
        let id = format!("probe-{i:04}");
        let t = Instant::now();
        self.add(&id, &netns)?;
        let add = t.elapsed();
        let t = Instant::now();
        let out = self
            .net
            .call(&Call::new("DEL", &id, Some(&netns.path())), &json!({}))?;
        let del = t.elapsed();
        ensure!(out.status == 0, "ptp DEL {id}: {}", out.json);
        Ok((add.as_secs_f64() * 1e3, del.as_secs_f64() * 1e3))
    }

    fn settle(&self) -> Result<()> {
        Ok(())
    }

    fn filled(&self) -> usize {
        self.pods.len()
    }
}

impl Drop for PtpFill {
    fn drop(&mut self) {
        for (i, p) in self.pods.iter().enumerate() {
            let _ = self.net.call(
                &Call::new("DEL", &format!("fill-{i:03}"), Some(&p.path())),
                &json!({}),
            );
        }
    }
}

/// The agent's `/v1/status`.
fn status(node: &Netns, listen: &str) -> Result<Value> {
    let (code, body) = http_get(node, listen, "/v1/status")?;
    ensure!(code == 200, "/v1/status: {code} {body}");
    Ok(serde_json::from_str(&body)?)
}

/// Waits until the agent lists `n` pods, each in `mode`.
fn wait_converged(node: &Netns, listen: &str, n: usize, mode: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        let s = status(node, listen)?;
        let pods = s["pods"].as_array().cloned().unwrap_or_default();
        if pods.len() == n && pods.iter().all(|p| p["mode"] == mode) {
            return Ok(());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(60),
            "the agent lists {} pods ({} in {mode}), wanted {n}",
            pods.len(),
            pods.iter().filter(|p| p["mode"] == mode).count()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Fills `node` to each of [`FILLS`] and probes ADD/DEL there.
fn fill_and_probe(o: &Opts, run: &mut Run, path: &str, node: &mut dyn Filled) -> Result<()> {
    let mut probe = 0;
    for fill in FILLS {
        while node.filled() < fill {
            check_interrupt()?;
            let i = node.filled();
            node.fill_one(i)?;
        }
        node.settle()?;
        for rep in 0..o.reps() {
            let (mut adds, mut dels) = (Vec::new(), Vec::new());
            for _ in 0..o.probes() {
                check_interrupt()?;
                let (a, d) = node.probe(probe)?;
                probe += 1;
                adds.push(a);
                dels.push(d);
            }
            for (op, v) in [("ADD", &mut adds), ("DEL", &mut dels)] {
                run.push(&add_figure("p50", op, fill), "ms", path, rep, median(v));
                run.push(
                    &add_figure("p99", op, fill),
                    "ms",
                    path,
                    rep,
                    percentile(v, 0.99),
                );
            }
        }
        eprintln!("scale: {path} at {fill} pods measured");
    }
    Ok(())
}

/// The `q` quantile of histogram `name{scope}` between two `/metrics`
/// snapshots, as the upper bound of the bucket it falls in (seconds).
fn histogram_quantile(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    name: &str,
    scope: &str,
    q: f64,
) -> Option<f64> {
    let buckets = |m: &BTreeMap<String, f64>| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = m
            .iter()
            .filter(|(k, _)| {
                k.starts_with(&format!("{name}_bucket{{"))
                    && k.contains(&format!("scope=\"{scope}\""))
            })
            .filter_map(|(k, v)| {
                let le = k.split("le=\"").nth(1)?.split('"').next()?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, *v))
            })
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let (b, a) = (buckets(before), buckets(after));
    let delta: Vec<(f64, f64)> = a
        .iter()
        .map(|(le, n)| {
            let was = b.iter().find(|(l, _)| l == le).map_or(0.0, |x| x.1);
            (*le, n - was)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    delta
        .iter()
        .find(|(_, n)| *n >= q * total)
        .map(|(le, _)| *le)
}

/// The agent's idle CPU (% of one CPU) over the window, once per rep.
fn idle_cpu(o: &Opts, run: &mut Run, figure: &str, pid: u32) -> Result<()> {
    // Let the work the last change started finish first.
    std::thread::sleep(Duration::from_secs(2));
    for rep in 0..o.reps() {
        check_interrupt()?;
        let pct = process_cpu_percent(pid, o.idle_window())?;
        run.push(figure, "% of a CPU", XDPCNI, rep, pct);
    }
    Ok(())
}

/// Whether `dst` has a route made by the agent in `node`.
fn has_route(node: &Netns, dst: &str) -> Result<bool> {
    Ok(!node
        .ip(&["route", "show", dst, "proto", "90"])?
        .trim()
        .is_empty())
}

fn node_routes(node: &Netns) -> Result<usize> {
    Ok(node
        .ip(&["route", "show", "proto", "90"])?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count())
}

/// Pod CIDR and InternalIP of other node `i` (the InternalIPs on a link of
/// the node namespace, so the gateways are on-link).
fn other_node(i: usize) -> (String, String) {
    (
        format!("10.{}.{}.0/24", 128 + i / 256, i % 256),
        format!("10.250.{}.{}", i / 200, 10 + i % 200),
    )
}

fn node_object(i: usize) -> Result<Node> {
    let (cidr, _) = other_node(i);
    Ok(serde_json::from_value(json!({
        "metadata": { "name": format!("scale-node-{i:04}") },
        "spec": { "podCIDR": cidr, "podCIDRs": [cidr] },
    }))?)
}

/// Creates other node `i` with its InternalIP.
async fn create_node(c: kube::Client, i: usize) -> Result<()> {
    let api: Api<Node> = Api::all(c);
    let (_, ip) = other_node(i);
    let name = format!("scale-node-{i:04}");
    api.create(&PostParams::default(), &node_object(i)?).await?;
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(
            json!({ "status": { "addresses": [{ "type": "InternalIP", "address": ip }] } }),
        ),
    )
    .await?;
    Ok(())
}

async fn delete_node(c: kube::Client, i: usize) -> Result<()> {
    Api::<Node>::all(c)
        .delete(&format!("scale-node-{i:04}"), &Default::default())
        .await?;
    Ok(())
}

/// Runs `f(client, i)` for every `i` of `range`, [`API_CONCURRENCY`] at once.
fn for_all<F, Fut>(node: &KubeNode, range: std::ops::Range<usize>, f: F) -> Result<()>
where
    F: Fn(kube::Client, usize) -> Fut + Send + Sync,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    node.client(|c| async move {
        futures::stream::iter(range.map(|i| f(c.clone(), i)))
            .buffer_unordered(API_CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    })
}

/// Polls `done` every 2 ms until it holds; the time it took (ms).
fn time_until(what: &str, within: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<f64> {
    let t = Instant::now();
    while !done()? {
        ensure!(t.elapsed() < within, "{what}: not after {within:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// The Kubernetes-mode node and its ptp twin, filled to 250 pods, then
/// 1000 Nodes, 5000 Services and 1000 NetworkPolicies added.
fn cluster_section(o: &Opts, run: &mut Run) -> Result<()> {
    let mut ptp = PtpFill::new()?;
    fill_and_probe(o, run, PTP, &mut ptp)?;
    drop(ptp);

    let node = KubeNode::start(|_| {})?;
    node.namespace(FILL_NS, json!({}))?;
    let mut x = XdpcniFill {
        node,
        pods: Vec::new(),
    };
    let before = x.node.metrics()?;
    fill_and_probe(o, run, XDPCNI, &mut x)?;
    let after = x.node.metrics()?;
    let pid = x.node.agent_pid();
    let node = &x.node;
    let netns = &node.net.node;

    // 250 pods, idle.
    idle_cpu(o, run, F_IDLE_CPU, pid)?;
    run.push(F_RSS, "MiB", XDPCNI, 0, process_rss_mib(pid)?);
    if let Some(s) = histogram_quantile(
        &before,
        &after,
        "xdpcni_reconcile_duration_seconds",
        "pod",
        0.99,
    ) {
        run.push(F_RECONCILE, "ms", XDPCNI, 0, s * 1e3);
    }

    // Annotation PATCH -> the veth in the new mode, and back.
    for rep in 0..o.reps() {
        let mut ms = Vec::new();
        for k in 0..o.changes() {
            check_interrupt()?;
            let pod = &x.pods[(rep * o.changes() + k) * 7 % x.pods.len()];
            for (value, want) in [
                (json!("native"), "xdp"),
                (Value::Null, xdpcni_e2e::agent::default_shown()),
            ] {
                let t = Instant::now();
                node.annotate(
                    &pod.namespace,
                    &pod.name,
                    json!({ "xdpcni.io/xdp-mode": value }),
                )?;
                let host = pod.host.clone();
                time_until("annotation applied", Duration::from_secs(10), || {
                    Ok(xdpcni_e2e::agent::mode_of(netns, &host)? == want)
                })?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        run.push(F_ANNOTATION_P50, "ms", XDPCNI, rep, median(&mut ms));
        run.push(
            F_ANNOTATION_P99,
            "ms",
            XDPCNI,
            rep,
            percentile(&mut ms, 0.99),
        );
    }

    // 1000 other nodes: their routes, then one added or removed at a time.
    let link = xdpcni_e2e::unique_name("xg");
    netns.add_veth(&link, &format!("{link}p"), None)?;
    netns.ip(&["addr", "add", "10.250.0.1/16", "dev", &link])?;
    for l in [link.clone(), format!("{link}p")] {
        netns.ip(&["link", "set", &l, "up"])?;
    }
    let t = Instant::now();
    for_all(node, 0..NODES, create_node)?;
    let created = t.elapsed().as_secs_f64() * 1e3;
    let all = time_until("1000 routes", Duration::from_secs(120), || {
        Ok(node_routes(netns)? == NODES)
    })?;
    run.push(F_NODES_LIST, "ms", XDPCNI, 0, created + all);
    run.notes.push(format!(
        "1000 Node objects: created in {created:.0} ms ({API_CONCURRENCY} API writes in flight), the last route {all:.0} ms after the last write"
    ));
    for rep in 0..o.reps() {
        let mut ms = Vec::new();
        for k in 0..o.changes() {
            check_interrupt()?;
            let i = NODES + rep * o.changes() + k;
            let (cidr, _) = other_node(i);
            let t = Instant::now();
            node.client(|c| create_node(c, i))?;
            time_until("route added", Duration::from_secs(10), || {
                has_route(netns, &cidr)
            })?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            node.client(|c| delete_node(c, i))?;
            time_until("route removed", Duration::from_secs(10), || {
                Ok(!has_route(netns, &cidr)?)
            })?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        run.push(F_ROUTE_P50, "ms", XDPCNI, rep, median(&mut ms));
        run.push(F_ROUTE_P99, "ms", XDPCNI, rep, percentile(&mut ms, 0.99));
    }
    idle_cpu(o, run, F_IDLE_CPU_NODES, pid)?;

    // 5000 headless Services, each with an Endpoints object naming one
    // port of one local pod (20 per pod).
    let ips: Vec<IpAddr> = x.pods.iter().map(|p| p.ip(false)).collect();
    let ips = Arc::new(ips);
    // The node task's passes while the Services arrive (each Endpoints
    // event wakes a full one) and at rest after: an idle window alone may
    // hold none, full passes running every 30 s.
    let before = node.metrics()?;
    let t = Instant::now();
    let svc_ips = Arc::clone(&ips);
    for_all(node, 0..SERVICES, move |c, i| {
        let ips = Arc::clone(&svc_ips);
        async move { create_service(c, i, ips[i % ips.len()], 10000 + (i / ips.len()) as u16).await }
    })?;
    let pins = node.pin_dir().to_path_buf();
    let nat = || -> Result<u32> {
        Ok(Maps::open_pinned(&pins)?
            .fill()?
            .iter()
            .find(|f| f.name == "nat_ports")
            .map_or(0, |f| f.entries))
    };
    time_until("5000 NAT'd ports", Duration::from_secs(120), || {
        Ok(nat()? as usize >= SERVICES)
    })?;
    run.push(
        F_SERVICES_NAT,
        "ms",
        XDPCNI,
        0,
        t.elapsed().as_secs_f64() * 1e3,
    );
    run.push(F_NAT_PORTS, "entries", XDPCNI, 0, f64::from(nat()?));
    idle_cpu(o, run, F_IDLE_CPU_ALL, pid)?;
    let after = node.metrics()?;
    for (q, f) in [(0.5, F_NODE_TASK_P50), (0.99, F_NODE_TASK_P99)] {
        if let Some(s) = histogram_quantile(
            &before,
            &after,
            "xdpcni_reconcile_duration_seconds",
            "node",
            q,
        ) {
            run.push(f, "ms", XDPCNI, 0, s * 1e3);
        }
    }
    run.push(F_RSS_ALL, "MiB", XDPCNI, 0, process_rss_mib(pid)?);

    policies(o, run, &x)?;
    eprintln!("scale: the Kubernetes-mode node measured");
    Ok(())
}

async fn create_service(c: kube::Client, i: usize, ip: IpAddr, port: u16) -> Result<()> {
    let name = format!("svc-{i:04}");
    let svc: Service = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "clusterIP": "None", "ports": [{ "port": port, "protocol": "TCP" }] },
    }))?;
    Api::<Service>::namespaced(c.clone(), FILL_NS)
        .create(&PostParams::default(), &svc)
        .await?;
    let ep: Endpoints = serde_json::from_value(json!({
        "metadata": { "name": name },
        "subsets": [{ "addresses": [{ "ip": ip.to_string() }], "ports": [{ "port": port, "protocol": "TCP" }] }],
    }))?;
    Api::<Endpoints>::namespaced(c, FILL_NS)
        .create(&PostParams::default(), &ep)
        .await?;
    Ok(())
}

/// 1000 NetworkPolicies selecting pod `b` of a namespace of its own: a
/// policy created until it is in force, and b's forwarding rate (from `a`,
/// both kernel path) with them against none.
fn policies(o: &Opts, run: &mut Run, x: &XdpcniFill) -> Result<()> {
    let node = &x.node;
    const NS: &str = "scale-np";
    node.namespace(NS, json!({}))?;
    let mut pair = Vec::new();
    for name in ["a", "b"] {
        let obj = node.create_pod_object(NS, name, json!({ "app": name }), json!([]))?;
        let pod = node.attach(obj, Netns::new("xs")?, &[])?;
        node.annotate(NS, name, json!({ "xdpcni.io/xdp-mode": "off" }))?;
        pair.push(pod);
    }
    let (a, b) = (&pair[0], &pair[1]);
    for p in &pair {
        time_until("off", Duration::from_secs(10), || {
            Ok(xdpcni_e2e::agent::mode_of(&node.net.node, &p.host)? == "none")
        })?;
    }
    let policy = |i: usize| {
        json!({ "metadata": { "name": format!("np-{i:04}"), "namespace": NS }, "spec": {
            "podSelector": { "matchLabels": { "app": "b" } },
            "ingress": [{ "from": [{ "ipBlock": { "cidr": format!("172.{}.{}.0/24", 16 + i / 256, i % 256) } }],
                          "ports": [{ "protocol": "UDP", "port": 1000 + (i % 60000) }] }] } })
    };
    let in_force = |n: usize| -> Result<bool> {
        Ok(node.metrics()?.get("xdpcni_policy_policies").copied() == Some(n as f64))
    };
    let frame = frame_between(&node.net.node, &a.host, &a.netns, a.ip(false), b.ip(false))?;
    let sender = vec![None; 1];
    for rep in 0..o.reps() {
        check_interrupt()?;
        let r = raw_sink_rate(&a.netns, &b.netns, &frame, &sender, o.flood())?.rate;
        run.push(F_POLICY_FWD, "Mpps", "no policy", rep, r / 1e6);
    }
    // 999 policies with ipBlock/port rules and one allowing a.
    node.client(|c| async move {
        let api: Api<k8s_openapi::api::networking::v1::NetworkPolicy> = Api::namespaced(c, NS);
        futures::stream::iter((0..POLICIES - 1).map(|i| {
            let api = api.clone();
            async move {
                let np = serde_json::from_value(policy(i))?;
                api.create(&PostParams::default(), &np).await?;
                anyhow::Ok(())
            }
        }))
        .buffer_unordered(API_CONCURRENCY)
        .try_collect::<Vec<()>>()
        .await?;
        let allow = serde_json::from_value(
            json!({ "metadata": { "name": "zz-allow-a", "namespace": NS }, "spec": {
            "podSelector": { "matchLabels": { "app": "b" } },
            "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "a" } } }] }] } }),
        )?;
        api.create(&PostParams::default(), &allow).await?;
        Ok(())
    })?;
    time_until("1000 policies in force", Duration::from_secs(120), || {
        in_force(POLICIES)
    })?;
    for rep in 0..o.reps() {
        check_interrupt()?;
        let r = raw_sink_rate(&a.netns, &b.netns, &frame, &sender, o.flood())?.rate;
        run.push(F_POLICY_FWD, "Mpps", "1000 policies", rep, r / 1e6);
    }
    let tx = |m: &BTreeMap<String, f64>, k: &str| {
        m.get(&format!("xdpcni_policy_apply_duration_seconds_{k}"))
            .copied()
            .unwrap_or(0.0)
    };
    let before = node.metrics()?;
    for rep in 0..o.reps() {
        let mut ms = Vec::new();
        for k in 0..o.policy_changes() {
            check_interrupt()?;
            let i = POLICIES + rep * o.policy_changes() + k;
            let t = Instant::now();
            node.create_policy(policy(i))?;
            time_until("policy in force", Duration::from_secs(10), || {
                in_force(POLICIES + 1)
            })?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            let name = format!("np-{i:04}");
            node.client(|c| async move {
                Api::<k8s_openapi::api::networking::v1::NetworkPolicy>::namespaced(c, NS)
                    .delete(&name, &Default::default())
                    .await?;
                Ok(())
            })?;
            time_until("policy removed", Duration::from_secs(10), || {
                in_force(POLICIES)
            })?;
        }
        run.push(F_POLICY_P50, "ms", XDPCNI, rep, median(&mut ms));
        run.push(F_POLICY_P99, "ms", XDPCNI, rep, percentile(&mut ms, 0.99));
    }
    let after = node.metrics()?;
    let n = tx(&after, "count") - tx(&before, "count");
    if n > 0.0 {
        run.push(
            F_POLICY_TX,
            "ms",
            XDPCNI,
            0,
            (tx(&after, "sum") - tx(&before, "sum")) / n * 1e3,
        );
    }
    node.delete_policies()?;
    Ok(())
}

/// Two pods of a standalone node in generic devmap (by the node default
/// of its config), the agent stopped once they are attached: the XDP program's run time
/// per packet of a UDP 64-byte flood, with the maps as they are (2
/// endpoints) and with endpoints4 filled to its 65536 entries.
fn endpoints_section(o: &Opts, run: &mut Run) -> Result<()> {
    use aya::maps::{HashMap as BpfHashMap, Map, MapData};
    let pins = PinDir::new("xe")?;
    let net = Network::new(pins.path(), "1.1.0", json!([[{"subnet": "10.77.0.0/24"}]]))?;
    let agent = StandaloneAgent::start(&net, pins.path(), |c| c.xdp_mode = "generic".into())?;
    let mut pods = Vec::new();
    let mut ips = Vec::new();
    let mut hosts = Vec::new();
    for i in 0..2 {
        let ns = Netns::new("xp")?;
        let out = net.call(
            &Call::new("ADD", &format!("ep{i}"), Some(&ns.path())),
            &json!({}),
        )?;
        ensure!(out.status == 0, "ADD: {}", out.json);
        ips.push(xdpcni_e2e::cni::result_ips(&out.json)[0]);
        hosts.push(
            out.json["interfaces"][0]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
        pods.push(ns);
    }
    for h in &hosts {
        xdpcni_e2e::agent::wait_mode(&net.node, h, "xdpgeneric", Duration::from_secs(10))?;
    }
    agent.stop(libc::SIGTERM)?;
    let layout = xdpcni_ebpf::layout_dir(pins.path());
    let prog = aya::programs::Xdp::from_pin(
        layout.join("progs").join(xdpcni_ebpf::FROM_POD_PROGRAM),
        aya_obj::programs::XdpAttachType::Interface,
    )?;
    let per_packet = |dst: IpAddr| -> Result<f64> {
        let to = SocketAddr::new(dst, 9);
        let sink = xdpcni_e2e::in_netns(&pods[1], || Ok(UdpSocket::bind(to)?))?;
        let stats = BpfStats::enable()?;
        let before = prog.info()?;
        udp_flood(&pods[0], to, 22, &[None, None], o.flood())?;
        let after = prog.info()?;
        drop(stats);
        drop(sink);
        let runs = after.run_count().saturating_sub(before.run_count());
        ensure!(runs > 0, "the datapath program did not run");
        Ok(after
            .run_time()
            .saturating_sub(before.run_time())
            .as_nanos() as f64
            / runs as f64)
    };
    let mut map: BpfHashMap<MapData, u32, xdpcni_ebpf::abi::EndpointInfo> =
        Map::from_map_data(MapData::from_pin(layout.join("endpoints4"))?)?.try_into()?;
    let IpAddr::V4(dst) = ips[1] else {
        anyhow::bail!("IPv4 pods expected");
    };
    let info = map.get(&xdpcni_ebpf::abi::ipv4_key(dst), 0)?;
    let have = map.keys().count();
    let extra: Vec<u32> = (0..ENDPOINTS.saturating_sub(have))
        .map(|i| xdpcni_ebpf::abi::ipv4_key(Ipv4Addr::from(0x0a40_0000u32 + i as u32)))
        .collect();
    for rep in 0..o.reps() {
        check_interrupt()?;
        run.push(F_PROG_NS, "ns", "2 endpoints", rep, per_packet(ips[1])?);
        for k in &extra {
            map.insert(k, info, 0)?;
        }
        ensure!(
            map.keys().count() == ENDPOINTS,
            "endpoints4 holds {} entries, wanted {ENDPOINTS}",
            map.keys().count()
        );
        run.push(F_PROG_NS, "ns", "65536 endpoints", rep, per_packet(ips[1])?);
        for k in &extra {
            map.remove(k)?;
        }
    }
    for (i, ns) in pods.iter().enumerate() {
        let _ = net.call(
            &Call::new("DEL", &format!("ep{i}"), Some(&ns.path())),
            &json!({}),
        );
    }
    eprintln!("scale: the per-packet cost measured");
    Ok(())
}

/// Standalone mode with 250 pods: idle CPU and RSS.
fn standalone_section(o: &Opts, run: &mut Run) -> Result<()> {
    let pins = PinDir::new("xa")?;
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack())?;
    let agent = StandaloneAgent::start(&net, pins.path(), |_| {})?;
    let mut pods = Vec::new();
    for i in 0..FULL {
        check_interrupt()?;
        let ns = Netns::new("xs")?;
        let out = net.call(
            &Call::new("ADD", &format!("sa{i:03}"), Some(&ns.path())),
            &json!({}),
        )?;
        ensure!(out.status == 0, "ADD: {}", out.json);
        pods.push(ns);
    }
    wait_converged(
        &net.node,
        xdpcni_e2e::agent::LISTEN,
        FULL,
        xdpcni_host::pod::DEFAULT_MODE.as_str(),
    )?;
    idle_cpu(o, run, F_STANDALONE_CPU, agent.pid())?;
    run.push(
        F_STANDALONE_RSS,
        "MiB",
        XDPCNI,
        0,
        process_rss_mib(agent.pid())?,
    );
    for (i, ns) in pods.iter().enumerate() {
        let _ = net.call(
            &Call::new("DEL", &format!("sa{i:03}"), Some(&ns.path())),
            &json!({}),
        );
    }
    drop(agent);
    eprintln!("scale: standalone mode measured");
    Ok(())
}

/// The goals, from the medians of this run.
fn targets(run: &Run) -> Vec<Target> {
    let x = |f: &str| run.median_of(f, XDPCNI);
    let add_ratio = match (
        x(&add_figure("p99", "ADD", FULL)),
        x(&add_figure("p99", "ADD", 0)),
    ) {
        (Some(full), Some(empty)) if empty > 0.0 => Some(full / empty),
        _ => None,
    };
    let prog_ratio = match (
        run.median_of(F_PROG_NS, "65536 endpoints"),
        run.median_of(F_PROG_NS, "2 endpoints"),
    ) {
        (Some(full), Some(two)) if two > 0.0 => Some(full / two),
        _ => None,
    };
    let t = |name, value, op, goal, what: &str| Target {
        name,
        value,
        op,
        goal,
        what: what.into(),
    };
    vec![
        t(
            "add_p99_250_pods",
            add_ratio,
            Op::AtMost,
            1.2,
            "CNI ADD p99 at 250 pods / at 0 pods (xdpcni, Kubernetes mode)",
        ),
        t(
            "agent_idle_cpu_250_pods",
            x(F_IDLE_CPU),
            Op::Below,
            1.0,
            "% of one CPU, Kubernetes mode, 250 pods",
        ),
        t(
            "agent_rss_250_pods_1000_nodes_5000_services",
            x(F_RSS_ALL),
            Op::Below,
            64.0,
            "MiB (VmRSS) with 250 pods, 1000 Nodes, 5000 Services and Endpoints",
        ),
        t(
            "annotation_p99_250_pods",
            x(F_ANNOTATION_P99),
            Op::Below,
            100.0,
            "ms, annotation PATCH until the veth is in the new mode",
        ),
        t(
            "route_converge_1000_nodes",
            x(F_ROUTE_P99),
            Op::Below,
            1000.0,
            "ms, p99 of one Node added or removed until its route is",
        ),
        t(
            "prog_ns_64k_endpoints",
            prog_ratio,
            Op::AtMost,
            1.1,
            "XDP program ns/packet with 65536 endpoints / with 2",
        ),
        t(
            "policy_update_1000",
            x(F_POLICY_P99),
            Op::Below,
            100.0,
            "ms, p99 of a policy created until in force, with 1000 policies",
        ),
    ]
}

/// Prints the table and the target lines; writes scale.md, scale.json and
/// scale.png under `--out`.
fn report(o: &Opts, run: &Run) -> Result<()> {
    let mut paths: Vec<String> = Vec::new();
    for s in &run.samples {
        if !paths.contains(&s.path) {
            paths.push(s.path.clone());
        }
    }
    let mut md = format!(
        "{} repetitions{}, medians; ptp is Debian's reference plugin on a node of the same fill.\n\n\
         | figure | unit | path | median | min-max | vs ptp |\n| --- | --- | --- | ---: | ---: | ---: |\n",
        o.reps(),
        if o.quick { " (--quick)" } else { "" }
    );
    let mut summary = Vec::new();
    for (figure, unit) in &run.figures {
        for path in &paths {
            let v: Vec<f64> = run
                .samples
                .iter()
                .filter(|s| &s.figure == figure && &s.path == path)
                .map(|s| s.value)
                .collect();
            if v.is_empty() {
                continue;
            }
            let m = run.median_of(figure, path).unwrap_or(f64::NAN);
            let (lo, hi) = v
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
                    (a.min(*x), b.max(*x))
                });
            let ratio = match (path.as_str(), run.median_of(figure, PTP)) {
                (XDPCNI, Some(p)) if m > 0.0 => format!("{:.2}x", p / m),
                _ => "-".into(),
            };
            md.push_str(&format!(
                "| {figure} | {unit} | {path} | {m:.3} | {lo:.3}-{hi:.3} | {ratio} |\n"
            ));
            summary.push(json!({ "figure": figure, "unit": unit, "path": path, "median": m, "min": lo, "max": hi }));
        }
    }
    let targets = targets(run);
    md.push_str(&report_tail(&run.notes, &targets));
    let doc = json!({
        "quick": o.quick, "reps": o.reps(), "fills": FILLS, "summary": summary,
        "samples": run.samples, "notes": run.notes,
        "targets": targets.iter().map(Target::json).collect::<Vec<_>>(),
        "node": NODE,
    });
    write_report(&o.out, "scale", &md, &doc, "scale_plot.py")?;
    Ok(())
}
