//! Every write of the pinned maps, private to this crate: the lifecycle
//! verbs of `datapath/pod.rs` (a pod's state), the loader (`meta`) and the
//! migration are their only callers, so the order the programs rely on has
//! one home.

use std::net::IpAddr;

use aya::maps::{MapError, PerCpuValues};
use tracing::warn;

use super::{is_full, nat_key, removed, row, MapName, Maps, NOEXIST};
use crate::{
    abi::{
        ipv4_key, DatapathMeta, Endpoint6Key, EndpointInfo, PolicyNsKey, StatsValue, Verdict,
        EP_NO_NAT_PORTS, MAX_CPUS, MAX_SLOTS,
    },
    datapath::types::L4Proto,
    Error, Result,
};

impl Maps {
    pub(crate) fn set_meta(&mut self, meta: DatapathMeta) -> Result<()> {
        self.meta
            .set(0, meta, 0)
            .map_err(|e| Error::map("writing the datapath's meta", e))
    }

    /// Makes `policy_namespaces` list exactly `want` (namespace -> number of
    /// policies), then marks the gate complete. Additions go before
    /// removals, so a namespace never looks free of policies on the way;
    /// when the list cannot be written (a full map, a name that does not
    /// fit), the gate is marked incomplete instead and the error returned:
    /// every new pod is then held (the safe side).
    pub(crate) fn write_policy_gate(
        &mut self,
        want: &std::collections::BTreeMap<String, u32>,
    ) -> Result<()> {
        let written = self.write_policy_namespaces(want);
        let mut gate = self.policy_gate()?;
        gate.complete = u32::from(written.is_ok());
        gate.pad = 0;
        gate.generation = gate.generation.wrapping_add(1);
        self.policy_gate
            .set(0, gate, 0)
            .map_err(|e| Error::map("writing the policy gate", e))?;
        written
    }

    fn write_policy_namespaces(
        &mut self,
        want: &std::collections::BTreeMap<String, u32>,
    ) -> Result<()> {
        let have = self.policy_namespaces()?;
        for (ns, n) in want {
            if have.get(ns) == Some(n) {
                continue;
            }
            let key = PolicyNsKey::of(ns).ok_or_else(|| Error::Invalid {
                what: "namespace",
                why: format!(
                    "{ns:?} does not fit in {} bytes",
                    crate::abi::NS_NAME_LEN - 1
                ),
            })?;
            self.policy_namespaces.insert(key, n, 0).map_err(|e| {
                let op = format!("listing policy namespace {ns}");
                if is_full(&e) {
                    Error::MapFull {
                        map: MapName::PolicyNamespaces.as_str(),
                        capacity: crate::abi::c_layout::XDPCNI_MAX_POLICY_NS,
                        op,
                    }
                } else {
                    Error::map(op, e)
                }
            })?;
        }
        for ns in have.keys().filter(|ns| !want.contains_key(*ns)) {
            if let Some(key) = PolicyNsKey::of(ns) {
                removed(self.policy_namespaces.remove(&key), || {
                    format!("unlisting policy namespace {ns}")
                })?;
            }
        }
        Ok(())
    }

    /// Inserts or replaces the endpoint record of `addr`. The fields the maps
    /// own are filled in here: `stats_slot` (its veth's counter slot, claimed
    /// on first use) and [`EP_NO_NAT_PORTS`] (set when `nat_ports` holds no
    /// port of `addr`); the caller's values of both are ignored.
    pub(crate) fn upsert_endpoint(&mut self, addr: IpAddr, info: &EndpointInfo) -> Result<()> {
        if info.cpu_mask != 0 && info.cpu_mask >> MAX_CPUS.min(63) > 1 {
            return Err(Error::Invalid {
                what: "cpu_mask",
                why: format!("{:#x} names CPUs beyond {}", info.cpu_mask, MAX_CPUS - 1),
            });
        }
        let mut info = *info;
        info.stats_slot = self.claim_slot(info.ifindex)?;
        info.flags &= !EP_NO_NAT_PORTS;
        if !self.has_nat_port(addr)? {
            info.flags |= EP_NO_NAT_PORTS;
        }
        self.change_record(addr, Some(&info), |m| {
            m.put_endpoint(addr, &info, "inserting")
        })
    }

    /// Writes a record as given, in the map of its family (callers go
    /// through [`Maps::change_record`], which keeps the cache in step);
    /// `doing` names the change in an error.
    pub(crate) fn put_endpoint(
        &mut self,
        addr: IpAddr,
        info: &EndpointInfo,
        doing: &str,
    ) -> Result<()> {
        let r = match addr {
            IpAddr::V4(v4) => self.endpoints4.insert(ipv4_key(v4), info, 0),
            IpAddr::V6(v6) => self
                .endpoints6
                .insert(Endpoint6Key { addr: v6.octets() }, info, 0),
        };
        r.map_err(|e| {
            let op = format!("{doing} endpoint {addr}");
            if is_full(&e) {
                Error::MapFull {
                    map: match addr {
                        IpAddr::V4(_) => MapName::Endpoints4.as_str(),
                        IpAddr::V6(_) => MapName::Endpoints6.as_str(),
                    },
                    capacity: crate::abi::c_layout::XDPCNI_MAX_ENDPOINTS,
                    op,
                }
            } else {
                Error::map(op, e)
            }
        })
    }

    /// Flags the record of `addr`, if any, kernel-only: no program
    /// redirects to or from it any more. Whether there was one.
    pub(crate) fn flag_kernel_only(&mut self, addr: IpAddr) -> Result<bool> {
        let Some(mut info) = self.endpoint(addr)? else {
            return Ok(false);
        };
        if info.flags & crate::abi::EP_KERNEL_ONLY != 0 {
            return Ok(true);
        }
        info.flags |= crate::abi::EP_KERNEL_ONLY;
        self.change_record(addr, Some(&info), |m| {
            m.put_endpoint(addr, &info, "flagging kernel-only")
        })?;
        Ok(true)
    }

    /// Sets or clears [`EP_NO_NAT_PORTS`] on the record of `addr`, if any.
    fn set_no_nat(&mut self, addr: IpAddr, no_nat: bool) -> Result<()> {
        let Some(mut info) = self.endpoint(addr)? else {
            return Ok(());
        };
        let flags = if no_nat {
            info.flags | EP_NO_NAT_PORTS
        } else {
            info.flags & !EP_NO_NAT_PORTS
        };
        if flags == info.flags {
            return Ok(());
        }
        info.flags = flags;
        self.change_record(addr, Some(&info), |m| {
            m.put_endpoint(addr, &info, "flagging")
        })
    }

    /// Makes every endpoint's [`EP_NO_NAT_PORTS`] agree with `nat_ports`:
    /// repairs what a writer racing a NAT port change may have left. Returns
    /// how many records changed.
    pub(crate) fn refresh_nat_flags(&mut self) -> Result<usize> {
        let natted: std::collections::HashSet<IpAddr> =
            self.nat_ports()?.into_iter().map(|(ip, _, _)| ip).collect();
        let mut changed = 0;
        for (ip, info) in self.endpoints()? {
            let want = !natted.contains(&ip);
            if (info.flags & EP_NO_NAT_PORTS != 0) != want {
                self.set_no_nat(ip, want)?;
                changed += 1;
            }
        }
        Ok(changed)
    }

    /// The counter slot of `ifindex`, claimed if it has none: the first free
    /// slot, taken with `BPF_NOEXIST` in `slot_owners` so that concurrent
    /// writers (parallel CNI ADDs, the agent) never share one. Its rows start
    /// at zero. With every slot taken, the shared slot 0 (and a warning).
    pub(crate) fn claim_slot(&mut self, ifindex: u32) -> Result<u32> {
        if let Some(s) = self.slot(ifindex)? {
            return Ok(s);
        }
        for slot in 1..MAX_SLOTS {
            match self.slot_owners.insert(slot, ifindex, NOEXIST) {
                Ok(()) => {}
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
                {
                    // Taken; ours only if a claim of this ifindex stopped
                    // half way (between the two inserts).
                    if self.slot_owners.get(&slot, 0).ok() != Some(ifindex) {
                        continue;
                    }
                }
                Err(e) => return Err(Error::map(format!("claiming counter slot {slot}"), e)),
            }
            self.zero_slot(slot)?;
            self.port_slots
                .insert(ifindex, slot, 0)
                .map_err(|e| Error::map(format!("recording counter slot of {ifindex}"), e))?;
            return Ok(slot);
        }
        warn!(
            ifindex,
            capacity = MAX_SLOTS - 1,
            "every counter slot is taken: this veth counts in the shared slot 0"
        );
        Ok(0)
    }

    fn zero_slot(&mut self, slot: u32) -> Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(path, e)| Error::io("reading", path, e))?;
        for &v in Verdict::ALL {
            let zero = PerCpuValues::try_from(vec![StatsValue::default(); cpus]).map_err(|e| {
                Error::io(
                    "sizing per-CPU counters from",
                    "/sys/devices/system/cpu/possible",
                    e,
                )
            })?;
            self.counters
                .set(row(slot, v), zero, 0)
                .map_err(|e| Error::map(format!("zeroing counter slot {slot}"), e))?;
        }
        Ok(())
    }

    /// Removes the endpoint record of `addr`; `Ok(false)` if there was none.
    pub(crate) fn remove_endpoint(&mut self, addr: IpAddr) -> Result<bool> {
        self.change_record(addr, None, |m| {
            let r = match addr {
                IpAddr::V4(v4) => m.endpoints4.remove(&ipv4_key(v4)),
                IpAddr::V6(v6) => m.endpoints6.remove(&Endpoint6Key { addr: v6.octets() }),
            };
            removed(r, || format!("removing endpoint {addr}"))
        })
    }

    /// Removes every endpoint record pointing at host veth `ifindex`, named
    /// anywhere or not (an ADD killed before it saved its addresses leaves
    /// records nobody lists); the addresses removed.
    pub(crate) fn remove_endpoints_of(&mut self, ifindex: u32) -> Result<Vec<IpAddr>> {
        let mine: Vec<IpAddr> = self
            .endpoints()?
            .into_iter()
            .filter(|(_, e)| e.ifindex == ifindex)
            .map(|(ip, _)| ip)
            .collect();
        for ip in &mine {
            self.remove_endpoint(*ip)?;
        }
        Ok(mine)
    }

    /// Makes host veth `ifindex` a redirect target (devmap entry).
    pub(crate) fn add_tx_port(&mut self, ifindex: u32) -> Result<()> {
        self.tx_ports
            .insert(ifindex, ifindex, None, 0)
            .map_err(|e| Error::XdpMap {
                op: format!("adding tx port {ifindex}"),
                source: Box::new(e),
            })
    }

    /// Removes host veth `ifindex` from the redirect targets.
    pub(crate) fn remove_tx_port(&mut self, ifindex: u32) -> Result<bool> {
        removed(self.tx_ports.remove(ifindex), || {
            format!("removing tx port {ifindex}")
        })
    }

    /// Sends replies from `(addr, proto, port)` to the kernel, which may NAT them.
    /// Clears the address's [`EP_NO_NAT_PORTS`] first, so no packet skips a
    /// lookup that would now match.
    pub(crate) fn add_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<()> {
        self.set_no_nat(addr, false)?;
        let key = nat_key(addr, proto, port);
        self.nat_ports.insert(key, 1, 0).map_err(|e| {
            let op = format!("adding NAT port {addr} {proto:?}/{port}");
            if is_full(&e) {
                Error::MapFull {
                    map: MapName::NatPorts.as_str(),
                    capacity: crate::abi::c_layout::XDPCNI_MAX_NAT_PORTS,
                    op,
                }
            } else {
                Error::map(op, e)
            }
        })
    }

    /// Undoes [`Maps::add_nat_port`].
    /// Undoes [`Maps::add_nat_port`]. The address's record keeps looking its
    /// ports up (the safe side) until [`Maps::refresh_nat_flags`], which the
    /// agent runs after each batch of changes: one scan per batch, not one
    /// per removed port.
    pub(crate) fn remove_nat_port(
        &mut self,
        addr: IpAddr,
        proto: L4Proto,
        port: u16,
    ) -> Result<bool> {
        removed(self.nat_ports.remove(&nat_key(addr, proto, port)), || {
            format!("removing NAT port {addr}/{port}")
        })
    }

    /// Forgets the counters of `ifindex` (its veth is gone) and frees its slot.
    pub(crate) fn remove_counters(&mut self, ifindex: u32) -> Result<()> {
        let Some(slot) = self.slot(ifindex)? else {
            return Ok(());
        };
        if slot != 0 {
            self.zero_slot(slot)?;
        }
        removed(self.port_slots.remove(&ifindex), || {
            format!("removing the counter slot of {ifindex}")
        })?;
        if slot != 0 && self.slot_owners.get(&slot, 0).ok() == Some(ifindex) {
            removed(self.slot_owners.remove(&slot), || {
                format!("freeing counter slot {slot}")
            })?;
        }
        Ok(())
    }
}
