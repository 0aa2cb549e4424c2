//! The VXLAN device the agent owns: found, made or changed to what the
//! routing asks, and removed.

use std::net::IpAddr;

use ipnet::IpNet;
use rtnetlink::{
    packet_route::{
        link::{InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkInfo, LinkMessage},
        RouteNetlinkMessage,
    },
    LinkMessageBuilder, LinkUnspec, LinkVxlan,
};
use xdpcni_host::{
    netlink::{Netlink, NetlinkError},
    overlay::{MacAddr, Underlay, Vtep, DEVICE},
};

use super::{sync::mac_of, RouteError};
use crate::config::Routing;

/// The VXLAN device as the kernel has it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DeviceState {
    index: u32,
    vni: Option<u32>,
    port: Option<u16>,
    local: Option<IpAddr>,
    link: Option<u32>,
    mac: Option<MacAddr>,
    mtu: Option<u32>,
}

fn device_state(m: &LinkMessage) -> DeviceState {
    let mut s = DeviceState {
        index: m.header.index,
        vni: None,
        port: None,
        local: None,
        link: None,
        mac: None,
        mtu: None,
    };
    for a in &m.attributes {
        match a {
            LinkAttribute::Address(l) => s.mac = mac_of(l),
            LinkAttribute::Mtu(v) => s.mtu = Some(*v),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Data(InfoData::Vxlan(attrs)) = i {
                        for x in attrs {
                            match x {
                                InfoVxlan::Id(v) => s.vni = Some(*v),
                                InfoVxlan::Port(p) => s.port = Some(*p),
                                InfoVxlan::Local(a) => s.local = Some(IpAddr::V4(*a)),
                                InfoVxlan::Local6(a) => s.local = Some(IpAddr::V6(*a)),
                                InfoVxlan::Link(l) => s.link = Some(*l),
                                _ => {}
                            }
                        }
                    }
                    if let LinkInfo::Kind(k) = i {
                        if *k != InfoKind::Vxlan {
                            s.vni = None;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    s
}

fn find_device(nl: &mut Netlink) -> Result<Option<LinkMessage>, NetlinkError> {
    let mut get = LinkMessage::default();
    get.attributes
        .push(LinkAttribute::IfName(DEVICE.to_string()));
    Ok(
        match nl.get(
            &format!("looking up {DEVICE}"),
            RouteNetlinkMessage::GetLink(get),
        )? {
            Some(RouteNetlinkMessage::NewLink(m)) => Some(m),
            _ => None,
        },
    )
}

/// What [`ensure_device`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    /// Its ifindex.
    pub index: u32,
    /// Whether it was made (or made again) now.
    pub created: bool,
}

/// Makes the VXLAN device match `routing` over `underlay` with `vtep`: made
/// if missing, made again if its VNI, port, local address or lower link
/// differ, its MAC and MTU set, up, with this node's pod CIDRs' gateway
/// addresses (the source of the node's own packets to other nodes' pods,
/// so replies come back through the tunnel), transmit checksum offload as
/// the config says ([`xdpcni_host::overlay::DEFAULT_TX_CHECKSUM_OFFLOAD`]).
pub fn ensure_device(
    nl: &mut Netlink,
    routing: &Routing,
    underlay: &Underlay,
    vtep: &Vtep,
    own_cidrs: &[IpNet],
) -> Result<Device, RouteError> {
    let mtu = underlay.pod_mtu(routing.mode);
    let mut created = false;
    let mut state = find_device(nl)?.map(|m| device_state(&m));
    if let Some(s) = &state {
        let same = s.vni == Some(routing.vni)
            && s.port == Some(routing.port)
            && s.local == Some(vtep.address)
            && s.link == Some(underlay.link.index);
        if !same {
            nl.del_link(s.index)?;
            state = None;
        }
    }
    let index = match state {
        Some(s) => {
            if s.mac != Some(vtep.mac) || s.mtu != Some(mtu) {
                let set = LinkMessageBuilder::<LinkUnspec>::new()
                    .index(s.index)
                    .address(vtep.mac.0.to_vec())
                    .mtu(mtu)
                    .build();
                nl.change(
                    &format!("setting {DEVICE}'s MAC and MTU {mtu}"),
                    RouteNetlinkMessage::SetLink(set),
                )?;
            }
            s.index
        }
        None => {
            let b = LinkVxlan::new(DEVICE, routing.vni)
                .port(routing.port)
                .dev(underlay.link.index)
                .learning(false);
            let b = match vtep.address {
                IpAddr::V4(a) => b.local(a),
                IpAddr::V6(a) => b.local6(a),
            };
            nl.create(
                &format!(
                    "creating {DEVICE} (VNI {}, port {}, local {}, over {})",
                    routing.vni, routing.port, vtep.address, underlay.link.name
                ),
                RouteNetlinkMessage::NewLink(b.address(vtep.mac.0.to_vec()).mtu(mtu).build()),
            )?;
            created = true;
            find_device(nl)?
                .map(|m| m.header.index)
                .ok_or(RouteError::Vanished)?
        }
    };
    for cidr in own_cidrs {
        let host = if cidr.addr().is_ipv4() { 32 } else { 128 };
        nl.add_address(index, cidr.addr(), host)?;
    }
    nl.set_up(index)?;
    xdpcni_host::ethtool::ensure(
        DEVICE,
        xdpcni_host::ethtool::Offload::TxChecksum,
        routing.tx_checksum_offload,
    )
    .map_err(RouteError::Offload)?;
    Ok(Device { index, created })
}
