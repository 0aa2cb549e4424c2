//! One reconcile pass over the pods of this node, shared by the standalone
//! and the Kubernetes modes: records from the CNI, a policy per pod, applied
//! to the datapath; problems reported once per change; metrics collected.

use std::collections::{BTreeMap, HashMap};

use tracing::{info, warn};
use xdpcni_ebpf::Datapath;
use xdpcni_node::state::Record;

use crate::{
    apply::apply,
    metrics::{AgentMetrics, PodMetrics},
    policy::{resolve, Policy, Problem},
};

/// Annotations of a pod.
pub type Annotations = BTreeMap<String, String>;

/// What the agent knows of a pod beyond its record.
#[derive(Clone, Debug, Default)]
pub struct PodInput {
    /// Its annotations.
    pub annotations: Annotations,
    /// Selected by a NetworkPolicy: kernel routing both ways.
    pub kernel_only: bool,
}

/// Problems first seen (or changed) in a pass, for Events.
#[derive(Clone, Debug)]
pub struct NewProblems {
    /// Namespace of the pod.
    pub namespace: String,
    /// Name of the pod.
    pub name: String,
    /// The problems.
    pub problems: Vec<Problem>,
}

/// The outcome of a pass.
#[derive(Debug, Default)]
pub struct Pass {
    /// One entry per pod with a live record.
    pub pods: Vec<PodMetrics>,
    /// Problems to report.
    pub new_problems: Vec<NewProblems>,
    /// Whether some pod failed to apply.
    pub failed: bool,
}

/// (namespace, name) of a record: the pod's, or ("", container ID).
pub fn pod_key(rec: &Record) -> (String, String) {
    if rec.pod_name.is_empty() {
        (String::new(), rec.container_id.clone())
    } else {
        (rec.pod_namespace.clone(), rec.pod_name.clone())
    }
}

/// Whether a device with `ifindex` exists in this network namespace.
fn link_exists(ifindex: u32) -> bool {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `name` has IF_NAMESIZE bytes, as if_indextoname requires.
    !unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) }.is_null()
}

/// The datapath and what the agent remembers between passes.
pub struct Reconciler {
    /// The datapath.
    pub dp: Datapath,
    defaults: Policy,
    online: u64,
    reported: HashMap<(String, String), String>,
    /// Agent-wide metrics.
    pub metrics: AgentMetrics,
}

impl Reconciler {
    /// A reconciler over `dp` with node `defaults`.
    pub fn new(dp: Datapath, defaults: Policy, online: u64) -> Self {
        Self {
            dp,
            defaults,
            online,
            reported: HashMap::new(),
            metrics: AgentMetrics::default(),
        }
    }

    /// Removes endpoint records (and their devmap entries and counters) whose
    /// veth is gone and that no attachment record claims: pods whose DEL
    /// never came.
    fn gc_endpoints(&mut self, records: &[Record]) {
        let Ok(endpoints) = self.dp.maps().endpoints() else {
            return;
        };
        for (ip, ep) in endpoints {
            if records.iter().any(|r| r.host_ifindex == ep.ifindex) || link_exists(ep.ifindex) {
                continue;
            }
            info!(%ip, ifindex = ep.ifindex, "removing the endpoint of a vanished veth");
            let _ = self.dp.maps_mut().remove_endpoint(ip);
            let _ = self.dp.maps_mut().remove_tx_port(ep.ifindex);
            let _ = self.dp.maps_mut().remove_counters(ep.ifindex);
        }
    }

    /// Makes the datapath's NAT'd ports equal `want`: the (address, protocol,
    /// port) of local pods that are Service backends or hostPort targets,
    /// whose replies conntrack must translate, and every endpoint's no-NAT
    /// flag agree with them. Returns (added, removed).
    pub fn sync_nat_ports(
        &mut self,
        want: &std::collections::BTreeSet<(std::net::IpAddr, xdpcni_ebpf::L4Proto, u16)>,
    ) -> Result<(usize, usize), xdpcni_ebpf::Error> {
        let have: std::collections::BTreeSet<_> = self.dp.maps().nat_ports()?.into_iter().collect();
        let (mut added, mut removed) = (0, 0);
        for (ip, proto, port) in want.difference(&have) {
            self.dp.maps_mut().add_nat_port(*ip, *proto, *port)?;
            added += 1;
        }
        for (ip, proto, port) in have.difference(want) {
            self.dp.maps_mut().remove_nat_port(*ip, *proto, *port)?;
            removed += 1;
        }
        // add/remove keep each endpoint's no-NAT flag; this repairs a record
        // written by a CNI ADD that raced a change here.
        let repaired = self.dp.maps_mut().refresh_nat_flags()?;
        if repaired > 0 {
            info!(repaired, "endpoint NAT flags repaired");
        }
        Ok((added, removed))
    }

    /// Applies every record's policy; `input` gives what is known of a pod
    /// (None: nothing, the node defaults apply).
    pub fn pass(
        &mut self,
        records: &[Record],
        input: impl Fn(&str, &str) -> Option<PodInput>,
    ) -> Pass {
        let started = std::time::Instant::now();
        let mut out = Pass::default();
        for rec in records {
            // A pod whose netns is gone is being deleted: DEL cleans it.
            if !std::path::Path::new(&rec.netns).exists() {
                continue;
            }
            let (ns, name) = pod_key(rec);
            let pod = input(&ns, &name).unwrap_or_default();
            let (policy, mut problems) = resolve(&pod.annotations, &self.defaults, self.online);
            let mode = match apply(&mut self.dp, rec, &policy, pod.kernel_only) {
                Ok(applied) => {
                    if applied.changed {
                        info!(pod = %format!("{ns}/{name}"), mode = applied.mode.as_str(), kernel_only = pod.kernel_only, "applied");
                    }
                    problems.extend(applied.problems);
                    applied.mode.as_str().to_string()
                }
                Err(e) => {
                    warn!(pod = %format!("{ns}/{name}"), error = %e, "apply failed");
                    out.failed = true;
                    continue;
                }
            };
            let text = problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            let key = (ns.clone(), name.clone());
            if !text.is_empty() && self.reported.get(&key) != Some(&text) {
                warn!(pod = %format!("{ns}/{name}"), problem = %text, "policy refused, fallback in use");
                self.metrics.policy_problems += problems.len() as u64;
                out.new_problems.push(NewProblems {
                    namespace: ns.clone(),
                    name: name.clone(),
                    problems,
                });
            }
            self.reported.insert(key, text);
            out.pods.push(PodMetrics {
                namespace: ns,
                pod: name,
                interface: rec.host_veth.clone(),
                mode,
                counters: self
                    .dp
                    .maps()
                    .counters(rec.host_ifindex)
                    .unwrap_or_default(),
            });
        }
        if let Ok(gone) = self.dp.gc_links() {
            for ifindex in gone {
                info!(ifindex, "collected the link pin of a deleted veth");
            }
        }
        self.gc_endpoints(records);
        self.metrics.reconciles += 1;
        self.metrics.reconcile_seconds += started.elapsed().as_secs_f64();
        if out.failed {
            self.metrics.reconcile_errors += 1;
        }
        out
    }
}
