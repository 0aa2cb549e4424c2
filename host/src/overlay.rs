//! Routing between nodes, decided once for every binary: the modes
//! (host-gateway, VXLAN, auto), the VXLAN device the agent owns on a node,
//! the encapsulation's overhead and the pod MTU it leaves, the VTEP a node
//! publishes on its Node object, and what `uninstall` takes away.
//!
//! The packet path is the kernel's own VXLAN device (no userspace): for
//! every other node whose pods are reached through it, a permanent FDB
//! entry (its VTEP MAC to its VTEP address), a permanent neighbour (the
//! gateway address of each of its pod CIDRs to that MAC) and a route
//! (`<pod CIDR> via <gateway> dev xdpcni.vxlan onlink`), as Flannel's
//! VXLAN backend does; host-gateway routes go `via <InternalIP>`.

use std::{fmt, net::IpAddr};

use serde::{Deserialize, Serialize};

use crate::{
    netlink::{Netlink, NetlinkError},
    pod::Mac,
};

/// How a node reaches the pods of the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RoutingMode {
    /// A route per pod CIDR via the node's InternalIP: every node must be
    /// on this node's L2 segment.
    HostGateway,
    /// Every other node through the VXLAN device.
    Vxlan,
    /// Host-gateway to the nodes on this node's own subnet, VXLAN to the
    /// rest (Calico's CrossSubnet).
    Auto,
}

/// The mode a node runs when its config names none: VXLAN, which reaches
/// every node that can send UDP to it: across routers, and in cloud
/// networks that drop packets addressed to pod CIDRs even between hosts of
/// one subnet (where `auto`'s host-gateway half would fail in silence).
pub const DEFAULT_ROUTING: RoutingMode = RoutingMode::Vxlan;

impl RoutingMode {
    /// Every mode, in the order the chart and docs list them.
    pub const ALL: [RoutingMode; 3] = [Self::HostGateway, Self::Vxlan, Self::Auto];

    /// Parses a mode name (`hostGateway`, `vxlan`, `auto`).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    /// The mode's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HostGateway => "hostGateway",
            Self::Vxlan => "vxlan",
            Self::Auto => "auto",
        }
    }

    /// The names, for an error message: `hostGateway, vxlan, auto`.
    pub fn names() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }

    /// Whether the node has a VXLAN device (and so pods a smaller MTU).
    pub fn tunnels(self) -> bool {
        !matches!(self, Self::HostGateway)
    }
}

impl fmt::Display for RoutingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The VXLAN device's name on every node.
pub const DEVICE: &str = "xdpcni.vxlan";
/// The VXLAN network identifier when the config names none.
pub const DEFAULT_VNI: u32 = 1;
/// The VXLAN UDP port when the config names none (IANA's).
pub const DEFAULT_PORT: u16 = 4789;
/// VNIs a config may name (24 bits; 0 is not used).
pub const VNI_RANGE: std::ops::RangeInclusive<u32> = 1..=0x00ff_ffff;
/// The Node annotation holding a node's [`Vtep`].
pub const VTEP_ANNOTATION: &str = "xdpcni.io/vtep";
/// Transmit checksum offload on the VXLAN device unless the config says
/// otherwise: on. Flannel's fix for the 63-second connection delays
/// (kubernetes/kubernetes#88986, flannel-io/flannel#1282) turned it off:
/// netfilter NAT of the outer UDP header (kube-proxy's masquerade,
/// `--random-fully`) wrote a bad checksum, which Linux 5.7 fixed (commit
/// ea64d8d6c675, "netfilter: nat: never update the UDP checksum when it's
/// 0"); xdpcni needs 6.6 or later (tcx). Off costs 4.6x of the tunnel's TCP
/// throughput here (docs/benchmark.md, "Across nodes": the device loses
/// TSO), so it stays on, and `routing.vxlan.txChecksumOffload: false` is
/// there for a network whose NAT between nodes still corrupts checksums
/// (flannel-io/flannel#1929).
pub const DEFAULT_TX_CHECKSUM_OFFLOAD: bool = true;
/// The `proto` of every route the agent owns (`ip route` shows `proto 90`).
pub const ROUTE_PROTOCOL: u8 = 90;

/// What VXLAN adds to a pod's packet: the inner Ethernet header (14), the
/// VXLAN header (8), UDP (8) and the outer IP header (20 or 40).
pub fn overhead(underlay_v6: bool) -> u32 {
    if underlay_v6 {
        70
    } else {
        50
    }
}

/// The MTU of pod interfaces on a node whose underlay interface has
/// `underlay_mtu`: all of it in host-gateway mode, less the encapsulation
/// where some peer may be reached through the tunnel.
pub fn pod_mtu(mode: RoutingMode, underlay_mtu: u32, underlay_v6: bool) -> u32 {
    if mode.tunnels() {
        underlay_mtu.saturating_sub(overhead(underlay_v6))
    } else {
        underlay_mtu
    }
}

/// A node's VXLAN tunnel endpoint, as it publishes it on its Node object
/// (annotation [`VTEP_ANNOTATION`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Vtep {
    /// The underlay address other nodes send the tunnel's UDP to.
    pub address: IpAddr,
    /// The MAC of its VXLAN device (inner frames are addressed to it).
    pub mac: MacAddr,
}

/// A MAC address, ordered (for sets of entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl Serialize for MacAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Mac(self.0).serialize(s)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Mac::deserialize(d).map(|m| Self(m.0))
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Mac(self.0).fmt(f)
    }
}

impl Vtep {
    /// The VTEP of the node whose underlay address is `address`: its MAC
    /// is derived from the address (locally administered, unicast), so a
    /// device made again after a reboot or a crash keeps the MAC the other
    /// nodes have in their FDB and neighbour entries.
    pub fn for_address(address: IpAddr) -> Self {
        let (tag, tail) = match address {
            IpAddr::V4(a) => (0x78, a.octets()),
            IpAddr::V6(a) => {
                let o = a.octets();
                let mut t = [0u8; 4];
                for (i, b) in o.iter().enumerate() {
                    t[i % 4] ^= b;
                }
                (0x79, t)
            }
        };
        Self {
            address,
            mac: MacAddr([0x0e, tag, tail[0], tail[1], tail[2], tail[3]]),
        }
    }

    /// The annotation value.
    pub fn to_annotation(&self) -> String {
        format!(
            "{{\"address\":\"{}\",\"mac\":\"{}\"}}",
            self.address, self.mac
        )
    }

    /// Reads an annotation value.
    pub fn from_annotation(s: &str) -> Result<Self, String> {
        serde_json::from_str(s).map_err(|e| format!("{VTEP_ANNOTATION} {s:?}: {e}"))
    }
}

/// The interface a node's tunnel runs over: the one holding its VTEP
/// address (its first InternalIP).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Underlay {
    /// The address.
    pub address: IpAddr,
    /// The interface holding it.
    pub link: crate::netlink::Link,
    /// Its addresses and prefix lengths (this node's subnets, for `auto`).
    pub subnets: Vec<(IpAddr, u8)>,
}

impl Underlay {
    /// The interface holding `address` in the calling thread's network
    /// namespace, or `None` if no interface holds it (an InternalIP behind
    /// NAT).
    pub fn find(nl: &mut Netlink, address: IpAddr) -> Result<Option<Self>, NetlinkError> {
        let Some(link) = nl.link_with_address(address)? else {
            return Ok(None);
        };
        let subnets = nl.addresses(link.index)?;
        Ok(Some(Self {
            address,
            link,
            subnets,
        }))
    }

    /// Whether `peer` is on one of this interface's subnets (of its family).
    pub fn on_subnet(&self, peer: IpAddr) -> bool {
        self.subnets
            .iter()
            .any(|(net, len)| same_prefix(*net, peer, *len))
    }

    /// The pod MTU this underlay leaves in `mode`.
    pub fn pod_mtu(&self, mode: RoutingMode) -> u32 {
        pod_mtu(mode, self.link.mtu, self.address.is_ipv6())
    }
}

/// Whether `a` and `b` share their first `len` bits (false across families).
pub fn same_prefix(a: IpAddr, b: IpAddr, len: u8) -> bool {
    let (a, b, bits): (u128, u128, u32) = match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u32::from(a).into(), u32::from(b).into(), 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let len = u32::from(len).min(bits);
    if len == 0 {
        return true;
    }
    (a ^ b) >> (bits - len) == 0
}

/// The next hop of a tunnel route to a pod CIDR starting at `cidr_addr`
/// on the node whose VTEP MAC is `mac`, which a permanent neighbour maps
/// to that MAC: for IPv4 the CIDR's own network address (on link on the
/// device); for IPv6 the link-local address of the MAC (EUI-64), as IPv6
/// refuses an on-link gateway that another route (a host-gateway route
/// being replaced in a switch of mode) already covers.
pub fn tunnel_gateway(cidr_addr: IpAddr, mac: MacAddr) -> IpAddr {
    match cidr_addr {
        IpAddr::V4(_) => cidr_addr,
        IpAddr::V6(_) => {
            let m = mac.0;
            IpAddr::V6(std::net::Ipv6Addr::from([
                0xfe,
                0x80,
                0,
                0,
                0,
                0,
                0,
                0,
                m[0] ^ 0x02,
                m[1],
                m[2],
                0xff,
                0xfe,
                m[3],
                m[4],
                m[5],
            ]))
        }
    }
}

/// What [`remove`] took away.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TunnelRemoved {
    /// Whether the VXLAN device was there (its FDB entries, neighbours
    /// and routes went with it).
    pub device: bool,
    /// Host-gateway routes the agent owned.
    pub routes: usize,
}

/// Removes the VXLAN device and every route the agent owns (`proto 90`)
/// from the calling thread's network namespace. Nothing there is success.
pub fn remove(nl: &mut Netlink) -> Result<TunnelRemoved, NetlinkError> {
    Ok(TunnelRemoved {
        device: remove_device(nl)?,
        routes: nl.del_routes_of_protocol(ROUTE_PROTOCOL)?,
    })
}

/// Removes the VXLAN device (its neighbours, FDB entries and routes go
/// with it): whether it was there. The one removal of the device, for the
/// agent leaving the tunnel and for uninstall.
pub fn remove_device(nl: &mut Netlink) -> Result<bool, NetlinkError> {
    match nl.link_by_name(DEVICE)? {
        Some(link) => nl.del_link(link.index),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn modes_round_trip_and_only_host_gateway_keeps_the_full_mtu() {
        for m in RoutingMode::ALL {
            assert_eq!(RoutingMode::parse(m.as_str()), Some(m));
        }
        assert_eq!(RoutingMode::parse("host-gw"), None);
        assert_eq!(RoutingMode::names(), "hostGateway, vxlan, auto");
        assert_eq!(pod_mtu(RoutingMode::HostGateway, 1500, false), 1500);
        assert_eq!(pod_mtu(RoutingMode::Vxlan, 1500, false), 1450);
        assert_eq!(pod_mtu(RoutingMode::Auto, 9000, true), 8930);
    }

    #[test]
    fn subnets_compare_by_prefix_and_family() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(same_prefix(ip("192.168.71.1"), ip("192.168.71.200"), 24));
        assert!(!same_prefix(ip("192.168.71.1"), ip("192.168.72.1"), 24));
        assert!(same_prefix(ip("192.168.71.1"), ip("192.168.72.1"), 16));
        assert!(same_prefix(ip("fd71::1"), ip("fd71::9"), 64));
        assert!(!same_prefix(ip("fd71::1"), ip("fd72::1"), 64));
        assert!(!same_prefix(ip("192.168.71.1"), ip("fd71::1"), 0));
        assert!(same_prefix(ip("10.0.0.1"), ip("11.0.0.1"), 0));
        assert!(!same_prefix(ip("10.0.0.1"), ip("10.0.0.2"), 32));
    }

    #[test]
    fn a_vtep_mac_is_unicast_local_and_follows_the_address() {
        let a = Vtep::for_address("192.168.71.1".parse().unwrap());
        assert_eq!(a.mac.to_string(), "0e:78:c0:a8:47:01");
        assert_eq!(a.mac.0[0] & 0x03, 0x02, "locally administered unicast");
        let b = Vtep::for_address("fd71::1".parse().unwrap());
        assert_eq!(b.mac.0[..2], [0x0e, 0x79]);
        assert_ne!(b.mac, Vtep::for_address("fd71::2".parse().unwrap()).mac);
        assert_eq!(Vtep::from_annotation(&a.to_annotation()).unwrap(), a);
        assert_eq!(
            tunnel_gateway("fd82:1::".parse().unwrap(), a.mac).to_string(),
            "fe80::c78:c0ff:fea8:4701"
        );
        assert_eq!(
            tunnel_gateway("10.82.1.0".parse().unwrap(), a.mac).to_string(),
            "10.82.1.0"
        );
        assert!(Vtep::from_annotation(r#"{"address":"x","mac":"0e:78:c0:a8:47:01"}"#).is_err());
        assert!(Vtep::from_annotation(r#"{"address":"10.0.0.1","mac":"0e"}"#).is_err());
    }
}
