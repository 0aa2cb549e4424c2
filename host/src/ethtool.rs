//! The three offload switches the XDP modes need, through the ethtool ioctls
//! (SIOCETHTOOL), in the calling thread's network namespace.
//!
//! GRO and tx checksum use the legacy one-value commands. TSO does not: the
//! legacy ETHTOOL_STSO covers only the kernel's NETIF_F_ALL_TSO, and 6.18's
//! `tx-tcp-accecn-segmentation` is outside it (seen on a real node: TSO "off"
//! while `ethtool -k` said on). TSO is every feature named
//! `tx-tcp*-segmentation`, looked up by name (ETHTOOL_GSTRINGS) and set with
//! ETHTOOL_SFEATURES, as `ethtool -K tso` does, so features a later kernel
//! adds to the family are covered too.
//!
//! Why not ethtool's netlink interface through rust-netlink's `ethtool`
//! crate: its newest release (0.3.0) reads features (FEATURES_GET) but
//! cannot set them (no FEATURES_SET among its commands), and setting is all
//! this module does.

use std::{ffi::CString, io};

const SIOCETHTOOL: libc::c_ulong = 0x8946;
const ETHTOOL_GSTRINGS: u32 = 0x1b;
const ETHTOOL_GSSET_INFO: u32 = 0x37;
const ETHTOOL_GFEATURES: u32 = 0x3a;
const ETHTOOL_SFEATURES: u32 = 0x3b;
const ETH_SS_FEATURES: u32 = 4;
const ETH_GSTRING_LEN: usize = 32;

/// An offload the plugin sets on the pod's interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offload {
    /// Generic receive offload: lets a veth receive redirected XDP frames.
    Gro,
    /// Transmit checksum offload: off for native XDP (xdp_frame has no
    /// CHECKSUM_PARTIAL).
    TxChecksum,
    /// TCP segmentation offload (every `tx-tcp*-segmentation` feature).
    Tso,
}

#[repr(C)]
struct Ifreq {
    name: [libc::c_char; libc::IFNAMSIZ],
    data: *mut u8,
    pad: [u8; 16],
}

/// Runs SIOCETHTOOL on `ifname` with `buf` (an ethtool command struct,
/// starting with its u32 command), which the kernel may fill in.
fn ioctl(ifname: &str, buf: &mut [u8]) -> io::Result<()> {
    let name = CString::new(ifname).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let bytes = name.as_bytes_with_nul();
    if bytes.len() > libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long",
        ));
    }
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut req = Ifreq {
        name: [0; libc::IFNAMSIZ],
        data: buf.as_mut_ptr(),
        pad: [0; 16],
    };
    for (d, s) in req.name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: req is a valid ifreq whose data points at a live buffer sized
    // for the command it holds.
    let rc = unsafe { libc::ioctl(fd, SIOCETHTOOL as _, &mut req) };
    let err = io::Error::last_os_error();
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return Err(err);
    }
    Ok(())
}

fn u32_at(buf: &[u8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[off..off + 4]);
    u32::from_ne_bytes(b)
}

fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

/// A legacy one-value command (`struct ethtool_value`).
fn value(ifname: &str, cmd: u32, data: u32) -> io::Result<u32> {
    let mut buf = [0u8; 8];
    put_u32(&mut buf, 0, cmd);
    put_u32(&mut buf, 4, data);
    ioctl(ifname, &mut buf)?;
    Ok(u32_at(&buf, 4))
}

/// Indexes of the features whose names `select` picks, and the feature
/// count.
fn feature_bits(ifname: &str, select: impl Fn(&str) -> bool) -> io::Result<(Vec<usize>, usize)> {
    // struct ethtool_sset_info { cmd, reserved, u64 sset_mask, u32 data[] }
    let mut info = [0u8; 20];
    put_u32(&mut info, 0, ETHTOOL_GSSET_INFO);
    info[8..16].copy_from_slice(&(1u64 << ETH_SS_FEATURES).to_ne_bytes());
    ioctl(ifname, &mut info)?;
    let count = u32_at(&info, 16) as usize;
    // struct ethtool_gstrings { cmd, string_set, len, u8 data[len * 32] }
    let mut strings = vec![0u8; 12 + count * ETH_GSTRING_LEN];
    put_u32(&mut strings, 0, ETHTOOL_GSTRINGS);
    put_u32(&mut strings, 4, ETH_SS_FEATURES);
    put_u32(&mut strings, 8, count as u32);
    ioctl(ifname, &mut strings)?;
    let bits = strings[12..]
        .chunks(ETH_GSTRING_LEN)
        .enumerate()
        .filter(|(_, name)| {
            let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            std::str::from_utf8(&name[..end]).is_ok_and(&select)
        })
        .map(|(i, _)| i)
        .collect();
    Ok((bits, count))
}

fn is_tso(name: &str) -> bool {
    name.starts_with("tx-tcp") && name.ends_with("-segmentation")
}

fn get_features(ifname: &str, select: impl Fn(&str) -> bool) -> io::Result<bool> {
    let (bits, count) = feature_bits(ifname, select)?;
    let blocks = count.div_ceil(32);
    // struct ethtool_gfeatures { cmd, size, { available, requested, active, never_changed }[size] }
    let mut buf = vec![0u8; 8 + blocks * 16];
    put_u32(&mut buf, 0, ETHTOOL_GFEATURES);
    put_u32(&mut buf, 4, blocks as u32);
    ioctl(ifname, &mut buf)?;
    Ok(bits
        .iter()
        .any(|&b| u32_at(&buf, 8 + (b / 32) * 16 + 8) & (1 << (b % 32)) != 0))
}

fn set_features(ifname: &str, select: impl Fn(&str) -> bool, on: bool) -> io::Result<()> {
    let (bits, count) = feature_bits(ifname, select)?;
    let blocks = count.div_ceil(32);
    // struct ethtool_sfeatures { cmd, size, { valid, requested }[size] }
    let mut buf = vec![0u8; 8 + blocks * 8];
    put_u32(&mut buf, 0, ETHTOOL_SFEATURES);
    put_u32(&mut buf, 4, blocks as u32);
    for b in bits {
        let off = 8 + (b / 32) * 8;
        let valid = u32_at(&buf, off) | 1 << (b % 32);
        put_u32(&mut buf, off, valid);
        if on {
            let requested = u32_at(&buf, off + 4) | 1 << (b % 32);
            put_u32(&mut buf, off + 4, requested);
        }
    }
    // A request the device cannot fully honour still returns >= 0: callers
    // that care read the result back (see `ensure`).
    ioctl(ifname, &mut buf)
}

/// Reads an offload of `ifname` (TSO: on if any TCP segmentation feature is).
pub fn get(ifname: &str, offload: Offload) -> io::Result<bool> {
    match offload {
        Offload::Gro => value(ifname, 0x2b, 0).map(|v| v != 0), // ETHTOOL_GGRO
        Offload::TxChecksum => value(ifname, 0x16, 0).map(|v| v != 0), // ETHTOOL_GTXCSUM
        Offload::Tso => get_features(ifname, is_tso),
    }
}

/// Sets an offload of `ifname`.
pub fn set(ifname: &str, offload: Offload, on: bool) -> io::Result<()> {
    match offload {
        Offload::Gro => value(ifname, 0x2c, u32::from(on)).map(drop), // ETHTOOL_SGRO
        Offload::TxChecksum => value(ifname, 0x17, u32::from(on)).map(drop), // ETHTOOL_STXCSUM
        Offload::Tso => set_features(ifname, is_tso, on),
    }
}

/// Sets an offload unless it already is `on`, and checks that the device
/// took it, accepting a refusal when the device already is in the wanted
/// state (veth refuses to toggle TSO while native XDP on its peer has forced
/// it off, for instance).
pub fn ensure(ifname: &str, offload: Offload, on: bool) -> io::Result<()> {
    if get(ifname, offload).is_ok_and(|now| now == on) {
        return Ok(());
    }
    let set_result = set(ifname, offload, on);
    match get(ifname, offload) {
        Ok(now) if now == on => Ok(()),
        Ok(now) => Err(set_result.err().unwrap_or_else(|| {
            io::Error::other(format!(
                "{ifname}: {offload:?} is {} after asking for {}",
                if now { "on" } else { "off" },
                if on { "on" } else { "off" }
            ))
        })),
        Err(e) => Err(set_result.err().unwrap_or(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::is_tso;

    #[test]
    fn tso_is_every_tcp_segmentation_feature() {
        for name in [
            "tx-tcp-segmentation",
            "tx-tcp-ecn-segmentation",
            "tx-tcp-mangleid-segmentation",
            "tx-tcp6-segmentation",
            "tx-tcp-accecn-segmentation",
        ] {
            assert!(is_tso(name), "{name}");
        }
        for name in [
            "tx-udp-segmentation",
            "tx-gre-segmentation",
            "tx-checksum-ipv4",
            "tx-tcp",
        ] {
            assert!(!is_tso(name), "{name}");
        }
    }
}
