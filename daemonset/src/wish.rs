//! What a pod asks of the fast path (its wish: mode, redirect, cpus), from its
//! annotations (`xdpcni.io/...`) over the node defaults for what is absent and a fallback, plus a problem report, for
//! every value that is wrong.

use std::collections::BTreeMap;

use xdpcni_ebpf::abi::RedirectPolicy;
use xdpcni_host::pod::{parse_cpu_list, XdpMode};

/// `xdpcni.io/xdp-mode`: `native`, `tc`, `generic` or `off` (XdpMode::ALL).
pub const ANNOTATION_MODE: &str = "xdpcni.io/xdp-mode";
/// `xdpcni.io/redirect`: `devmap` or `cpumap`.
pub const ANNOTATION_REDIRECT: &str = "xdpcni.io/redirect";
/// `xdpcni.io/cpus`: CPU list a cpumap may deliver on (`1`, `0-3`, `0,2`).
pub const ANNOTATION_CPUS: &str = "xdpcni.io/cpus";

/// What the datapath does for one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wish {
    /// XDP mode on the pod's host veth.
    pub mode: XdpMode,
    /// How frames to the pod are delivered.
    pub redirect: RedirectPolicy,
    /// CPUs a cpumap may deliver on.
    pub cpu_mask: u64,
}

/// An annotation value that could not be honoured, and what was used instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The annotation (or `attach` for a kernel refusal).
    pub key: String,
    /// The value given.
    pub value: String,
    /// Why it was refused.
    pub why: String,
    /// What the pod gets instead.
    pub fallback: String,
}

/// Every problem the agent reports (as an Event, in the status, in the
/// log) is made here, so each kind reads the same wherever it arises.
impl Problem {
    /// An annotation (or node default) value that is refused.
    fn refused_value(
        key: &str,
        value: &str,
        why: impl Into<String>,
        fallback: impl Into<String>,
    ) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
            why: why.into(),
            fallback: fallback.into(),
        }
    }

    /// The kernel refused to attach `mode`; the pod gets `fallback`.
    pub fn attach_refused(mode: &str, error: &str, fallback: &str) -> Self {
        Self {
            key: "attach".into(),
            value: mode.into(),
            why: format!("the kernel refused {mode} XDP: {error}"),
            fallback: fallback.into(),
        }
    }

    /// A datapath map is full: the pod's `target` mode waits for room.
    pub fn map_full(target: &str, why: &str) -> Self {
        Self {
            key: "datapath".into(),
            value: target.into(),
            why: why.into(),
            fallback: "kernel routing (off) until the map has room".into(),
        }
    }

    /// The pod's host veth is gone (deleted outside the CNI).
    pub fn veth_gone(host_veth: &str) -> Self {
        Self {
            key: "veth".into(),
            value: host_veth.into(),
            why: "the pod's host veth was deleted outside the CNI".into(),
            fallback: "no network until the pod is deleted and re-created".into(),
        }
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}={:?}: {}; using {}",
            self.key, self.value, self.why, self.fallback
        )
    }
}

/// Resolves a pod's policy from `annotations`, `defaults` for what is absent,
/// and `online` (mask of online CPUs) to check CPU lists against.
pub fn resolve(
    annotations: &BTreeMap<String, String>,
    defaults: &Wish,
    online: u64,
) -> (Wish, Vec<Problem>) {
    let mut p = *defaults;
    let mut problems = Vec::new();
    if let Some(v) = annotations.get(ANNOTATION_MODE) {
        match XdpMode::parse(v.trim()) {
            Some(m) => p.mode = m,
            None => problems.push(Problem::refused_value(
                ANNOTATION_MODE,
                v,
                format!("not one of {}", XdpMode::names()),
                format!("the node default {}", defaults.mode.as_str()),
            )),
        }
    }
    if let Some(v) = annotations.get(ANNOTATION_REDIRECT) {
        match RedirectPolicy::parse(v.trim()) {
            Some(r) => p.redirect = r,
            None => problems.push(Problem::refused_value(
                ANNOTATION_REDIRECT,
                v,
                "not one of devmap, cpumap",
                format!("the node default {}", defaults.redirect.as_str()),
            )),
        }
    }
    if let Some(v) = annotations.get(ANNOTATION_CPUS) {
        match parse_cpu_list(v.trim()) {
            Ok(mask) if mask & !online == 0 => p.cpu_mask = mask,
            Ok(mask) => problems.push(Problem::refused_value(
                ANNOTATION_CPUS,
                v,
                format!(
                    "names offline CPUs (mask {:#x}, online {online:#x})",
                    mask & !online
                ),
                "all online CPUs",
            )),
            Err(e) => problems.push(Problem::refused_value(
                ANNOTATION_CPUS,
                v,
                e,
                "all online CPUs",
            )),
        }
    }
    if p.cpu_mask == 0 || p.cpu_mask & !online != 0 {
        p.cpu_mask = online;
    }
    (p, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const DEF: Wish = Wish {
        mode: XdpMode::Native,
        redirect: RedirectPolicy::Devmap,
        cpu_mask: 0,
    };

    #[test]
    fn no_annotations_means_defaults() {
        let (p, probs) = resolve(&ann(&[]), &DEF, 0b11);
        assert_eq!(p.mode, DEF.mode);
        assert_eq!(p.redirect, RedirectPolicy::Devmap);
        assert_eq!(p.cpu_mask, 0b11);
        assert!(probs.is_empty());
    }

    #[test]
    fn every_valid_value() {
        for (v, m) in [
            ("native", XdpMode::Native),
            ("generic", XdpMode::Generic),
            ("tc", XdpMode::Tc),
            ("off", XdpMode::Off),
        ] {
            let (p, probs) = resolve(&ann(&[(ANNOTATION_MODE, v)]), &DEF, 0b11);
            assert_eq!(p.mode, m);
            assert!(probs.is_empty());
        }
        let (p, _) = resolve(
            &ann(&[(ANNOTATION_REDIRECT, "cpumap"), (ANNOTATION_CPUS, "1")]),
            &DEF,
            0b11,
        );
        assert_eq!((p.redirect, p.cpu_mask), (RedirectPolicy::Cpumap, 0b10));
    }

    #[test]
    fn bad_values_fall_back_and_say_why() {
        let (p, probs) = resolve(
            &ann(&[
                (ANNOTATION_MODE, "turbo"),
                (ANNOTATION_REDIRECT, "bridge"),
                (ANNOTATION_CPUS, "7"),
            ]),
            &DEF,
            0b11,
        );
        assert_eq!(p.mode, DEF.mode);
        assert_eq!(p.redirect, RedirectPolicy::Devmap);
        assert_eq!(p.cpu_mask, 0b11);
        assert_eq!(probs.len(), 3);
        assert!(probs[0].to_string().contains("turbo"));
        assert!(probs[2].why.contains("offline"));
        let (_, probs) = resolve(&ann(&[(ANNOTATION_CPUS, "1-x")]), &DEF, 0b11);
        assert_eq!(probs.len(), 1);
    }
}
