//! A node made of network namespaces: a "node" namespace holding the host
//! ends of the pods' veths (where the datapath attaches), and one namespace
//! per pod with its eth0, addresses, a link-local gateway and routes, wired
//! the way the CNI plugin wires real pods. IP forwarding is off in the node
//! namespace, so traffic between pods can only cross it through XDP.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use xdpcni_ebpf::testing::RawMaps;

use anyhow::{Context, Result};
use xdpcni_ebpf::{abi::EndpointInfo, abi::RedirectPolicy, AttachMode, Maps};

use crate::netns::{unique_name, Netns};

/// IPv4 gateway the pods route through (answered by a static neighbour).
pub const GW4: &str = "169.254.1.1";
/// IPv6 gateway the pods route through.
pub const GW6: &str = "fe80::1";

/// One pod: its namespace and both ends of its veth.
#[derive(Debug)]
pub struct Pod {
    /// The pod's namespace (its interface is `eth0`).
    pub ns: Netns,
    /// Host-side veth name, in the node namespace.
    pub host_veth: String,
    /// Host-side veth ifindex, in the node namespace.
    pub host_ifindex: u32,
    /// Host-side veth MAC.
    pub host_mac: [u8; 6],
    /// The pod's eth0 MAC.
    pub pod_mac: [u8; 6],
    /// The pod's IPv4 address.
    pub ipv4: Ipv4Addr,
    /// The pod's IPv6 address.
    pub ipv6: Ipv6Addr,
}

impl Pod {
    /// The endpoint record the CNI plugin would register for this pod.
    pub fn endpoint(&self, redirect: RedirectPolicy, cpu_mask: u64) -> EndpointInfo {
        EndpointInfo {
            ifindex: self.host_ifindex,
            pod_mac: self.pod_mac,
            host_mac: self.host_mac,
            flags: 0,
            redirect: redirect.as_raw(),
            mtu: 1500,
            stats_slot: 0,
            cpu_mask,
        }
    }

    /// Both addresses.
    pub fn addrs(&self) -> [IpAddr; 2] {
        [IpAddr::V4(self.ipv4), IpAddr::V6(self.ipv6)]
    }

    /// Applies the pod side of `mode` as the CNI plugin and agent do
    /// (`xdpcni_host::pod::offloads`, the one home of that table).
    pub fn apply_mode_offloads(&self, mode: AttachMode) -> Result<()> {
        let settings = xdpcni_host::pod::offloads(xdpcni_host::pod::XdpMode::from(mode));
        xdpcni_host::pod::set_offloads(&self.ns.path(), "eth0", &settings)
            .with_context(|| format!("{mode} offloads on eth0 in {}", self.ns.name()))
    }
}

/// The node namespace and its pods, wired by hand (no CNI, no agent: see
/// [`crate::node::Node`] for a node made the way a cluster makes one).
#[derive(Debug)]
pub struct WiredNode {
    /// Pods first: dropped before the node namespace.
    pub pods: Vec<Pod>,
    /// The node ("host") namespace.
    pub ns: Netns,
}

impl WiredNode {
    /// Builds a node with `n` pods (10.77.0.2.., fd77::2..).
    pub fn new(n: u8) -> Result<Self> {
        let ns = Netns::new("xn")?;
        ns.sysctl("net.ipv4.ip_forward", "0")?;
        ns.sysctl("net.ipv6.conf.all.forwarding", "0")?;
        let mut pods = Vec::new();
        for i in 0..n {
            pods.push(Self::add_pod(&ns, i + 2)?);
        }
        Ok(Self { pods, ns })
    }

    fn add_pod(node: &Netns, host: u8) -> Result<Pod> {
        let pod_ns = Netns::new("xp")?;
        let host_veth = unique_name("xh");
        let ipv4 = Ipv4Addr::new(10, 77, 0, host);
        let ipv6 = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, u16::from(host));
        node.add_veth(&host_veth, "eth0", Some(&pod_ns))?;
        node.ip(&["link", "set", &host_veth, "up"])?;
        let host_mac = node.mac(&host_veth)?;
        let host_mac_s = fmt_mac(&host_mac);
        let host_ifindex = node.ifindex(&host_veth)?;

        let v4 = format!("{ipv4}/32");
        let v6 = format!("{ipv6}/128");
        pod_ns.ip(&["link", "set", "eth0", "up"])?;
        pod_ns.ip(&["addr", "add", &v4, "dev", "eth0"])?;
        pod_ns.ip(&["-6", "addr", "add", &v6, "dev", "eth0", "nodad"])?;
        pod_ns.ip(&["route", "add", GW4, "dev", "eth0", "scope", "link"])?;
        pod_ns.ip(&["route", "add", "default", "via", GW4, "dev", "eth0"])?;
        pod_ns.ip(&[
            "neigh",
            "replace",
            GW4,
            "lladdr",
            &host_mac_s,
            "dev",
            "eth0",
            "nud",
            "permanent",
        ])?;
        pod_ns.ip(&["-6", "route", "add", "default", "via", GW6, "dev", "eth0"])?;
        pod_ns.ip(&[
            "-6",
            "neigh",
            "replace",
            GW6,
            "lladdr",
            &host_mac_s,
            "dev",
            "eth0",
            "nud",
            "permanent",
        ])?;
        let pod_mac = pod_ns.mac("eth0")?;
        // Kernel routes on the node: what would carry the traffic if
        // forwarding were on (it is not, in these tests).
        node.ip(&["route", "add", &v4, "dev", &host_veth])?;
        node.ip(&["-6", "route", "add", &v6, "dev", &host_veth])?;
        // The pods' static neighbour entries for each other are not needed:
        // they always send to the gateway MAC.
        Ok(Pod {
            ns: pod_ns,
            host_veth,
            host_ifindex,
            host_mac,
            pod_mac,
            ipv4,
            ipv6,
        })
    }

    /// Registers every pod as an endpoint (both addresses) with a devmap
    /// entry for its host veth. Call from a thread inside the node namespace.
    pub fn register_all(
        &self,
        maps: &mut Maps,
        redirect: RedirectPolicy,
        cpu_mask: u64,
    ) -> Result<()> {
        for pod in &self.pods {
            let info = pod.endpoint(redirect, cpu_mask);
            for addr in pod.addrs() {
                maps.raw_upsert_endpoint(addr, &info)
                    .with_context(|| format!("registering {addr}"))?;
            }
            maps.raw_add_tx_port(pod.host_ifindex)?;
        }
        Ok(())
    }
}

/// `aa:bb:...`
pub fn fmt_mac(m: &[u8; 6]) -> String {
    xdpcni_host::pod::Mac(*m).to_string()
}
