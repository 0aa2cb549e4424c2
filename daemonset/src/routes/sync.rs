//! The kernel's routes, neighbours and FDB entries made equal to a [`Plan`].

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use rtnetlink::{
    packet_route::{
        neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
        route::{RouteAttribute, RouteMessage, RouteProtocol},
        AddressFamily, RouteNetlinkMessage,
    },
    RouteMessageBuilder,
};
use xdpcni_host::{
    netlink::{ip_of, Netlink, NetlinkError},
    overlay::{MacAddr, DEVICE, ROUTE_PROTOCOL},
};

use super::{NodeRoute, Plan, Report, RouteError, Unreachable, Via};

/// An agent's route (its protocol) as the kernel has it, with the device
/// it leaves by.
fn parse_route(m: &RouteMessage, device: Option<u32>) -> Option<(NodeRoute, Option<u32>)> {
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
    let route = NodeRoute {
        dst: dst?,
        prefix: m.header.destination_prefix_length,
        via: if oif.is_some() && oif == device {
            Via::Tunnel(gw)
        } else {
            Via::Gateway(gw)
        },
    };
    Some((route, oif))
}

/// The agent's routes in the kernel (both families), each with the device
/// it leaves by; `device` is the VXLAN device's ifindex, if any.
pub(super) fn agent_routes(
    nl: &mut Netlink,
    device: Option<u32>,
) -> Result<Vec<(NodeRoute, Option<u32>)>, NetlinkError> {
    let mut out = Vec::new();
    for req in [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        for m in nl.dump("listing routes", RouteNetlinkMessage::GetRoute(req))? {
            if let RouteNetlinkMessage::NewRoute(m) = m {
                out.extend(parse_route(&m, device));
            }
        }
    }
    Ok(out)
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

fn device_entries(nl: &mut Netlink, device: u32) -> Result<Entries, NetlinkError> {
    let (mut neigh, mut fdb) = (BTreeMap::new(), BTreeMap::new());
    for family in [
        AddressFamily::Inet,
        AddressFamily::Inet6,
        AddressFamily::Bridge,
    ] {
        let mut req = NeighbourMessage::default();
        req.header.family = family;
        let dump = nl.dump(
            &format!("listing the entries of {DEVICE}"),
            RouteNetlinkMessage::GetNeighbour(req),
        )?;
        for m in dump {
            let RouteNetlinkMessage::NewNeighbour(m) = m else {
                continue;
            };
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
fn off_link(e: &NetlinkError) -> Option<String> {
    let code = e.errno()?;
    matches!(code, libc::EINVAL | libc::ENETUNREACH | libc::EHOSTUNREACH)
        .then(|| std::io::Error::from_raw_os_error(code).to_string())
}

/// Makes the agent's routes, and the entries on `device` (its ifindex, if
/// the node has one), equal `want`.
pub fn sync(nl: &mut Netlink, want: &Plan, device: Option<u32>) -> Result<Report, RouteError> {
    let mut report = Report::default();
    let (neigh, fdb) = match device {
        Some(d) => device_entries(nl, d)?,
        None => Default::default(),
    };
    // The tunnel's entries before the routes that use them.
    if let Some(d) = device {
        for (mac, vtep) in want.fdb.iter().filter(|k| !fdb.contains_key(k)) {
            nl.add_fdb_entry(d, mac.0, *vtep)?;
            report.added += 1;
        }
        for (gw, mac) in want.neighbours.iter().filter(|k| !neigh.contains_key(k)) {
            nl.add_permanent_neighbour(d, *gw, mac.0)?;
            report.added += 1;
        }
    }
    let have: BTreeSet<NodeRoute> = agent_routes(nl, device)?
        .into_iter()
        .map(|(r, _)| r)
        .collect();
    let dev = device.unwrap_or_default();
    for (r, node) in want.routes.iter().filter(|(r, _)| !have.contains(r)) {
        if matches!(r.via, Via::Tunnel(_)) && device.is_none() {
            continue;
        }
        // Replace: a route changing next hop (a switch of mode) changes in
        // one step, with no moment without a route.
        let add = RouteNetlinkMessage::NewRoute(route_message(r, dev));
        match nl.replace(&format!("adding route {r:?}"), add) {
            Ok(()) => report.added += 1,
            Err(e) => match (r.via, off_link(&e)) {
                (Via::Gateway(via), Some(why)) => report.unreachable.push(Unreachable {
                    node: node.clone(),
                    cidr: r.cidr(),
                    via,
                    why,
                    awaiting_vtep: device.is_some(),
                }),
                _ => return Err(e.into()),
            },
        }
    }
    let kept: BTreeSet<(IpAddr, u8)> = want.routes.keys().map(|r| (r.dst, r.prefix)).collect();
    for r in have.iter().filter(|r| !want.routes.contains_key(r)) {
        if kept.contains(&(r.dst, r.prefix)) {
            // Replaced above by the route that took its place.
            continue;
        }
        let del = RouteNetlinkMessage::DelRoute(route_message(r, dev));
        if nl.delete(&format!("removing route {r:?}"), del)? {
            report.removed += 1;
        }
    }
    let stale = neigh
        .into_iter()
        .filter(|(k, _)| !want.neighbours.contains(k))
        .map(|((gw, mac), m)| (format!("removing neighbour {gw} lladdr {mac}"), m))
        .chain(
            fdb.into_iter()
                .filter(|(k, _)| !want.fdb.contains(k))
                .map(|((mac, vtep), m)| (format!("removing FDB entry {mac} dst {vtep}"), m)),
        );
    for (op, m) in stale {
        if nl.delete(&op, RouteNetlinkMessage::DelNeighbour(m))? {
            report.removed += 1;
        }
    }
    report.unreachable.sort();
    Ok(report)
}
