//! The fast path between nodes, as userspace sees it: `remote_nets` (other
//! nodes' pod CIDRs and their routes' devices and gateways) and the program
//! on the uplink (`xdpcni_tc_from_node`, one pinned tcx link per device,
//! `links/<ifindex>_uplink`). The agent alone writes both, in the pass that
//! makes the routes: an entry after its route is in place, and before the
//! route goes ([`Datapath::prune_remote_nets`]), so no program sends where
//! the kernel has no route.

use std::{collections::BTreeMap, fs, net::IpAddr, os::fd::AsFd};

use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        HashMap, Map, MapData, MapError,
    },
    programs::{tc::TcAttachOptions, LinkOrder, TcAttachType},
    Ebpf,
};
use tracing::info;

use super::{
    links::{ifname_of, link_pin, link_pins, pin_link, unpin_link, LinkKind},
    maps::{is_full, removed},
    Datapath,
};
use crate::{
    abi::{RemoteKey, RemoteNet, MAX_REMOTE_NETS, REMOTE_FIXED_BITS},
    sys, Error, Result,
};

/// Another node's pod CIDR: its address and prefix length.
pub type RemoteCidr = (IpAddr, u8);

/// What [`Datapath::sync_remote_nets`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteSynced {
    /// Entries written (new, or with another route).
    pub written: usize,
    /// Entries removed.
    pub removed: usize,
}

/// The `remote_nets` map of a datapath, and the Service layout's
/// `svc_uplinks` (the devices the uplink program runs on) it keeps true.
pub struct RemoteMaps {
    nets: LpmTrie<MapData, RemoteKey, RemoteNet>,
    /// `None` where only the pins were opened.
    uplinks: Option<HashMap<MapData, u32, u32>>,
}

fn map_err(op: String) -> impl FnOnce(MapError) -> Error {
    move |e| Error::map(op, e)
}

fn key((ip, prefix): RemoteCidr) -> Key<RemoteKey> {
    Key::new(REMOTE_FIXED_BITS + u32::from(prefix), RemoteKey::new(ip))
}

impl RemoteMaps {
    /// The map of `ebpf`, just loaded (created, or reused from its pin).
    pub(crate) fn take(ebpf: &mut Ebpf) -> Result<Self> {
        let map = ebpf.take_map("remote_nets").ok_or(Error::Missing {
            kind: "map",
            name: "remote_nets",
        })?;
        let uplinks = ebpf.take_map("svc_uplinks").ok_or(Error::Missing {
            kind: "map",
            name: "svc_uplinks",
        })?;
        Ok(Self {
            nets: LpmTrie::try_from(map).map_err(map_err("map remote_nets".into()))?,
            uplinks: Some(HashMap::try_from(uplinks).map_err(map_err("map svc_uplinks".into()))?),
        })
    }

    /// The map pinned under `pin_dir` (this build's layout), to read.
    pub fn open_pinned(pin_dir: &std::path::Path) -> Result<Self> {
        let path = super::layout_dir(pin_dir).join("remote_nets");
        let data = MapData::from_pin(&path)
            .map_err(|e| Error::map(format!("opening {}", path.display()), e))?;
        Ok(Self {
            nets: LpmTrie::try_from(Map::LpmTrie(data))
                .map_err(map_err("map remote_nets".into()))?,
            uplinks: None,
        })
    }

    /// Marks `ifindex` as running the uplink program (`up`) or not, in
    /// `svc_uplinks`: a north-south flow to another node's backend is made
    /// only where its replies come back by a marked device.
    fn mark_uplink(&mut self, ifindex: u32, up: bool) -> Result<()> {
        let Some(m) = self.uplinks.as_mut() else {
            return Ok(());
        };
        if up {
            m.insert(ifindex, 1, 0)
                .map_err(map_err(format!("marking uplink {ifindex} in svc_uplinks")))
        } else {
            removed(m.remove(&ifindex), || {
                format!("unmarking uplink {ifindex} in svc_uplinks")
            })
            .map(|_| ())
        }
    }

    /// Every entry.
    pub fn entries(&self) -> Result<BTreeMap<RemoteCidr, RemoteNet>> {
        let mut out = BTreeMap::new();
        for kv in self.nets.iter() {
            let (k, v) = kv.map_err(map_err("reading remote_nets".into()))?;
            let data = k.data();
            let Some(ip) = data.ip() else { continue };
            let prefix = k.prefix_len().saturating_sub(REMOTE_FIXED_BITS);
            out.insert((ip, u8::try_from(prefix).unwrap_or(u8::MAX)), v);
        }
        Ok(out)
    }

    fn remove(&mut self, cidr: RemoteCidr) -> Result<bool> {
        removed(self.nets.remove(&key(cidr)), || {
            format!("removing {}/{} from remote_nets", cidr.0, cidr.1)
        })
    }
}

impl Datapath {
    fn remote(&mut self) -> Result<&mut RemoteMaps> {
        self.remote.as_mut().ok_or(Error::Missing {
            kind: "map",
            name: "remote_nets (the datapath was opened without it)",
        })
    }

    /// Removes every `remote_nets` entry that `want` does not hold as it is
    /// (a CIDR gone, or routed otherwise). How many went.
    pub fn prune_remote_nets(&mut self, want: &BTreeMap<RemoteCidr, RemoteNet>) -> Result<usize> {
        self.retain_remote_nets(|cidr, have| want.get(&cidr) == Some(have))
    }

    /// Removes every `remote_nets` entry `keep` refuses: what a routing pass
    /// does before it changes the routes (an entry whose route goes, or
    /// changes its next hop, goes first). How many went.
    pub fn retain_remote_nets(
        &mut self,
        keep: impl Fn(RemoteCidr, &RemoteNet) -> bool,
    ) -> Result<usize> {
        let remote = self.remote()?;
        let mut n = 0;
        for (cidr, have) in remote.entries()? {
            if !keep(cidr, &have) && remote.remove(cidr)? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Makes `remote_nets` equal `want` (after the routes are in place).
    /// A full map leaves the CIDRs it could not take to the kernel path
    /// and says so.
    pub fn sync_remote_nets(
        &mut self,
        want: &BTreeMap<RemoteCidr, RemoteNet>,
    ) -> Result<RemoteSynced> {
        let mut done = RemoteSynced {
            removed: self.prune_remote_nets(want)?,
            ..Default::default()
        };
        let remote = self.remote()?;
        let have = remote.entries()?;
        for (cidr, v) in want {
            if have.get(cidr) == Some(v) {
                continue;
            }
            remote.nets.insert(&key(*cidr), *v, 0).map_err(|e| {
                let what = format!("adding {}/{} to remote_nets", cidr.0, cidr.1);
                if is_full(&e) {
                    Error::MapFull {
                        map: "remote_nets",
                        capacity: MAX_REMOTE_NETS,
                        op: what,
                    }
                } else {
                    Error::map(what, e)
                }
            })?;
            done.written += 1;
        }
        Ok(done)
    }

    /// Attaches the program that delivers other nodes' pods' packets to
    /// device `ifindex` (its tcx ingress, last), through a pinned link;
    /// a live link runs this build's program after it. Whether anything
    /// changed.
    pub fn attach_uplink(&mut self, ifindex: u32) -> Result<bool> {
        let changed = self.attach_uplink_program(ifindex)?;
        // After the program: a flow it may make has its replies caught.
        self.remote()?.mark_uplink(ifindex, true)?;
        Ok(changed)
    }

    fn attach_uplink_program(&mut self, ifindex: u32) -> Result<bool> {
        // Its counters of its own, before its first packet.
        self.maps.claim_slot(ifindex)?;
        let pin = link_pin(&self.pin_dir, ifindex, LinkKind::Uplink);
        let prog = self.tc_from_node.as_mut().ok_or(Error::Missing {
            kind: "program",
            name: super::TC_FROM_NODE_PROGRAM,
        })?;
        let want = prog
            .info()
            .map_err(|e| Error::program("program info", e))?
            .id();
        if pin.exists() {
            match LinkKind::Uplink.state(&pin) {
                Ok(s) if s.ifindex == ifindex && s.prog_id == want => return Ok(false),
                Ok(s) if s.ifindex == ifindex => {
                    let fd = prog.fd().map_err(|e| Error::program("tc program fd", e))?;
                    sys::update_pinned_link(&pin, fd.as_fd()).map_err(|e| Error::Link {
                        op: "swapping the uplink program",
                        path: pin.clone(),
                        message: e.to_string(),
                    })?;
                    return Ok(true);
                }
                _ => fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?,
            }
        }
        let ifname = ifname_of(ifindex)?;
        let id = prog
            .attach_with_options(
                &ifname,
                TcAttachType::Ingress,
                TcAttachOptions::TcxOrder(LinkOrder::last()),
            )
            .map_err(|e| Error::program(format!("attaching the uplink program to {ifname}"), e))?;
        let link = prog
            .take_link(id)
            .map_err(|e| Error::program("taking link", e))?;
        pin_link(link, &pin, "converting to an fd link (kernel without tcx?)")?;
        info!(ifindex, ifname, "uplink program attached");
        Ok(true)
    }

    /// Detaches the uplink program from `ifindex`, and frees its counter
    /// slot; whether it was there.
    pub fn detach_uplink(&mut self, ifindex: u32) -> Result<bool> {
        // Before the program goes: no new flow counts on it.
        self.remote()?.mark_uplink(ifindex, false)?;
        let was = unpin_link(&link_pin(&self.pin_dir, ifindex, LinkKind::Uplink))?;
        self.maps.remove_counters(ifindex)?;
        Ok(was)
    }

    /// Makes the devices the uplink program runs on exactly `want`: each
    /// attached (or its program swapped to this build's), every other
    /// detached. (attached or swapped, detached).
    pub fn sync_uplinks(&mut self, want: &[u32]) -> Result<(usize, usize)> {
        let mut done = (0, 0);
        for &ifindex in want {
            if self.attach_uplink(ifindex)? {
                done.0 += 1;
            }
        }
        for ifindex in self.uplinks()? {
            if !want.contains(&ifindex) && self.detach_uplink(ifindex)? {
                done.1 += 1;
            }
        }
        Ok(done)
    }

    /// The devices the uplink program is attached to (live links).
    pub fn uplinks(&self) -> Result<Vec<u32>> {
        Ok(link_pins(&self.pin_dir)?
            .into_iter()
            .filter(|(i, k, p)| *k == LinkKind::Uplink && k.is_live(p, *i))
            .map(|(i, _, _)| i)
            .collect())
    }
}
