//! The VXLAN device the agent owns: found, made or changed to what the
//! routing asks, and removed.

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::{
    packet_route::link::{InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkInfo, LinkMessage},
    Handle, LinkMessageBuilder, LinkUnspec, LinkVxlan,
};
use xdpcni_host::overlay::{MacAddr, Underlay, Vtep, DEVICE};

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

async fn find_device(handle: &Handle) -> Result<Option<LinkMessage>, rtnetlink::Error> {
    let mut links = handle.link().get().match_name(DEVICE.to_string()).execute();
    match links.try_next().await {
        Ok(l) => Ok(l),
        Err(rtnetlink::Error::NetlinkError(m))
            if m.code.is_some_and(|c| -c.get() == libc::ENODEV) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The ifindex of the VXLAN device, if the node has one.
pub async fn device_index(handle: &Handle) -> Result<Option<u32>, rtnetlink::Error> {
    Ok(find_device(handle).await?.map(|m| m.header.index))
}

/// Removes the VXLAN device (its neighbours, FDB entries and routes go
/// with it): whether it was there.
pub async fn remove_device(handle: &Handle) -> Result<bool, rtnetlink::Error> {
    match find_device(handle).await? {
        Some(m) => {
            handle.link().del(m.header.index).execute().await?;
            Ok(true)
        }
        None => Ok(false),
    }
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
pub async fn ensure_device(
    handle: &Handle,
    routing: &Routing,
    underlay: &Underlay,
    vtep: &Vtep,
    own_cidrs: &[IpNet],
) -> Result<Device, RouteError> {
    let named = |op: String| move |source| RouteError::Request { op, source };
    let mtu = underlay.pod_mtu(routing.mode);
    let mut created = false;
    let mut state = find_device(handle).await?.map(|m| device_state(&m));
    if let Some(s) = &state {
        let same = s.vni == Some(routing.vni)
            && s.port == Some(routing.port)
            && s.local == Some(vtep.address)
            && s.link == Some(underlay.link.index);
        if !same {
            handle
                .link()
                .del(s.index)
                .execute()
                .await
                .map_err(named(format!("removing {DEVICE} made for other settings")))?;
            state = None;
        }
    }
    let index = match state {
        Some(s) => {
            if s.mac != Some(vtep.mac) || s.mtu != Some(mtu) {
                handle
                    .link()
                    .set(
                        LinkMessageBuilder::<LinkUnspec>::new()
                            .index(s.index)
                            .address(vtep.mac.0.to_vec())
                            .mtu(mtu)
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(named(format!("setting {DEVICE}'s MAC and MTU {mtu}")))?;
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
            handle
                .link()
                .add(b.address(vtep.mac.0.to_vec()).mtu(mtu).build())
                .execute()
                .await
                .map_err(named(format!(
                    "creating {DEVICE} (VNI {}, port {}, local {}, over {})",
                    routing.vni, routing.port, vtep.address, underlay.link.name
                )))?;
            created = true;
            find_device(handle)
                .await?
                .map(|m| m.header.index)
                .ok_or(RouteError::Netlink(rtnetlink::Error::RequestFailed))?
        }
    };
    for cidr in own_cidrs {
        let host = if cidr.addr().is_ipv4() { 32 } else { 128 };
        match handle
            .address()
            .add(index, cidr.addr(), host)
            .replace()
            .execute()
            .await
        {
            Ok(()) => {}
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.is_some_and(|c| -c.get() == libc::EEXIST) => {}
            Err(e) => {
                return Err(named(format!("adding {}/{host} to {DEVICE}", cidr.addr()))(
                    e,
                ))
            }
        }
    }
    handle
        .link()
        .set(
            LinkMessageBuilder::<LinkUnspec>::new()
                .index(index)
                .up()
                .build(),
        )
        .execute()
        .await
        .map_err(named(format!("setting {DEVICE} up")))?;
    xdpcni_host::ethtool::ensure(
        DEVICE,
        xdpcni_host::ethtool::Offload::TxChecksum,
        routing.tx_checksum_offload,
    )
    .map_err(RouteError::Offload)?;
    Ok(Device { index, created })
}
