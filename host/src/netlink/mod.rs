//! Synchronous rtnetlink: one socket per network namespace, typed verbs for
//! what the plugin and the agent do (veth pairs, addresses, routes,
//! neighbours, the VXLAN device and its FDB), over the product's one netlink
//! socket ([`Socket`], which netfilter's verbs use too).
//!
//! A netlink socket talks to the namespace of the thread that created it, so
//! to configure a pod, create the socket on a thread inside the pod's
//! namespace (see [`xdpcni_host::netns::in_netns`]). The plugin is synchronous on
//! purpose: it is exec'd per call and must answer in milliseconds.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsRawFd, BorrowedFd},
};

use netlink_packet_core::{Nla, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage, State},
    neighbour::{
        NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
    },
    route::{RouteAddress, RouteType},
    AddressFamily, RouteNetlinkMessage,
};
use netlink_sys::protocols::NETLINK_ROUTE;

mod route;
mod socket;
pub use socket::{errno, Announcements, Socket};

/// The kernel's announcements of address and route changes in the calling
/// thread's network namespace, both families: what a node's addresses and
/// the sources routed from them follow.
pub fn address_and_route_announcements() -> Result<Announcements> {
    Announcements::open(
        NETLINK_ROUTE,
        &[
            libc::RTNLGRP_IPV4_IFADDR,
            libc::RTNLGRP_IPV6_IFADDR,
            libc::RTNLGRP_IPV4_ROUTE,
            libc::RTNLGRP_IPV6_ROUTE,
        ],
    )
    .map_err(|e| NetlinkError::Kernel {
        op: "subscribing to address and route announcements".into(),
        source: e,
    })
}

/// `IFLA_HEADROOM`: reported in dumps; the kernel refuses it in RTM_SETLINK
/// for veth on the kernels we know (see README).
const IFLA_HEADROOM: u16 = 68;

/// A netlink failure.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The kernel answered with an error.
    #[error("{op}: {source}")]
    Kernel {
        /// The request.
        op: String,
        /// errno as an io::Error.
        source: io::Error,
    },
    /// The socket failed or the answer could not be decoded.
    #[error("{op}: {msg}")]
    Protocol {
        /// The request.
        op: String,
        /// What went wrong.
        msg: String,
    },
}

impl NetlinkError {
    /// The errno of a kernel error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Kernel { source, .. } => source.raw_os_error(),
            Self::Protocol { .. } => None,
        }
    }

    /// Whether the object did not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(
            self.errno(),
            Some(libc::ENODEV | libc::ENOENT | libc::ESRCH)
        )
    }
}

type Result<T> = std::result::Result<T, NetlinkError>;

/// What the plugin needs to know of a link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Name.
    pub name: String,
    /// MAC address.
    pub mac: [u8; 6],
    /// MTU.
    pub mtu: u32,
    /// Administratively up.
    pub up: bool,
    /// Operationally up (`IFLA_OPERSTATE`): the kernel's link watch has
    /// seen its carrier, and with it given the device its queueing
    /// discipline (until then it drops what it is asked to send).
    pub oper_up: bool,
    /// `IFLA_HEADROOM` as reported by the kernel, if it reports it.
    pub headroom: Option<u16>,
    /// Link kind (`veth`, ...), if any.
    pub kind: Option<String>,
    /// Ifindex of the peer (`IFLA_LINK`), for veth.
    pub peer_index: Option<u32>,
}

/// A route-netlink socket bound to the calling thread's network namespace,
/// with typed verbs.
pub struct Netlink {
    socket: Socket<RouteNetlinkMessage>,
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace.
    pub fn new() -> Result<Self> {
        let socket = Socket::open(NETLINK_ROUTE).map_err(|e| NetlinkError::Protocol {
            op: "opening a netlink socket".into(),
            msg: e.to_string(),
        })?;
        Ok(Self { socket })
    }

    /// Sends `msg` with `flags` and collects its answers (see
    /// [`Socket::request`]); a failure names `op`.
    fn request(
        &mut self,
        op: &str,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<RouteNetlinkMessage>> {
        self.socket
            .request(msg, flags)
            .map_err(|e| match e.raw_os_error() {
                Some(_) => NetlinkError::Kernel {
                    op: op.to_string(),
                    source: e,
                },
                None => NetlinkError::Protocol {
                    op: op.to_string(),
                    msg: e.to_string(),
                },
            })
    }

    /// The one answer to GET request `msg` (built with netlink-packet-route
    /// or rtnetlink's message builders), `None` when the object does not
    /// exist; a failure names `op`.
    pub fn get(
        &mut self,
        op: &str,
        msg: RouteNetlinkMessage,
    ) -> Result<Option<RouteNetlinkMessage>> {
        match self.request(op, msg, 0) {
            Ok(msgs) => Ok(msgs.into_iter().next()),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every object dump request `msg` lists.
    pub fn dump(&mut self, op: &str, msg: RouteNetlinkMessage) -> Result<Vec<RouteNetlinkMessage>> {
        self.request(op, msg, NLM_F_DUMP)
    }

    /// Creates the object of NEW request `msg`; it must not exist yet.
    pub fn create(&mut self, op: &str, msg: RouteNetlinkMessage) -> Result<()> {
        self.request(op, msg, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
            .map(drop)
    }

    /// Creates the object of NEW request `msg`, or replaces the one there
    /// in one step.
    pub fn replace(&mut self, op: &str, msg: RouteNetlinkMessage) -> Result<()> {
        self.request(op, msg, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE)
            .map(drop)
    }

    /// Changes an object as SET request `msg` says.
    pub fn change(&mut self, op: &str, msg: RouteNetlinkMessage) -> Result<()> {
        self.request(op, msg, NLM_F_ACK).map(drop)
    }

    /// Deletes the object of DEL request `msg`; `Ok(false)` if it did not
    /// exist.
    pub fn delete(&mut self, op: &str, msg: RouteNetlinkMessage) -> Result<bool> {
        match self.request(op, msg, NLM_F_ACK) {
            Ok(_) => Ok(true),
            Err(e) if e.is_not_found() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates a veth pair: `host` here, `peer` directly inside the
    /// namespace `peer_netns` (an open netns file), both with `mtu`.
    pub fn create_veth(
        &mut self,
        host: &str,
        peer: &str,
        peer_netns: BorrowedFd<'_>,
        mtu: u32,
    ) -> Result<()> {
        let mut peer_msg = LinkMessage::default();
        peer_msg
            .attributes
            .push(LinkAttribute::IfName(peer.to_string()));
        peer_msg.attributes.push(LinkAttribute::Mtu(mtu));
        peer_msg
            .attributes
            .push(LinkAttribute::NetNsFd(peer_netns.as_raw_fd()));
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(host.to_string()));
        msg.attributes.push(LinkAttribute::Mtu(mtu));
        msg.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_msg))),
        ]));
        self.request(
            &format!("creating veth {host} (peer {peer})"),
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// The link named `name`, or `None`.
    pub fn link_by_name(&mut self, name: &str) -> Result<Option<Link>> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        self.get_link(&format!("looking up link {name}"), msg)
    }

    /// The link with ifindex `index`, or `None`.
    pub fn link_by_index(&mut self, index: u32) -> Result<Option<Link>> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        self.get_link(&format!("looking up link {index}"), msg)
    }

    fn get_link(&mut self, op: &str, msg: LinkMessage) -> Result<Option<Link>> {
        Ok(match self.get(op, RouteNetlinkMessage::GetLink(msg))? {
            Some(RouteNetlinkMessage::NewLink(l)) => Some(parse_link(&l)),
            _ => None,
        })
    }

    fn set_link(&mut self, op: &str, index: u32, f: impl FnOnce(&mut LinkMessage)) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        f(&mut msg);
        self.request(op, RouteNetlinkMessage::SetLink(msg), NLM_F_ACK)
            .map(drop)
    }

    /// Sets the link administratively up.
    pub fn set_up(&mut self, index: u32) -> Result<()> {
        self.set_link(&format!("setting link {index} up"), index, |m| {
            m.header.flags = LinkFlags::Up;
            m.header.change_mask = LinkFlags::Up;
        })
    }

    /// Asks for `headroom` bytes of headroom through `IFLA_HEADROOM`.
    pub fn set_headroom(&mut self, index: u32, headroom: u16) -> Result<()> {
        self.set_link(&format!("setting headroom of link {index}"), index, |m| {
            m.attributes
                .push(LinkAttribute::Other(netlink_packet_core::DefaultNla::new(
                    IFLA_HEADROOM,
                    headroom.to_ne_bytes().to_vec(),
                )));
        })
    }

    /// Deletes the link; `Ok(false)` if it did not exist.
    pub fn del_link(&mut self, index: u32) -> Result<bool> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        self.delete(
            &format!("deleting link {index}"),
            RouteNetlinkMessage::DelLink(msg),
        )
    }

    /// Adds `addr/prefix` to the link (IPv6 without DAD: the address is
    /// unique by IPAM, and DAD would delay the pod's first packets).
    pub fn add_address(&mut self, index: u32, addr: IpAddr, prefix: u8) -> Result<()> {
        let mut msg = AddressMessage::default();
        msg.header.index = index;
        msg.header.prefix_len = prefix;
        msg.header.family = family(addr);
        msg.attributes.push(AddressAttribute::Local(addr));
        msg.attributes.push(AddressAttribute::Address(addr));
        if addr.is_ipv6() {
            msg.attributes.push(AddressAttribute::Flags(
                netlink_packet_route::address::AddressFlags::Nodad,
            ));
        }
        self.request(
            &format!("adding address {addr}/{prefix}"),
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .map(drop)
    }

    /// The addresses of link `index` as (address, prefix length).
    pub fn addresses(&mut self, index: u32) -> Result<Vec<(IpAddr, u8)>> {
        Ok(self
            .all_addresses()?
            .into_iter()
            .filter(|a| a.0 == index)
            .map(|a| (a.1, a.2))
            .collect())
    }

    /// Every address of the namespace as (link index, address, prefix length).
    pub fn all_addresses(&mut self) -> Result<Vec<(u32, IpAddr, u8)>> {
        let msgs = self.request(
            "listing addresses",
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            NLM_F_DUMP,
        )?;
        let mut out = Vec::new();
        for m in msgs {
            if let RouteNetlinkMessage::NewAddress(a) = m {
                for attr in &a.attributes {
                    if let AddressAttribute::Address(ip) = attr {
                        out.push((a.header.index, *ip, a.header.prefix_len));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The link holding address `ip`, if one does.
    pub fn link_with_address(&mut self, ip: IpAddr) -> Result<Option<Link>> {
        let msgs = self.request(
            "listing addresses",
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            NLM_F_DUMP,
        )?;
        let index = msgs.iter().find_map(|m| match m {
            RouteNetlinkMessage::NewAddress(a)
                if a.attributes
                    .iter()
                    .any(|at| matches!(at, AddressAttribute::Address(x) if *x == ip)) =>
            {
                Some(a.header.index)
            }
            _ => None,
        });
        match index {
            Some(i) => self.link_by_index(i),
            None => Ok(None),
        }
    }

    /// Adds a permanent neighbour entry `ip -> mac` on link `index`.
    pub fn add_permanent_neighbour(&mut self, index: u32, ip: IpAddr, mac: [u8; 6]) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = family(ip);
        msg.header.ifindex = index;
        msg.header.state = NeighbourState::Permanent;
        msg.header.kind = RouteType::Unicast;
        msg.attributes
            .push(NeighbourAttribute::Destination(neighbour_address(ip)));
        msg.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        self.replace(
            &format!("adding neighbour {ip} lladdr {}", mac_text(mac)),
            RouteNetlinkMessage::NewNeighbour(msg),
        )
    }

    /// Adds a permanent forwarding-database entry `mac -> dst` on link
    /// `index` (a VXLAN device: frames for `mac` go to the remote endpoint
    /// `dst`), as `bridge fdb replace <mac> dev <index> dst <dst> self`.
    pub fn add_fdb_entry(&mut self, index: u32, mac: [u8; 6], dst: IpAddr) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Bridge;
        msg.header.ifindex = index;
        msg.header.state = NeighbourState::Permanent;
        msg.header.flags = NeighbourFlags::Own;
        msg.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        msg.attributes
            .push(NeighbourAttribute::Destination(neighbour_address(dst)));
        self.replace(
            &format!("adding FDB entry {} dst {dst}", mac_text(mac)),
            RouteNetlinkMessage::NewNeighbour(msg),
        )
    }
}

fn neighbour_address(ip: IpAddr) -> NeighbourAddress {
    match ip {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }
}

fn family(ip: IpAddr) -> AddressFamily {
    if ip.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    }
}

fn route_addr(ip: IpAddr) -> RouteAddress {
    match ip {
        IpAddr::V4(v4) => RouteAddress::Inet(v4),
        IpAddr::V6(v6) => RouteAddress::Inet6(v6),
    }
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The address of a route attribute (destination, gateway), if IPv4 or IPv6.
pub fn ip_of(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn parse_link(l: &LinkMessage) -> Link {
    let mut link = Link {
        index: l.header.index,
        name: String::new(),
        mac: [0; 6],
        mtu: 0,
        up: l.header.flags.contains(LinkFlags::Up),
        oper_up: false,
        headroom: None,
        kind: None,
        peer_index: None,
    };
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Address(m) if m.len() == 6 => link.mac.copy_from_slice(m),
            LinkAttribute::Mtu(m) => link.mtu = *m,
            LinkAttribute::OperState(st) => link.oper_up = *st == State::Up,
            LinkAttribute::Link(p) => link.peer_index = Some(*p),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        link.kind = Some(k.to_string());
                    }
                }
            }
            LinkAttribute::Other(nla) if nla.kind() == IFLA_HEADROOM => {
                let mut val = vec![0u8; nla.value_len()];
                nla.emit_value(&mut val);
                if let [a, b, ..] = val[..] {
                    link.headroom = Some(u16::from_ne_bytes([a, b]));
                }
            }
            _ => {}
        }
    }
    link
}
