//! The policy gate: whether a pod a CNI ADD is building must be held (every
//! IP packet to and from it dropped, `Datapath::hold`) until the agent has
//! classified it. Decided here once, from the pinned maps the agent keeps
//! (`policy_namespaces`, `policy_gate`), so that the plugin decides without
//! the agent: right after ADD, before the agent's first reconcile, and while
//! the agent is down, a pod that a NetworkPolicy may select is reached by
//! nothing and reaches nothing.

use xdpcni_ebpf::Maps;

/// Why a new pod is held; `None` from [`hold_reason`]: it needs no hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HoldReason {
    /// The agent has not written the namespaces that hold NetworkPolicies
    /// since this datapath was loaded (a fresh node, pins re-created).
    PoliciesNotListed,
    /// The pod's namespace holds NetworkPolicies.
    PolicyNamespace(String),
}

impl std::fmt::Display for HoldReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PoliciesNotListed => {
                f.write_str("the agent has not listed the NetworkPolicies on this datapath yet")
            }
            Self::PolicyNamespace(ns) => write!(f, "namespace {ns} has NetworkPolicies"),
        }
    }
}

/// Whether a new pod of `namespace` must be held, and why. A pod without a
/// namespace (no Kubernetes runtime: no `K8S_POD_NAMESPACE`) can be selected
/// by no policy. An unreadable gate is an error: the caller refuses the ADD
/// rather than guess.
pub fn hold_reason(maps: &Maps, namespace: &str) -> Result<Option<HoldReason>, xdpcni_ebpf::Error> {
    if namespace.is_empty() {
        return Ok(None);
    }
    if maps.policy_gate()?.complete == 0 {
        return Ok(Some(HoldReason::PoliciesNotListed));
    }
    if maps.is_policy_namespace(namespace)? {
        return Ok(Some(HoldReason::PolicyNamespace(namespace.to_string())));
    }
    Ok(None)
}
