//! The routing plan's unit tests.

use super::*;

fn node(name: &str, cidrs: &[&str], ips: &[&str], vtep: Option<&str>) -> Arc<Node> {
    let addresses: Vec<serde_json::Value> = ips
        .iter()
        .map(|ip| serde_json::json!({ "type": "InternalIP", "address": ip }))
        .chain(std::iter::once(
            serde_json::json!({ "type": "Hostname", "address": name }),
        ))
        .collect();
    let mut meta = serde_json::json!({ "name": name });
    if let Some(v) = vtep {
        meta["annotations"] = serde_json::json!({ VTEP_ANNOTATION: v });
    }
    Arc::new(
        serde_json::from_value(serde_json::json!({
            "metadata": meta,
            "spec": { "podCIDR": cidrs[0], "podCIDRs": cidrs },
            "status": { "addresses": addresses },
        }))
        .unwrap(),
    )
}

fn underlay(addr: &str, prefix: u8) -> Underlay {
    Underlay {
        address: addr.parse().unwrap(),
        link: xdpcni_host::netlink::Link {
            index: 2,
            name: "eth0".into(),
            mac: [0; 6],
            mtu: 1500,
            up: true,
            oper_up: true,
            headroom: None,
            kind: None,
            peer_index: None,
        },
        subnets: vec![(addr.parse().unwrap(), prefix)],
    }
}

fn vias(p: &Plan, node: &str) -> Vec<String> {
    p.routes
        .iter()
        .filter(|(_, n)| *n == node)
        .map(|(r, _)| format!("{} {:?}", r.cidr(), r.via))
        .collect()
}

#[test]
fn host_gateway_routes_one_per_other_node_and_family() {
    let nodes = vec![
        node("me", &["10.1.0.0/24"], &["192.0.2.1"], None),
        node("b", &["10.1.1.0/24"], &["192.0.2.2"], None),
        node("c", &["fd00:1::/64"], &["192.0.2.3"], None), // no IPv6 InternalIP
    ];
    let p = plan(&nodes, "me", RoutingMode::HostGateway, None);
    assert_eq!(vias(&p, "b"), ["10.1.1.0/24 Gateway(192.0.2.2)"]);
    assert!(vias(&p, "c").is_empty());
    assert!(p.fdb.is_empty() && p.neighbours.is_empty());
}

#[test]
fn vxlan_tunnels_to_every_publishing_node_and_auto_only_off_subnet() {
    let b_vtep = Vtep::for_address("192.0.2.2".parse().unwrap());
    let c_vtep = Vtep::for_address("198.51.100.3".parse().unwrap());
    let nodes = vec![
        node("me", &["10.1.0.0/24"], &["192.0.2.1"], None),
        node(
            "b",
            &["10.1.1.0/24", "fd00:1:1::/64"],
            &["192.0.2.2", "2001:db8::2"],
            Some(&b_vtep.to_annotation()),
        ),
        node(
            "c",
            &["10.1.2.0/24", "fd00:1:2::/64"],
            &["198.51.100.3"],
            Some(&c_vtep.to_annotation()),
        ),
        // Not publishing yet (an older agent): host-gateway.
        node("d", &["10.1.3.0/24"], &["192.0.2.4"], None),
        node("e", &["10.1.4.0/24"], &["192.0.2.5"], Some("{bad")),
    ];
    let u = underlay("192.0.2.1", 24);
    let local = Local {
        vtep: Vtep::for_address(u.address),
        underlay: &u,
    };
    let p = plan(&nodes, "me", RoutingMode::Vxlan, Some(&local));
    let b6 = tunnel_gateway("fd00:1:1::".parse().unwrap(), b_vtep.mac);
    let c6 = tunnel_gateway("fd00:1:2::".parse().unwrap(), c_vtep.mac);
    assert_eq!(
        vias(&p, "b"),
        [
            "10.1.1.0/24 Tunnel(10.1.1.0)".to_string(),
            format!("fd00:1:1::/64 Tunnel({b6})")
        ]
    );
    assert_eq!(vias(&p, "c").len(), 2, "both families through the tunnel");
    assert_eq!(vias(&p, "d"), ["10.1.3.0/24 Gateway(192.0.2.4)"]);
    assert_eq!(vias(&p, "e"), ["10.1.4.0/24 Gateway(192.0.2.5)"]);
    assert_eq!(p.bad_vteps.len(), 1);
    assert!(p.fdb.contains(&(b_vtep.mac, b_vtep.address)));
    assert!(p.fdb.contains(&(c_vtep.mac, c_vtep.address)));
    assert!(p.neighbours.contains(&(c6, c_vtep.mac)));

    let a = plan(&nodes, "me", RoutingMode::Auto, Some(&local));
    assert_eq!(
        vias(&a, "b"),
        [
            "10.1.1.0/24 Gateway(192.0.2.2)".to_string(),
            format!("fd00:1:1::/64 Tunnel({b6})")
        ],
        "same IPv4 subnet: direct; no IPv6 subnet in common: the tunnel"
    );
    assert_eq!(
        vias(&a, "c"),
        [
            "10.1.2.0/24 Tunnel(10.1.2.0)".to_string(),
            format!("fd00:1:2::/64 Tunnel({c6})")
        ]
    );
    assert!(
        a.fdb.contains(&(b_vtep.mac, b_vtep.address)),
        "b's IPv6 pods"
    );
    // Without a device of its own (not made yet), host-gateway.
    let none = plan(&nodes, "me", RoutingMode::Vxlan, None);
    assert_eq!(vias(&none, "c"), ["10.1.2.0/24 Gateway(198.51.100.3)"]);
}

#[test]
fn an_unreachable_next_hop_says_which_and_what_to_do() {
    let u = Unreachable {
        node: "node-2".into(),
        cidr: "10.81.2.0/24".into(),
        via: "192.168.72.2".parse().unwrap(),
        why: "Invalid argument".into(),
        awaiting_vtep: false,
    };
    let s = u.to_string();
    assert!(s.contains("node-2") && s.contains("192.168.72.2") && s.contains("vxlan or auto"));
    let waiting = Unreachable {
        awaiting_vtep: true,
        ..u
    }
    .to_string();
    assert!(waiting.contains("until it publishes") && !waiting.contains("set routing.mode"));
}
