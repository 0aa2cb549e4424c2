//! The agent's configuration file (JSON), shared by every mode, and the node
//! defaults it names.

use std::{collections::HashMap, path::PathBuf};

use anyhow::{bail, Context, Result};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use xdpcni_ebpf::abi::RedirectPolicy;
use xdpcni_host::{
    overlay::RoutingMode,
    pod::{parse_cpu_list, XdpMode},
};

use crate::{records::Annotations, wish::Wish};

fn default_mode() -> String {
    xdpcni_host::pod::DEFAULT_MODE.as_str().into()
}

fn default_redirect() -> String {
    xdpcni_ebpf::abi::RedirectPolicy::default().as_str().into()
}

fn default_interval() -> u64 {
    500
}

fn default_forward_scan() -> u64 {
    10_000
}

/// Where /metrics, /healthz and /readyz are served unless `listen` says
/// otherwise: the node's loopback. The agent runs in the node's network
/// namespace, so any other address would be reachable from every pod;
/// scraping from elsewhere is an explicit choice (the chart's
/// `agent.listenAddress`).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9965";

fn default_listen() -> String {
    DEFAULT_LISTEN.into()
}

fn is_default_listen(v: &String) -> bool {
    *v == default_listen()
}

fn is_default_mode(v: &String) -> bool {
    *v == default_mode()
}

fn is_default_redirect(v: &String) -> bool {
    *v == default_redirect()
}

fn is_default_interval(v: &u64) -> bool {
    *v == default_interval()
}

fn is_default_forward_scan(v: &u64) -> bool {
    *v == default_forward_scan()
}

/// The agent's configuration file (JSON). Serialize writes what the file
/// would say, leaving out every field at its default (the tests and the
/// benchmark write their agents' files from it, an older release's agent
/// included, which refuses fields it does not know), so every field's name
/// and default has this one home.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Datapath pin directory.
    pub pin_dir: PathBuf,
    /// The CNI plugin's record directory (its `stateDir`).
    pub state_dir: PathBuf,
    /// Created once the node is reconciled (the CNI's `agentReadyFile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_file: Option<PathBuf>,
    /// Address of /metrics, /healthz, /readyz ([`DEFAULT_LISTEN`] if absent).
    #[serde(default = "default_listen", skip_serializing_if = "is_default_listen")]
    pub listen: String,
    /// Node default mode: one of [`XdpMode::ALL`] (default:
    /// [`xdpcni_host::pod::DEFAULT_MODE`], tc: docs/bench.md).
    #[serde(default = "default_mode", skip_serializing_if = "is_default_mode")]
    pub xdp_mode: String,
    /// Node default redirect: `devmap` (the default) or `cpumap`.
    #[serde(
        default = "default_redirect",
        skip_serializing_if = "is_default_redirect"
    )]
    pub redirect: String,
    /// Node default cpumap CPUs (empty: all online).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cpus: String,
    /// Standalone: JSON object `{"namespace/name" | "containerID": {annotations}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_file: Option<PathBuf>,
    /// Kubernetes: this node's name (default: the NODE_NAME variable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// install-cni: MTU of pod interfaces (default [`xdpcni_host::netconf::DEFAULT_MTU`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// install-cni: headroom asked of pod veths (default
    /// [`xdpcni_host::netconf::DEFAULT_HEADROOM`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headroom: Option<u16>,
    /// Period of the node-wide work (records, routes, NAT ports, GC) in
    /// milliseconds; pods are reconciled on their watch events.
    #[serde(
        default = "default_interval",
        skip_serializing_if = "is_default_interval"
    )]
    pub interval_ms: u64,
    /// How often the node's FORWARD rules are read for DROP/REJECT rules
    /// naming pods (which make them kernel-only); 0: never.
    #[serde(
        default = "default_forward_scan",
        skip_serializing_if = "is_default_forward_scan"
    )]
    pub forward_scan_ms: u64,
    /// How this node reaches the other nodes' pods (Kubernetes mode).
    #[serde(default, skip_serializing_if = "RoutingConfig::is_default")]
    pub routing: RoutingConfig,
    /// ClusterIP Services translated at the node's pods' sockets
    /// (Kubernetes mode; docs/services.md).
    #[serde(default, skip_serializing_if = "ServicesConfig::is_default")]
    pub services: ServicesConfig,
    /// NetworkPolicy verdicts in the datapath: pods a policy isolates keep
    /// the fast path, which enforces their policies (docs/netpol.md); off:
    /// such pods take the kernel path, where the nftables rules are.
    #[serde(default = "yes", skip_serializing_if = "is_yes")]
    pub policy_datapath: bool,
}

fn yes() -> bool {
    true
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if signature
fn is_yes(v: &bool) -> bool {
    *v
}

/// Where the Service programs attach when no path is given: the host's
/// cgroup mount (cgroup2 itself, or a v1 layout's `unified` beneath it).
pub const DEFAULT_CGROUP: &str = "/sys/fs/cgroup";

fn default_cgroup() -> PathBuf {
    PathBuf::from(DEFAULT_CGROUP)
}

fn default_translate() -> bool {
    true
}

/// The config's `services` object (the chart's `services`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServicesConfig {
    /// Translate ClusterIP Services at the socket (default true); false
    /// leaves every Service to kube-proxy.
    #[serde(default = "default_translate")]
    pub translate: bool,
    /// The cgroup v2 root, or the directory it is mounted under as
    /// `unified` (default [`DEFAULT_CGROUP`]).
    #[serde(default = "default_cgroup")]
    pub cgroup: PathBuf,
    /// The `service.kubernetes.io/service-proxy-name` this agent answers to:
    /// a Service labelled with another name (or any name, when unset) is
    /// left alone, as kube-proxy leaves it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_name: Option<String>,
    /// Translate the node's own sockets too (host processes, hostNetwork
    /// pods), with kube-proxy's source address (default false: kube-proxy
    /// keeps them).
    #[serde(default)]
    pub node_sockets: bool,
    /// The cluster's pod ranges, as kube-proxy's `clusterCIDR`: a node's
    /// call to a Service from a source outside them is masqueraded; none
    /// for a family: never (kube-proxy without a clusterCIDR).
    #[serde(default, rename = "clusterCIDRs")]
    pub cluster_cidrs: Vec<IpNet>,
    /// Answer the `healthCheckNodePort` of every LoadBalancer Service under
    /// `externalTrafficPolicy: Local`, as kube-proxy does (default false:
    /// kube-proxy answers them, and holds their ports).
    #[serde(default)]
    pub health_check_node_ports: bool,
    /// The node's uplinks, by name, on which the node device's program
    /// serves north-south Services (node ports, externalIPs, LoadBalancer
    /// IPs) to outside clients in BPF, for backends on this node and on
    /// other nodes whose route leaves by one of them (default none:
    /// kube-proxy serves them).
    #[serde(default, rename = "northSouthDevices")]
    pub north_south_devices: Vec<String>,
    /// Entries of the north-south NAT table (`svc_nat`, an LRU: two per
    /// flow), applied when the table is made (a node's first agent, or
    /// after `xdpcni-agent uninstall`): a table made already keeps its size.
    #[serde(default = "default_nat_capacity")]
    pub nat_capacity: u32,
}

fn default_nat_capacity() -> u32 {
    xdpcni_ebpf::abi::MAX_SVC_NAT
}

impl ServicesConfig {
    /// Whether north-south Services are served in BPF on some uplink.
    pub fn north_south(&self) -> bool {
        !self.north_south_devices.is_empty()
    }
}

impl ServicesConfig {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl Default for ServicesConfig {
    fn default() -> Self {
        Self {
            translate: default_translate(),
            cgroup: default_cgroup(),
            proxy_name: None,
            node_sockets: false,
            cluster_cidrs: Vec::new(),
            health_check_node_ports: false,
            north_south_devices: Vec::new(),
            nat_capacity: default_nat_capacity(),
        }
    }
}

fn default_routing() -> String {
    xdpcni_host::overlay::DEFAULT_ROUTING.as_str().into()
}

fn default_vni() -> u32 {
    xdpcni_host::overlay::DEFAULT_VNI
}

fn default_port() -> u16 {
    xdpcni_host::overlay::DEFAULT_PORT
}

/// The config's `routing` object (the chart's `routing`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RoutingConfig {
    /// `hostGateway`, `vxlan` or `auto` (default:
    /// [`xdpcni_host::overlay::DEFAULT_ROUTING`]).
    #[serde(default = "default_routing")]
    pub mode: String,
    /// The VXLAN network identifier, the same on every node.
    #[serde(default = "default_vni")]
    pub vni: u32,
    /// The VXLAN UDP port, the same on every node.
    #[serde(default = "default_port")]
    pub port: u16,
    /// Transmit checksum offload on the VXLAN device (default
    /// [`xdpcni_host::overlay::DEFAULT_TX_CHECKSUM_OFFLOAD`]).
    #[serde(default = "default_tx_checksum_offload")]
    pub tx_checksum_offload: bool,
    /// The fast path between nodes: tc sends other nodes' pods their
    /// packets, and delivers theirs, without the host stack where the
    /// kernel path would do the same (host-gateway and tunnel routes;
    /// docs/install.md).
    /// A Node annotated [`crate::routes::NODE_FAST_PATH_ANNOTATION`]
    /// `"false"` turns it off for that node.
    #[serde(default = "yes")]
    pub fast_path: bool,
}

fn default_tx_checksum_offload() -> bool {
    xdpcni_host::overlay::DEFAULT_TX_CHECKSUM_OFFLOAD
}

impl RoutingConfig {
    fn is_default(&self) -> bool {
        let d = Self::default();
        (
            &self.mode,
            self.vni,
            self.port,
            self.tx_checksum_offload,
            self.fast_path,
        ) == (&d.mode, d.vni, d.port, d.tx_checksum_offload, d.fast_path)
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            mode: default_routing(),
            vni: default_vni(),
            port: default_port(),
            tx_checksum_offload: default_tx_checksum_offload(),
            fast_path: true,
        }
    }
}

/// The routing a node runs, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    /// The mode.
    pub mode: RoutingMode,
    /// The VXLAN network identifier.
    pub vni: u32,
    /// The VXLAN UDP port.
    pub port: u16,
    /// Transmit checksum offload on the device.
    pub tx_checksum_offload: bool,
    /// The fast path between nodes (unless the Node turns it off).
    pub fast_path: bool,
}

impl Config {
    /// A config over `pin_dir` and `state_dir` with every other field at its
    /// default (what a file naming only those two gives).
    pub fn new(pin_dir: PathBuf, state_dir: PathBuf) -> Self {
        Self {
            pin_dir,
            state_dir,
            ready_file: None,
            listen: default_listen(),
            xdp_mode: default_mode(),
            redirect: default_redirect(),
            cpus: String::new(),
            pods_file: None,
            node_name: None,
            mtu: None,
            headroom: None,
            interval_ms: default_interval(),
            forward_scan_ms: default_forward_scan(),
            routing: RoutingConfig::default(),
            services: ServicesConfig::default(),
            policy_datapath: true,
        }
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &std::path::Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let cfg: Self = serde_json::from_slice(&bytes)
            .with_context(|| format!("parsing {}", path.display()))?;
        if cfg.services.health_check_node_ports && !cfg.services.translate {
            bail!(
                "{}: services.healthCheckNodePorts needs services.translate (the Service watch that counts each load balancer's local endpoints)",
                path.display()
            );
        }
        if !(xdpcni_ebpf::MIN_SVC_NAT..=xdpcni_ebpf::MAX_SVC_NAT_CAPACITY)
            .contains(&cfg.services.nat_capacity)
        {
            bail!(
                "{}: services.natCapacity {} is outside {}..={}",
                path.display(),
                cfg.services.nat_capacity,
                xdpcni_ebpf::MIN_SVC_NAT,
                xdpcni_ebpf::MAX_SVC_NAT_CAPACITY
            );
        }
        if cfg.services.north_south() && !cfg.services.translate {
            bail!(
                "{}: services.northSouthDevices needs services.translate (the Service watch and maps the uplink program reads)",
                path.display()
            );
        }
        Ok(cfg)
    }

    /// The node defaults, validated against the `online` CPU mask.
    pub fn defaults(&self, online: u64) -> Result<Wish> {
        let mode = XdpMode::parse(&self.xdp_mode).with_context(|| {
            format!(
                "xdpMode {:?} is not one of {}",
                self.xdp_mode,
                XdpMode::names()
            )
        })?;
        let redirect = RedirectPolicy::parse(&self.redirect)
            .with_context(|| format!("redirect {:?} is not devmap or cpumap", self.redirect))?;
        let cpu_mask = if self.cpus.is_empty() {
            online
        } else {
            parse_cpu_list(&self.cpus).map_err(|e| anyhow::anyhow!("cpus: {e}"))?
        };
        Ok(Wish {
            mode,
            redirect,
            cpu_mask,
        })
    }

    /// The routing section, validated.
    pub fn routing(&self) -> Result<Routing> {
        let r = &self.routing;
        let mode = RoutingMode::parse(&r.mode).with_context(|| {
            format!(
                "routing.mode {:?} is not one of {}",
                r.mode,
                RoutingMode::names()
            )
        })?;
        if !xdpcni_host::overlay::VNI_RANGE.contains(&r.vni) {
            bail!(
                "routing.vni {} is not in {:?} (24 bits)",
                r.vni,
                xdpcni_host::overlay::VNI_RANGE
            );
        }
        if r.port == 0 {
            bail!("routing.port 0 is not a UDP port");
        }
        Ok(Routing {
            mode,
            vni: r.vni,
            port: r.port,
            tx_checksum_offload: r.tx_checksum_offload,
            fast_path: r.fast_path,
        })
    }

    /// The node name: the config's, else NODE_NAME.
    pub fn node_name(&self) -> Option<String> {
        self.node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok())
    }
}

/// Standalone mode's pods file: `{"ns/pod" | "containerID": {annotations}}`.
/// Missing or blank: no pods.
pub fn read_pods_file(path: &std::path::Path) -> Result<HashMap<String, Annotations>> {
    match std::fs::read(path) {
        Ok(bytes) if bytes.iter().all(u8::is_ascii_whitespace) => Ok(HashMap::new()),
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not {{\"ns/pod\": {{annotations}}}}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashMap::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(mode: &str, redirect: &str, cpus: &str) -> Config {
        serde_json::from_value(serde_json::json!({
            "pinDir": "/sys/fs/bpf/x", "stateDir": "/run/x", "listen": "127.0.0.1:1",
            "xdpMode": mode, "redirect": redirect, "cpus": cpus,
        }))
        .unwrap()
    }

    #[test]
    fn read_refuses_services_options_that_need_translate_naming_them() {
        let path = std::env::temp_dir().join(format!("xdpcni-cfg-{}.json", std::process::id()));
        for (option, value) in [
            ("healthCheckNodePorts", serde_json::json!(true)),
            ("northSouthDevices", serde_json::json!(["eth0"])),
        ] {
            let mut services = serde_json::json!({ "translate": false });
            services[option] = value;
            let body =
                serde_json::json!({ "pinDir": "/p", "stateDir": "/s", "services": services });
            std::fs::write(&path, body.to_string()).unwrap();
            let err = Config::read(&path).unwrap_err().to_string();
            assert!(
                err.contains(&format!("services.{option} needs services.translate")),
                "{err}"
            );
            services["translate"] = serde_json::json!(true);
            let body =
                serde_json::json!({ "pinDir": "/p", "stateDir": "/s", "services": services });
            std::fs::write(&path, body.to_string()).unwrap();
            assert!(Config::read(&path).is_ok(), "{option} with translate");
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn read_refuses_a_nat_capacity_out_of_range_naming_the_range() {
        let path = std::env::temp_dir().join(format!("xdpcni-nat-{}.json", std::process::id()));
        for (capacity, ok) in [
            (16u32, false),
            (1024, true),
            (1 << 24, true),
            ((1 << 24) + 1, false),
        ] {
            let body = serde_json::json!({
                "pinDir": "/p", "stateDir": "/s", "services": { "natCapacity": capacity }
            });
            std::fs::write(&path, body.to_string()).unwrap();
            match Config::read(&path) {
                Ok(c) => {
                    assert!(ok, "{capacity} taken");
                    assert_eq!(c.services.nat_capacity, capacity);
                }
                Err(e) => {
                    assert!(!ok, "{capacity}: {e}");
                    assert!(e.to_string().contains("services.natCapacity"), "{e}");
                    assert!(e.to_string().contains("1024..=16777216"), "{e}");
                }
            }
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn node_defaults_are_validated() {
        let p = cfg("generic", "cpumap", "1").defaults(0b11).unwrap();
        assert_eq!(p.mode.as_str(), "generic");
        assert_eq!((p.redirect, p.cpu_mask), (RedirectPolicy::Cpumap, 0b10));
        assert_eq!(
            cfg("off", "devmap", "").defaults(0b11).unwrap().cpu_mask,
            0b11
        );
        assert!(cfg("turbo", "devmap", "").defaults(1).is_err());
        assert!(cfg("native", "bridge", "").defaults(1).is_err());
        assert!(cfg("native", "devmap", "x").defaults(1).is_err());
        assert_eq!(cfg("native", "devmap", "").interval_ms, 500);
        assert!(
            serde_json::from_value::<Config>(serde_json::json!({"pinDir": "/", "bogus": 1}))
                .is_err()
        );
    }

    #[test]
    fn new_is_the_file_with_only_its_paths_and_round_trips() {
        let new = Config::new("/p".into(), "/s".into());
        let read: Config =
            serde_json::from_value(serde_json::json!({"pinDir": "/p", "stateDir": "/s"})).unwrap();
        assert_eq!(
            serde_json::to_value(&new).unwrap(),
            serde_json::to_value(&read).unwrap()
        );
        let mut c = new;
        c.pods_file = Some("/pods".into());
        c.routing.mode = "hostGateway".into();
        let text = serde_json::to_string(&c).unwrap();
        // Only what differs from the defaults is written.
        assert_eq!(
            serde_json::to_value(Config::new("/p".into(), "/s".into())).unwrap(),
            serde_json::json!({"pinDir": "/p", "stateDir": "/s"})
        );
        assert!(!text.contains("readyFile"), "{text}");
        let back: Config = serde_json::from_str(&text).unwrap();
        assert_eq!(back.pods_file, c.pods_file);
        assert_eq!(back.routing.mode, "hostGateway");
    }

    #[test]
    fn routing_is_validated_and_defaults_to_vxlan() {
        let with = |r: serde_json::Value| {
            serde_json::from_value::<Config>(serde_json::json!({
                "pinDir": "/", "stateDir": "/", "routing": r,
            }))
        };
        let d = cfg("tc", "devmap", "").routing().unwrap();
        assert_eq!(
            (d.mode, d.vni, d.port, d.tx_checksum_offload, d.fast_path),
            (RoutingMode::Vxlan, 1, 4789, true, true)
        );
        let off = with(serde_json::json!({"fastPath": false})).unwrap();
        assert!(!off.routing().unwrap().fast_path);
        let a = with(serde_json::json!({"mode": "auto", "vni": 42})).unwrap();
        assert_eq!(a.routing().unwrap().mode, RoutingMode::Auto);
        assert_eq!(a.routing().unwrap().vni, 42);
        let e = with(serde_json::json!({"mode": "host-gw"}))
            .unwrap()
            .routing()
            .unwrap_err();
        assert!(format!("{e}").contains("hostGateway, vxlan, auto"), "{e}");
        assert!(with(serde_json::json!({"vni": 0x0100_0000}))
            .unwrap()
            .routing()
            .is_err());
        assert!(with(serde_json::json!({"port": 0}))
            .unwrap()
            .routing()
            .is_err());
        assert!(with(serde_json::json!({"bogus": 1})).is_err());
    }
}
