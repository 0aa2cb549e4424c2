//! The fast path between nodes in the status: whether it runs on this node
//! (or why not), how many other nodes' pod CIDRs it reaches, and each
//! device its receiving program runs on, with that device's counters.

use serde::{Deserialize, Serialize};

use super::Counts;

/// One device the uplink program runs on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UplinkStatus {
    /// The device's name.
    pub interface: String,
    /// Its ifindex.
    pub ifindex: u32,
    /// Its program's counters: `forward` is from_node_peer (delivered to a
    /// pod), `kernel` the node's own traffic and everything else left to
    /// the stack, by verdict (filled at request time; absent in the book).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<Counts>,
}

/// The fast path between nodes on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CrossNodeStatus {
    /// Whether the last routing pass left it on.
    pub on: bool,
    /// Why it is off (config, node, bad_annotation, nat_ports), if it is.
    pub off: Option<String>,
    /// Other nodes' pod CIDRs it sends to (host-gateway routes in place).
    pub destinations: usize,
    /// The devices its receiving program runs on.
    pub uplinks: Vec<UplinkStatus>,
}

impl CrossNodeStatus {
    /// The line of the status table.
    pub(super) fn summary(&self) -> String {
        if let Some(why) = &self.off {
            return format!("between nodes off ({why}): the kernel routes to other nodes' pods");
        }
        if !self.on {
            return "between nodes: no routing pass yet".into();
        }
        let uplinks: Vec<String> = self
            .uplinks
            .iter()
            .map(|u| match &u.counters {
                Some(c) => format!(
                    "{} ({} delivered, {} to the kernel)",
                    u.interface, c.forward, c.kernel
                ),
                None => u.interface.clone(),
            })
            .collect();
        format!(
            "between nodes on: {} pod CIDRs, receiving on {}",
            self.destinations,
            if uplinks.is_empty() {
                "no device".to_string()
            } else {
                uplinks.join(", ")
            }
        )
    }
}
