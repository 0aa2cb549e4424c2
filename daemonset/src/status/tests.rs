//! The status's unit tests.

use super::*;

fn pod(ns: &str, name: &str, mode: &str, code: WhyCode, text: &str) -> PodStatus {
    PodStatus {
        namespace: ns.into(),
        name: name.into(),
        container_id: format!("c-{name}"),
        ips: vec!["10.1.0.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        host_veth: format!("xdp{name}"),
        ifindex: 7,
        mode: mode.into(),
        wanted: mode.into(),
        why: Why {
            code,
            text: text.into(),
        },
        redirect: "devmap".into(),
        cpus: "0-1".into(),
        problems: vec![],
        reconciled_at: 100.0,
        counters: Some(Counts {
            forward: 5,
            kernel: 2,
            drop: 0,
            received: 5,
            top: vec![VerdictCount {
                verdict: "redirect_devmap".into(),
                packets: 5,
            }],
        }),
    }
}

fn status() -> Status {
    Status {
        version: "0.1.0".into(),
        agent_mode: "kubernetes".into(),
        node: Some("n1".into()),
        ready: true,
        last_node_pass: Some(101.5),
        now: 102.0,
        datapath: DatapathStatus {
            pin_dir: "/sys/fs/bpf/xdpcni".into(),
            layout: 2,
            build: "0.1.0+abc".into(),
            programs: vec![ProgramStatus {
                name: "xdpcni_from_pod".into(),
                id: 42,
            }],
            maps: vec![MapStatus {
                name: "endpoints4".into(),
                entries: 2,
                capacity: 65536,
            }],
            migration_seconds: 0.0,
        },
        defaults: Defaults {
            mode: "generic".into(),
            redirect: "devmap".into(),
            cpus: "0-1".into(),
        },
        policies: PolicyStatus {
            known: true,
            in_force: vec!["db/deny".into()],
            rules: 4,
            isolated: vec![IsolatedPod {
                namespace: "db".into(),
                pod: "pg".into(),
                ingress: true,
                egress: false,
            }],
        },
        services: ServicesStatus {
            enabled: true,
            cgroup: Some("/sys/fs/cgroup/unified".into()),
            ..ServicesStatus::default()
        },
        cross_node: CrossNodeStatus {
            on: true,
            off: None,
            destinations: 4,
            uplinks: vec![UplinkStatus {
                interface: "eth0".into(),
                ifindex: 2,
                counters: Some(Counts {
                    forward: 7,
                    kernel: 30,
                    ..Counts::default()
                }),
            }],
        },
        unreadable_records: 0,
        pods: vec![
            pod(
                "default",
                "a",
                "native",
                WhyCode::Annotation,
                "annotation xdpcni.io/xdp-mode=native",
            ),
            pod(
                "db",
                "pg",
                "off",
                WhyCode::NetworkPolicy,
                "kernel-only: NetworkPolicy db/deny isolates it",
            ),
        ],
    }
}

#[test]
fn codes_are_named_alike_in_json_and_labels() {
    for c in WhyCode::ALL {
        assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
    }
}

#[test]
fn json_round_trips_through_the_same_types() {
    let s = status();
    let text = serde_json::to_string(&s).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["pods"][1]["why"]["code"], "network-policy");
    assert_eq!(v["datapath"]["programs"][0]["id"], 42);
    assert_eq!(v["pods"][0]["hostVeth"], "xdpa");
    let back: Status = serde_json::from_str(&text).unwrap();
    assert_eq!(back, s);
}

#[test]
fn the_table_has_one_line_per_pod_with_its_reason() {
    let s = status();
    let t = s.table();
    assert!(t.contains("node n1, ready"), "{t}");
    assert!(t.contains("layout 2, build 0.1.0+abc"), "{t}");
    assert!(t.contains("endpoints4 2/65536"), "{t}");
    assert!(
        t.contains("1 in force (db/deny), 4 rules, 1 pods isolated"),
        "{t}"
    );
    assert!(t.contains("Last pass: 0.5s ago"), "{t}");
    assert!(
        t.contains(
            "Fast path: between nodes on: 4 pod CIDRs, receiving on eth0 (7 delivered, 30 to the kernel)"
        ),
        "{t}"
    );
    let off = Status {
        cross_node: CrossNodeStatus {
            off: Some("node".into()),
            ..CrossNodeStatus::default()
        },
        ..s.clone()
    };
    assert!(
        off.table().contains("Fast path: between nodes off (node)"),
        "{}",
        off.table()
    );
    assert!(t.contains("Pods:      2 (1 on the fast path)"), "{t}");
    let lines: Vec<&str> = t
        .lines()
        .filter(|l| l.starts_with("default/") || l.starts_with("db/"))
        .collect();
    assert_eq!(lines.len(), 2, "{t}");
    assert!(
        lines[0].contains("native") && lines[0].ends_with("annotation xdpcni.io/xdp-mode=native")
    );
    assert!(lines[1].contains(" off ") && lines[1].contains("NetworkPolicy db/deny"));
    // Columns line up: every pod's MODE starts where the header's does.
    let header = t.lines().find(|l| l.starts_with("POD")).unwrap();
    let col = header.find("MODE").unwrap();
    for l in &lines {
        assert!(matches!(&l[col..col + 3], "nat" | "off"), "{l}");
    }
}

#[test]
fn pods_are_found_by_name_or_container() {
    let s = status();
    assert_eq!(s.find("db/pg").unwrap().name, "pg");
    assert_eq!(s.find("c-a").unwrap().name, "a");
    assert!(s.find("db/none").is_none());
    let d = s.pod_detail(s.find("default/a").unwrap());
    assert!(d.contains("[annotation]"), "{d}");
    assert!(
        d.lines()
            .any(|l| l.starts_with("Top:") && l.ends_with(" redirect_devmap 5")),
        "{d}"
    );
}
