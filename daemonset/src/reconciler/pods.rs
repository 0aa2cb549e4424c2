//! The reconciler's pods: one pod's record and facts ([`PodInput`]) into
//! its datapath state through `crate::apply` (its hold, mode, records,
//! attachment), and the outcome the status and the Events report.

use tracing::{info, warn};
use xdpcni_host::{pod::XdpMode, state::Record};

use super::{Hold, KernelOnly, PodInput, PodOutcome, Reconciler};
use crate::{
    apply::{apply, hold, Applied, ApplyError},
    records::{being_deleted, pod_key, veth_present, PodKey},
    status::{Why, WhyCode},
    wish::{resolve, Problem, Wish, ANNOTATION_MODE},
};

/// Why a pod is in its mode: the first that applies of a vanished veth, a
/// hold, kernel-only, a full map, a kernel refusal, the annotation, the
/// node default.
fn why(wish: &Wish, pod: &PodInput, held: bool, applied: &Applied) -> Why {
    let annotations = &pod.annotations;
    let (code, text) = if held && pod.hold == Hold::Hold {
        (
            WhyCode::Held,
            "held: the rules of a NetworkPolicy that selects it are not in force (fail closed)"
                .to_string(),
        )
    } else if held {
        (
            WhyCode::Held,
            "held since its CNI ADD until the agent classifies it against the NetworkPolicies"
                .to_string(),
        )
    } else if let Some(k) = &pod.kernel_only {
        match k {
            KernelOnly::Policies(names) => (
                WhyCode::NetworkPolicy,
                format!(
                    "kernel-only: NetworkPolicy {} isolates it",
                    names.join(", ")
                ),
            ),
            KernelOnly::ForwardRule(rule) => (
                WhyCode::ForwardRule,
                format!("kernel-only: the FORWARD rule `{rule}` names it"),
            ),
        }
    } else if let Some(full) = &applied.map_full {
        (
            WhyCode::MapFull,
            format!("kernel routing: a datapath map is full ({full})"),
        )
    } else if let Some((from, err)) = &applied.refused {
        (
            WhyCode::Fallback,
            format!(
                "fallback from {} to {}: the kernel refused {}: {err}",
                from.as_str(),
                applied.mode.as_str(),
                from.as_str()
            ),
        )
    } else {
        match annotations.get(ANNOTATION_MODE) {
            Some(v) if XdpMode::parse(v.trim()) == Some(wish.mode) => (
                WhyCode::Annotation,
                format!("annotation {ANNOTATION_MODE}={}", v.trim()),
            ),
            Some(v) => (
                WhyCode::NodeDefault,
                format!(
                    "node default {} ({ANNOTATION_MODE}={v:?} refused)",
                    wish.mode.as_str()
                ),
            ),
            None => (
                WhyCode::NodeDefault,
                format!("node default {}", wish.mode.as_str()),
            ),
        }
    };
    let text = match &pod.policy_in_datapath {
        Some(names) if !code.is_kernel_only() => format!(
            "{text}; fast path, NetworkPolicy {} enforced in the datapath",
            names.join(", ")
        ),
        _ => text,
    };
    Why { code, text }
}

impl Reconciler {
    /// Applies the wish of `pod` (annotations over the node defaults) to
    /// the pod of `rec`. A held pod (see `Hold`) is kept on
    /// kernel routing with kernel-only records whatever its input: the fast
    /// path would carry its frames past the hold.
    pub fn reconcile(&mut self, rec: &Record, pod: &PodInput) -> Result<PodOutcome, ApplyError> {
        let key = pod_key(rec);
        let (wish, mut problems) = resolve(&pod.annotations, &self.defaults, self.online);
        if !veth_present(rec) {
            if being_deleted(&self.state_dir, rec) {
                // Its DEL removed the veth and is removing the record: the
                // normal end of a pod, nothing to report.
                return Ok(self.deleted(key, wish));
            }
            // Deleted outside the CNI: nothing to attach to. Its leftovers
            // in the datapath go at its DEL (or collection once it has no
            // record); reported once, not retried as a failure.
            let why = Why {
                code: WhyCode::VethGone,
                text: "no network: the host veth was deleted outside the CNI".into(),
            };
            let problem = Problem::veth_gone(&rec.host_veth);
            return Ok(self.outcome(key, wish, why, Applied::nothing(), vec![problem]));
        }
        let held = match hold(&mut self.dp, rec, pod.hold) {
            Ok(held) => held,
            Err(_) if being_deleted(&self.state_dir, rec) => return Ok(self.deleted(key, wish)),
            Err(e) => return Err(e.into()),
        };
        let kernel_only = pod.kernel_only.is_some() || held;
        let policy = !kernel_only && pod.policy_in_datapath.is_some();
        let applied = match apply(&mut self.dp, rec, &wish, kernel_only, policy) {
            Ok(a) => a,
            // Its DEL took the veth away meanwhile: the normal end of a
            // pod, not a failure to retry or report.
            Err(_) if being_deleted(&self.state_dir, rec) => return Ok(self.deleted(key, wish)),
            Err(e) => return Err(e),
        };
        if applied.changed {
            info!(mode = applied.mode.as_str(), kernel_only, held, "applied");
        }
        let why = why(&wish, pod, held, &applied);
        problems.extend(applied.problems.iter().cloned());
        Ok(self.outcome(key, wish, why, applied, problems))
    }

    /// The outcome for a pod whose CNI DEL runs: off, nothing to report.
    fn deleted(&mut self, key: PodKey, wish: Wish) -> PodOutcome {
        let why = Why {
            code: WhyCode::VethGone,
            text: "being deleted (its CNI DEL removed the host veth)".into(),
        };
        self.outcome(key, wish, why, Applied::nothing(), Vec::new())
    }

    /// The outcome of a reconcile, with `problems` reported (logged and
    /// returned) only when they differ from the pod's last ones.
    fn outcome(
        &mut self,
        key: PodKey,
        wish: Wish,
        why: Why,
        applied: Applied,
        problems: Vec<Problem>,
    ) -> PodOutcome {
        let text = problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let new_problems = if !text.is_empty() && self.reported.get(&key) != Some(&text) {
            warn!(problem = %text, "wish refused, fallback in use");
            problems.clone()
        } else {
            Vec::new()
        };
        self.reported.insert(key, text);
        PodOutcome {
            mode: applied.mode,
            wish,
            why,
            changed: applied.changed,
            map_full: applied.map_full.is_some(),
            problems,
            new_problems,
        }
    }
}
