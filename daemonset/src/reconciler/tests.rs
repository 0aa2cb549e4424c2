//! The reconciler's unit tests.

use super::*;

fn key(ns: &str, name: &str) -> PodKey {
    (ns.to_string(), name.to_string())
}

#[test]
fn a_hold_goes_only_for_a_record_classified_with_its_rules_in_force() {
    let (a, b, orphan) = (key("ns", "a"), key("ns", "b"), key("", "c1"));
    let mut f = PolicyFacts {
        isolated: [(a.clone(), vec!["ns/deny".to_string()])].into(),
        classified: ["ca".to_string()].into(),
        in_force: true,
        all_classified: false,
        in_datapath: BTreeSet::new(),
    };
    assert_eq!(
        f.hold(&a, "ca"),
        Hold::Release,
        "isolated, in force: classified"
    );
    assert_eq!(
        f.hold(&a, "ca2"),
        Hold::Keep,
        "the same pod made again after the pass: its new address is in no rule yet"
    );
    assert_eq!(
        f.hold(&b, "cb"),
        Hold::Keep,
        "not in the pass (a record after it, or its Pod unknown)"
    );
    assert_eq!(
        f.hold(&orphan, "c1"),
        Hold::Keep,
        "no pod name: never classified"
    );
    f.in_force = false;
    assert_eq!(
        f.hold(&a, "ca"),
        Hold::Hold,
        "a policy selects it, rules failed"
    );
    assert_eq!(f.hold(&b, "cb"), Hold::Keep);
    let none = PolicyFacts::none();
    assert_eq!(
        none.hold(&orphan, "c1"),
        Hold::Release,
        "standalone: no policy can select it"
    );
    assert_eq!(none.isolating(&a), None);
}

#[test]
fn changed_names_pods_whose_isolation_or_hold_moved() {
    let (a, b) = (key("ns", "a"), key("ns", "b"));
    let before = PolicyFacts {
        in_force: true,
        ..PolicyFacts::default()
    };
    let mut now = before.clone();
    now.isolated.insert(a.clone(), vec!["ns/p".into()]);
    let records = [(a.clone(), "ca".to_string()), (b.clone(), "cb".to_string())];
    assert_eq!(before.changed(&now, &records), [a.clone()].into());
    assert_eq!(now.changed(&before, &records), [a.clone()].into());
    // Classified in the next pass: its hold changes.
    let mut next = now.clone();
    next.classified.insert("cb".into());
    assert_eq!(now.changed(&next, &records), [b.clone()].into());
    // Rules failing: the isolated pod is held.
    let mut failed = now.clone();
    failed.in_force = false;
    assert_eq!(now.changed(&failed, &records), [a.clone()].into());
    assert!(now.changed(&now.clone(), &records).is_empty());
}
