//! Routes: added, listed, looked up (the source the kernel would give) and
//! deleted by route protocol.

use netlink_packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REPLACE};
use netlink_packet_route::{
    route::{RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType},
    AddressFamily, RouteNetlinkMessage,
};
use std::net::IpAddr;

use super::{family, ip_of, route_addr, Netlink, Result};

impl Netlink {
    /// Adds a route to `dst/prefix` out of link `oif`, via `gateway` if any
    /// (scope link when direct).
    pub fn add_route(
        &mut self,
        dst: IpAddr,
        prefix: u8,
        gateway: Option<IpAddr>,
        oif: u32,
    ) -> Result<()> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = family(dst);
        msg.header.destination_prefix_length = prefix;
        msg.header.table = libc::RT_TABLE_MAIN;
        msg.header.protocol = RouteProtocol::Boot;
        msg.header.kind = RouteType::Unicast;
        msg.header.scope = if gateway.is_some() {
            RouteScope::Universe
        } else {
            RouteScope::Link
        };
        if prefix > 0 {
            msg.attributes
                .push(RouteAttribute::Destination(route_addr(dst)));
        }
        if let Some(gw) = gateway {
            msg.attributes.push(RouteAttribute::Gateway(route_addr(gw)));
        }
        msg.attributes.push(RouteAttribute::Oif(oif));
        self.request(
            &format!("adding route {dst}/{prefix} via {gateway:?} dev {oif}"),
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .map(drop)
    }

    /// The main-table routes out of link `oif`: (destination, prefix, gateway).
    pub fn routes(&mut self, oif: u32, v6: bool) -> Result<Vec<(IpAddr, u8, Option<IpAddr>)>> {
        let mut req = RouteMessage::default();
        req.header.address_family = if v6 {
            AddressFamily::Inet6
        } else {
            AddressFamily::Inet
        };
        let msgs = self.request(
            "listing routes",
            RouteNetlinkMessage::GetRoute(req),
            NLM_F_DUMP,
        )?;
        let mut out = Vec::new();
        for m in msgs {
            let RouteNetlinkMessage::NewRoute(r) = m else {
                continue;
            };
            if r.header.table != libc::RT_TABLE_MAIN {
                continue;
            }
            let (mut dst, mut gw, mut dev) = (None, None, None);
            for a in &r.attributes {
                match a {
                    RouteAttribute::Destination(d) => dst = ip_of(d),
                    RouteAttribute::Gateway(g) => gw = ip_of(g),
                    RouteAttribute::Oif(o) => dev = Some(*o),
                    _ => {}
                }
            }
            if dev != Some(oif) {
                continue;
            }
            let dst = dst.unwrap_or(if v6 {
                IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
            } else {
                IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
            });
            out.push((dst, r.header.destination_prefix_length, gw));
        }
        Ok(out)
    }

    /// The source address the kernel gives an unbound socket's packet to
    /// `dst` (`ip route get`'s `src`): `None` when there is no route.
    pub fn route_source(&mut self, dst: IpAddr) -> Result<Option<IpAddr>> {
        let mut req = RouteMessage::default();
        req.header.address_family = family(dst);
        req.header.destination_prefix_length = if dst.is_ipv6() { 128 } else { 32 };
        req.attributes
            .push(RouteAttribute::Destination(route_addr(dst)));
        let op = format!("looking up the route to {dst}");
        let answer = match self.request(&op, RouteNetlinkMessage::GetRoute(req), 0) {
            Ok(msgs) => msgs,
            Err(e) if matches!(e.errno(), Some(libc::ENETUNREACH | libc::EHOSTUNREACH)) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        Ok(answer.into_iter().find_map(|m| match m {
            RouteNetlinkMessage::NewRoute(r) => r.attributes.iter().find_map(|a| match a {
                RouteAttribute::PrefSource(p) => ip_of(p),
                _ => None,
            }),
            _ => None,
        }))
    }

    /// Deletes every main-table route of route protocol `protocol`, both
    /// families: how many went.
    pub fn del_routes_of_protocol(&mut self, protocol: u8) -> Result<usize> {
        let mut n = 0;
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut req = RouteMessage::default();
            req.header.address_family = family;
            let msgs = self.request(
                "listing routes",
                RouteNetlinkMessage::GetRoute(req),
                NLM_F_DUMP,
            )?;
            for m in msgs {
                let RouteNetlinkMessage::NewRoute(r) = m else {
                    continue;
                };
                if r.header.table != libc::RT_TABLE_MAIN
                    || r.header.protocol != RouteProtocol::Other(protocol)
                {
                    continue;
                }
                match self.request(
                    &format!("deleting a route of protocol {protocol}"),
                    RouteNetlinkMessage::DelRoute(r),
                    NLM_F_ACK,
                ) {
                    Ok(_) => n += 1,
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(n)
    }
}
