//! The kernel's connection tracking table over ctnetlink
//! (netlink-packet-netfilter): list its entries, delete some, clear bits of
//! their marks. The agent deletes the entries a pod's fast-path traffic left
//! behind when a policy isolates it (see the agent's
//! `netpol::fast_path_entries`), and clears the rules' generation from every
//! mark when the generation starts over (`netpol::forget_generations`).

use std::{io, net::IpAddr};

use netlink_packet_core::{DefaultNla, NetlinkPayload, Nla, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_netfilter::{
    conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, Tuple},
    NetfilterHeader, NetfilterMessageInner, NetfilterProtoFamily,
};

use xdpcni_host::{
    netfilter::{self, message},
    netlink::errno,
};

/// `CTA_ZONE`: kept from a listed entry so that its delete names the same
/// zone.
const CTA_ZONE: u16 = 18;

/// `CTA_MARK_MASK`: the bits of the mark an update changes.
const CTA_MARK_MASK: u16 = 21;

/// Requests sent before their acknowledgements are read.
const BATCH: usize = 64;

/// One entry of the table: its two directions' addresses, and what a
/// delete names it by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The original direction: source (the client) and destination (what
    /// it sent to, before DNAT).
    pub orig: (IpAddr, IpAddr),
    /// The reply direction: source (the server, after DNAT) and
    /// destination (the client, before SNAT).
    pub reply: (IpAddr, IpAddr),
    /// Its mark.
    pub mark: u32,
    key: Vec<ConntrackAttribute>,
}

impl Entry {
    /// An entry with these addresses (for tests of what is selected).
    pub fn new(orig: (IpAddr, IpAddr), reply: (IpAddr, IpAddr)) -> Self {
        Self {
            orig,
            reply,
            mark: 0,
            key: Vec::new(),
        }
    }

    /// Whether no address was translated either way (no DNAT, no SNAT).
    pub fn untranslated(&self) -> bool {
        self.orig == (self.reply.1, self.reply.0)
    }

    fn parse(attrs: Vec<ConntrackAttribute>) -> Option<Self> {
        let ends = |tuple: &[Tuple]| {
            let ip = tuple.iter().find_map(|t| match t {
                Tuple::Ip(ip) => Some(ip),
                _ => None,
            })?;
            let src = ip.iter().find_map(|a| match a {
                IPTuple::SourceAddress(a) => Some(*a),
                _ => None,
            })?;
            let dst = ip.iter().find_map(|a| match a {
                IPTuple::DestinationAddress(a) => Some(*a),
                _ => None,
            })?;
            Some((src, dst))
        };
        let mut orig = None;
        let mut reply = None;
        let mut mark = 0;
        let mut key = Vec::new();
        for a in attrs {
            match &a {
                ConntrackAttribute::CtaTupleOrig(t) => {
                    orig = ends(t);
                    key.push(a);
                }
                ConntrackAttribute::CtaTupleReply(t) => reply = ends(t),
                ConntrackAttribute::CtaMark(m) => mark = *m,
                ConntrackAttribute::Other(o) if o.kind() == CTA_ZONE => key.push(a),
                _ => {}
            }
        }
        Some(Self {
            orig: orig?,
            reply: reply?,
            mark,
            key,
        })
    }
}

fn family(v6: bool) -> NetfilterHeader {
    let f = if v6 {
        NetfilterProtoFamily::IPv6
    } else {
        NetfilterProtoFamily::IPv4
    };
    NetfilterHeader::new(f, 0, 0)
}

fn error(c: i32) -> io::Error {
    io::Error::from_raw_os_error(c)
}

/// Every entry of one family in the calling thread's network namespace.
pub fn entries(v6: bool) -> io::Result<Vec<Entry>> {
    let dump = message(family(v6), ConntrackMessage::Get(Vec::new()));
    let mut out = Vec::new();
    for m in netfilter::open()?.request(dump, NLM_F_DUMP)? {
        if let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) = m.inner {
            out.extend(Entry::parse(attrs));
        }
    }
    Ok(out)
}

/// Deletes `entries` (listed by [`entries`]); how many went. One already
/// gone is not counted and is no error.
pub fn delete(entries: &[&Entry]) -> io::Result<u64> {
    each(entries, |e| ConntrackMessage::Delete(e.key.clone()))
}

/// Clears the bits `mask` of the marks of `entries` (listed by
/// [`entries`]), leaving the others; how many were changed. One gone
/// meanwhile is not counted and is no error.
pub fn clear_mark(entries: &[&Entry], mask: u32) -> io::Result<u64> {
    // The kernel keeps the bits outside the mask and sets those inside to
    // CTA_MARK's: 0.
    each(entries, |e| {
        let mut attrs = e.key.clone();
        attrs.push(ConntrackAttribute::CtaMark(0));
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_MARK_MASK,
            mask.to_be_bytes().to_vec(),
        )));
        // A "new" message without NLM_F_CREATE updates the entry it names.
        ConntrackMessage::New(attrs)
    })
}

/// Sends `request(entry)` for each of `entries`, in batches; how many the
/// kernel did. An entry gone (ENOENT) is not counted and is no error.
fn each(entries: &[&Entry], request: impl Fn(&Entry) -> ConntrackMessage) -> io::Result<u64> {
    let mut socket = netfilter::open()?;
    let mut done = 0;
    for chunk in entries.chunks(BATCH) {
        let msgs: Vec<_> = chunk
            .iter()
            .map(|e| {
                (
                    NLM_F_REQUEST | NLM_F_ACK,
                    message(family(e.orig.0.is_ipv6()), request(e)),
                )
            })
            .collect();
        let seqs = socket.send(msgs)?;
        let mut answered = 0;
        socket.receive(seqs.clone(), |_, payload| {
            if let NetlinkPayload::Error(e) = payload {
                answered += 1;
                match errno(&e) {
                    None => done += 1,
                    Some(libc::ENOENT) => {}
                    Some(c) => return Some(Err(error(c))),
                }
            }
            (answered == seqs.len()).then_some(Ok(()))
        })?;
    }
    Ok(done)
}
