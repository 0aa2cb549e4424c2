//! The `#[repr(C)]` twins of the NetworkPolicy structs of `include/xdpcni.h`
//! (lib/policy.h's maps), with their compile-time layout checks.

use std::net::IpAddr;

use super::{c_layout, family_addr};

/// `endpoint_info.flags`: set with `EP_KERNEL_ONLY` on a pod whose policies
/// the programs enforce (its verdicts are in the `pol_*` maps).
pub const EP_POLICY: u32 = c_layout::XDPCNI_EP_POLICY;
/// Capacity of `pol_pods` (addresses of pods with verdicts).
pub const MAX_POL_PODS: u32 = c_layout::XDPCNI_MAX_POL_PODS;
/// Capacity of `pol_peers` (peer prefixes).
pub const MAX_POL_PEERS: u32 = c_layout::XDPCNI_MAX_POL_PEERS;
/// Capacity of `pol_ports` (port prefixes).
pub const MAX_POL_PORTS: u32 = c_layout::XDPCNI_MAX_POL_PORTS;
/// Capacity of `pol_named` (egress named ports).
pub const MAX_POL_NAMED: u32 = c_layout::XDPCNI_MAX_POL_NAMED;
/// Capacity of `pol_flows` (LRU).
pub const MAX_POL_FLOWS: u32 = c_layout::XDPCNI_MAX_POL_FLOWS;
/// Rule groups per pod and direction: the bits of a mask.
pub const POL_MAX_GROUPS: u32 = c_layout::XDPCNI_POL_MAX_GROUPS;
/// Index of the ingress direction.
pub const POL_INGRESS: u8 = c_layout::XDPCNI_POL_INGRESS as u8;
/// Index of the egress direction.
pub const POL_EGRESS: u8 = c_layout::XDPCNI_POL_EGRESS as u8;
/// `pol_pod.flags`: isolated for ingress.
pub const POL_ISOLATED_IN: u32 = c_layout::XDPCNI_POL_ISOLATED_IN;
/// `pol_pod.flags`: isolated for egress.
pub const POL_ISOLATED_OUT: u32 = c_layout::XDPCNI_POL_ISOLATED_OUT;
/// `pol_pod.flags`: `pol_named` holds egress ports of its id.
pub const POL_NAMED_OUT: u32 = c_layout::XDPCNI_POL_NAMED_OUT;
/// Bits of a [`PolPeerKey`] before the address.
pub const POL_PEER_FIXED_BITS: u32 = c_layout::XDPCNI_POL_PEER_FIXED_BITS;
/// Bits of a [`PolPortKey`] before the port.
pub const POL_PORT_FIXED_BITS: u32 = c_layout::XDPCNI_POL_PORT_FIXED_BITS;
/// `pol_stats` rows: new flows allowed, packets of recorded flows, flows
/// allowed again under new verdicts, packets refused, packets left to the
/// kernel's rules; how many rows.
pub const POL_NEW: u32 = c_layout::XDPCNI_POL_NEW;
/// See [`POL_NEW`].
pub const POL_HIT: u32 = c_layout::XDPCNI_POL_HIT;
/// See [`POL_NEW`].
pub const POL_RECHECK: u32 = c_layout::XDPCNI_POL_RECHECK;
/// See [`POL_NEW`].
pub const POL_REFUSED: u32 = c_layout::XDPCNI_POL_REFUSED;
/// See [`POL_NEW`].
pub const POL_KERNEL: u32 = c_layout::XDPCNI_POL_KERNEL;
/// See [`POL_NEW`].
pub const POL_STATS: u32 = c_layout::XDPCNI_POL_STATS;

/// `struct pol_pod_key`: a pod address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolPodKey {
    /// IPv4 in the first 4 bytes, the rest 0.
    pub addr: [u8; 16],
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// Written as 0.
    pub pad: [u8; 3],
}

impl PolPodKey {
    /// The key of `ip`.
    pub fn of(ip: IpAddr) -> Self {
        let (family, addr) = family_addr(ip);
        Self {
            addr,
            family,
            pad: [0; 3],
        }
    }
}

/// `struct pol_pod`: a pod's verdicts: their id and the group masks that
/// need no lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolPod {
    /// The id its entries are keyed by.
    pub id: u32,
    /// `POL_ISOLATED_IN`, `POL_ISOLATED_OUT`, `POL_NAMED_OUT`.
    pub flags: u32,
    /// Groups allowing every peer, by direction.
    pub any_peer: [u64; 2],
    /// Groups allowing every port and protocol, by direction.
    pub any_port: [u64; 2],
    /// CLOCK_MONOTONIC ns until which a new UDP flow is checked both ways.
    pub window_until: u64,
}

/// `struct pol_peer_key` after its `prefixlen`: (id, direction, family,
/// peer prefix). aya's `lpm_trie::Key` puts the prefix length in front.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolPeerKey {
    /// The pod's verdicts' id.
    pub id: u32,
    /// `POL_INGRESS` or `POL_EGRESS`.
    pub dir: u8,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// Written as 0.
    pub pad: [u8; 2],
    /// The prefix's address (IPv4 in the first 4 bytes).
    pub addr: [u8; 16],
}

/// `struct pol_port_key` after its `prefixlen`: (id, direction, protocol,
/// port prefix). aya's `lpm_trie::Key` puts the prefix length in front.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolPortKey {
    /// The pod's verdicts' id.
    pub id: u32,
    /// `POL_INGRESS` or `POL_EGRESS`.
    pub dir: u8,
    /// IPPROTO_TCP, IPPROTO_UDP.
    pub proto: u8,
    /// Network order.
    pub port: u16,
}

/// `struct pol_named_key`: an egress destination's named port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolNamedKey {
    /// The pod's verdicts' id.
    pub id: u32,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// IPPROTO_TCP, IPPROTO_UDP.
    pub proto: u8,
    /// Network order.
    pub port: u16,
    /// The destination pod's address.
    pub addr: [u8; 16],
}

/// `struct pol_flow_key`: a flow, its lower end first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolFlowKey {
    /// The lower address.
    pub lo: [u8; 16],
    /// The higher one.
    pub hi: [u8; 16],
    /// The lower end's port (network order).
    pub lo_port: u16,
    /// The higher end's.
    pub hi_port: u16,
    /// Its protocol.
    pub proto: u8,
    /// Its family.
    pub family: u8,
    /// Written as 0.
    pub pad: [u8; 2],
}

/// `struct pol_flow`: a flow the policies allowed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolFlow {
    /// The generation it was last allowed under.
    pub generation: u64,
    /// Its last packet (CLOCK_MONOTONIC_COARSE ns).
    pub last_ns: u64,
    /// 1: it began from `lo`.
    pub orig_lo: u8,
    /// `XDPCNI_POL_REPLIED`, `_FIN`, `_RST`.
    pub state: u8,
    /// Written as 0.
    pub pad: [u8; 6],
}

/// `struct pol_state`: the verdicts' generation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolState {
    /// Bumped after each change of the verdicts.
    pub generation: u64,
}

// SAFETY: plain old data, #[repr(C)] twins of the C structs, every byte a
// named field (no implicit padding: checked below).
unsafe impl aya::Pod for PolPodKey {}
// SAFETY: as above.
unsafe impl aya::Pod for PolPod {}
// SAFETY: as above.
unsafe impl aya::Pod for PolPeerKey {}
// SAFETY: as above.
unsafe impl aya::Pod for PolPortKey {}
// SAFETY: as above.
unsafe impl aya::Pod for PolNamedKey {}
// SAFETY: as above.
unsafe impl aya::Pod for PolFlowKey {}
// SAFETY: as above.
unsafe impl aya::Pod for PolFlow {}
// SAFETY: as above.
unsafe impl aya::Pod for PolState {}

mod layout_checks {
    use super::{c_layout as c, *};
    use std::mem::{offset_of, size_of};

    macro_rules! twin {
        ($t:ty, $size:ident, $($f:ident => $off:ident),+) => {
            const _: () = assert!(size_of::<$t>() == c::$size);
            $(const _: () = assert!(offset_of!($t, $f) == c::$off);)+
        };
    }
    twin!(PolPodKey, SIZEOF_pol_pod_key, addr => OFFSETOF_pol_pod_key_addr,
        family => OFFSETOF_pol_pod_key_family, pad => OFFSETOF_pol_pod_key_pad);
    twin!(PolPod, SIZEOF_pol_pod, id => OFFSETOF_pol_pod_id, flags => OFFSETOF_pol_pod_flags,
        any_peer => OFFSETOF_pol_pod_any_peer, any_port => OFFSETOF_pol_pod_any_port,
        window_until => OFFSETOF_pol_pod_window_until);
    // The LPM keys without their prefixlen (4 bytes, first): aya adds it.
    macro_rules! lpm_twin {
        ($t:ty, $size:ident, $($f:ident => $off:ident),+) => {
            const _: () = assert!(size_of::<$t>() + 4 == c::$size);
            $(const _: () = assert!(offset_of!($t, $f) + 4 == c::$off);)+
        };
    }
    const _: () = assert!(c::OFFSETOF_pol_peer_key_prefixlen == 0);
    const _: () = assert!(c::OFFSETOF_pol_port_key_prefixlen == 0);
    lpm_twin!(PolPeerKey, SIZEOF_pol_peer_key, id => OFFSETOF_pol_peer_key_id,
        dir => OFFSETOF_pol_peer_key_dir, family => OFFSETOF_pol_peer_key_family,
        pad => OFFSETOF_pol_peer_key_pad, addr => OFFSETOF_pol_peer_key_addr);
    lpm_twin!(PolPortKey, SIZEOF_pol_port_key, id => OFFSETOF_pol_port_key_id,
        dir => OFFSETOF_pol_port_key_dir, proto => OFFSETOF_pol_port_key_proto,
        port => OFFSETOF_pol_port_key_port);
    twin!(PolNamedKey, SIZEOF_pol_named_key, id => OFFSETOF_pol_named_key_id,
        family => OFFSETOF_pol_named_key_family, proto => OFFSETOF_pol_named_key_proto,
        port => OFFSETOF_pol_named_key_port, addr => OFFSETOF_pol_named_key_addr);
    twin!(PolFlowKey, SIZEOF_pol_flow_key, lo => OFFSETOF_pol_flow_key_lo,
        hi => OFFSETOF_pol_flow_key_hi, lo_port => OFFSETOF_pol_flow_key_lo_port,
        hi_port => OFFSETOF_pol_flow_key_hi_port, proto => OFFSETOF_pol_flow_key_proto,
        family => OFFSETOF_pol_flow_key_family, pad => OFFSETOF_pol_flow_key_pad);
    twin!(PolFlow, SIZEOF_pol_flow, generation => OFFSETOF_pol_flow_generation,
        last_ns => OFFSETOF_pol_flow_last_ns, orig_lo => OFFSETOF_pol_flow_orig_lo,
        state => OFFSETOF_pol_flow_state, pad => OFFSETOF_pol_flow_pad);
    twin!(PolState, SIZEOF_pol_state, generation => OFFSETOF_pol_state_generation);
    // No implicit padding: the fields fill each struct.
    const _: () = assert!(size_of::<PolPodKey>() == 20);
    const _: () = assert!(size_of::<PolPod>() == 48);
    const _: () = assert!(size_of::<PolPeerKey>() == 24);
    const _: () = assert!(size_of::<PolPortKey>() == 8);
    const _: () = assert!(size_of::<PolNamedKey>() == 24);
    const _: () = assert!(size_of::<PolFlowKey>() == 40);
    const _: () = assert!(size_of::<PolFlow>() == 24);
    const _: () = assert!(POL_MAX_GROUPS == u64::BITS);
}
