//! Loading, pinning, attaching and feeding the XDP datapath.
//!
//! Pin layout under a directory on bpffs (default `/sys/fs/bpf/xdpcni`):
//!
//! ```text
//! layout-3/                                    this build's layout (XDPCNI_LAYOUT)
//!   meta                                       layout, state (filling/complete), build
//!   endpoints4 endpoints6 tx_ports cpu_map nat_ports   maps, pinned by name by aya
//!   epcache4 epcache6                          the endpoint records again, by slot (cache.rs)
//!   counters port_slots slot_owners                     per-veth counters (see xdpcni.h)
//!   policy_namespaces policy_gate                      what the CNI reads to hold a new pod
//!   pol_pods pol_peers pol_ports pol_named     NetworkPolicy verdicts of isolated pods
//!   pol_flows pol_state pol_stats              the flows they allowed, their generation, counts
//!   remote_nets                                other nodes' pod CIDRs and their routes (remote.rs)
//!   progs/xdpcni_from_pod progs/xdpcni_cpumap  the programs in use
//!   progs/xdpcni_hold                          the tc program of a held pod
//!   progs/xdpcni_tc_from_pod                   the datapath on the tc hook (mode tc)
//!   progs/xdpcni_tc_from_node                  on the uplink: other nodes' pods to this node's
//! layout-2/                                    the previous release's names: aliases of
//!                                              layout-3's maps (less the cache) and programs
//! links/<ifindex>_native | _generic | _tc      one datapath bpf_link per host veth (XDP, or
//!                                              tcx ingress), shared by every layout (bpffs
//!                                              refuses names with dots); two mid-switch
//! links/<ifindex>_hold_ingress | _hold_egress  the two tcx links of a held pod
//! links/<ifindex>_uplink                       the tcx link of the uplink program
//! ```
//!
//! Each layout has its own directory so that binaries of two layouts never
//! share a map they do not both know: [`Datapath::open`] migrates the
//! previous layout it finds into its own (`crate::migrate`), and a binary
//! that finds only a layout it does not know leaves it alone. (Layout 1
//! pinned its maps in the pin directory itself; layout 2 kept those names as
//! aliases, which the migration to layout 3 removes.)
//!
//! Everything that carries traffic is pinned, so the process that loaded it
//! can exit (or crash) without detaching anything, and the next one reopens
//! the same objects: [`Datapath::open`] reuses pinned programs whose tag
//! matches the embedded object and swaps links atomically when it does not.

pub(crate) mod kfunc;
pub(crate) mod links;
mod load;
pub(crate) mod maps;
mod pod;
pub(crate) mod policy;
mod remote;
pub(crate) mod types;

use std::path::{Path, PathBuf};

use aya::programs::{SchedClassifier, Xdp};

pub use links::is_held;
pub use load::{datapath_loader, SHARED_SVC_MAPS};
pub use maps::{MapFill, Maps};
pub use pod::{Collected, NatSync, CPUMAP_QUEUE};
pub use policy::{PodVerdicts, PolicyMaps, PolicyStats, PolicySynced};
pub use remote::{RemoteCidr, RemoteMaps, RemoteSynced};
pub use types::{AttachMode, Attachment, Counters, Filled, HoldHook, L4Proto, Migration};

/// Name of the program attached to pod host veths.
pub const FROM_POD_PROGRAM: &str = "xdpcni_from_pod";
/// Name of the same datapath on the tc hook (tcx ingress of host veths).
pub const TC_FROM_POD_PROGRAM: &str = "xdpcni_tc_from_pod";
/// Name of the tc program on the devices other nodes' pods' packets come
/// in by (node.bpf.c).
pub const TC_FROM_NODE_PROGRAM: &str = "xdpcni_tc_from_node";
/// Name of the cpumap second-stage program.
pub const CPUMAP_PROGRAM: &str = "xdpcni_cpumap";
/// Name of the tc program that holds a pod until the agent classifies it.
pub const HOLD_PROGRAM: &str = "xdpcni_hold";
/// Default pin directory.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/xdpcni";

/// The directory of this build's layout under `pin_dir`: its maps and
/// `progs/` (the links stay in `pin_dir/links`, shared by every layout).
pub fn layout_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("layout-{}", crate::abi::LAYOUT))
}

/// The layout this build migrates from: the previous release's.
pub const PREVIOUS_LAYOUT: u32 = crate::abi::LAYOUT - 1;

/// The directory of the previous release's layout under `pin_dir`.
pub fn previous_layout_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("layout-{PREVIOUS_LAYOUT}"))
}

/// `e: its source: its source...`, since aya's errors put the errno in sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// The loaded datapath: programs, pinned links and maps.
pub struct Datapath {
    pub(crate) pin_dir: PathBuf,
    from_pod: Xdp,
    tc_from_pod: SchedClassifier,
    /// The uplink program; `None` where only the pins were opened.
    tc_from_node: Option<SchedClassifier>,
    cpumap: Xdp,
    pub(crate) hold: SchedClassifier,
    pub(crate) maps: Maps,
    /// The NetworkPolicy maps; `None` where only the pins were opened
    /// ([`Datapath::open_existing`]: the CNI plugin never writes them).
    policy: Option<PolicyMaps>,
    /// `remote_nets`; `None` where only the pins were opened.
    remote: Option<RemoteMaps>,
    upgraded: bool,
    migration: Option<Migration>,
}
