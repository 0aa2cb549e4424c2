//! The agent's metrics, through prometheus-client: reconcile figures kept in
//! the registry, and the datapath's per-pod counters read from the pinned
//! maps at scrape time (a collector), so a scrape is never older than the
//! packets it reports.

use std::{fmt, sync::Arc};

use prometheus_client::{
    encoding::{EncodeLabelValue, LabelValueEncoder},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};
use xdpcni_ebpf::{Counters, MapFill, Maps};

use crate::status::Book;

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
    /// Loading the Service programs or writing their maps.
    Services,
}

impl Stage {
    /// Every stage (all are exported from the start, at 0).
    pub const ALL: [Stage; 10] = [
        Self::Apply,
        Self::Records,
        Self::NatPorts,
        Self::Routes,
        Self::Event,
        Self::Gc,
        Self::Pins,
        Self::Gate,
        Self::Netpol,
        Self::Services,
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
            Self::Services => "services",
        }
    }
}

mod collectors;

pub use collectors::{
    family_name, PodsCollector, PolicyCollector, PolicyCounterSource, PolicyStatsSource,
    ServiceStatsSource, ServicesCollector,
};

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
    /// `xdpcni_service_sync_seconds`: a watch event to the Service maps.
    pub service_sync: Histogram,
    /// `xdpcni_service_sockets_closed_total`.
    pub sockets_closed: Counter,
}

/// `metric`, registered in `registry` as `name` with `help`.
fn add<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

fn duration_histogram() -> Histogram {
    // 100 us .. ~3 s.
    Histogram::new(exponential_buckets(1e-4, 2.0, 16))
}

impl Metrics {
    /// Metrics whose per-pod and policy families read `book` and the
    /// counters in `maps` at scrape time, the policy drop counters
    /// `policy_source`, the datapath's policy check counts `policy_stats`,
    /// and the Service programs' counters `service_source`.
    pub fn new(
        maps: Arc<dyn DatapathReader>,
        book: Arc<Book>,
        policy_source: PolicyCounterSource,
        policy_stats: PolicyStatsSource,
        service_source: ServiceStatsSource,
    ) -> Self {
        let mut r = Registry::default();
        let errors = Family::<OneLabel, Counter>::default();
        for stage in Stage::ALL {
            let _ = errors.get_or_create(&[("stage", stage.as_str())]);
        }
        let retries = Family::<OneLabel, Counter>::default();
        for kind in ["datapath", "offloads", "task"] {
            let _ = retries.get_or_create(&[("kind", kind)]);
        }
        let node_routes = Family::<OneLabel, Gauge>::default();
        for via in ["hostGateway", "vxlan", "unreachable"] {
            let _ = node_routes.get_or_create(&[("via", via)]);
        }
        let metrics = Self {
            errors: add(
                &mut r,
                "xdpcni_reconcile_errors",
                "Reconcile failures, by stage (apply, records, nat_ports, routes, event, gc, pins, gate, netpol, services)",
                errors,
            ),
            duration: add(
                &mut r,
                "xdpcni_reconcile_duration_seconds",
                "Time to reconcile one pod (scope=pod) or the node-wide work (scope=node)",
                Family::new_with_constructor(duration_histogram),
            ),
            retries: add(
                &mut r,
                "xdpcni_reconcile_retries",
                "Pod reconciles that failed and were retried (Kubernetes mode), by kind of error (datapath, offloads, task)",
                retries,
            ),
            policy_problems: add(
                &mut r,
                "xdpcni_policy_problems",
                "Annotation values refused and kernel attach refusals, each with a fallback used",
                Counter::default(),
            ),
            ready: add(
                &mut r,
                "xdpcni_ready",
                "Whether the agent has reconciled the node",
                Gauge::default(),
            ),
            forward_rule_pods: add(
                &mut r,
                "xdpcni_forward_rule_pods",
                "Pods made kernel-only because a DROP/REJECT rule reachable from the node's FORWARD chain names them",
                Gauge::default(),
            ),
            reloads: add(
                &mut r,
                "xdpcni_datapath_reloads",
                "Times the agent re-created and re-pinned a datapath whose pins were removed",
                Counter::default(),
            ),
            datapath: add(
                &mut r,
                "xdpcni_datapath_info",
                "1 for the pinned datapath in use: its layout (map definitions) and build (programs)",
                Family::default(),
            ),
            migration: add(
                &mut r,
                "xdpcni_datapath_migration_seconds",
                "How long this agent's start took to migrate the datapath from an older layout (0: none)",
                Gauge::default(),
            ),
            node_routes: add(
                &mut r,
                "xdpcni_node_routes",
                "Routes to other nodes' pod CIDRs in place, by next hop (hostGateway, vxlan), and host-gateway routes the kernel refused (unreachable: the next hop is not on this node's L2 segment)",
                node_routes,
            ),
            policy_apply: add(
                &mut r,
                "xdpcni_policy_apply_duration_seconds",
                "Time of one nftables transaction putting the node's NetworkPolicy rules in force",
                duration_histogram(),
            ),
            service_sync: add(
                &mut r,
                "xdpcni_service_sync_seconds",
                "Time from a Service, EndpointSlice or Endpoints watch event (or a pod's record) to the Service maps holding it",
                duration_histogram(),
            ),
            sockets_closed: add(
                &mut r,
                "xdpcni_service_sockets_closed",
                "Connected UDP sockets closed because the Service backend they were translated to went (their application sees ECONNABORTED)",
                Counter::default(),
            ),
            registry: Registry::default(),
        };
        r.register_collector(Box::new(PodsCollector {
            maps,
            book: Arc::clone(&book),
        }));
        r.register_collector(Box::new(PolicyCollector {
            source: policy_source,
            datapath: policy_stats,
            book: Arc::clone(&book),
        }));
        r.register_collector(Box::new(ServicesCollector {
            source: service_source,
            book,
            nat_evictions: std::sync::atomic::AtomicU64::new(0),
        }));
        Self {
            registry: r,
            ..metrics
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
    use std::collections::BTreeMap;

    use xdpcni_ebpf::abi::{Verdict, VerdictKind};

    use crate::status::{PodStatus, Why, WhyCode};

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
        let m = Metrics::new(
            Arc::new(Fake),
            Arc::clone(&book),
            Box::new(BTreeMap::new),
            Box::new(|| {
                Some(xdpcni_ebpf::PolicyStats {
                    new: 3,
                    refused: 5,
                    ..Default::default()
                })
            }),
            Box::new(|| {
                Some(xdpcni_ebpf::ServiceStats {
                    translated: 4,
                    no_backend: 1,
                    left: 0,
                    expired: 2,
                    nat_entries: 6,
                    nat_capacity: 262144,
                    nat_made: 10,
                    nat_evictions: 4,
                    nat_no_tuple: 1,
                })
            }),
        );
        book.set_pod(pod(WhyCode::NodeDefault));
        // An uplink north-south Services come in by (and eth0 again:
        // one row for a device both use).
        book.update_services(|s| {
            s.north_south_uplinks = vec![(5, "up1".into()), (2, "eth0".into())];
        });
        book.set_cross_node(crate::status::CrossNodeStatus {
            on: true,
            off: None,
            destinations: 3,
            uplinks: vec![crate::status::UplinkStatus {
                interface: "eth0".into(),
                ifindex: 2,
                counters: None,
            }],
        });
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
        // The fast path between nodes: on, its destinations, each uplink's
        // verdicts.
        assert!(
            text.contains(r#"xdpcni_cross_node_fast_path{state="on"} 1"#)
                && text.contains(r#"xdpcni_cross_node_fast_path{state="node"} 0"#)
                && text.contains("\nxdpcni_cross_node_destinations 3\n")
                && text.contains(
                    r#"xdpcni_uplink_packets_total{interface="eth0",verdict="from_node_peer"} 0"#
                )
                && text.contains(
                    r#"xdpcni_uplink_packets_total{interface="up1",verdict="ns_to_pod"} 0"#
                )
                && text
                    .matches(r#"xdpcni_uplink_packets_total{interface="eth0",verdict="ns_to_pod"}"#)
                    .count()
                    == 1,
            "{text}"
        );
        // The Service programs' counters, and the frontends from the book.
        assert!(
            text.contains(r#"xdpcni_service_calls_total{result="translated"} 4"#)
                && text.contains(r#"xdpcni_policy_datapath_packets_total{verdict="refused"} 5"#),
            "{text}"
        );
        assert!(
            text.contains(r#"xdpcni_service_calls_total{result="no_backend"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"xdpcni_service_calls_total{result="expired"} 2"#),
            "{text}"
        );
        assert!(
            text.contains("xdpcni_service_nat_entries 6")
                && text.contains("xdpcni_service_nat_capacity 262144")
                && text.contains("xdpcni_service_nat_evictions_total 4")
                && text.contains("xdpcni_service_nat_no_tuple_total 1"),
            "{text}"
        );
        assert!(
            text.contains(r#"xdpcni_service_frontends{backends="ready"} 0"#),
            "{text}"
        );
        assert!(text.contains(r#"xdpcni_reconcile_errors_total{stage="services"} 0"#));
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
