//! `xdpcni-agent status` against a known node: a real kube-apiserver, pods
//! made by the real CNI plugin in every mode and one isolated by a
//! NetworkPolicy; the table a person reads and the JSON a script parses,
//! each pod with its mode and the right reason.
//! Needs root, bpffs, containernetworking-plugins and scripts/k8s-build.sh.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use xdpcni_agent::status::{Status, WhyCode};
use xdpcni_e2e::{cluster::KubeNode, traffic::ping};

/// (namespace, pod, annotations, mode in force, why code, words the reason
/// must hold).
const PODS: [(&str, &str, &str, &str, WhyCode, &str); 6] = [
    (
        "default",
        "a",
        r#"{"xdpcni.io/xdp-mode": "native", "xdpcni.io/redirect": "cpumap", "xdpcni.io/cpus": "0"}"#,
        "native",
        WhyCode::Annotation,
        "annotation xdpcni.io/xdp-mode=native",
    ),
    (
        "default",
        "b",
        r#"{"xdpcni.io/xdp-mode": "generic"}"#,
        "generic",
        WhyCode::Annotation,
        "annotation xdpcni.io/xdp-mode=generic",
    ),
    (
        "default",
        "c",
        "{}",
        "generic",
        WhyCode::NodeDefault,
        "node default generic",
    ),
    (
        "default",
        "d",
        r#"{"xdpcni.io/xdp-mode": "turbo"}"#,
        "generic",
        WhyCode::NodeDefault,
        r#"node default generic (xdpcni.io/xdp-mode="turbo" refused)"#,
    ),
    (
        "default",
        "e",
        r#"{"xdpcni.io/xdp-mode": "off"}"#,
        "off",
        WhyCode::Annotation,
        "annotation xdpcni.io/xdp-mode=off",
    ),
    (
        "db",
        "pg",
        r#"{"xdpcni.io/xdp-mode": "native"}"#,
        "native",
        WhyCode::Annotation,
        "annotation xdpcni.io/xdp-mode=native; fast path, NetworkPolicy db/deny-in enforced in the datapath",
    ),
];

fn status_json(node: &KubeNode) -> Status {
    let (code, out, err) = node.status(&["-o", "json"]).unwrap();
    assert_eq!(code, Some(0), "status -o json: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn status_shows_each_pod_mode_and_why_as_a_table_and_as_json() {
    let node = KubeNode::start(|c| c.xdp_mode = "generic".into()).unwrap();
    node.namespace("db", json!({})).unwrap();
    node.create_policy(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": { "name": "deny-in", "namespace": "db" },
        "spec": { "podSelector": { "matchLabels": { "app": "pg" } }, "policyTypes": ["Ingress"] },
    }))
    .unwrap();
    let mut pods = Vec::new();
    for (ns, name, ann, ..) in PODS {
        let ann: Value = serde_json::from_str(ann).unwrap();
        node.create_pod_object(ns, name, json!({ "app": name }), json!([]))
            .unwrap();
        node.annotate(ns, name, ann).unwrap();
        let netns = xdpcni_e2e::netns::Netns::new("xq").unwrap();
        pods.push(
            node.add_network((ns.to_string(), name.to_string()), netns, &[])
                .unwrap(),
        );
    }
    // Settled: every pod in its mode, for its reason.
    let start = Instant::now();
    let status = loop {
        let s = status_json(&node);
        let settled = PODS.iter().all(|(ns, name, _, mode, code, _)| {
            s.find(&format!("{ns}/{name}"))
                .is_some_and(|p| p.mode == *mode && p.why.code == *code)
        });
        if settled {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "not settled: {:#?}\n{}",
            s.pods,
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("settled in {:?}", start.elapsed());

    // The node.
    assert!(status.ready);
    assert_eq!(status.agent_mode, "kubernetes");
    assert_eq!(status.node.as_deref(), Some(xdpcni_e2e::cluster::NODE));
    assert_eq!(status.datapath.layout, xdpcni_ebpf::abi::LAYOUT);
    assert_eq!(
        status.datapath.pin_dir,
        node.pin_dir().display().to_string()
    );
    let names: Vec<&str> = status
        .datapath
        .programs
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            xdpcni_ebpf::FROM_POD_PROGRAM,
            xdpcni_ebpf::TC_FROM_POD_PROGRAM,
            xdpcni_ebpf::CPUMAP_PROGRAM,
            xdpcni_ebpf::HOLD_PROGRAM,
            xdpcni_ebpf::TC_FROM_NODE_PROGRAM
        ]
    );
    assert!(status.datapath.programs.iter().all(|p| p.id > 0));
    // Fast-path pods have endpoint records (two addresses each); off and
    // kernel-only pods have theirs flagged: every pod is in the maps.
    let ep4 = status
        .datapath
        .maps
        .iter()
        .find(|m| m.name == "endpoints4")
        .unwrap();
    assert_eq!(ep4.capacity, 65536);
    assert!(ep4.entries >= 4, "{:?}", status.datapath.maps);
    assert_eq!(status.defaults.mode, "generic");
    assert_eq!(status.policies.in_force, ["db/deny-in"]);
    assert!(status.policies.rules > 0);
    assert!(status.last_node_pass.is_some());
    for (ns, name, _, mode, code, text) in PODS {
        let p = status.find(&format!("{ns}/{name}")).unwrap();
        assert_eq!((p.mode.as_str(), p.why.code), (mode, code), "{p:#?}");
        assert_eq!(p.why.text, text, "{ns}/{name}");
        assert_eq!(p.ips.len(), 2, "{ns}/{name}: both families");
        assert!(p.host_veth.starts_with("xdp"), "{p:?}");
    }
    let a = status.find("default/a").unwrap();
    assert_eq!((a.redirect.as_str(), a.cpus.as_str()), ("cpumap", "0"));
    let d = status.find("default/d").unwrap();
    assert!(
        d.problems.iter().any(|p| p.contains("turbo")),
        "{:?}",
        d.problems
    );

    // Counters: b pings a (cpumap), then a's reply counts on a.
    ping(&pods[1].netns, pods[0].ip(false), 5).unwrap();
    let s = status_json(&node);
    let (a, b) = (s.find("default/a").unwrap(), s.find("default/b").unwrap());
    let (ca, cb) = (a.counters.clone().unwrap(), b.counters.clone().unwrap());
    assert!(cb.forward >= 5 && ca.received >= 5, "{cb:?} {ca:?}");
    assert!(ca.forward >= 5 && cb.received >= 5, "{ca:?} {cb:?}");
    assert!(
        cb.top.iter().any(|t| t.verdict == "redirect_cpumap"),
        "{cb:?}"
    );

    // The table: one line per pod, its mode and its reason.
    let (code, table, err) = node.status(&[]).unwrap();
    assert_eq!(code, Some(0), "{err}");
    eprintln!("{table}");
    assert!(
        table.contains(&format!("node {}, ready", xdpcni_e2e::cluster::NODE)),
        "{table}"
    );
    assert!(table.contains("1 in force (db/deny-in)"), "{table}");
    assert!(
        table.contains("Pods:      6 (5 on the fast path)"),
        "{table}"
    );
    let header = table.lines().find(|l| l.starts_with("POD")).unwrap();
    let col = header.find("MODE").unwrap();
    for (ns, name, _, mode, _, text) in PODS {
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("{ns}/{name} ")))
            .unwrap_or_else(|| panic!("no line for {ns}/{name}:\n{table}"));
        assert!(line[col..].starts_with(mode), "{line}");
        assert!(line.ends_with(text), "{line}");
    }
    assert!(table.contains("cpumap:0"), "{table}");

    // One pod, both ways; an unknown pod is a clear error.
    let (code, one, _) = node.status(&["--pod", "db/pg", "-o", "json"]).unwrap();
    assert_eq!(code, Some(0));
    let v: Value = serde_json::from_str(&one).unwrap();
    assert_eq!(v["why"]["code"], "annotation");
    assert!(
        v["why"]["text"]
            .as_str()
            .unwrap()
            .ends_with("NetworkPolicy db/deny-in enforced in the datapath"),
        "{v}"
    );
    assert_eq!(v["name"], "pg");
    let (code, one, _) = node.status(&["--pod", "default/d"]).unwrap();
    assert_eq!(code, Some(0));
    assert!(one.contains("Problem:") && one.contains("turbo"), "{one}");
    let (code, _, err) = node.status(&["--pod", "default/nope"]).unwrap();
    assert_ne!(code, Some(0));
    assert!(err.contains("no pod default/nope on this node"), "{err}");
    // No agent at the address: says so.
    let (code, _, err) = node.status(&["--url", "http://127.0.0.1:1"]).unwrap();
    assert_ne!(code, Some(0));
    assert!(err.contains("is it running on this node?"), "{err}");
}
