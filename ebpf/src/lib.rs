//! xdpcni's XDP datapath.
//!
//! The C programs live in `src/*.bpf.c` and share every key, value and
//! constant through `include/xdpcni.h`; `build.rs` compiles them with clang
//! and this crate embeds the object ([`DATAPATH_OBJECT`]). [`abi`] holds the
//! `#[repr(C)]` twins of the shared structs, [`Datapath`] loads, pins and
//! attaches the programs, and [`Maps`] opens the pinned maps alone;
//! [`Pinned`] says what is pinned without opening it for writing, and
//! `migrate` moves an older layout into this build's.

mod bpffs;
mod datapath;
mod error;
mod migrate;
mod svc;
mod sys;

pub mod abi;

pub use bpffs::{is_bpffs, mount_bpffs};
pub use datapath::Migration;
pub use datapath::{
    datapath_loader, is_held, layout_dir, previous_layout_dir, AttachMode, Attachment, Collected,
    Counters, Datapath, Filled, HoldHook, L4Proto, MapFill, Maps, NatSync, PodVerdicts, PolicyMaps,
    PolicyStats, PolicySynced, RemoteCidr, RemoteMaps, RemoteSynced, CPUMAP_PROGRAM, CPUMAP_QUEUE,
    DEFAULT_PIN_DIR, FROM_POD_PROGRAM, HOLD_PROGRAM, PREVIOUS_LAYOUT, SHARED_SVC_MAPS,
    TC_FROM_NODE_PROGRAM, TC_FROM_POD_PROGRAM,
};
pub use error::{Error, Result};
pub use migrate::Pinned;
pub use svc::{
    cgroup2_root, make_nat_table, monotonic_ns, plan as plan_services, svc_layout_dir,
    Ids as ServiceIds, Op as ServiceOp, ServiceEntry, ServiceStats, Services, SourceRanges,
    Want as ServiceWant, MAX_SVC_NAT_CAPACITY, MIN_SVC_NAT, SERVICES_OBJECT, SOCK_PROGRAMS,
    SVC_LEASE_SECS,
};
pub use sys::{ifname, LinkState};

/// What the kernel holds, by id: how the tests show that a migration left
/// no map or program behind.
pub mod objects {
    pub use crate::sys::{object_exists, pinned_id};
}

/// The compiled datapath object (BPF ELF with BTF), as built by `build.rs`.
pub static DATAPATH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni.bpf.o"));

/// The datapath built with `-DXDPCNI_UPGRADE_TEST`: identical behaviour,
/// different instructions (so a different program tag). Tests open it over a
/// running datapath to exercise [`Datapath::open_object`]'s in-place upgrade.
#[cfg(feature = "test-objects")]
pub static UPGRADE_TEST_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni-upgrade-test.bpf.o"));

/// The stage-cost builds of the datapath: `STAGE_OBJECTS[n]` runs the fast
/// path's stages up to and including stage `n` (0 entry, 1 parse, 2 source
/// check, 3 decide, then XDP: 4 redirect target, 5 rewrite; tc: 4 rewrite,
/// 5 redirect) and returns the hook's pass there, counting nothing; the
/// product object adds the counters. Same maps as the datapath: they open
/// its pins. What a stage costs is the difference between consecutive
/// builds on one frame (the e2e crate's `cost` module).
#[cfg(feature = "test-objects")]
pub static STAGE_OBJECTS: [&[u8]; 6] = [
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni-stage0.bpf.o")),
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni-stage1.bpf.o")),
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni-stage2.bpf.o")),
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni-stage3.bpf.o")),
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni-stage4.bpf.o")),
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdpcni-stage5.bpf.o")),
];

/// A benchmark helper object (not the datapath): `xdp_drop_count` drops
/// every frame and counts it in the per-CPU array `drop_count`.
#[cfg(feature = "test-objects")]
pub static BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bench.bpf.o"));

/// Map-level writes and links for tests that build a datapath by hand
/// (hand-made records, a devmap entry removed to prove a redirect's target,
/// counter slots claimed by the thousand). Only with the `test-objects`
/// feature, which only the e2e crate turns on: the product writes a pod's
/// state through the verbs of `datapath/pod.rs`, which keep the order the
/// programs rely on, and `scripts/test.sh` builds the node's crates alone to
/// prove none of them needs this.
#[cfg(feature = "test-objects")]
pub mod testing {
    use std::net::IpAddr;

    use crate::{abi::EndpointInfo, AttachMode, Attachment, Datapath, L4Proto, Maps, Result};

    /// The datapath object with its conntrack kfunc calls left out (each
    /// `r0 = 0`, `xdpcni_ct_kfuncs` left 0): loaded, every flow on a NAT'd
    /// port takes the kernel path without conntrack being asked, as before
    /// the exact NAT check (the baseline its cost is measured against).
    pub fn datapath_without_ct_kfuncs() -> Result<impl AsRef<[u8]>> {
        crate::datapath::kfunc::bind(crate::DATAPATH_OBJECT, None)
    }

    /// Raw writes of [`Maps`], for tests.
    pub trait RawMaps {
        /// `Maps::upsert_endpoint`: one record, as given.
        fn raw_upsert_endpoint(&mut self, addr: IpAddr, info: &EndpointInfo) -> Result<()>;
        /// `Maps::remove_endpoint`.
        fn raw_remove_endpoint(&mut self, addr: IpAddr) -> Result<bool>;
        /// `Maps::add_tx_port`.
        fn raw_add_tx_port(&mut self, ifindex: u32) -> Result<()>;
        /// `Maps::remove_tx_port`.
        fn raw_remove_tx_port(&mut self, ifindex: u32) -> Result<bool>;
        /// `Maps::add_nat_port`.
        fn raw_add_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<()>;
        /// `Maps::remove_nat_port`.
        fn raw_remove_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<bool>;
        /// `Maps::refresh_nat_flags`.
        fn raw_refresh_nat_flags(&mut self) -> Result<usize>;
        /// `Maps::claim_slot`.
        fn raw_claim_slot(&mut self, ifindex: u32) -> Result<u32>;
        /// `Maps::remove_counters`.
        fn raw_remove_counters(&mut self, ifindex: u32) -> Result<()>;
        /// `Maps::write_policy_gate`.
        fn raw_write_policy_gate(
            &mut self,
            want: &std::collections::BTreeMap<String, u32>,
        ) -> Result<()>;
        /// The hash record of `addr` written as given and its cache slot left
        /// alone: what a writer of the previous layout does.
        fn raw_write_hash_only(&mut self, addr: IpAddr, info: &EndpointInfo) -> Result<()>;
        /// `Maps::refresh_cache`.
        fn raw_refresh_cache(&mut self) -> Result<usize>;
    }

    impl RawMaps for Maps {
        fn raw_upsert_endpoint(&mut self, addr: IpAddr, info: &EndpointInfo) -> Result<()> {
            self.upsert_endpoint(addr, info)
        }
        fn raw_remove_endpoint(&mut self, addr: IpAddr) -> Result<bool> {
            self.remove_endpoint(addr)
        }
        fn raw_add_tx_port(&mut self, ifindex: u32) -> Result<()> {
            self.add_tx_port(ifindex)
        }
        fn raw_remove_tx_port(&mut self, ifindex: u32) -> Result<bool> {
            self.remove_tx_port(ifindex)
        }
        fn raw_add_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<()> {
            self.add_nat_port(addr, proto, port)
        }
        fn raw_remove_nat_port(&mut self, addr: IpAddr, proto: L4Proto, port: u16) -> Result<bool> {
            self.remove_nat_port(addr, proto, port)
        }
        fn raw_refresh_nat_flags(&mut self) -> Result<usize> {
            self.refresh_nat_flags()
        }
        fn raw_claim_slot(&mut self, ifindex: u32) -> Result<u32> {
            self.claim_slot(ifindex)
        }
        fn raw_remove_counters(&mut self, ifindex: u32) -> Result<()> {
            self.remove_counters(ifindex)
        }
        fn raw_write_policy_gate(
            &mut self,
            want: &std::collections::BTreeMap<String, u32>,
        ) -> Result<()> {
            self.write_policy_gate(want)
        }
        fn raw_write_hash_only(&mut self, addr: IpAddr, info: &EndpointInfo) -> Result<()> {
            self.put_endpoint(addr, info, "writing")
        }
        fn raw_refresh_cache(&mut self) -> Result<usize> {
            self.refresh_cache()
        }
    }

    /// Raw link and map access of a [`Datapath`], for tests.
    pub trait RawDatapath {
        /// The maps, writable through [`RawMaps`].
        fn raw_maps(&mut self) -> &mut Maps;
        /// `Datapath::attach` without the records check of `switch_mode`.
        fn raw_attach(&mut self, ifindex: u32, mode: AttachMode) -> Result<Attachment>;
        /// `Datapath::detach`.
        fn raw_detach(&mut self, ifindex: u32) -> Result<bool>;
        /// `Datapath::gc_links`.
        fn raw_gc_links(&mut self) -> Result<Vec<u32>>;
        /// `Datapath::enable_cpu`.
        fn raw_enable_cpu(&mut self, cpu: u32, queue_size: u32) -> Result<()>;
        /// `Datapath::disable_cpu`.
        fn raw_disable_cpu(&mut self, cpu: u32) -> Result<()>;
    }

    impl RawDatapath for Datapath {
        fn raw_maps(&mut self) -> &mut Maps {
            &mut self.maps
        }
        fn raw_attach(&mut self, ifindex: u32, mode: AttachMode) -> Result<Attachment> {
            self.attach(ifindex, mode)
        }
        fn raw_detach(&mut self, ifindex: u32) -> Result<bool> {
            self.detach(ifindex)
        }
        fn raw_gc_links(&mut self) -> Result<Vec<u32>> {
            self.gc_links()
        }
        fn raw_enable_cpu(&mut self, cpu: u32, queue_size: u32) -> Result<()> {
            self.enable_cpu(cpu, queue_size)
        }
        fn raw_disable_cpu(&mut self, cpu: u32) -> Result<()> {
            self.disable_cpu(cpu)
        }
    }
}
