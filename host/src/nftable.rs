//! The nftables table of the product: the agent writes its NetworkPolicy
//! rules there (with `nft`, from its image), and `xdpcni uninstall` removes
//! it. The uninstall runs on the node, where `nft` may not be installed, so
//! it speaks nf_tables netlink itself (netlink-packet-netfilter): one
//! transaction that deletes the table.

use netlink_packet_core::{NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST};
use netlink_packet_netfilter::{
    nftables::{NfTablesMessage, TableAttribute, TableMessage},
    none::ControlMessage,
    NetfilterHeader, NetfilterProtoFamily,
};

use crate::{
    netfilter::{self, message},
    netlink::errno,
};

/// The table (family `inet`) that holds every rule of the product.
pub const TABLE: &str = "xdpcni";

/// `NFNL_SUBSYS_NFTABLES`: batches are addressed to it.
const NFNL_SUBSYS_NFTABLES: u16 = 10;

/// Deletes table `inet xdpcni` in the calling thread's network namespace,
/// with every chain, set and counter in it; `Ok(false)` if there was none.
pub fn remove_table() -> std::io::Result<bool> {
    let batch = || NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES);
    let delete = NfTablesMessage::DeleteTable(TableMessage {
        attributes: vec![TableAttribute::Name(TABLE.into())],
    });
    let mut socket = netfilter::open()?;
    let seqs = socket.send(vec![
        (NLM_F_REQUEST, message(batch(), ControlMessage::BatchBegin)),
        (
            NLM_F_REQUEST | NLM_F_ACK,
            message(
                NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0),
                delete,
            ),
        ),
        (NLM_F_REQUEST, message(batch(), ControlMessage::BatchEnd)),
    ])?;
    // Only the delete asks for an answer.
    let delete_seq = seqs.start + 1;
    socket.receive(seqs, |seq, payload| match payload {
        NetlinkPayload::Error(e) if seq == delete_seq => Some(match errno(&e) {
            None => Ok(true),
            Some(libc::ENOENT) => Ok(false),
            Some(c) => Err(std::io::Error::from_raw_os_error(c)),
        }),
        _ => None,
    })
}
