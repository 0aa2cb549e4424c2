//! The `#[repr(C)]` twins of the structs of the fast path between nodes
//! (`include/xdpcni.h`, node.bpf.c's `remote_nets`), with their
//! compile-time layout checks.

use std::net::IpAddr;

use super::{c_layout, family_addr, ip_of};

/// Capacity of `remote_nets` (other nodes' pod CIDRs).
pub const MAX_REMOTE_NETS: u32 = c_layout::XDPCNI_MAX_REMOTE_NETS;
/// Bits of a [`RemoteKey`] before the address.
pub const REMOTE_FIXED_BITS: u32 = c_layout::XDPCNI_REMOTE_FIXED_BITS;
/// `remote_net.via`: `bpf_redirect_neigh` to the gateway out of the
/// route's device (the uplink for host-gateway, the VXLAN device for the
/// tunnel).
pub const VIA_GATEWAY: u32 = c_layout::XDPCNI_VIA_GATEWAY;

/// `struct remote_key` without its prefixlen (aya's LPM `Key` adds it):
/// another node's pod CIDR.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteKey {
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// Written as 0.
    pub pad: [u8; 3],
    /// IPv4 in the first 4 bytes, the rest 0.
    pub addr: [u8; 16],
}

impl RemoteKey {
    /// The key of the CIDR at `ip`.
    pub fn new(ip: IpAddr) -> Self {
        let (family, addr) = family_addr(ip);
        Self {
            family,
            pad: [0; 3],
            addr,
        }
    }

    /// Its address.
    pub fn ip(&self) -> Option<IpAddr> {
        ip_of(self.family, self.addr)
    }
}

// SAFETY: repr(C), only integer fields, no implicit padding (checked below).
unsafe impl aya::Pod for RemoteKey {}

/// `struct remote_net`: how the route of another node's pod CIDR leaves.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteNet {
    /// The device the route leaves by.
    pub ifindex: u32,
    /// `VIA_*`.
    pub via: u32,
    /// The largest IP packet that path carries.
    pub mtu: u32,
    /// `FAMILY_*` of `nexthop`.
    pub nh_family: u8,
    /// Written as 0.
    pub pad: [u8; 3],
    /// The route's gateway.
    pub nexthop: [u8; 16],
}

impl RemoteNet {
    /// A route out of `ifindex` (MTU `mtu`) via `gateway`: the uplink and
    /// the peer's InternalIP, or the VXLAN device and the CIDR's tunnel
    /// gateway.
    pub fn gateway(ifindex: u32, mtu: u32, gateway: IpAddr) -> Self {
        let (nh_family, nexthop) = family_addr(gateway);
        Self {
            ifindex,
            via: VIA_GATEWAY,
            mtu,
            nh_family,
            pad: [0; 3],
            nexthop,
        }
    }

    /// Its next hop.
    pub fn nexthop(&self) -> Option<IpAddr> {
        ip_of(self.nh_family, self.nexthop)
    }
}

// SAFETY: as above.
unsafe impl aya::Pod for RemoteNet {}

mod layout_checks {
    use super::{c_layout as c, *};
    use std::mem::{offset_of, size_of};

    // The LPM key without its prefixlen (4 bytes, first): aya adds it.
    const _: () = assert!(c::OFFSETOF_remote_key_prefixlen == 0);
    const _: () = assert!(size_of::<RemoteKey>() + 4 == c::SIZEOF_remote_key);
    const _: () = assert!(offset_of!(RemoteKey, family) + 4 == c::OFFSETOF_remote_key_family);
    const _: () = assert!(offset_of!(RemoteKey, pad) + 4 == c::OFFSETOF_remote_key_pad);
    const _: () = assert!(offset_of!(RemoteKey, addr) + 4 == c::OFFSETOF_remote_key_addr);
    const _: () = assert!(size_of::<RemoteNet>() == c::SIZEOF_remote_net);
    const _: () = assert!(offset_of!(RemoteNet, ifindex) == c::OFFSETOF_remote_net_ifindex);
    const _: () = assert!(offset_of!(RemoteNet, via) == c::OFFSETOF_remote_net_via);
    const _: () = assert!(offset_of!(RemoteNet, mtu) == c::OFFSETOF_remote_net_mtu);
    const _: () = assert!(offset_of!(RemoteNet, nh_family) == c::OFFSETOF_remote_net_nh_family);
    const _: () = assert!(offset_of!(RemoteNet, pad) == c::OFFSETOF_remote_net_pad);
    const _: () = assert!(offset_of!(RemoteNet, nexthop) == c::OFFSETOF_remote_net_nexthop);
    // No implicit padding.
    const _: () = assert!(size_of::<RemoteKey>() == 20);
    const _: () = assert!(size_of::<RemoteNet>() == 32);
    const _: () = assert!(REMOTE_FIXED_BITS == 32);
}
