//! A pod's eth0 as the differential tests use it: frames sent from inside
//! the pod with AF_PACKET (so any frame can be sent), everything that
//! arrives captured, and the pod's own stack silenced so that every frame
//! captured is the node's doing, not the pod's answers.

use std::os::fd::{AsRawFd, OwnedFd};

use anyhow::{ensure, Result};

use crate::{
    in_netns,
    netns::Netns,
    traffic::{packet_socket, PacketUse},
};

/// An AF_PACKET socket on one interface of a pod: sends, and captures what
/// arrives (not what it sends).
pub struct Capture {
    sock: OwnedFd,
}

impl Capture {
    /// The socket on `ifname` of `ns`.
    pub fn open(ns: &Netns, ifname: &str) -> Result<Self> {
        let ifname = ifname.to_string();
        let sock = in_netns(ns, move || packet_socket(&ifname, PacketUse::Capture))?;
        Ok(Self { sock })
    }

    /// Sends `frame` as it is.
    pub fn send(&self, frame: &[u8]) -> Result<()> {
        // SAFETY: a valid socket and buffer.
        let n = unsafe { libc::send(self.sock.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        ensure!(
            n == frame.len() as isize,
            "send: {}",
            std::io::Error::last_os_error()
        );
        Ok(())
    }

    /// Every frame received since the last call.
    pub fn drain(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 65536];
        loop {
            // SAFETY: a valid socket and buffer of the given size.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return out;
            }
            out.push(buf[..n as usize].to_vec());
        }
    }
}

/// Silences the stack of the pod in `ns`: everything for it dropped at
/// INPUT but IPv6 neighbour discovery (how the node finds it; ARP is not IP).
pub fn silence_stack(ns: &Netns) -> Result<()> {
    let nd = |ty: &'static str| {
        vec![
            "ip6tables",
            "-A",
            "INPUT",
            "-p",
            "icmpv6",
            "--icmpv6-type",
            ty,
            "-j",
            "ACCEPT",
        ]
    };
    for cmd in [
        vec!["iptables", "-A", "INPUT", "-j", "DROP"],
        nd("neighbour-solicitation"),
        nd("neighbour-advertisement"),
        vec!["ip6tables", "-A", "INPUT", "-j", "DROP"],
    ] {
        ns.exec(&cmd)?;
    }
    Ok(())
}
