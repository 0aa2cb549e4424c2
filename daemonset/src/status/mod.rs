//! What the agent has put in force, in one place: each pod's mode and why,
//! and the NetworkPolicy view. `/metrics` reads it (the per-pod and policy
//! families) and so does `/v1/status`, whose JSON `xdpcni-agent status`
//! prints. The types serialize and deserialize: the command parses the very
//! structs the agent wrote.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{Mutex, PoisonError},
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

mod nodes;
mod services;
mod table;

pub use nodes::{CrossNodeStatus, UplinkStatus};
pub use services::{FrontendStatus, HealthCheckStatus, ServicesStatus};

/// The path of the status endpoint.
pub const PATH: &str = "/v1/status";

/// Why a pod is in the mode it is in: a code a script matches on, and the
/// sentence a person reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Why {
    /// What decided it.
    pub code: WhyCode,
    /// The same, in words, with the names involved.
    pub text: String,
}

/// What decided a pod's mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WhyCode {
    /// Its `xdpcni.io/xdp-mode` annotation.
    Annotation,
    /// The node default (no annotation, or one refused).
    NodeDefault,
    /// The kernel refused the mode asked for; the next one down is in force.
    Fallback,
    /// A NetworkPolicy isolates it: kernel path both ways.
    NetworkPolicy,
    /// A DROP/REJECT rule reachable from the node's FORWARD chain names it.
    ForwardRule,
    /// Held since its CNI ADD until the agent classifies it.
    Held,
    /// A datapath map had no room for its records.
    MapFull,
    /// Its host veth was deleted outside the CNI.
    VethGone,
}

impl WhyCode {
    /// Every code.
    pub const ALL: [WhyCode; 8] = [
        Self::Annotation,
        Self::NodeDefault,
        Self::Fallback,
        Self::NetworkPolicy,
        Self::ForwardRule,
        Self::Held,
        Self::MapFull,
        Self::VethGone,
    ];

    /// The code as JSON and the `reason` label write it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Annotation => "annotation",
            Self::NodeDefault => "node-default",
            Self::Fallback => "fallback",
            Self::NetworkPolicy => "network-policy",
            Self::ForwardRule => "forward-rule",
            Self::Held => "held",
            Self::MapFull => "map-full",
            Self::VethGone => "veth-gone",
        }
    }

    /// Whether the pod is kept off the fast path by this (kernel-only).
    pub const fn is_kernel_only(self) -> bool {
        matches!(
            self,
            Self::NetworkPolicy | Self::ForwardRule | Self::Held | Self::MapFull | Self::VethGone
        )
    }
}

/// Packets of one verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictCount {
    /// The verdict's counter label.
    pub verdict: String,
    /// Packets.
    pub packets: u64,
}

/// A pod's datapath counters by kind (packets), read at request time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// Redirected to another pod by this pod's host veth (once per delivery).
    pub forward: u64,
    /// Passed to the kernel stack.
    pub kernel: u64,
    /// Dropped.
    pub drop: u64,
    /// Delivered to this pod by the fast path (the receive side).
    pub received: u64,
    /// The verdicts with the most packets, at most [`TOP_VERDICTS`].
    pub top: Vec<VerdictCount>,
}

/// How many verdicts [`Counts::top`] lists.
pub const TOP_VERDICTS: usize = 3;

impl Counts {
    /// The counts of `c`.
    pub fn of(c: &xdpcni_ebpf::Counters) -> Self {
        use xdpcni_ebpf::abi::VerdictKind;
        let mut top: Vec<VerdictCount> = c
            .iter()
            .filter(|(v, _)| v.kind().is_decision())
            .map(|(v, s)| VerdictCount {
                verdict: v.label().into(),
                packets: s.packets,
            })
            .collect();
        top.sort_by(|a, b| b.packets.cmp(&a.packets).then(a.verdict.cmp(&b.verdict)));
        top.truncate(TOP_VERDICTS);
        Self {
            forward: c.of_kind(VerdictKind::Forward),
            kernel: c.of_kind(VerdictKind::Kernel),
            drop: c.of_kind(VerdictKind::Drop),
            received: c.of_kind(VerdictKind::Received),
            top,
        }
    }
}

/// One pod as the agent last reconciled it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    /// Kubernetes namespace (empty for a record without a pod).
    pub namespace: String,
    /// Pod name (the container ID for a record without a pod).
    pub name: String,
    /// The runtime's container ID.
    pub container_id: String,
    /// Its addresses.
    pub ips: Vec<IpAddr>,
    /// Host veth name.
    pub host_veth: String,
    /// Host veth ifindex.
    pub ifindex: u32,
    /// The mode in force: `native`, `tc`, `generic` or `off`.
    pub mode: String,
    /// The mode its policy asks for (annotation or node default).
    pub wanted: String,
    /// Why it is in `mode`.
    pub why: Why,
    /// Redirect policy of frames to it: `devmap` or `cpumap`.
    pub redirect: String,
    /// The CPUs of its cpumap redirect.
    pub cpus: String,
    /// Annotation values or kernel answers refused, with the fallback used.
    pub problems: Vec<String>,
    /// When it was last reconciled (seconds since the epoch).
    pub reconciled_at: f64,
    /// Its counters (filled at request time; absent in the book).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<Counts>,
}

/// The NetworkPolicy rules in force.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// Whether the policies were listed and put in force at least once.
    pub known: bool,
    /// NetworkPolicies selecting at least one local pod, `namespace/name`.
    pub in_force: Vec<String>,
    /// Rules in the nftables ruleset in force.
    pub rules: usize,
    /// Each isolated local pod: (namespace, pod, ingress, egress).
    pub isolated: Vec<IsolatedPod>,
}

/// A local pod NetworkPolicies isolate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IsolatedPod {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Isolated for ingress.
    pub ingress: bool,
    /// Isolated for egress.
    pub egress: bool,
}

impl PolicyStatus {
    /// The policies' line of the status table.
    fn summary(&self) -> String {
        if !self.known {
            "not listed yet (new pods of every namespace are held)".to_string()
        } else if self.in_force.is_empty() {
            "none selects a pod of this node".to_string()
        } else {
            format!(
                "{} in force ({}), {} rules, {} pods isolated",
                self.in_force.len(),
                self.in_force.join(", "),
                self.rules,
                self.isolated.len()
            )
        }
    }

    /// The view of `e`, in force with `rules` rules.
    pub fn of(e: &crate::netpol::model::Enforcement, rules: usize) -> Self {
        let in_force: std::collections::BTreeSet<&String> =
            e.pods.values().flat_map(|p| &p.policies).collect();
        Self {
            known: true,
            in_force: in_force.into_iter().cloned().collect(),
            rules,
            isolated: e
                .pods
                .iter()
                .map(|((ns, pod), r)| IsolatedPod {
                    namespace: ns.clone(),
                    pod: pod.clone(),
                    ingress: r.ingress.is_some(),
                    egress: r.egress.is_some(),
                })
                .collect(),
        }
    }
}

/// A map's fill.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapStatus {
    /// Pinned name.
    pub name: String,
    /// Entries now.
    pub entries: u32,
    /// Its size.
    pub capacity: u32,
}

/// A loaded program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramStatus {
    /// Its name.
    pub name: String,
    /// Its kernel id (`bpftool prog show id N`).
    pub id: u32,
}

/// The datapath in use.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DatapathStatus {
    /// The pin directory.
    pub pin_dir: String,
    /// Its layout (map definitions).
    pub layout: u32,
    /// Its build (programs).
    pub build: String,
    /// The programs.
    pub programs: Vec<ProgramStatus>,
    /// The maps that can fill.
    pub maps: Vec<MapStatus>,
    /// Seconds this agent's start spent migrating from an older layout.
    pub migration_seconds: f64,
}

/// The node defaults pods without annotations get.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Defaults {
    /// XDP mode.
    pub mode: String,
    /// Redirect policy.
    pub redirect: String,
    /// cpumap CPUs.
    pub cpus: String,
}

/// What `/v1/status` answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// The agent's version.
    pub version: String,
    /// `kubernetes` or `standalone`.
    pub agent_mode: String,
    /// The node's name (Kubernetes mode).
    pub node: Option<String>,
    /// Whether the node was reconciled once.
    pub ready: bool,
    /// When the node-wide work last ran (seconds since the epoch).
    pub last_node_pass: Option<f64>,
    /// When this answer was made (seconds since the epoch).
    pub now: f64,
    /// The datapath.
    pub datapath: DatapathStatus,
    /// The node defaults.
    pub defaults: Defaults,
    /// NetworkPolicy enforcement.
    pub policies: PolicyStatus,
    /// Service translation at the socket.
    #[serde(default)]
    pub services: ServicesStatus,
    /// The fast path between nodes.
    #[serde(default)]
    pub cross_node: CrossNodeStatus,
    /// Pods whose records a failure to read left out (see the agent's log).
    pub unreadable_records: usize,
    /// Every pod, by namespace and name.
    pub pods: Vec<PodStatus>,
}

/// Seconds since the epoch, now.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The agent's book of what is in force: pods by container ID, and the
/// policy view.
#[derive(Debug, Default)]
pub struct Book {
    pods: Mutex<BTreeMap<String, PodStatus>>,
    policy: Mutex<PolicyStatus>,
    services: Mutex<ServicesStatus>,
    cross_node: Mutex<CrossNodeStatus>,
    last_node_pass: Mutex<Option<f64>>,
}

impl Book {
    /// Records (or updates) a pod, keyed by its container ID.
    pub fn set_pod(&self, pod: PodStatus) {
        self.pods
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(pod.container_id.clone(), pod);
    }

    /// Keeps only the pods whose container IDs `keep` accepts.
    pub fn retain_pods(&self, keep: impl Fn(&str) -> bool) {
        self.pods
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|id, _| keep(id));
    }

    /// Every pod, ordered by namespace and name.
    pub fn pods(&self) -> Vec<PodStatus> {
        let mut v: Vec<PodStatus> = self
            .pods
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        v
    }

    /// Records the NetworkPolicy rules in force.
    pub fn set_policy(&self, p: PolicyStatus) {
        *self.policy.lock().unwrap_or_else(PoisonError::into_inner) = p;
    }

    /// The NetworkPolicy rules in force.
    pub fn policy(&self) -> PolicyStatus {
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records what the Service writer last did.
    pub fn set_services(&self, s: ServicesStatus) {
        *self.services.lock().unwrap_or_else(PoisonError::into_inner) = s;
    }

    /// Changes the Services status in place (its writers, the Service
    /// task and the health check listeners, each change their own part).
    pub fn update_services(&self, f: impl FnOnce(&mut ServicesStatus)) {
        f(&mut self.services.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Service translation as last recorded.
    pub fn services(&self) -> ServicesStatus {
        self.services
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records what the last routing pass left of the fast path between
    /// nodes.
    pub fn set_cross_node(&self, s: CrossNodeStatus) {
        *self
            .cross_node
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = s;
    }

    /// The fast path between nodes as last recorded.
    pub fn cross_node(&self) -> CrossNodeStatus {
        self.cross_node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Notes that the node-wide work ran now.
    pub fn node_pass(&self) {
        *self
            .last_node_pass
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(now());
    }

    /// When the node-wide work last ran.
    pub fn last_node_pass(&self) -> Option<f64> {
        *self
            .last_node_pass
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
