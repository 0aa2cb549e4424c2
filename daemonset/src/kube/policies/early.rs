//! What the datapath's verdicts become before a pass puts the rules in
//! force: the new verdicts of the pods the datapath checks and will still
//! check, what the maps hold for every other pod.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::{netpol::model, records::PodKey};

/// One pod's verdicts as the datapath holds them: its addresses, its
/// verdicts, the end of its window.
pub type VerdictsOf = (Vec<IpAddr>, xdpcni_ebpf::PodVerdicts, u64);

/// What the datapath's verdicts become before the rules change (step 2),
/// from what the maps hold (`synced`): the `compiled` verdicts of the pods
/// in the check (`in_datapath`) that stay in it with the same addresses,
/// what the maps hold for every other pod. `None` when that changes
/// nothing.
pub(super) fn before_rules(
    synced: &BTreeMap<PodKey, VerdictsOf>,
    in_datapath: &BTreeSet<PodKey>,
    e: &model::Enforcement,
    compiled: &[(PodKey, xdpcni_ebpf::PodVerdicts)],
) -> Option<Vec<(PodKey, VerdictsOf)>> {
    let mut changed = false;
    let want = synced
        .iter()
        .map(|(key, (addrs, old, until))| {
            let now = compiled
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v)
                .filter(|_| in_datapath.contains(key))
                .filter(|_| e.pods.get(key).is_some_and(|p| &p.addrs == addrs));
            let v = match now {
                Some(v) if v != old => {
                    changed = true;
                    v.clone()
                }
                _ => old.clone(),
            };
            (key.clone(), (addrs.clone(), v, *until))
        })
        .collect();
    changed.then_some(want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdpcni_ebpf::PodVerdicts;

    fn key(name: &str) -> PodKey {
        ("x".to_string(), name.to_string())
    }

    fn ip(s: &str) -> Vec<IpAddr> {
        vec![s.parse().unwrap()]
    }

    fn verdicts(any_port: u64) -> PodVerdicts {
        PodVerdicts {
            any_port: [any_port, 0],
            ..PodVerdicts::default()
        }
    }

    /// What the maps hold, the pods in the check, the model, the compiled
    /// verdicts.
    type Scene = (
        BTreeMap<PodKey, VerdictsOf>,
        BTreeSet<PodKey>,
        model::Enforcement,
        Vec<(PodKey, PodVerdicts)>,
    );

    /// x/stays, x/leaves and x/moved in the maps and the check; x/enters
    /// new. x/stays compiles to `compiled_stays`, x/leaves to nothing (its
    /// verdicts no longer fit), x/moved has new addresses.
    fn scene(compiled_stays: PodVerdicts) -> Scene {
        let synced: BTreeMap<PodKey, VerdictsOf> = [
            (key("stays"), (ip("10.0.0.1"), verdicts(0), 7)),
            (key("leaves"), (ip("10.0.0.2"), verdicts(0), 0)),
            (key("moved"), (ip("10.0.0.3"), verdicts(0), 0)),
        ]
        .into();
        let in_datapath: BTreeSet<PodKey> = synced.keys().cloned().collect();
        let mut e = model::Enforcement::default();
        for (name, addr) in [
            ("stays", "10.0.0.1"),
            ("leaves", "10.0.0.2"),
            ("moved", "10.0.0.9"),
            ("enters", "10.0.0.4"),
        ] {
            e.pods.insert(
                key(name),
                model::PodRules {
                    addrs: ip(addr),
                    ..Default::default()
                },
            );
        }
        let compiled = vec![
            (key("stays"), compiled_stays),
            (key("moved"), verdicts(1)),
            (key("enters"), verdicts(1)),
        ];
        (synced, in_datapath, e, compiled)
    }

    #[test]
    fn before_the_rules_only_pods_staying_in_the_check_get_their_new_verdicts() {
        let (synced, in_datapath, e, compiled) = scene(verdicts(1));
        let want: BTreeMap<PodKey, VerdictsOf> = before_rules(&synced, &in_datapath, &e, &compiled)
            .expect("x/stays changed")
            .into_iter()
            .collect();
        // x/stays: its new verdicts, its window end as the maps hold it.
        assert_eq!(want[&key("stays")], (ip("10.0.0.1"), verdicts(1), 7));
        // x/leaves (not compiled now) and x/moved (other addresses) keep
        // what the maps hold until the rules are in force.
        assert_eq!(want[&key("leaves")], synced[&key("leaves")]);
        assert_eq!(want[&key("moved")], synced[&key("moved")]);
        // x/enters waits for the rules.
        assert!(!want.contains_key(&key("enters")));
        assert_eq!(want.len(), 3);
    }

    #[test]
    fn before_the_rules_nothing_is_written_when_no_checked_pod_changed() {
        let (synced, in_datapath, e, compiled) = scene(verdicts(0));
        assert_eq!(before_rules(&synced, &in_datapath, &e, &compiled), None);
        // A pod the last pass did not put in the check is not written early.
        let (synced, _, e, compiled) = scene(verdicts(1));
        let only_moved: BTreeSet<PodKey> = [key("moved")].into();
        assert_eq!(before_rules(&synced, &only_moved, &e, &compiled), None);
    }
}
