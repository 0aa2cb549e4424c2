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
mod sys;

pub mod abi;

pub use bpffs::{is_bpffs, mount_bpffs};
pub use datapath::{
    is_held, layout_dir, AttachMode, Attachment, Counters, Datapath, Filled, HoldHook, L4Proto,
    MapFill, Maps, CPUMAP_PROGRAM, DEFAULT_PIN_DIR, FROM_POD_PROGRAM, HOLD_PROGRAM,
    TC_FROM_POD_PROGRAM,
};
pub use error::{Error, Result};
pub use migrate::{Migration, Pinned};
pub use sys::LinkState;

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

/// A benchmark helper object (not the datapath): `xdp_drop_count` drops
/// every frame and counts it in the per-CPU array `drop_count`.
#[cfg(feature = "test-objects")]
pub static BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bench.bpf.o"));
