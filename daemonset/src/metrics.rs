//! The agent's metrics, through prometheus-client: reconcile figures kept in
//! the registry, and the datapath's per-pod counters read from the pinned
//! maps at scrape time (a collector), so a scrape is never older than the
//! packets it reports.

use std::{collections::BTreeMap, fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelValue, EncodeMetric, LabelValueEncoder},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{exponential_buckets, Histogram},
        MetricType,
    },
    registry::Registry,
};
use xdpcni_ebpf::{
    abi::{Verdict, VerdictKind},
    Counters, MapFill, Maps,
};
use xdpcni_host::pod::XdpMode;

use crate::status::{Book, IsolatedPod, WhyCode};

/// A label value escaped as the exposition format requires (backslash,
/// double quote, newline): prometheus-client writes values as given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Escaped<'a>(pub &'a str);

impl EncodeLabelValue for Escaped<'_> {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), fmt::Error> {
        use fmt::Write;
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// A label set of one (name, value) pair.
pub type OneLabel = [(&'static str, &'static str); 1];

/// Where a reconcile error happened: the `stage` label of
/// `xdpcni_reconcile_errors_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Applying a pod's policy to the datapath and its netns.
    Apply,
    /// Reading the CNI's attachment records.
    Records,
    /// Syncing the NAT'd ports.
    NatPorts,
    /// Syncing the routes to other nodes' pod CIDRs.
    Routes,
    /// Publishing a Kubernetes Event.
    Event,
    /// Collecting what deleted pods left.
    Gc,
    /// Re-creating a datapath whose pins were removed.
    Pins,
    /// Writing the policy gate, or holding and releasing pods.
    Gate,
    /// Applying NetworkPolicy rules (nftables).
    Netpol,
}

impl Stage {
    /// Every stage (all are exported from the start, at 0).
    pub const ALL: [Stage; 9] = [
        Self::Apply,
        Self::Records,
        Self::NatPorts,
        Self::Routes,
        Self::Event,
        Self::Gc,
        Self::Pins,
        Self::Gate,
        Self::Netpol,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Apply => "apply",
            Self::Records => "records",
            Self::NatPorts => "nat_ports",
            Self::Routes => "routes",
            Self::Event => "event",
            Self::Gc => "gc",
            Self::Pins => "pins",
            Self::Gate => "gate",
            Self::Netpol => "netpol",
        }
    }
}

/// What scrapes and /v1/status read of the datapath: the pinned maps in
/// the agent (a fake in unit tests).
pub trait DatapathReader: Send + Sync {
    /// The counters of host veth `ifindex` (none when unreadable).
    fn counters(&self, ifindex: u32) -> Counters;
    /// How full the maps are (none when unreadable).
    fn fill(&self) -> Vec<MapFill>;
}

impl DatapathReader for Maps {
    fn counters(&self, ifindex: u32) -> Counters {
        Maps::counters(self, ifindex).unwrap_or_default()
    }

    fn fill(&self) -> Vec<MapFill> {
        Maps::fill(self).unwrap_or_default()
    }
}

/// The per-pod families, read at scrape time: the pods from the book,
/// their counters from the pinned maps.
pub struct PodsCollector {
    maps: Arc<dyn DatapathReader>,
    book: Arc<Book>,
}

impl fmt::Debug for PodsCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PodsCollector").finish_non_exhaustive()
    }
}

/// The family name of a verdict kind's packets or bytes counter (the
/// encoder appends `_total`).
pub fn family_name(kind: VerdictKind, bytes: bool) -> String {
    format!(
        "xdpcni_{}_{}",
        kind.as_str(),
        if bytes { "bytes" } else { "packets" }
    )
}

fn family_help(kind: VerdictKind, bytes: bool) -> String {
    let what = if bytes { "Bytes" } else { "Packets" };
    match kind {
        VerdictKind::Forward => {
            format!("{what} the XDP fast path redirected to another pod, counted once on the sender's pod, by verdict")
        }
        VerdictKind::CpumapStage => {
            format!("{what} of xdpcni_forward with verdict redirect_cpumap counted again by the cpumap's second stage, by sender pod (not more deliveries)")
        }
        VerdictKind::Received => {
            format!("{what} the XDP fast path delivered to each pod, counted on the receiver (the same deliveries as xdpcni_forward, seen from the other end)")
        }
        VerdictKind::Kernel => {
            format!("{what} the XDP datapath passed to the kernel stack, by pod and reason")
        }
        VerdictKind::Drop => format!("{what} the XDP datapath dropped, by pod and reason"),
    }
}

impl Collector for PodsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let views = self.book.pods();
        // One read of each pod's counters serves every family.
        let counters: Vec<_> = views
            .iter()
            .map(|v| self.maps.counters(v.ifindex))
            .collect();
        for kind in VerdictKind::ALL {
            for bytes in [false, true] {
                let name = family_name(kind, bytes);
                let help = family_help(kind, bytes);
                let mut family =
                    encoder.encode_descriptor(&name, &help, None, MetricType::Counter)?;
                for (view, c) in views.iter().zip(&counters) {
                    for &verdict in Verdict::ALL.iter().filter(|v| v.kind() == kind) {
                        let s = c.get(verdict);
                        let labels = [
                            ("namespace", Escaped(&view.namespace)),
                            ("pod", Escaped(&view.name)),
                            ("interface", Escaped(&view.host_veth)),
                            ("verdict", Escaped(verdict.label())),
                        ];
                        let value = if bytes { s.bytes } else { s.packets };
                        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
                    }
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "xdpcni_attach_mode",
            "The XDP mode of each pod's host veth (1 for the mode in force)",
            None,
            MetricType::Gauge,
        )?;
        for view in &views {
            for mode in XdpMode::ALL {
                let labels = [
                    ("namespace", Escaped(&view.namespace)),
                    ("pod", Escaped(&view.name)),
                    ("mode", Escaped(mode.as_str())),
                ];
                ConstGauge::new(i64::from(view.mode == mode.as_str()))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "xdpcni_pod_kernel_only",
            "1 for each pod kept off the fast path, by reason (network-policy, forward-rule, held, map-full, veth-gone)",
            None,
            MetricType::Gauge,
        )?;
        for view in views.iter().filter(|v| v.why.code.is_kernel_only()) {
            let labels = [
                ("namespace", Escaped(&view.namespace)),
                ("pod", Escaped(&view.name)),
                ("reason", Escaped(view.why.code.as_str())),
            ];
            ConstGauge::new(1).encode(family.encode_family(&labels)?)?;
        }
        let fill = self.maps.fill();
        for (name, help, capacity) in [
            (
                "xdpcni_map_entries",
                "Entries in each datapath map that can fill",
                false,
            ),
            (
                "xdpcni_map_capacity",
                "Size (max_entries) of each datapath map that can fill",
                true,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for m in &fill {
                let v = if capacity { m.capacity } else { m.entries };
                ConstGauge::new(i64::from(v)).encode(family.encode_family(&[("map", m.name)])?)?;
            }
        }
        let full = views
            .iter()
            .filter(|v| v.why.code == WhyCode::MapFull)
            .count();
        let family = encoder.encode_descriptor(
            "xdpcni_map_full_pods",
            "Pods on kernel routing because a datapath map had no room for their records",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(i64::try_from(full).unwrap_or(i64::MAX)).encode(family)?;
        Ok(())
    }
}

/// Reads the policy table's named counters: name -> (packets, bytes).
pub type PolicyCounterSource = Box<dyn Fn() -> BTreeMap<String, (u64, u64)> + Send + Sync>;

/// The NetworkPolicy families: what is in force, and the drops by pod read
/// from nftables counters at scrape time.
pub struct PolicyCollector {
    source: PolicyCounterSource,
    book: Arc<Book>,
}

impl fmt::Debug for PolicyCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyCollector").finish_non_exhaustive()
    }
}

impl Collector for PolicyCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        use crate::netpol::{model::Direction, nft};
        let view = self.book.policy();
        let counters = if view.isolated.is_empty() {
            BTreeMap::new()
        } else {
            (self.source)()
        };
        let mut family = encoder.encode_descriptor(
            "xdpcni_policy_isolated_pods",
            "Pods of this node that NetworkPolicies isolate, by direction (their traffic takes the kernel path, where the rules are)",
            None,
            MetricType::Gauge,
        )?;
        for (direction, pick) in [
            ("ingress", (|p: &IsolatedPod| p.ingress) as fn(&_) -> bool),
            ("egress", |p| p.egress),
        ] {
            let n = view.isolated.iter().filter(|p| pick(p)).count();
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(family.encode_family(&[("direction", direction)])?)?;
        }
        for (name, help, value) in [
            (
                "xdpcni_policy_policies",
                "NetworkPolicies in force on this node (selecting at least one of its pods)",
                view.in_force.len(),
            ),
            (
                "xdpcni_policy_rules",
                "nftables rules in force in table inet xdpcni",
                view.rules,
            ),
        ] {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(family)?;
        }
        for bytes in [false, true] {
            let unit = if bytes { "bytes" } else { "packets" };
            let name = format!("xdpcni_policy_drop_{unit}");
            let help = format!(
                "{unit} NetworkPolicy rules dropped, by pod and direction (nftables counters)"
            );
            let mut family = encoder.encode_descriptor(&name, &help, None, MetricType::Counter)?;
            for IsolatedPod {
                namespace: ns,
                pod,
                ingress,
                egress,
            } in &view.isolated
            {
                for (direction, isolated) in
                    [(Direction::Ingress, *ingress), (Direction::Egress, *egress)]
                {
                    if !isolated {
                        continue;
                    }
                    let c = counters
                        .get(&nft::counter_name(&(ns.clone(), pod.clone()), direction))
                        .copied()
                        .unwrap_or_default();
                    let labels = [
                        ("namespace", Escaped(ns)),
                        ("pod", Escaped(pod)),
                        ("direction", Escaped(direction.as_str())),
                    ];
                    ConstCounter::new(if bytes { c.1 } else { c.0 })
                        .encode(family.encode_family(&labels)?)?;
                }
            }
        }
        let invalid = counters.get(nft::DROP_INVALID).map_or(0, |c| c.0);
        let family = encoder.encode_descriptor(
            "xdpcni_policy_invalid_drop_packets",
            "Packets to or from isolated pods dropped because conntrack found them invalid or untracked",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(invalid).encode(family)?;
        Ok(())
    }
}

/// The agent's metrics.
pub struct Metrics {
    registry: Registry,
    /// `xdpcni_policy_apply_duration_seconds`: one nftables transaction.
    pub policy_apply: Histogram,
    /// `xdpcni_reconcile_errors_total{stage}`.
    pub errors: Family<OneLabel, Counter>,
    /// `xdpcni_reconcile_duration_seconds{scope="pod"|"node"}`.
    pub duration: Family<OneLabel, Histogram, fn() -> Histogram>,
    /// `xdpcni_reconcile_retries_total{kind}`.
    retries: Family<OneLabel, Counter>,
    /// `xdpcni_policy_problems_total`.
    pub policy_problems: Counter,
    /// `xdpcni_ready`.
    pub ready: Gauge,
    /// `xdpcni_forward_rule_pods`.
    pub forward_rule_pods: Gauge,
    /// `xdpcni_datapath_reloads_total`.
    pub reloads: Counter,
    /// `xdpcni_datapath_info{layout, build}`.
    datapath: Family<Vec<(String, String)>, Gauge>,
    /// `xdpcni_datapath_migration_seconds`.
    pub migration: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// `xdpcni_node_routes{via}`.
    pub node_routes: Family<OneLabel, Gauge>,
}

fn duration_histogram() -> Histogram {
    // 100 us .. ~3 s.
    Histogram::new(exponential_buckets(1e-4, 2.0, 16))
}

impl Metrics {
    /// Metrics whose per-pod and policy families read `book` and the
    /// counters in `maps` at scrape time, and the policy drop counters
    /// `policy_source`.
    pub fn new(
        maps: Arc<dyn DatapathReader>,
        book: Arc<Book>,
        policy_source: PolicyCounterSource,
    ) -> Self {
        let mut registry = Registry::default();
        let errors = Family::<OneLabel, Counter>::default();
        for stage in Stage::ALL {
            let _ = errors.get_or_create(&[("stage", stage.as_str())]);
        }
        registry.register(
            "xdpcni_reconcile_errors",
            "Reconcile failures, by stage (apply, records, nat_ports, routes, event, gc, pins)",
            errors.clone(),
        );
        let duration: Family<OneLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(duration_histogram);
        registry.register(
            "xdpcni_reconcile_duration_seconds",
            "Time to reconcile one pod (scope=pod) or the node-wide work (scope=node)",
            duration.clone(),
        );
        let retries = Family::<OneLabel, Counter>::default();
        for kind in ["datapath", "offloads", "task"] {
            let _ = retries.get_or_create(&[("kind", kind)]);
        }
        registry.register(
            "xdpcni_reconcile_retries",
            "Pod reconciles that failed and were retried (Kubernetes mode), by kind of error (datapath, converge, task)",
            retries.clone(),
        );
        let policy_problems = Counter::default();
        registry.register(
            "xdpcni_policy_problems",
            "Annotation values refused and kernel attach refusals, each with a fallback used",
            policy_problems.clone(),
        );
        let ready = Gauge::default();
        registry.register(
            "xdpcni_ready",
            "Whether the agent has reconciled the node",
            ready.clone(),
        );
        let forward_rule_pods = Gauge::default();
        registry.register(
            "xdpcni_forward_rule_pods",
            "Pods made kernel-only because a DROP/REJECT rule reachable from the node's FORWARD chain names them",
            forward_rule_pods.clone(),
        );
        let reloads = Counter::default();
        registry.register(
            "xdpcni_datapath_reloads",
            "Times the agent re-created and re-pinned a datapath whose pins were removed",
            reloads.clone(),
        );
        let datapath = Family::<Vec<(String, String)>, Gauge>::default();
        registry.register(
            "xdpcni_datapath_info",
            "1 for the pinned datapath in use: its layout (map definitions) and build (programs)",
            datapath.clone(),
        );
        let migration = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "xdpcni_datapath_migration_seconds",
            "How long this agent's start took to migrate the datapath from an older layout (0: none)",
            migration.clone(),
        );
        let node_routes = Family::<OneLabel, Gauge>::default();
        for via in ["hostGateway", "vxlan", "unreachable"] {
            let _ = node_routes.get_or_create(&[("via", via)]);
        }
        registry.register(
            "xdpcni_node_routes",
            "Routes to other nodes' pod CIDRs in place, by next hop (hostGateway, vxlan), and host-gateway routes the kernel refused (unreachable: the next hop is not on this node's L2 segment)",
            node_routes.clone(),
        );
        registry.register_collector(Box::new(PodsCollector {
            maps,
            book: Arc::clone(&book),
        }));
        registry.register_collector(Box::new(PolicyCollector {
            source: policy_source,
            book,
        }));
        let policy_apply = duration_histogram();
        registry.register(
            "xdpcni_policy_apply_duration_seconds",
            "Time of one nftables transaction putting the node's NetworkPolicy rules in force",
            policy_apply.clone(),
        );
        Self {
            registry,
            policy_apply,
            errors,
            duration,
            retries,
            policy_problems,
            ready,
            forward_rule_pods,
            reloads,
            datapath,
            migration,
            node_routes,
        }
    }

    /// Says which datapath is in use (`xdpcni_datapath_info`).
    pub fn set_datapath(&self, layout: u32, build: &str) {
        self.datapath.clear();
        self.datapath
            .get_or_create(&vec![
                ("layout".to_string(), layout.to_string()),
                ("build".to_string(), build.to_string()),
            ])
            .set(1);
    }

    /// Sets `xdpcni_node_routes`: (host-gateway, tunnel) routes in place,
    /// and host-gateway routes refused.
    pub fn set_node_routes(&self, (gateway, tunnel): (usize, usize), unreachable: usize) {
        for (via, n) in [
            ("hostGateway", gateway),
            ("vxlan", tunnel),
            ("unreachable", unreachable),
        ] {
            self.node_routes
                .get_or_create(&[("via", via)])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Counts an error at `stage`.
    pub fn error(&self, stage: Stage) {
        self.errors
            .get_or_create(&[("stage", stage.as_str())])
            .inc();
    }

    /// Counts a retried pod reconcile of error `kind`.
    pub fn retry(&self, kind: &'static str) {
        self.retries.get_or_create(&[("kind", kind)]).inc();
    }

    /// Records one reconcile's duration in `scope` (`pod` or `node`).
    pub fn observe(&self, scope: &'static str, seconds: f64) {
        self.duration
            .get_or_create(&[("scope", scope)])
            .observe(seconds);
    }

    /// The OpenMetrics text of every family.
    pub fn render(&self) -> Result<String, fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// The Content-Type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{PodStatus, Why};

    struct Fake;

    impl DatapathReader for Fake {
        fn counters(&self, _: u32) -> Counters {
            Counters::default()
        }
        fn fill(&self) -> Vec<MapFill> {
            vec![MapFill {
                name: "endpoints4",
                entries: 3,
                capacity: 65536,
            }]
        }
    }

    fn pod(code: WhyCode) -> PodStatus {
        PodStatus {
            namespace: "ns".into(),
            name: "we\"ird".into(),
            container_id: "c1".into(),
            ips: vec![],
            host_veth: "xdp0".into(),
            ifindex: 7,
            mode: "generic".into(),
            wanted: "generic".into(),
            why: Why {
                code,
                text: String::new(),
            },
            redirect: "devmap".into(),
            cpus: "0".into(),
            problems: vec![],
            reconciled_at: 0.0,
            counters: None,
        }
    }

    #[test]
    fn families_by_verdict_kind_modes_errors_and_histogram() {
        let book = Arc::new(Book::default());
        let m = Metrics::new(Arc::new(Fake), Arc::clone(&book), Box::new(BTreeMap::new));
        book.set_pod(pod(WhyCode::NodeDefault));
        m.error(Stage::Routes);
        m.observe("pod", 0.002);
        m.ready.set(1);
        let text = m.render().unwrap();
        // Each verdict sits in its kind's family, none in another.
        for v in Verdict::ALL {
            for kind in VerdictKind::ALL {
                let line = format!(
                    "{}_total{{namespace=\"ns\",pod=\"we\\\"ird\",interface=\"xdp0\",verdict=\"{}\"}} 0",
                    family_name(kind, false),
                    v.label()
                );
                assert_eq!(text.contains(&line), v.kind() == kind, "{line}\n{text}");
            }
        }
        // The kinds that count a delivery again have families of their own.
        assert!(text.contains("xdpcni_received_packets_total{"), "{text}");
        assert!(
            text.contains("xdpcni_cpumap_stage_packets_total{"),
            "{text}"
        );
        assert!(!text.contains(r#"xdpcni_forward_packets_total{namespace="ns",pod="we\"ird",interface="xdp0",verdict="rx_fastpath"}"#));
        assert!(
            text.contains(r#"xdpcni_attach_mode{namespace="ns",pod="we\"ird",mode="generic"} 1"#)
        );
        assert!(text.contains(r#"mode="off"} 0"#));
        assert!(text.contains("\nxdpcni_map_full_pods 0\n"), "{text}");
        assert!(
            text.contains(r#"xdpcni_map_entries{map="endpoints4"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"xdpcni_map_capacity{map="endpoints4"} 65536"#),
            "{text}"
        );
        assert!(!text.contains("xdpcni_pod_kernel_only{"), "{text}");
        assert!(text.contains(r#"xdpcni_reconcile_errors_total{stage="routes"} 1"#));
        assert!(text.contains(r#"xdpcni_reconcile_errors_total{stage="apply"} 0"#));
        m.retry("offloads");
        assert!(m
            .render()
            .unwrap()
            .contains(r#"xdpcni_reconcile_retries_total{kind="offloads"} 1"#));
        assert!(text.contains(r#"xdpcni_reconcile_duration_seconds_count{scope="pod"} 1"#));
        assert!(text.contains("xdpcni_ready 1"));
        assert!(text.ends_with("# EOF\n"));
        assert!(!text.contains(".."), "help ends with one period");
        book.set_pod(pod(WhyCode::MapFull));
        let text = m.render().unwrap();
        assert!(text.contains("\nxdpcni_map_full_pods 1\n"), "{text}");
        assert!(
            text.contains(
                r#"xdpcni_pod_kernel_only{namespace="ns",pod="we\"ird",reason="map-full"} 1"#
            ),
            "{text}"
        );
        book.retain_pods(|id| id != "c1");
        assert!(!m.render().unwrap().contains("xdp0"));
    }
}
