//! The kernel's routes, neighbours and FDB entries made equal to a [`Plan`].

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use futures::TryStreamExt;
use rtnetlink::{
    packet_route::{
        neighbour::{
            NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
        },
        route::{RouteAttribute, RouteMessage, RouteProtocol},
        AddressFamily,
    },
    Handle, RouteMessageBuilder,
};
use xdpcni_host::{
    netlink::ip_of,
    overlay::{MacAddr, DEVICE, ROUTE_PROTOCOL},
};

use super::{NodeRoute, Plan, Report, RouteError, Unreachable, Via};

fn parse_route(m: &RouteMessage, device: Option<u32>) -> Option<NodeRoute> {
    if m.header.protocol != RouteProtocol::Other(ROUTE_PROTOCOL) {
        return None;
    }
    let (mut dst, mut gw, mut oif) = (None, None, None);
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(d) => dst = ip_of(d),
            RouteAttribute::Gateway(g) => gw = ip_of(g),
            RouteAttribute::Oif(o) => oif = Some(*o),
            _ => {}
        }
    }
    let gw = gw?;
    Some(NodeRoute {
        dst: dst?,
        prefix: m.header.destination_prefix_length,
        via: if oif.is_some() && oif == device {
            Via::Tunnel(gw)
        } else {
            Via::Gateway(gw)
        },
    })
}

fn route_message(r: &NodeRoute, device: u32) -> RouteMessage {
    let proto = RouteProtocol::Other(ROUTE_PROTOCOL);
    match (r.dst, r.via) {
        (IpAddr::V4(d), Via::Gateway(IpAddr::V4(v))) => {
            RouteMessageBuilder::<std::net::Ipv4Addr>::new()
                .destination_prefix(d, r.prefix)
                .gateway(v)
                .protocol(proto)
                .build()
        }
        (IpAddr::V4(d), Via::Tunnel(IpAddr::V4(v))) => {
            RouteMessageBuilder::<std::net::Ipv4Addr>::new()
                .destination_prefix(d, r.prefix)
                .gateway(v)
                .output_interface(device)
                .onlink()
                .protocol(proto)
                .build()
        }
        (IpAddr::V6(d), Via::Gateway(IpAddr::V6(v))) => {
            RouteMessageBuilder::<std::net::Ipv6Addr>::new()
                .destination_prefix(d, r.prefix)
                .gateway(v)
                .protocol(proto)
                .build()
        }
        (IpAddr::V6(d), Via::Tunnel(IpAddr::V6(v))) => {
            RouteMessageBuilder::<std::net::Ipv6Addr>::new()
                .destination_prefix(d, r.prefix)
                .gateway(v)
                .output_interface(device)
                .protocol(proto)
                .build()
        }
        _ => RouteMessage::default(),
    }
}

fn neighbour_ip(a: &NeighbourAddress) -> Option<IpAddr> {
    match a {
        NeighbourAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        NeighbourAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        // An FDB entry's (AF_BRIDGE) destination: raw bytes of either family.
        NeighbourAddress::Other(b) => match b.len() {
            4 => <[u8; 4]>::try_from(b.as_slice()).ok().map(IpAddr::from),
            16 => <[u8; 16]>::try_from(b.as_slice()).ok().map(IpAddr::from),
            _ => None,
        },
        _ => None,
    }
}

pub(super) fn mac_of(lla: &[u8]) -> Option<MacAddr> {
    <[u8; 6]>::try_from(lla).ok().map(MacAddr)
}

/// The permanent entries on the device: (neighbours, FDB), each with the
/// kernel's message (to delete it by).
type Entries = (
    BTreeMap<(IpAddr, MacAddr), NeighbourMessage>,
    BTreeMap<(MacAddr, IpAddr), NeighbourMessage>,
);

async fn device_entries(handle: &Handle, device: u32) -> Result<Entries, rtnetlink::Error> {
    let (mut neigh, mut fdb) = (BTreeMap::new(), BTreeMap::new());
    for family in [
        AddressFamily::Inet,
        AddressFamily::Inet6,
        AddressFamily::Bridge,
    ] {
        let mut dump = handle
            .neighbours()
            .get()
            .set_address_family(family)
            .execute();
        while let Some(m) = dump.try_next().await? {
            if m.header.ifindex != device || m.header.state != NeighbourState::Permanent {
                continue;
            }
            let (mut dst, mut lla) = (None, None);
            for a in &m.attributes {
                match a {
                    NeighbourAttribute::Destination(d) => dst = neighbour_ip(d),
                    NeighbourAttribute::LinkLayerAddress(l) => lla = mac_of(l),
                    _ => {}
                }
            }
            let (Some(dst), Some(mac)) = (dst, lla) else {
                continue;
            };
            if family == AddressFamily::Bridge {
                fdb.insert((mac, dst), m);
            } else {
                neigh.insert((dst, mac), m);
            }
        }
    }
    Ok((neigh, fdb))
}

/// Whether a refused host-gateway route means its next hop is off-link.
fn off_link(e: &rtnetlink::Error) -> Option<String> {
    let rtnetlink::Error::NetlinkError(m) = e else {
        return None;
    };
    let code = m.code.map(|c| -c.get())?;
    matches!(code, libc::EINVAL | libc::ENETUNREACH | libc::EHOSTUNREACH)
        .then(|| std::io::Error::from_raw_os_error(code).to_string())
}

/// Makes the agent's routes, and the entries on `device` (its ifindex, if
/// the node has one), equal `want`.
pub async fn sync(handle: &Handle, want: &Plan, device: Option<u32>) -> Result<Report, RouteError> {
    let named = |op: String| move |source| RouteError::Request { op, source };
    let mut report = Report::default();
    let (neigh, fdb) = match device {
        Some(d) => device_entries(handle, d)
            .await
            .map_err(named(format!("listing the entries of {DEVICE}")))?,
        None => Default::default(),
    };
    // The tunnel's entries before the routes that use them.
    if let Some(d) = device {
        for (mac, vtep) in want.fdb.iter().filter(|k| !fdb.contains_key(k)) {
            handle
                .neighbours()
                .add_bridge(d, &mac.0)
                .destination(*vtep)
                .flags(NeighbourFlags::Own)
                .replace()
                .execute()
                .await
                .map_err(named(format!("adding FDB entry {mac} dst {vtep}")))?;
            report.added += 1;
        }
        for (gw, mac) in want.neighbours.iter().filter(|k| !neigh.contains_key(k)) {
            handle
                .neighbours()
                .add(d, *gw)
                .link_layer_address(&mac.0)
                .replace()
                .execute()
                .await
                .map_err(named(format!("adding neighbour {gw} lladdr {mac}")))?;
            report.added += 1;
        }
    }
    let mut have = BTreeSet::new();
    for req in [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        let mut routes = handle.route().get(req).execute();
        while let Some(m) = routes
            .try_next()
            .await
            .map_err(named("listing routes".into()))?
        {
            if let Some(r) = parse_route(&m, device) {
                have.insert(r);
            }
        }
    }
    let dev = device.unwrap_or_default();
    for (r, node) in want.routes.iter().filter(|(r, _)| !have.contains(r)) {
        if matches!(r.via, Via::Tunnel(_)) && device.is_none() {
            continue;
        }
        // Replace: a route changing next hop (a switch of mode) changes in
        // one step, with no moment without a route.
        match handle
            .route()
            .add(route_message(r, dev))
            .replace()
            .execute()
            .await
        {
            Ok(()) => report.added += 1,
            Err(e) => match (r.via, off_link(&e)) {
                (Via::Gateway(via), Some(why)) => report.unreachable.push(Unreachable {
                    node: node.clone(),
                    cidr: r.cidr(),
                    via,
                    why,
                    awaiting_vtep: device.is_some(),
                }),
                _ => return Err(named(format!("adding route {r:?}"))(e)),
            },
        }
    }
    let kept: BTreeSet<(IpAddr, u8)> = want.routes.keys().map(|r| (r.dst, r.prefix)).collect();
    for r in have.iter().filter(|r| !want.routes.contains_key(r)) {
        if kept.contains(&(r.dst, r.prefix)) {
            // Replaced above by the route that took its place.
            continue;
        }
        match handle.route().del(route_message(r, dev)).execute().await {
            Ok(()) => report.removed += 1,
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.is_some_and(|c| -c.get() == libc::ESRCH) => {}
            Err(e) => return Err(named(format!("removing route {r:?}"))(e)),
        }
    }
    for ((gw, mac), m) in neigh
        .into_iter()
        .filter(|(k, _)| !want.neighbours.contains(k))
    {
        handle
            .neighbours()
            .del(m)
            .execute()
            .await
            .map_err(named(format!("removing neighbour {gw} lladdr {mac}")))?;
        report.removed += 1;
    }
    for ((mac, vtep), m) in fdb.into_iter().filter(|(k, _)| !want.fdb.contains(k)) {
        handle
            .neighbours()
            .del(m)
            .execute()
            .await
            .map_err(named(format!("removing FDB entry {mac} dst {vtep}")))?;
        report.removed += 1;
    }
    report.unreachable.sort();
    Ok(report)
}
