//! The three offload switches the XDP modes need, through the legacy ethtool
//! ioctls (SIOCETHTOOL), in the calling thread's network namespace.

use std::{ffi::CString, io};

const SIOCETHTOOL: libc::c_ulong = 0x8946;

/// An offload the plugin sets on the pod's interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offload {
    /// Generic receive offload: lets a veth receive redirected XDP frames.
    Gro,
    /// Transmit checksum offload: off for native XDP (xdp_frame has no
    /// CHECKSUM_PARTIAL).
    TxChecksum,
    /// TCP segmentation offload: off for generic XDP (redirected skbs above
    /// the MTU are dropped).
    Tso,
}

impl Offload {
    /// (get, set) ethtool commands.
    const fn cmds(self) -> (u32, u32) {
        match self {
            Self::Gro => (0x2b, 0x2c),        // ETHTOOL_GGRO, ETHTOOL_SGRO
            Self::TxChecksum => (0x16, 0x17), // ETHTOOL_GTXCSUM, ETHTOOL_STXCSUM
            Self::Tso => (0x1e, 0x1f),        // ETHTOOL_GTSO, ETHTOOL_STSO
        }
    }
}

#[repr(C)]
struct EthtoolValue {
    cmd: u32,
    data: u32,
}

#[repr(C)]
struct Ifreq {
    name: [libc::c_char; libc::IFNAMSIZ],
    data: *mut EthtoolValue,
    pad: [u8; 16],
}

fn ioctl(ifname: &str, cmd: u32, data: u32) -> io::Result<u32> {
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
    let mut value = EthtoolValue { cmd, data };
    let mut req = Ifreq {
        name: [0; libc::IFNAMSIZ],
        data: &mut value,
        pad: [0; 16],
    };
    for (d, s) in req.name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: req is a valid ifreq whose data points at a live ethtool_value.
    let rc = unsafe { libc::ioctl(fd, SIOCETHTOOL as _, &mut req) };
    let err = io::Error::last_os_error();
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return Err(err);
    }
    Ok(value.data)
}

/// Reads an offload of `ifname`.
pub fn get(ifname: &str, offload: Offload) -> io::Result<bool> {
    ioctl(ifname, offload.cmds().0, 0).map(|v| v != 0)
}

/// Sets an offload of `ifname`.
pub fn set(ifname: &str, offload: Offload, on: bool) -> io::Result<()> {
    ioctl(ifname, offload.cmds().1, u32::from(on)).map(drop)
}

/// Sets an offload, accepting a refusal when the device already is in the
/// wanted state (veth refuses to toggle TSO while native XDP on its peer
/// has forced it off, for instance).
pub fn ensure(ifname: &str, offload: Offload, on: bool) -> io::Result<()> {
    match set(ifname, offload, on) {
        Ok(()) => Ok(()),
        Err(e) => match get(ifname, offload) {
            Ok(now) if now == on => Ok(()),
            _ => Err(e),
        },
    }
}
