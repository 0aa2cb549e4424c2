//! The node side of a pod's attachment, in one place for both binaries that
//! make or change one: the `xdpcni` CNI plugin (at ADD: the veth, the hold)
//! and the `xdpcni-agent` (the fast path: a pod's mode, its endpoint records).
//!
//! - [`pod`]: what an attachment should be: the mode type, the per-mode
//!   offload table, the attach fallback order, cpumap CPU enabling, the
//!   endpoint record, MAC and CPU-list parsing and formatting.
//! - [`gate`]: whether a new pod is held until the agent classifies it (the
//!   CNI's NetworkPolicy gate).
//! - [`state`]: the per-attachment records the plugin writes and the agent
//!   reads; [`install`]: the CNI files on a node and their removal.
//! - [`source_check`]: the kernel path's check that pods send from their own
//!   addresses (what the datapath's `drop_spoofed` is on the fast path).
//! - [`nftable`]: the product's nftables table (NetworkPolicy rules) and
//!   its removal, over [`netfilter`] netlink.
//! - [`overlay`]: routing between nodes (host-gateway, VXLAN, auto): the
//!   modes, the VXLAN device, the pod MTU it leaves, the published VTEP.
//! - [`netlink`]: the product's one netlink socket, generic over the family,
//!   and synchronous route netlink's verbs (links, addresses, routes,
//!   neighbours, FDB) for the plugin, the agent and `uninstall`.
//! - [`ethtool`], [`netns`]: the two system calls the above need inside pods.
//! - [`sockets`]: a namespace's connected UDP sockets (`sock_diag`), and
//!   closing those whose Service backend went.
//! - [`netconf`]: the plugin's entry of the conflist, typed once for
//!   install-cni (which writes it) and the plugin (which reads it), with the
//!   defaults and ranges of its settings.
//! - [`hook`]: the named crash points the tests stop a process at.

pub mod ethtool;
pub mod gate;
pub mod hook;
pub mod install;
pub mod netconf;
pub mod netfilter;
pub mod netlink;
pub mod netns;
pub mod nftable;
pub mod overlay;
pub mod pod;
pub mod sockets;
pub mod source_check;
pub mod state;
