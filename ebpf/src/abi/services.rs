//! The `#[repr(C)]` twins of the Service structs of `include/xdpcni.h`
//! (services.bpf.c's maps), with their compile-time layout checks.

use std::net::{IpAddr, SocketAddr};

use super::{c_layout, family_addr};

/// The Service maps' layout: their pin directory is `svc-layout-<N>`.
pub const SVC_LAYOUT: u32 = c_layout::XDPCNI_SVC_LAYOUT;
/// Capacity of `services` (frontends).
pub const MAX_SERVICES: u32 = c_layout::XDPCNI_MAX_SERVICES;
/// Capacity of `svc_slots` and `svc_backends` ((service, backend) pairs).
pub const MAX_SVC_BACKENDS: u32 = c_layout::XDPCNI_MAX_SVC_BACKENDS;
/// Capacity of `svc_netns` (pod network namespaces translated).
pub const MAX_SVC_NETNS: u32 = c_layout::XDPCNI_MAX_SVC_NETNS;
/// Capacity of `svc_own` ((pod namespace, its own address) pairs).
pub const MAX_SVC_OWN: u32 = c_layout::XDPCNI_MAX_SVC_OWN;
/// Backends one service chooses among, at most.
pub const SVC_MAX_CHOICES: u32 = c_layout::XDPCNI_SVC_MAX_CHOICES;
/// `svc_value.flags`: sessionAffinity ClientIP.
pub const SVC_AFFINITY: u32 = c_layout::XDPCNI_SVC_AFFINITY;
/// `svc_value.flags`: translated for the node's own sockets alone (a node
/// port, an external or LoadBalancer IP: kube-proxy masquerades a pod's
/// calls to them, which a pod's translated socket could not give).
pub const SVC_NODE_ONLY: u32 = c_layout::XDPCNI_SVC_NODE_ONLY;
/// `svc_value.flags`: an outside frontend under `externalTrafficPolicy:
/// Local` (the client's address kept, no masquerade).
pub const SVC_EXT_LOCAL: u32 = c_layout::XDPCNI_SVC_EXT_LOCAL;
/// The bit of `svc_addr.family` that keys a frontend outside clients reach
/// (north-south: a node port at a node address, an externalIP, a
/// LoadBalancer IP), beside the same address for the node's own sockets.
pub const SVC_OUTSIDE: u8 = c_layout::XDPCNI_SVC_OUTSIDE as u8;
/// Capacity of `svc_nat` (LRU: two entries per north-south flow).
pub const MAX_SVC_NAT: u32 = c_layout::XDPCNI_MAX_SVC_NAT;
/// `svc_nat_stats` rows: entries the programs made in `svc_nat`.
pub const NAT_MADE: u32 = c_layout::XDPCNI_NAT_MADE;
/// `svc_nat_stats` rows: new flows left to kube-proxy, no reply tuple free.
pub const NAT_NO_TUPLE: u32 = c_layout::XDPCNI_NAT_NO_TUPLE;
/// `svc_nat_stats` rows in all.
pub const NAT_STATS: u32 = c_layout::XDPCNI_NAT_STATS;
/// `svc_nat.flags`: the reply direction's entry.
pub const NAT_REPLY: u32 = c_layout::XDPCNI_NAT_REPLY;
/// `svc_nat.flags`: a flow to another node's backend (masqueraded, routed
/// by the kernel's FIB, its replies caught on an uplink).
pub const NAT_REMOTE: u32 = c_layout::XDPCNI_NAT_REMOTE;
/// `svc_netns` values: a pod's namespace.
pub const SVC_NS_POD: u32 = c_layout::XDPCNI_SVC_NS_POD;
/// `svc_netns` values: the node's own namespace (its translated calls take
/// kube-proxy's source address, `svc_node_src`).
pub const SVC_NS_NODE: u32 = c_layout::XDPCNI_SVC_NS_NODE;

/// `svc_stats` rows: calls translated to a backend chosen at the socket.
pub const SVC_TRANSLATED: u32 = c_layout::XDPCNI_SVC_TRANSLATED;
/// `svc_stats` rows: calls to a frontend with no ready backend (left to
/// kube-proxy, which refuses them).
pub const SVC_NO_BACKEND: u32 = c_layout::XDPCNI_SVC_NO_BACKEND;
/// `svc_stats` rows: calls left to kube-proxy for another reason.
pub const SVC_LEFT: u32 = c_layout::XDPCNI_SVC_LEFT;
/// `svc_stats` rows: calls left to kube-proxy because the writer's lease
/// ran out.
pub const SVC_EXPIRED: u32 = c_layout::XDPCNI_SVC_EXPIRED;
/// `svc_stats` rows.
pub const SVC_STATS: u32 = c_layout::XDPCNI_SVC_STATS;

/// `struct svc_addr`: a frontend or a backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcAddr {
    /// IPv4 in the first 4 bytes, the rest 0.
    pub addr: [u8; 16],
    /// Network byte order.
    pub port: u16,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// `IPPROTO_TCP` (6) or `IPPROTO_UDP` (17).
    pub proto: u8,
}

impl SvcAddr {
    /// `to` as the programs key it, for protocol number `proto`.
    pub fn new(to: SocketAddr, proto: u8) -> Self {
        let (family, addr) = family_addr(to.ip());
        Self {
            addr,
            port: to.port().to_be(),
            family,
            proto,
        }
    }

    /// `to` as the node device's program keys a frontend outside clients
    /// reach ([`SVC_OUTSIDE`]).
    pub fn outside(to: SocketAddr, proto: u8) -> Self {
        let mut a = Self::new(to, proto);
        a.family |= SVC_OUTSIDE;
        a
    }

    /// Whether this is an outside frontend's key.
    pub fn is_outside(&self) -> bool {
        self.family & SVC_OUTSIDE != 0
    }

    /// The address (without [`SVC_OUTSIDE`]); `None` for an unknown family.
    pub fn ip(&self) -> Option<IpAddr> {
        super::ip_of(self.family & !SVC_OUTSIDE, self.addr)
    }
}

/// `struct svc_value`: what a connect to a frontend chooses among.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcValue {
    /// The service's id: its backends are `svc_slots[(id, 0..count)]`.
    pub id: u32,
    /// Ready backends; 0 leaves the call to the kernel path.
    pub count: u32,
    /// [`SVC_AFFINITY`].
    pub flags: u32,
    /// Seconds, with [`SVC_AFFINITY`].
    pub affinity_timeout: u32,
}

/// `struct svc_slot_key`: (service id, index) -> backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcSlotKey {
    /// Service id.
    pub id: u32,
    /// 0 .. count.
    pub index: u32,
}

/// `struct svc_own_key`: one of a pod's own addresses, by its network
/// namespace (a backend that is the caller itself is kube-proxy's).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcOwnKey {
    /// The pod's network namespace cookie.
    pub netns: u64,
    /// IPv4 in the first 4 bytes, the rest 0.
    pub addr: [u8; 16],
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// Zero.
    pub pad: [u8; 7],
}

impl SvcOwnKey {
    /// Address `ip` of the pod whose namespace has cookie `netns`.
    pub fn new(netns: u64, ip: IpAddr) -> Self {
        let (family, addr) = family_addr(ip);
        Self {
            netns,
            addr,
            family,
            pad: [0; 7],
        }
    }
}

/// The data of `struct svc_range_key` (`svc_source_ranges`, an LPM trie:
/// aya's `Key` puts the prefix length before it): an outside frontend, then
/// a source address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcRangeKey {
    /// The frontend (an outside one: a LoadBalancer IP).
    pub fe: SvcAddr,
    /// The range's network address (IPv4 in the first 4 bytes), zero for
    /// the frontend's own entry.
    pub src: [u8; 16],
}

/// The bits of a [`SvcRangeKey`] its frontend takes: the prefix length of
/// the frontend's own entry.
pub const RANGE_FIXED_BITS: u32 = c_layout::XDPCNI_RANGE_FIXED_BITS;
/// Capacity of `svc_source_ranges`.
pub const MAX_SVC_RANGES: u32 = c_layout::XDPCNI_MAX_SVC_RANGES;

/// `struct svc_ip`: an address without a port (`svc_node_src`'s values:
/// the source a node's socket binds to).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcIp {
    /// IPv4 in the first 4 bytes, the rest 0.
    pub addr: [u8; 16],
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// Zero.
    pub pad: [u8; 3],
}

impl From<IpAddr> for SvcIp {
    fn from(ip: IpAddr) -> Self {
        let (family, addr) = family_addr(ip);
        Self {
            addr,
            family,
            pad: [0; 3],
        }
    }
}

/// `struct svc_revnat_key`: what a socket was translated to (the programs
/// write it; the agent reads it to find the sockets a gone backend leaves).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcRevnatKey {
    /// The socket's cookie.
    pub cookie: u64,
    /// The backend it was translated to.
    pub to: SvcAddr,
    /// Zero.
    pub pad: u32,
}

/// `struct svc_nat_key`: a north-south flow's packet as it is seen, in one
/// direction (the client's as it enters the node, the backend's reply as
/// its pod sends it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcNatKey {
    /// Source address (IPv4 in the first 4 bytes).
    pub saddr: [u8; 16],
    /// Destination address.
    pub daddr: [u8; 16],
    /// Network byte order.
    pub sport: u16,
    /// Network byte order.
    pub dport: u16,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Zero.
    pub pad: [u8; 2],
}

/// `struct svc_nat`: what a packet of that direction is given.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcNat {
    /// New source address.
    pub saddr: [u8; 16],
    /// New destination address.
    pub daddr: [u8; 16],
    /// Network byte order.
    pub sport: u16,
    /// Network byte order.
    pub dport: u16,
    /// The uplink the flow came in by.
    pub ifindex: u32,
    /// The backend's id (`svc_backends`).
    pub backend: u32,
    /// [`NAT_REPLY`], [`NAT_REMOTE`].
    pub flags: u32,
}

// SAFETY: #[repr(C)], only integer fields and arrays of them, no implicit
// padding (the layout checks below hold the sizes to the fields' sum).
unsafe impl aya::Pod for SvcAddr {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcValue {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcSlotKey {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcOwnKey {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcRevnatKey {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcIp {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcRangeKey {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcNatKey {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcNat {}

mod layout_checks {
    use super::{c_layout as c, *};
    use std::mem::{offset_of, size_of};

    const _: () = assert!(size_of::<SvcAddr>() == c::SIZEOF_svc_addr);
    const _: () = assert!(size_of::<SvcAddr>() == 16 + 2 + 1 + 1);
    const _: () = assert!(offset_of!(SvcAddr, addr) == c::OFFSETOF_svc_addr_addr);
    const _: () = assert!(offset_of!(SvcAddr, port) == c::OFFSETOF_svc_addr_port);
    const _: () = assert!(offset_of!(SvcAddr, family) == c::OFFSETOF_svc_addr_family);
    const _: () = assert!(offset_of!(SvcAddr, proto) == c::OFFSETOF_svc_addr_proto);

    const _: () = assert!(size_of::<SvcValue>() == c::SIZEOF_svc_value);
    const _: () = assert!(offset_of!(SvcValue, id) == c::OFFSETOF_svc_value_id);
    const _: () = assert!(offset_of!(SvcValue, count) == c::OFFSETOF_svc_value_count);
    const _: () = assert!(offset_of!(SvcValue, flags) == c::OFFSETOF_svc_value_flags);
    const _: () =
        assert!(offset_of!(SvcValue, affinity_timeout) == c::OFFSETOF_svc_value_affinity_timeout);

    const _: () = assert!(size_of::<SvcNatKey>() == c::SIZEOF_svc_nat_key);
    const _: () = assert!(size_of::<SvcNatKey>() == 16 + 16 + 2 + 2 + 1 + 1 + 2);
    const _: () = assert!(offset_of!(SvcNatKey, saddr) == c::OFFSETOF_svc_nat_key_saddr);
    const _: () = assert!(offset_of!(SvcNatKey, daddr) == c::OFFSETOF_svc_nat_key_daddr);
    const _: () = assert!(offset_of!(SvcNatKey, sport) == c::OFFSETOF_svc_nat_key_sport);
    const _: () = assert!(offset_of!(SvcNatKey, dport) == c::OFFSETOF_svc_nat_key_dport);
    const _: () = assert!(offset_of!(SvcNatKey, family) == c::OFFSETOF_svc_nat_key_family);
    const _: () = assert!(offset_of!(SvcNatKey, proto) == c::OFFSETOF_svc_nat_key_proto);
    const _: () = assert!(offset_of!(SvcNatKey, pad) == c::OFFSETOF_svc_nat_key_pad);

    const _: () = assert!(size_of::<SvcNat>() == c::SIZEOF_svc_nat);
    const _: () = assert!(size_of::<SvcNat>() == 16 + 16 + 2 + 2 + 4 + 4 + 4);
    const _: () = assert!(offset_of!(SvcNat, saddr) == c::OFFSETOF_svc_nat_saddr);
    const _: () = assert!(offset_of!(SvcNat, daddr) == c::OFFSETOF_svc_nat_daddr);
    const _: () = assert!(offset_of!(SvcNat, sport) == c::OFFSETOF_svc_nat_sport);
    const _: () = assert!(offset_of!(SvcNat, dport) == c::OFFSETOF_svc_nat_dport);
    const _: () = assert!(offset_of!(SvcNat, ifindex) == c::OFFSETOF_svc_nat_ifindex);
    const _: () = assert!(offset_of!(SvcNat, backend) == c::OFFSETOF_svc_nat_backend);
    const _: () = assert!(offset_of!(SvcNat, flags) == c::OFFSETOF_svc_nat_flags);

    const _: () = assert!(size_of::<SvcSlotKey>() == c::SIZEOF_svc_slot_key);
    const _: () = assert!(offset_of!(SvcSlotKey, id) == c::OFFSETOF_svc_slot_key_id);
    const _: () = assert!(offset_of!(SvcSlotKey, index) == c::OFFSETOF_svc_slot_key_index);

    const _: () = assert!(size_of::<SvcOwnKey>() == c::SIZEOF_svc_own_key);
    const _: () = assert!(size_of::<SvcOwnKey>() == 8 + 16 + 1 + 7);
    const _: () = assert!(offset_of!(SvcOwnKey, netns) == c::OFFSETOF_svc_own_key_netns);
    const _: () = assert!(offset_of!(SvcOwnKey, addr) == c::OFFSETOF_svc_own_key_addr);
    const _: () = assert!(offset_of!(SvcOwnKey, family) == c::OFFSETOF_svc_own_key_family);
    const _: () = assert!(offset_of!(SvcOwnKey, pad) == c::OFFSETOF_svc_own_key_pad);

    const _: () = assert!(size_of::<SvcIp>() == c::SIZEOF_svc_ip);
    const _: () = assert!(size_of::<SvcIp>() == 16 + 1 + 3);
    const _: () = assert!(offset_of!(SvcIp, addr) == c::OFFSETOF_svc_ip_addr);
    const _: () = assert!(offset_of!(SvcIp, family) == c::OFFSETOF_svc_ip_family);
    const _: () = assert!(offset_of!(SvcIp, pad) == c::OFFSETOF_svc_ip_pad);

    const _: () = assert!(size_of::<SvcRevnatKey>() == c::SIZEOF_svc_revnat_key);
    const _: () = assert!(size_of::<SvcRevnatKey>() == 8 + c::SIZEOF_svc_addr + 4);
    const _: () = assert!(offset_of!(SvcRevnatKey, cookie) == c::OFFSETOF_svc_revnat_key_cookie);
    const _: () = assert!(offset_of!(SvcRevnatKey, to) == c::OFFSETOF_svc_revnat_key_to);
    const _: () = assert!(offset_of!(SvcRevnatKey, pad) == c::OFFSETOF_svc_revnat_key_pad);

    const _: () =
        assert!(size_of::<aya::maps::lpm_trie::Key<SvcRangeKey>>() == c::SIZEOF_svc_range_key);
    const _: () = assert!(size_of::<SvcRangeKey>() == c::SIZEOF_svc_addr + 16);
    const _: () = assert!(4 + offset_of!(SvcRangeKey, fe) == c::OFFSETOF_svc_range_key_fe);
    const _: () = assert!(4 + offset_of!(SvcRangeKey, src) == c::OFFSETOF_svc_range_key_src);
    const _: () = assert!(c::XDPCNI_RANGE_FIXED_BITS as usize == 8 * c::SIZEOF_svc_addr);

    // The choice records are the programs' own (userspace only counts and
    // clears them): their sizes still must not drift unseen.
    const _: () = assert!(c::SIZEOF_svc_choice_key == 16);
    const _: () = assert!(c::SIZEOF_svc_choice == 16);
    const _: () = assert!(c::SIZEOF_svc_client_key == 16 + 4 + 1 + 3);
    const _: () = assert!(c::OFFSETOF_svc_client_key_id == 16);
    const _: () = assert!(c::OFFSETOF_svc_client_key_family == 20);
}
