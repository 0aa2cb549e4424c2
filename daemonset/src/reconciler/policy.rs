//! The reconciler's NetworkPolicy: the policy gate the CNI reads at ADD,
//! and the verdicts the programs check (`lib/policy.h`), as the policy task
//! computes them (`crate::kube::policies`).

use std::{collections::BTreeMap, net::IpAddr};

use tracing::info;
use xdpcni_ebpf::PodVerdicts;

use super::Reconciler;

/// Each isolated pod's addresses, its verdicts, and when its window closes
/// (CLOCK_MONOTONIC ns).
pub type PolicyWant = Vec<(Vec<IpAddr>, PodVerdicts, u64)>;

impl Reconciler {
    /// Writes the policy gate the CNI reads at ADD: the namespaces that hold
    /// NetworkPolicies (name -> how many), complete.
    pub fn write_gate(
        &mut self,
        namespaces: &BTreeMap<String, u32>,
    ) -> Result<bool, xdpcni_ebpf::Error> {
        if !self.dp.set_policy_namespaces(namespaces)? {
            return Ok(false);
        }
        info!(namespaces = namespaces.len(), "policy gate written");
        Ok(true)
    }

    /// Makes the datapath's NetworkPolicy verdicts those of `want` (each
    /// isolated pod's addresses, verdicts and window end).
    pub fn sync_policy(
        &mut self,
        want: &[(Vec<IpAddr>, PodVerdicts, u64)],
    ) -> Result<xdpcni_ebpf::PolicySynced, xdpcni_ebpf::Error> {
        let started = std::time::Instant::now();
        let done = self.dp.sync_policy(want)?;
        if done.written > 0 || done.removed > 0 {
            info!(
                written = done.written,
                removed = done.removed,
                generation = done.generation,
                ms = started.elapsed().as_secs_f64() * 1e3,
                "NetworkPolicy verdicts in the datapath"
            );
        }
        Ok(done)
    }
}
