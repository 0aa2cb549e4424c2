//! Host-gateway routing between nodes: a route to every other node's pod
//! CIDR via that node's InternalIP, in the main table, marked with our own
//! route protocol number so the agent only ever touches routes it made.

use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Node;
use rtnetlink::{
    packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol},
    Handle, RouteMessageBuilder,
};

/// The `proto` of the routes the agent owns (`ip route` shows `proto 90`).
pub const ROUTE_PROTOCOL: u8 = 90;

/// A route to another node's pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeRoute {
    /// Pod CIDR address.
    pub dst: IpAddr,
    /// Pod CIDR prefix length.
    pub prefix: u8,
    /// The node's InternalIP of the same family.
    pub via: IpAddr,
}

/// The routes this node needs: one per other node and pod CIDR family.
pub fn desired(nodes: &[Arc<Node>], me: &str) -> BTreeSet<NodeRoute> {
    let mut out = BTreeSet::new();
    for n in nodes {
        if n.metadata.name.as_deref() == Some(me) {
            continue;
        }
        let Some(spec) = &n.spec else { continue };
        let mut cidrs: Vec<String> = spec.pod_cidrs.clone().unwrap_or_default();
        if let Some(c) = &spec.pod_cidr {
            if !cidrs.contains(c) {
                cidrs.push(c.clone());
            }
        }
        let internal: Vec<IpAddr> = n
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .map(|a| {
                a.iter()
                    .filter(|a| a.type_ == "InternalIP")
                    .filter_map(|a| a.address.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        for c in cidrs {
            let Some((addr, prefix)) = c.split_once('/') else {
                continue;
            };
            let (Ok(dst), Ok(prefix)) = (addr.parse::<IpAddr>(), prefix.parse::<u8>()) else {
                continue;
            };
            if let Some(via) = internal.iter().find(|v| v.is_ipv4() == dst.is_ipv4()) {
                out.insert(NodeRoute {
                    dst,
                    prefix,
                    via: *via,
                });
            }
        }
    }
    out
}

fn ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn parse(m: &RouteMessage) -> Option<NodeRoute> {
    if m.header.protocol != RouteProtocol::Other(ROUTE_PROTOCOL) {
        return None;
    }
    let (mut dst, mut via) = (None, None);
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(d) => dst = ip(d),
            RouteAttribute::Gateway(g) => via = ip(g),
            _ => {}
        }
    }
    Some(NodeRoute {
        dst: dst?,
        prefix: m.header.destination_prefix_length,
        via: via?,
    })
}

fn message(r: &NodeRoute) -> RouteMessage {
    match (r.dst, r.via) {
        (IpAddr::V4(d), IpAddr::V4(v)) => RouteMessageBuilder::<std::net::Ipv4Addr>::new()
            .destination_prefix(d, r.prefix)
            .gateway(v)
            .protocol(RouteProtocol::Other(ROUTE_PROTOCOL))
            .build(),
        (IpAddr::V6(d), IpAddr::V6(v)) => RouteMessageBuilder::<std::net::Ipv6Addr>::new()
            .destination_prefix(d, r.prefix)
            .gateway(v)
            .protocol(RouteProtocol::Other(ROUTE_PROTOCOL))
            .build(),
        _ => RouteMessage::default(),
    }
}

/// Makes the routes the agent owns equal `want`: (added, removed).
pub async fn sync(
    handle: &Handle,
    want: &BTreeSet<NodeRoute>,
) -> Result<(usize, usize), rtnetlink::Error> {
    let mut have = BTreeSet::new();
    for req in [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        let mut routes = handle.route().get(req).execute();
        while let Some(m) = routes.try_next().await? {
            if let Some(r) = parse(&m) {
                have.insert(r);
            }
        }
    }
    let (mut added, mut removed) = (0, 0);
    for r in want.difference(&have) {
        handle.route().add(message(r)).replace().execute().await?;
        added += 1;
    }
    for r in have.difference(want) {
        handle.route().del(message(r)).execute().await?;
        removed += 1;
    }
    Ok((added, removed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cidr: &str, ip: &str) -> Arc<Node> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": name },
                "spec": { "podCIDR": cidr },
                "status": { "addresses": [{ "type": "InternalIP", "address": ip }, { "type": "Hostname", "address": name }] },
            }))
            .unwrap(),
        )
    }

    #[test]
    fn one_route_per_other_node_and_family() {
        let nodes = vec![
            node("me", "10.1.0.0/24", "192.0.2.1"),
            node("b", "10.1.1.0/24", "192.0.2.2"),
            node("c", "fd00:1::/64", "192.0.2.3"), // no IPv6 InternalIP: skipped
        ];
        let want = desired(&nodes, "me");
        assert_eq!(want.len(), 1);
        let r = want.iter().next().unwrap();
        assert_eq!(r.dst.to_string(), "10.1.1.0");
        assert_eq!(r.prefix, 24);
        assert_eq!(r.via.to_string(), "192.0.2.2");
    }
}
