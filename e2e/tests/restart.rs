//! The datapath outlives the processes that manage it: a process that exits
//! detaches nothing, the next one reopens the pins and changes nothing that is
//! already right, and an upgrade swaps programs atomically through the pinned
//! links, all while a pod pings another every 10 ms without losing a reply.
//! Needs root and bpffs at /sys/fs/bpf.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    io::Write,
    net::IpAddr,
    process::{Command, Stdio},
    time::Duration,
};
use xdpcni_ebpf::testing::RawDatapath;

use serde_json::{json, Value};
use xdpcni_e2e::{
    in_netns,
    topo::{fmt_mac, WiredNode},
    traffic::{ping, BackgroundPing},
    PinDir,
};
use xdpcni_ebpf::{abi::RedirectPolicy, AttachMode, Datapath, UPGRADE_TEST_OBJECT};

fn spec(node: &WiredNode, pins: &PinDir) -> Value {
    json!({
        "pin_dir": pins.path(),
        "netns": node.ns.path(),
        "mode": "native",
        "endpoints": node.pods.iter().map(|p| json!({
            "ips": p.addrs(),
            "ifindex": p.host_ifindex,
            "pod_mac": fmt_mac(&p.pod_mac),
            "host_mac": fmt_mac(&p.host_mac),
        })).collect::<Vec<_>>(),
    })
}

/// Runs the dp-holder process to completion and returns its report.
fn holder(spec: &Value) -> Value {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dp-holder"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dp-holder");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(spec.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "dp-holder failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn netlink_prog_ids(node: &WiredNode) -> Vec<u64> {
    node.pods
        .iter()
        .map(|p| {
            let (mode, id) = node
                .ns
                .xdp_attached(&p.host_veth)
                .unwrap()
                .expect("attached");
            assert_eq!(mode, "xdp", "native mode on {}", p.host_veth);
            id
        })
        .collect()
}

#[test]
fn a_new_process_takes_over_without_dropping_traffic() {
    let node = WiredNode::new(2).unwrap();
    let pins = PinDir::new("xr").unwrap();
    let (a, b) = (&node.pods[0], &node.pods[1]);
    let spec = spec(&node, &pins);

    let first = holder(&spec);
    assert_eq!(first["upgraded"], false);
    for att in first["attachments"].as_array().unwrap() {
        assert_eq!(att["changed"], true, "first process attaches");
    }
    for pod in &node.pods {
        pod.apply_mode_offloads(AttachMode::Native).unwrap();
    }
    // The first process has exited: still attached, still forwarding.
    let ids = netlink_prog_ids(&node);
    let first_ids: Vec<u64> = first["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["prog_id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, first_ids);
    ping(&a.ns, IpAddr::V4(b.ipv4), 3).unwrap();

    // Two more processes come and go while A pings B every 10 ms.
    let bg = BackgroundPing::start(&a.ns, IpAddr::V4(b.ipv4), 400).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..2 {
        let again = holder(&spec);
        assert_eq!(again["upgraded"], false);
        for (att, before) in again["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .zip(first["attachments"].as_array().unwrap())
        {
            assert_eq!(att["changed"], false, "nothing that is right is redone");
            assert_eq!(att["prog_id"], before["prog_id"]);
            assert_eq!(att["link_id"], before["link_id"]);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(bg.lost().unwrap(), 0, "no reply lost across restarts");
    assert_eq!(netlink_prog_ids(&node), ids, "program ids unchanged");
}

#[test]
fn an_upgrade_swaps_programs_atomically_under_traffic() {
    let node = WiredNode::new(2).unwrap();
    let pins = PinDir::new("xu").unwrap();
    let (a, b) = (&node.pods[0], &node.pods[1]);
    let links_before = in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        let mut links = Vec::new();
        for pod in &node.pods {
            links.push(
                dp.switch_mode(pod.host_ifindex, AttachMode::Native)?
                    .link_id,
            );
        }
        Ok(links)
    })
    .unwrap();
    for pod in &node.pods {
        pod.apply_mode_offloads(AttachMode::Native).unwrap();
    }
    let ids_before = netlink_prog_ids(&node);

    let bg = BackgroundPing::start(&a.ns, IpAddr::V6(b.ipv6), 300).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // Upgrade to a build with other instructions, then roll back.
    let mut seen = Vec::new();
    for object in [UPGRADE_TEST_OBJECT, xdpcni_ebpf::DATAPATH_OBJECT] {
        let (upgraded, new_id, links) = in_netns(&node.ns, || {
            let dp = Datapath::open_object(pins.path(), object)?;
            let mut links = Vec::new();
            for pod in &node.pods {
                let att = dp.attachment(pod.host_ifindex)?.expect("still attached");
                assert_eq!(att.prog_id, dp.from_pod_program_id()?);
                links.push(att.link_id);
            }
            Ok((dp.upgraded(), dp.from_pod_program_id()?, links))
        })
        .unwrap();
        assert!(upgraded, "a different program tag is an upgrade");
        assert_eq!(
            links, links_before,
            "the same links: swapped, not re-attached"
        );
        assert_eq!(netlink_prog_ids(&node), vec![u64::from(new_id); 2]);
        assert!(!ids_before.contains(&u64::from(new_id)));
        seen.push(new_id);
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_ne!(seen[0], seen[1]);
    assert_eq!(bg.lost().unwrap(), 0, "no reply lost across the swaps");
}

#[test]
fn link_pins_of_deleted_veths_are_collected() {
    let node = WiredNode::new(2).unwrap();
    let pins = PinDir::new("xg").unwrap();
    let (a, b) = (&node.pods[0], &node.pods[1]);
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        for pod in &node.pods {
            dp.raw_attach(pod.host_ifindex, AttachMode::Generic)?;
        }
        assert!(dp.raw_gc_links()?.is_empty(), "live links stay");
        // The veth goes (pod deleted); its pinned link outlives it.
        node.ns.ip(&["link", "del", &b.host_veth])?;
        assert!(
            dp.attachment(b.host_ifindex)?.is_none(),
            "defunct link is not an attachment"
        );
        let pin = pins
            .path()
            .join("links")
            .join(format!("{}_generic", b.host_ifindex));
        assert!(pin.exists());
        assert_eq!(dp.raw_gc_links()?, vec![b.host_ifindex]);
        assert!(!pin.exists());
        assert!(dp.attachment(a.host_ifindex)?.is_some(), "A untouched");
        Ok(())
    })
    .unwrap();
}
