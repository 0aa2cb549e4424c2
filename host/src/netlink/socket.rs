//! The one netlink socket of the product, generic over the netlink family
//! (route, netfilter): messages framed and numbered, sent in one write, and
//! the kernel's answers read back with stale ones (an earlier request's,
//! after an error cut it short) skipped by sequence number. The typed verbs
//! of each family ([`super::Netlink`] for routes, links, addresses and
//! neighbours; `crate::nftable` and `crate::conntrack` for netfilter) are
//! built on it; nothing else in the product reads a netlink socket.
//!
//! A socket talks to the network namespace of the thread that opened it.

use std::{fmt::Debug, io, ops::Range};

use netlink_packet_core::{
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::SocketAddr;

/// A netlink socket of one family, whose messages are `M`.
pub struct Socket<M> {
    socket: netlink_sys::Socket,
    seq: u32,
    _family: std::marker::PhantomData<M>,
}

/// The errno of an error answer, `None` for an acknowledgement.
pub fn errno(e: &netlink_packet_core::ErrorMessage) -> Option<i32> {
    e.code.map(|c| -c.get())
}

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl<M> Socket<M>
where
    M: NetlinkSerializable + NetlinkDeserializable + Debug,
{
    /// Opens a socket of `protocol` (`netlink_sys::protocols::*`) in the
    /// calling thread's network namespace, with extended acknowledgements
    /// where the kernel offers them.
    pub fn open(protocol: isize) -> io::Result<Self> {
        let mut socket = netlink_sys::Socket::new(protocol)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        socket.set_ext_ack(true).ok();
        Ok(Self {
            socket,
            seq: 0,
            _family: std::marker::PhantomData,
        })
    }

    /// Sends `msgs` (each with its netlink flags) in one write, numbered
    /// anew; returns their sequence numbers.
    pub fn send(&mut self, msgs: Vec<(u16, M)>) -> io::Result<Range<u32>> {
        let first = self.seq.wrapping_add(1);
        let mut buf = Vec::new();
        for (flags, inner) in msgs {
            self.seq = self.seq.wrapping_add(1);
            let mut header = NetlinkHeader::default();
            header.flags = flags;
            header.sequence_number = self.seq;
            let mut m = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(inner));
            m.finalize();
            let start = buf.len();
            buf.resize(start + m.buffer_len(), 0);
            m.serialize(&mut buf[start..]);
        }
        self.socket.send(&buf, 0)?;
        Ok(first..self.seq.wrapping_add(1))
    }

    /// Hands each answer to a message of `seqs` to `each` (with its
    /// sequence number) until it returns `Some`: what this returns. Answers
    /// to other requests are skipped.
    pub fn receive<T>(
        &mut self,
        seqs: Range<u32>,
        mut each: impl FnMut(u32, NetlinkPayload<M>) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        loop {
            let (data, _) = self.socket.recv_from_full()?;
            let mut offset = 0;
            while offset < data.len() {
                let m = NetlinkMessage::<M>::deserialize(&data[offset..]).map_err(invalid)?;
                let len = m.header.length as usize;
                if len == 0 {
                    return Err(invalid("a zero-length netlink message"));
                }
                offset += len;
                let seq = m.header.sequence_number;
                if !seqs.contains(&seq) {
                    continue;
                }
                if let Some(done) = each(seq, m.payload) {
                    return done;
                }
            }
        }
    }

    /// Sends one request with `flags` and collects its answers: until the
    /// end of a dump (`NLM_F_DUMP`), the acknowledgement (`NLM_F_ACK`), or
    /// else the one answer a GET gets. A kernel error is an `io::Error` of
    /// its errno.
    pub fn request(&mut self, msg: M, flags: u16) -> io::Result<Vec<M>> {
        use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
        let seqs = self.send(vec![(NLM_F_REQUEST | flags, msg)])?;
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let acked = flags & NLM_F_ACK != 0;
        let mut out = Vec::new();
        self.receive(seqs, |_, payload| match payload {
            NetlinkPayload::Done(_) => Some(Ok(())),
            NetlinkPayload::Error(e) => Some(match errno(&e) {
                None => Ok(()),
                Some(code) => Err(io::Error::from_raw_os_error(code)),
            }),
            NetlinkPayload::InnerMessage(inner) => {
                out.push(inner);
                // A GET that is no dump gets one answer and no ACK.
                (!dump && !acked).then_some(Ok(()))
            }
            _ => None,
        })?;
        Ok(out)
    }
}

/// A netlink socket that only listens: subscribed to multicast groups of
/// its family, it tells when the kernel announced a change. What changed
/// is read again by the caller's requests, not parsed here.
pub struct Announcements {
    socket: netlink_sys::Socket,
}

impl Announcements {
    /// Subscribes to `groups` (`RTNLGRP_*`) of `protocol`
    /// (`netlink_sys::protocols::*`) in the calling thread's network
    /// namespace.
    pub fn open(protocol: isize, groups: &[u32]) -> io::Result<Self> {
        let mut socket = netlink_sys::Socket::new(protocol)?;
        socket.bind_auto()?;
        for g in groups {
            socket.add_membership(*g)?;
        }
        Ok(Self { socket })
    }

    /// Blocks until the kernel announces something. Announcements lost to
    /// a full receive buffer (`ENOBUFS`) count as one.
    pub fn wait(&mut self) -> io::Result<()> {
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
        match self.socket.recv(&mut buf, 0) {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => Ok(()),
            Err(e) => Err(e),
        }
    }
}
