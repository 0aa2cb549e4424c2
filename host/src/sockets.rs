//! A network namespace's connected UDP sockets as `sock_diag` lists them,
//! and their destruction (`SOCK_DESTROY`, what `ss -K` does): the agent
//! closes a pod's UDP sockets that a Service translation connected to a
//! backend that has gone, so the application sees `ECONNABORTED` and
//! connects again (to a live backend) instead of sending into nothing.
//!
//! Both talk to the network namespace of the calling thread (run them
//! inside [`crate::netns::in_netns`] for a pod's).

use std::{io, net::SocketAddr};

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_sock_diag::{
    constants::{AF_INET, AF_INET6, IPPROTO_UDP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
    SockDiagDestroy, SockDiagMessage,
};
use netlink_sys::protocols::NETLINK_SOCK_DIAG;

use crate::netlink::Socket;

/// One connected UDP socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectedUdp {
    /// Its cookie: what `bpf_get_socket_cookie()` gives a program for it.
    pub cookie: u64,
    /// Its own address.
    pub local: SocketAddr,
    /// The address it is connected to.
    pub peer: SocketAddr,
    id: SocketId,
    family: u8,
}

/// A failure of `sock_diag`.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {source}")]
pub struct SocketsError {
    op: &'static str,
    source: io::Error,
}

impl SocketsError {
    /// The errno, if the kernel refused.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

impl From<io::Error> for SocketsError {
    fn from(source: io::Error) -> Self {
        Self {
            op: "entering the network namespace",
            source,
        }
    }
}

fn err(op: &'static str) -> impl FnOnce(io::Error) -> SocketsError {
    move |source| SocketsError { op, source }
}

/// The socket cookie `sock_diag` reports: two native-endian halves, low first.
fn cookie(c: &[u8; 8]) -> u64 {
    let half = |b: &[u8]| u64::from(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    half(&c[..4]) | half(&c[4..]) << 32
}

fn request(family: u8, id: SocketId) -> InetRequest {
    InetRequest {
        family,
        protocol: IPPROTO_UDP,
        extensions: ExtensionFlags::empty(),
        // A connected UDP socket is in TCP_ESTABLISHED.
        states: StateFlags::ESTABLISHED,
        socket_id: id,
    }
}

/// Every connected UDP socket of the calling thread's network namespace,
/// both families.
pub fn connected_udp() -> Result<Vec<ConnectedUdp>, SocketsError> {
    let mut socket: Socket<SockDiagMessage> =
        Socket::open(NETLINK_SOCK_DIAG).map_err(err("opening a sock_diag socket"))?;
    let mut out = Vec::new();
    for (family, id) in [
        (AF_INET, SocketId::new_v4()),
        (AF_INET6, SocketId::new_v6()),
    ] {
        let answers = socket
            .request(
                SockDiagMessage::InetRequest(request(family, id)),
                NLM_F_DUMP,
            )
            .map_err(err("listing UDP sockets"))?;
        for a in answers {
            let SockDiagMessage::InetResponse(r) = a else {
                continue;
            };
            let id = r.header.socket_id;
            out.push(ConnectedUdp {
                cookie: cookie(&id.cookie),
                local: SocketAddr::new(id.source_address, id.source_port),
                peer: SocketAddr::new(id.destination_address, id.destination_port),
                id,
                family: r.header.family,
            });
        }
    }
    Ok(out)
}

/// Closes `sockets` (of the calling thread's network namespace): each
/// owner's next call fails with `ECONNABORTED`. One already gone is not an
/// error. Returns how many were closed.
pub fn destroy(sockets: &[ConnectedUdp]) -> Result<usize, SocketsError> {
    if sockets.is_empty() {
        return Ok(0);
    }
    let mut socket: Socket<SockDiagDestroy> =
        Socket::open(NETLINK_SOCK_DIAG).map_err(err("opening a sock_diag socket"))?;
    let mut closed = 0;
    for s in sockets {
        let msg = SockDiagDestroy::new(SockDiagMessage::InetRequest(request(
            s.family,
            s.id.clone(),
        )));
        match socket.request(msg, NLM_F_ACK) {
            Ok(_) => closed += 1,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(err("closing a UDP socket")(e)),
        }
    }
    Ok(closed)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic
    use super::*;

    /// `SO_COOKIE`: the socket's cookie, as the kernel gives it.
    fn so_cookie(s: &std::net::UdpSocket) -> u64 {
        use std::os::fd::AsRawFd;
        let mut c: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: `c` and `len` are valid for the call's writes.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_COOKIE,
                (&mut c as *mut u64).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        c
    }

    /// Root: lists this test's own connected socket on loopback (with the
    /// kernel's cookie), closes it, and its next receive sees the abort;
    /// an unconnected socket is not listed.
    #[test]
    fn a_connected_udp_socket_is_listed_with_its_cookie_and_closed() {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let unconnected = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.connect(peer.local_addr().unwrap()).unwrap();
        let listed = connected_udp().unwrap();
        let mine: Vec<&ConnectedUdp> = listed
            .iter()
            .filter(|c| c.local == s.local_addr().unwrap())
            .collect();
        assert_eq!(mine.len(), 1, "{listed:?}");
        assert_eq!(mine[0].peer, peer.local_addr().unwrap());
        assert_eq!(mine[0].cookie, so_cookie(&s));
        assert!(!listed
            .iter()
            .any(|c| c.local == unconnected.local_addr().unwrap()));
        assert_eq!(destroy(&[mine[0].clone()]).unwrap(), 1);
        s.set_read_timeout(Some(std::time::Duration::from_secs(1)))
            .unwrap();
        let e = s.recv(&mut [0u8; 8]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNABORTED), "{e}");
        // Gone: closing it again closes nothing.
        assert_eq!(destroy(&[mine[0].clone()]).unwrap(), 0);
    }

    #[test]
    fn the_cookie_is_read_low_half_first() {
        let mut c = [0u8; 8];
        c[..4].copy_from_slice(&0x1122_3344u32.to_ne_bytes());
        c[4..].copy_from_slice(&0x5566_7788u32.to_ne_bytes());
        assert_eq!(cookie(&c), 0x5566_7788_1122_3344);
    }
}
