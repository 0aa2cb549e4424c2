//! The nftables table of the product: the agent writes its NetworkPolicy
//! rules there (with `nft`, from its image), and `xdpcni uninstall` removes
//! it. The uninstall runs on the node, where `nft` may not be installed, so
//! it speaks nf_tables netlink itself (netlink-packet-netfilter): one
//! transaction that deletes the table.

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST,
};
use netlink_packet_netfilter::{
    nftables::{NfTablesMessage, TableAttribute, TableMessage},
    none::ControlMessage,
    NetfilterHeader, NetfilterMessage, NetfilterProtoFamily,
};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

/// The table (family `inet`) that holds every rule of the product.
pub const TABLE: &str = "xdpcni";

/// `NFNL_SUBSYS_NFTABLES`: batches are addressed to it.
const NFNL_SUBSYS_NFTABLES: u16 = 10;

fn message(
    flags: u16,
    seq: u32,
    header: NetfilterHeader,
    inner: impl Into<netlink_packet_netfilter::NetfilterMessageInner>,
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

/// Deletes table `inet xdpcni` in the calling thread's network namespace,
/// with every chain, set and counter in it; `Ok(false)` if there was none.
pub fn remove_table() -> std::io::Result<bool> {
    let batch = || NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES);
    let msgs = [
        message(NLM_F_REQUEST, 1, batch(), ControlMessage::BatchBegin),
        message(
            NLM_F_REQUEST | NLM_F_ACK,
            2,
            NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0),
            NfTablesMessage::DeleteTable(TableMessage {
                attributes: vec![TableAttribute::Name(TABLE.into())],
            }),
        ),
        message(NLM_F_REQUEST, 3, batch(), ControlMessage::BatchEnd),
    ];
    let mut buf = Vec::new();
    for m in &msgs {
        let start = buf.len();
        buf.resize(start + m.buffer_len(), 0);
        m.serialize(&mut buf[start..]);
    }
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    socket.send(&buf, 0)?;
    let mut reply = vec![0u8; 8192];
    loop {
        let n = socket.recv(&mut &mut reply[..], 0)?;
        let mut offset = 0;
        while offset < n {
            let m = NetlinkMessage::<NetfilterMessage>::deserialize(&reply[offset..n])
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
            let len = m.header.length as usize;
            if m.header.sequence_number == 2 {
                if let NetlinkPayload::Error(e) = m.payload {
                    return match e.code {
                        None => Ok(true),
                        Some(c) if -c.get() == libc::ENOENT => Ok(false),
                        Some(c) => Err(std::io::Error::from_raw_os_error(-c.get())),
                    };
                }
            }
            if len == 0 {
                break;
            }
            offset += len;
        }
    }
}
