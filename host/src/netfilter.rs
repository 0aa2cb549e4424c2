//! The netfilter netlink family (`NETLINK_NETFILTER`) that [`crate::nftable`]
//! and the agent's conntrack cleanup speak: the product's one netlink socket
//! ([`crate::netlink::Socket`]) over netlink-packet-netfilter's messages.

use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner};
use netlink_sys::protocols::NETLINK_NETFILTER;

use crate::netlink::Socket;

/// A netfilter netlink socket of the calling thread's network namespace.
pub fn open() -> std::io::Result<Socket<NetfilterMessage>> {
    Socket::open(NETLINK_NETFILTER)
}

/// `inner` under `header`.
pub fn message(
    header: NetfilterHeader,
    inner: impl Into<NetfilterMessageInner>,
) -> NetfilterMessage {
    NetfilterMessage::new(header, inner)
}
