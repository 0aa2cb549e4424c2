//! The netfilter netlink socket (`NETLINK_NETFILTER`) that [`crate::nftable`]
//! and [`crate::conntrack`] speak through: message framing and the one
//! request/answer loop, with the messages themselves from
//! netlink-packet-netfilter.

use std::io;

use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

/// One framed message: `inner` under `header`, with netlink `flags` and
/// sequence number `seq`.
pub(crate) fn message(
    flags: u16,
    seq: u32,
    header: NetfilterHeader,
    inner: impl Into<NetfilterMessageInner>,
) -> NetlinkMessage<NetfilterMessage> {
    let mut h = NetlinkHeader::default();
    h.flags = flags;
    h.sequence_number = seq;
    let mut m = NetlinkMessage::new(
        h,
        NetlinkPayload::from(NetfilterMessage::new(header, inner)),
    );
    m.finalize();
    m
}

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// A netfilter netlink socket of the calling thread's network namespace.
pub(crate) struct Nfnl(Socket);

impl Nfnl {
    pub(crate) fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self(socket))
    }

    /// Sends `msgs` in one write, then hands every message the kernel
    /// answers to `each` until it returns `Some`: what this returns.
    pub(crate) fn exchange<T>(
        &mut self,
        msgs: &[NetlinkMessage<NetfilterMessage>],
        mut each: impl FnMut(NetlinkMessage<NetfilterMessage>) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let mut buf = Vec::new();
        for m in msgs {
            let start = buf.len();
            buf.resize(start + m.buffer_len(), 0);
            m.serialize(&mut buf[start..]);
        }
        self.0.send(&buf, 0)?;
        let mut reply = vec![0u8; 64 * 1024];
        loop {
            let n = self.0.recv(&mut &mut reply[..], 0)?;
            let mut offset = 0;
            while offset < n {
                let m = NetlinkMessage::<NetfilterMessage>::deserialize(&reply[offset..n])
                    .map_err(invalid)?;
                let len = m.header.length as usize;
                if let Some(done) = each(m) {
                    return done;
                }
                if len == 0 {
                    break;
                }
                offset += len;
            }
        }
    }
}

/// The errno of an error answer, `None` for an acknowledgement.
pub(crate) fn errno(e: &netlink_packet_core::ErrorMessage) -> Option<i32> {
    e.code.map(|c| -c.get())
}
