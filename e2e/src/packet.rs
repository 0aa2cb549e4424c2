//! Hand-built Ethernet frames for BPF_PROG_TEST_RUN.

use std::net::{Ipv4Addr, Ipv6Addr};

/// Ethertype IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// Ethertype IPv6.
pub const ETH_P_IPV6: u16 = 0x86dd;
/// Ethertype ARP.
pub const ETH_P_ARP: u16 = 0x0806;
/// IP protocol numbers.
pub const IPPROTO_ICMP: u8 = 1;
/// TCP.
pub const IPPROTO_TCP: u8 = 6;
/// UDP.
pub const IPPROTO_UDP: u8 = 17;
/// ICMPv6.
pub const IPPROTO_ICMPV6: u8 = 58;

/// Internet checksum of `data` (ones' complement of the ones' complement sum).
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in data.chunks(2) {
        let word = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet header followed by `payload`.
pub fn eth(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An IPv4 packet (20-byte header, valid checksum) carrying `payload`.
pub fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, ttl: u8, proto: u8, payload: &[u8]) -> Vec<u8> {
    let total = u16::try_from(20 + payload.len()).unwrap_or(u16::MAX);
    let mut h = vec![0x45, 0];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&[0x12, 0x34, 0x40, 0x00, ttl, proto, 0, 0]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    let c = checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h.extend_from_slice(payload);
    h
}

/// An IPv6 packet carrying `payload` with next header `nh`.
pub fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, hop_limit: u8, nh: u8, payload: &[u8]) -> Vec<u8> {
    let len = u16::try_from(payload.len()).unwrap_or(u16::MAX);
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&len.to_be_bytes());
    h.push(nh);
    h.push(hop_limit);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    h.extend_from_slice(payload);
    h
}

/// A UDP header (checksum 0) and payload.
pub fn udp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let len = u16::try_from(8 + payload.len()).unwrap_or(u16::MAX);
    let mut u = Vec::new();
    u.extend_from_slice(&sport.to_be_bytes());
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&len.to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    u
}

/// A 20-byte TCP header with ACK set.
pub fn tcp(sport: u16, dport: u16) -> Vec<u8> {
    let mut t = Vec::new();
    t.extend_from_slice(&sport.to_be_bytes());
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, 0x50, 0x10, 0xff, 0xff, 0, 0, 0, 0]);
    t
}

/// An ICMP (v4) or ICMPv6 message of `ty` with identifier and sequence.
pub fn icmp(ty: u8, id: u16, seq: u16) -> Vec<u8> {
    let mut m = vec![ty, 0, 0, 0];
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&seq.to_be_bytes());
    m.extend_from_slice(b"xdpcni-ping");
    let c = checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

/// IPv4 with `opts` (a multiple of 4 bytes), `flags_frag` and DF as given.
pub fn ipv4_full(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    ttl: u8,
    proto: u8,
    flags_frag: u16,
    opts: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    let hlen = 20 + opts.len();
    let total = u16::try_from(hlen + payload.len()).unwrap_or(u16::MAX);
    let mut h = vec![0x40 | u8::try_from(hlen / 4).unwrap_or(0x0f), 0];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&[0x12, 0x34]);
    h.extend_from_slice(&flags_frag.to_be_bytes());
    h.extend_from_slice(&[ttl, proto, 0, 0]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    h.extend_from_slice(opts);
    let c = checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h.extend_from_slice(payload);
    h
}

/// Fixes the UDP/TCP/ICMPv6 checksum of an IPv6 frame (Ethernet, a
/// 40-byte IPv6 header, then L4): the kernel forwards bad L4 checksums as
/// they are, but a realistic probe has good ones.
pub fn fix_l4_v6(frame: &mut [u8]) {
    if frame.len() < 54 {
        return;
    }
    let nh = frame[20];
    let l4 = 54;
    let len = frame.len() - l4;
    let off = match nh {
        6 => 16,
        17 => 6,
        58 => 2,
        _ => return,
    };
    if frame.len() < l4 + off + 2 {
        return;
    }
    frame[l4 + off..l4 + off + 2].copy_from_slice(&[0, 0]);
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&frame[22..54]);
    pseudo.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, nh]);
    pseudo.extend_from_slice(&frame[l4..]);
    let c = checksum(&pseudo);
    frame[l4 + off..l4 + off + 2].copy_from_slice(&c.to_be_bytes());
}

/// One of `weighted`'s values, each as likely as its weight (the seeded
/// random frames of the equivalence suites). Panics on an empty list or
/// weights that sum to 0.
pub fn pick<T: Copy>(rng: &mut fastrand::Rng, weighted: &[(u32, T)]) -> T {
    let total: u32 = weighted.iter().map(|(w, _)| w).sum();
    let mut x = rng.u32(..total);
    for (w, v) in weighted {
        if x < *w {
            return *v;
        }
        x -= w;
    }
    weighted[0].1
}

/// `n` random bytes.
pub fn random_bytes(rng: &mut fastrand::Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.u8(..)).collect()
}
