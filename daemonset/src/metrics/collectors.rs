//! The families read at scrape time: per pod from the book and the pinned
//! maps' counters, the NetworkPolicy view with the rules' counters, and
//! the Service programs' counters.

use std::{collections::BTreeMap, fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge, MetricType},
};
use xdpcni_ebpf::abi::{Verdict, VerdictKind};
use xdpcni_host::pod::XdpMode;

use super::{DatapathReader, Escaped};
use crate::status::{Book, IsolatedPod, PodStatus, WhyCode};

/// Reads the Service programs' counters (none where they are not loaded).
pub type ServiceStatsSource = Box<dyn Fn() -> Option<xdpcni_ebpf::ServiceStats> + Send + Sync>;

/// The Service families, read at scrape time: frontends from the book, the
/// programs' counters from their pinned map.
pub struct ServicesCollector {
    pub(super) source: ServiceStatsSource,
    pub(super) book: Arc<Book>,
    /// The highest NAT eviction count read (`ServiceStats::nat_evictions`
    /// may read lower for a moment; a counter never goes down).
    pub(super) nat_evictions: std::sync::atomic::AtomicU64,
}

impl fmt::Debug for ServicesCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServicesCollector").finish_non_exhaustive()
    }
}

impl Collector for ServicesCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let view = self.book.services();
        let mut family = encoder.encode_descriptor(
            "xdpcni_service_frontends",
            "ClusterIP frontends (address, port, protocol) translated at the node's pods' sockets, by whether they have a ready backend (none: left to kube-proxy, which refuses)",
            None,
            MetricType::Gauge,
        )?;
        let ready = view.frontends.iter().filter(|f| f.backends > 0).count();
        for (backends, n) in [("ready", ready), ("none", view.frontends.len() - ready)] {
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(family.encode_family(&[("backends", backends)])?)?;
        }
        let st = (self.source)().unwrap_or_default();
        let mut family = encoder.encode_descriptor(
            "xdpcni_service_calls",
            "Calls (connect, unconnected sendmsg) of the node's pods to a ClusterIP frontend, by what the socket programs did: translated to a backend, no_backend (left to kube-proxy, which refuses), expired (left to kube-proxy: the agent's lease on the maps ran out), left (to kube-proxy for another reason: the backend chosen is the caller itself, a socket record not written)",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [
            ("translated", st.translated),
            ("no_backend", st.no_backend),
            ("expired", st.expired),
            ("left", st.left),
        ] {
            ConstCounter::new(n).encode(family.encode_family(&[("result", result)])?)?;
        }
        for (name, help, v) in [
            (
                "xdpcni_service_nat_entries",
                "Entries in the north-south NAT table (svc_nat, two per flow; an LRU: at its size a new flow evicts the least recently used)",
                st.nat_entries,
            ),
            (
                "xdpcni_service_nat_capacity",
                "Size of the north-south NAT table (svc_nat)",
                st.nat_capacity,
            ),
        ] {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(i64::from(v)).encode(family)?;
        }
        let evicted = self
            .nat_evictions
            .fetch_max(st.nat_evictions, std::sync::atomic::Ordering::Relaxed)
            .max(st.nat_evictions);
        for (name, help, v) in [
            (
                "xdpcni_service_nat_evictions",
                "Entries the north-south NAT table (svc_nat) evicted to make room: a flow whose entry went is left to the kernel's path (kube-proxy) from its next packet",
                evicted,
            ),
            (
                "xdpcni_service_nat_no_tuple",
                "New north-south flows left to kube-proxy because no reply tuple (masquerade port) was free",
                st.nat_no_tuple,
            ),
        ] {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(family)?;
        }
        Ok(())
    }
}

/// The per-pod families, read at scrape time: the pods from the book,
/// their counters from the pinned maps.
pub struct PodsCollector {
    pub(super) maps: Arc<dyn DatapathReader>,
    pub(super) book: Arc<Book>,
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
        encode_verdicts(&mut encoder, &views, &counters)?;
        encode_pod_modes(&mut encoder, &views)?;
        self.encode_cross_node(&mut encoder)?;
        self.encode_maps(&mut encoder, &views)
    }
}

impl PodsCollector {
    /// The fast path between nodes: whether it is on (or why not), the pod
    /// CIDRs it reaches, and each uplink program's counters by verdict.
    fn encode_cross_node(&self, encoder: &mut DescriptorEncoder) -> Result<(), fmt::Error> {
        let x = self.book.cross_node();
        let mut family = encoder.encode_descriptor(
            "xdpcni_cross_node_fast_path",
            "1 when the fast path between nodes is on (state=on), else 1 for why it is off (config, node: the Node's annotation, bad_annotation, nat_ports: the NAT'd ports could not be written whole)",
            None,
            MetricType::Gauge,
        )?;
        for state in ["on", "config", "node", "bad_annotation", "nat_ports"] {
            let here = match &x.off {
                Some(why) => why == state,
                None => x.on && state == "on",
            };
            ConstGauge::new(i64::from(here)).encode(family.encode_family(&[("state", state)])?)?;
        }
        let family = encoder.encode_descriptor(
            "xdpcni_cross_node_destinations",
            "Other nodes' pod CIDRs the fast path sends to (host-gateway routes in place)",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(i64::try_from(x.destinations).unwrap_or(i64::MAX)).encode(family)?;
        // The uplink program's devices: toward other nodes, and those
        // north-south Services come in by (one row each).
        let mut uplinks: Vec<(u32, String)> = x
            .uplinks
            .iter()
            .map(|u| (u.ifindex, u.interface.clone()))
            .collect();
        for u in self.book.services().north_south_uplinks {
            if !uplinks.iter().any(|have| have.0 == u.0) {
                uplinks.push(u);
            }
        }
        let counters: Vec<_> = uplinks.iter().map(|u| self.maps.counters(u.0)).collect();
        for bytes in [false, true] {
            let what = if bytes { "bytes" } else { "packets" };
            let name = format!("xdpcni_uplink_{what}");
            let mut family = encoder.encode_descriptor(
                &name,
                &format!("{} that came in on a device the uplink program runs on (the fast path between nodes receives on it, or north-south Services come in by it), by its verdict: from_node_peer (delivered to a pod), ns_to_pod, ns_to_node, ns_reply (north-south), everything else left to the kernel (the node's own traffic as pass_no_endpoint)", if bytes { "Bytes" } else { "Packets" }),
                None,
                MetricType::Counter,
            )?;
            for (u, c) in uplinks.iter().zip(&counters) {
                for &verdict in Verdict::ALL {
                    let s = c.get(verdict);
                    let labels = [
                        ("interface", Escaped(&u.1)),
                        ("verdict", Escaped(verdict.label())),
                    ];
                    let value = if bytes { s.bytes } else { s.packets };
                    ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// The packet and byte families of every verdict kind, by pod and verdict.
fn encode_verdicts(
    encoder: &mut DescriptorEncoder,
    views: &[PodStatus],
    counters: &[xdpcni_ebpf::Counters],
) -> Result<(), fmt::Error> {
    for kind in VerdictKind::ALL {
        for bytes in [false, true] {
            let name = family_name(kind, bytes);
            let help = family_help(kind, bytes);
            let mut family = encoder.encode_descriptor(&name, &help, None, MetricType::Counter)?;
            for (view, c) in views.iter().zip(counters) {
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
    Ok(())
}

/// Each pod's mode in force, and why it is kept off the fast path.
fn encode_pod_modes(
    encoder: &mut DescriptorEncoder,
    views: &[PodStatus],
) -> Result<(), fmt::Error> {
    let mut family = encoder.encode_descriptor(
        "xdpcni_attach_mode",
        "The XDP mode of each pod's host veth (1 for the mode in force)",
        None,
        MetricType::Gauge,
    )?;
    for view in views {
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
    Ok(())
}

impl PodsCollector {
    /// Each map's fill and size, and the pods a full map left on kernel
    /// routing.
    fn encode_maps(
        &self,
        encoder: &mut DescriptorEncoder,
        views: &[PodStatus],
    ) -> Result<(), fmt::Error> {
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
        ConstGauge::new(i64::try_from(full).unwrap_or(i64::MAX)).encode(family)
    }
}

/// Reads the policy table's named counters: name -> (packets, bytes).
pub type PolicyCounterSource = Box<dyn Fn() -> BTreeMap<String, (u64, u64)> + Send + Sync>;

/// Reads the datapath's policy check counts (none where unreadable).
pub type PolicyStatsSource = Box<dyn Fn() -> Option<xdpcni_ebpf::PolicyStats> + Send + Sync>;

/// The NetworkPolicy families: what is in force, the drops by pod read
/// from nftables counters, and the datapath's check counts, at scrape time.
pub struct PolicyCollector {
    pub(super) source: PolicyCounterSource,
    pub(super) datapath: PolicyStatsSource,
    pub(super) book: Arc<Book>,
}

impl fmt::Debug for PolicyCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyCollector").finish_non_exhaustive()
    }
}

impl Collector for PolicyCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        use crate::netpol::nft;
        let view = self.book.policy();
        let counters = if view.isolated.is_empty() {
            BTreeMap::new()
        } else {
            (self.source)()
        };
        let mut family = encoder.encode_descriptor(
            "xdpcni_policy_isolated_pods",
            "Pods of this node that NetworkPolicies isolate, by direction (the datapath enforces their policies where their verdicts fit it, the nftables rules everywhere else)",
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
        encode_policy_drops(&mut encoder, &view, &counters)?;
        let invalid = counters.get(nft::DROP_INVALID).map_or(0, |c| c.0);
        let family = encoder.encode_descriptor(
            "xdpcni_policy_invalid_drop_packets",
            "Packets to or from isolated pods dropped because conntrack found them invalid or untracked",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(invalid).encode(family)?;
        let st = (self.datapath)().unwrap_or_default();
        let mut family = encoder.encode_descriptor(
            "xdpcni_policy_datapath_packets",
            "Packets to or from pods whose NetworkPolicies the datapath enforces, by its verdict: new (a flow's first packet, allowed and recorded), established (a packet of a recorded flow, either way), recheck (a recorded flow allowed again after a policy change), refused (dropped: drop_policy), kernel (left to the nftables rules: begun on the kernel path, TCP mid-stream, not decidable)",
            None,
            MetricType::Counter,
        )?;
        for (verdict, n) in [
            ("new", st.new),
            ("established", st.hit),
            ("recheck", st.recheck),
            ("refused", st.refused),
            ("kernel", st.kernel),
        ] {
            ConstCounter::new(n).encode(family.encode_family(&[("verdict", verdict)])?)?;
        }
        Ok(())
    }
}

/// The packets and bytes the rules dropped, by isolated pod and direction
/// (`counters`: the table's named counters).
fn encode_policy_drops(
    encoder: &mut DescriptorEncoder,
    view: &crate::status::PolicyStatus,
    counters: &BTreeMap<String, (u64, u64)>,
) -> Result<(), fmt::Error> {
    use crate::netpol::{model::Direction, nft};
    for bytes in [false, true] {
        let unit = if bytes { "bytes" } else { "packets" };
        let name = format!("xdpcni_policy_drop_{unit}");
        let help =
            format!("{unit} NetworkPolicy rules dropped, by pod and direction (nftables counters)");
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
    Ok(())
}
