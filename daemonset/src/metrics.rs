//! The agent's metrics, through prometheus-client: reconcile figures kept in
//! the registry, and the datapath's per-pod counters read from the pinned
//! maps at scrape time (a collector), so a scrape is never older than the
//! packets it reports.

use std::{
    collections::BTreeMap,
    fmt,
    sync::{Mutex, PoisonError},
};

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
    Counters,
};
use xdpcni_node::pod::XdpMode;

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

/// What /metrics shows of one pod: its labels, veth and mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodView {
    /// Kubernetes namespace (or empty).
    pub namespace: String,
    /// Pod name (or the container ID when unknown).
    pub pod: String,
    /// Host veth name.
    pub interface: String,
    /// Host veth ifindex (its counters).
    pub ifindex: u32,
    /// The mode in force.
    pub mode: XdpMode,
    /// On kernel routing because a datapath map is full.
    pub map_full: bool,
}

/// Reads a host veth's datapath counters (the pinned maps, in the agent).
pub type CounterSource = Box<dyn Fn(u32) -> Counters + Send + Sync>;

/// The per-pod families, read at scrape time.
pub struct PodsCollector {
    source: CounterSource,
    pods: Mutex<BTreeMap<String, PodView>>,
}

impl fmt::Debug for PodsCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PodsCollector").finish_non_exhaustive()
    }
}

impl PodsCollector {
    fn views(&self) -> Vec<PodView> {
        self.pods
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
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
            format!("{what} the XDP fast path delivered, by pod and verdict")
        }
        VerdictKind::Kernel => {
            format!("{what} the XDP datapath passed to the kernel stack, by pod and reason")
        }
        VerdictKind::Drop => format!("{what} the XDP datapath dropped, by pod and reason"),
    }
}

impl Collector for PodsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let views = self.views();
        // One read of each pod's counters serves all six families.
        let counters: Vec<_> = views.iter().map(|v| (self.source)(v.ifindex)).collect();
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
                            ("pod", Escaped(&view.pod)),
                            ("interface", Escaped(&view.interface)),
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
                    ("pod", Escaped(&view.pod)),
                    ("mode", Escaped(mode.as_str())),
                ];
                ConstGauge::new(i64::from(view.mode == mode))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        let full = views.iter().filter(|v| v.map_full).count();
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

/// What /metrics shows of the NetworkPolicy rules in force.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyView {
    /// Each isolated local pod: (namespace, pod, ingress, egress).
    pub pods: Vec<(String, String, bool, bool)>,
    /// NetworkPolicies that select at least one local pod.
    pub policies: usize,
    /// Rules in the ruleset in force.
    pub rules: usize,
}

impl PolicyView {
    /// The view of `e`, in force with `rules` rules.
    pub fn of(e: &crate::netpol::model::Enforcement, rules: usize) -> Self {
        let policies: std::collections::BTreeSet<&String> =
            e.pods.values().flat_map(|p| &p.policies).collect();
        Self {
            pods: e
                .pods
                .iter()
                .map(|((ns, pod), r)| {
                    (
                        ns.clone(),
                        pod.clone(),
                        r.ingress.is_some(),
                        r.egress.is_some(),
                    )
                })
                .collect(),
            policies: policies.len(),
            rules,
        }
    }
}

/// Reads the policy table's named counters: name -> (packets, bytes).
pub type PolicyCounterSource = Box<dyn Fn() -> BTreeMap<String, (u64, u64)> + Send + Sync>;

/// The NetworkPolicy families: what is in force, and the drops by pod read
/// from nftables counters at scrape time.
pub struct PolicyCollector {
    source: PolicyCounterSource,
    view: Mutex<PolicyView>,
}

impl fmt::Debug for PolicyCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyCollector").finish_non_exhaustive()
    }
}

impl Collector for PolicyCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        use crate::netpol::{model::Direction, nft};
        let view = self
            .view
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let counters = if view.pods.is_empty() {
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
            (
                "ingress",
                (|p: &(String, String, bool, bool)| p.2) as fn(&_) -> bool,
            ),
            ("egress", |p| p.3),
        ] {
            let n = view.pods.iter().filter(|p| pick(p)).count();
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(family.encode_family(&[("direction", direction)])?)?;
        }
        for (name, help, value) in [
            (
                "xdpcni_policy_policies",
                "NetworkPolicies in force on this node (selecting at least one of its pods)",
                view.policies,
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
            for (ns, pod, ingress, egress) in &view.pods {
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
    pods: std::sync::Arc<PodsCollector>,
    policy: std::sync::Arc<PolicyCollector>,
    /// `xdpcni_policy_apply_duration_seconds`: one nftables transaction.
    pub policy_apply: Histogram,
    /// `xdpcni_reconcile_errors_total{stage}`.
    pub errors: Family<OneLabel, Counter>,
    /// `xdpcni_reconcile_duration_seconds{scope="pod"|"node"}`.
    pub duration: Family<OneLabel, Histogram, fn() -> Histogram>,
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
}

fn duration_histogram() -> Histogram {
    // 100 us .. ~3 s.
    Histogram::new(exponential_buckets(1e-4, 2.0, 16))
}

impl Metrics {
    /// Metrics whose per-pod families read `source` at scrape time, and the
    /// policy drop counters `policy_source`.
    pub fn new(source: CounterSource, policy_source: PolicyCounterSource) -> Self {
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
        let pods = std::sync::Arc::new(PodsCollector {
            source,
            pods: Mutex::new(BTreeMap::new()),
        });
        registry.register_collector(Box::new(std::sync::Arc::clone(&pods)));
        let policy = std::sync::Arc::new(PolicyCollector {
            source: policy_source,
            view: Mutex::new(PolicyView::default()),
        });
        registry.register_collector(Box::new(std::sync::Arc::clone(&policy)));
        let policy_apply = duration_histogram();
        registry.register(
            "xdpcni_policy_apply_duration_seconds",
            "Time of one nftables transaction putting the node's NetworkPolicy rules in force",
            policy_apply.clone(),
        );
        Self {
            registry,
            pods,
            policy,
            policy_apply,
            errors,
            duration,
            policy_problems,
            ready,
            forward_rule_pods,
            reloads,
            datapath,
            migration,
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

    /// Counts an error at `stage`.
    pub fn error(&self, stage: Stage) {
        self.errors
            .get_or_create(&[("stage", stage.as_str())])
            .inc();
    }

    /// Records one reconcile's duration in `scope` (`pod` or `node`).
    pub fn observe(&self, scope: &'static str, seconds: f64) {
        self.duration
            .get_or_create(&[("scope", scope)])
            .observe(seconds);
    }

    /// Shows (or updates) a pod, keyed by its container ID.
    pub fn show_pod(&self, container_id: &str, view: PodView) {
        self.pods
            .pods
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(container_id.to_string(), view);
    }

    /// Shows the NetworkPolicy rules in force.
    pub fn show_policy(&self, view: PolicyView) {
        *self
            .policy
            .view
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = view;
    }

    /// Keeps only the pods whose container IDs `keep` accepts.
    pub fn retain_pods(&self, keep: impl Fn(&str) -> bool) {
        self.pods
            .pods
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|id, _| keep(id));
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
    use xdpcni_ebpf::AttachMode;

    use super::*;

    #[test]
    fn families_by_verdict_kind_modes_errors_and_histogram() {
        let m = Metrics::new(Box::new(|_| Counters::default()), Box::new(BTreeMap::new));
        m.show_pod(
            "c1",
            PodView {
                namespace: "ns".into(),
                pod: "we\"ird".into(),
                interface: "xdp0".into(),
                ifindex: 7,
                mode: XdpMode::Xdp(AttachMode::Generic),
                map_full: false,
            },
        );
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
        assert!(
            text.contains(r#"xdpcni_attach_mode{namespace="ns",pod="we\"ird",mode="generic"} 1"#)
        );
        assert!(text.contains(r#"mode="off"} 0"#));
        assert!(text.contains("\nxdpcni_map_full_pods 0\n"), "{text}");
        assert!(text.contains(r#"xdpcni_reconcile_errors_total{stage="routes"} 1"#));
        assert!(text.contains(r#"xdpcni_reconcile_errors_total{stage="apply"} 0"#));
        assert!(text.contains(r#"xdpcni_reconcile_duration_seconds_count{scope="pod"} 1"#));
        assert!(text.contains("xdpcni_ready 1"));
        assert!(text.ends_with("# EOF\n"));
        assert!(!text.contains(".."), "help ends with one period");
        m.retain_pods(|id| id != "c1");
        assert!(!m.render().unwrap().contains("xdp0"));
    }
}
