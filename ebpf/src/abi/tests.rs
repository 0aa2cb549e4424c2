//! Unit tests of the address keys and the verdict list.

use super::*;
use std::net::{Ipv4Addr, Ipv6Addr};

#[test]
fn addresses_round_trip_through_their_keys() {
    let v4 = Ipv4Addr::new(10, 1, 2, 3);
    let k = ipv4_key(v4);
    assert_eq!(
        k.to_ne_bytes(),
        [10, 1, 2, 3],
        "network byte order in memory"
    );
    assert_eq!(ipv4_of_key(k), v4);
    let (f, a) = family_addr(IpAddr::V4(v4));
    assert_eq!(f, FAMILY_IPV4);
    assert_eq!(&a[..4], &[10, 1, 2, 3]);
    assert!(a[4..].iter().all(|b| *b == 0));
    assert_eq!(ip_of(f, a), Some(IpAddr::V4(v4)));

    let v6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 7));
    let (f, a) = family_addr(v6);
    assert_eq!(f, FAMILY_IPV6);
    assert_eq!(ip_of(f, a), Some(v6));
    assert_eq!(ip_of(0, [0; 16]), None);
}

#[test]
fn verdict_labels_are_unique_and_kinds_follow_the_names() {
    for v in Verdict::ALL {
        let want = match v.label() {
            l if l.starts_with("drop_") => VerdictKind::Drop,
            l if l.starts_with("pass_") => VerdictKind::Kernel,
            l if l.starts_with("rx_") => VerdictKind::Received,
            l if l.starts_with("cpumap_") => VerdictKind::CpumapStage,
            _ => VerdictKind::Forward,
        };
        assert_eq!(v.kind(), want, "{}", v.label());
        assert_eq!(v.c_name().to_ascii_lowercase(), v.label());
    }
    let mut labels: Vec<_> = Verdict::ALL.iter().map(|v| v.label()).collect();
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), Verdict::ALL.len());
}

/// The verdict table of docs/architecture.md is the header's list: same
/// rows, order, kinds and text.
#[test]
fn docs_verdict_table_is_the_header_list() {
    let readme = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/architecture.md"
    ));
    let head = "| verdict (counter label) | kind | when |";
    let start = readme
        .find(head)
        .expect("docs/architecture.md has the verdict table");
    let rows: Vec<&str> = readme[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    let want: Vec<String> = Verdict::ALL
        .iter()
        .map(|v| format!("| `{}` | {} | {} |", v.label(), v.kind().as_str(), v.when()))
        .collect();
    assert_eq!(
        rows, want,
        "docs/architecture.md verdict table != XDPCNI_VERDICTS"
    );
}

#[test]
fn namespace_keys_round_trip_and_refuse_what_does_not_fit() {
    let k = PolicyNsKey::of("kube-system").unwrap();
    assert_eq!(k.name(), "kube-system");
    assert_eq!(&k.name[..11], b"kube-system");
    assert!(k.name[11..].iter().all(|b| *b == 0));
    let longest = "a".repeat(NS_NAME_LEN - 1);
    assert_eq!(PolicyNsKey::of(&longest).unwrap().name(), longest);
    assert!(PolicyNsKey::of(&"a".repeat(NS_NAME_LEN)).is_none());
    assert!(PolicyNsKey::of("").is_none());
    assert!(PolicyNsKey::of("a\0b").is_none());
}

#[test]
fn redirect_policy_raw_round_trip() {
    for p in [RedirectPolicy::Devmap, RedirectPolicy::Cpumap] {
        assert_eq!(RedirectPolicy::from_raw(p.as_raw()), Some(p));
        assert_eq!(RedirectPolicy::parse(p.as_str()), Some(p));
    }
    assert_eq!(RedirectPolicy::parse("Devmap"), None);
    assert_eq!(RedirectPolicy::from_raw(7), None);
}
