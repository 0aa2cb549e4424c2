//! `install-cni`: what the chart's init container runs on every node. Builds
//! the CNI conflist for this node (its pod CIDRs from the Node object, the
//! veth settings and the paths it shares with the agent; the fast path's
//! mode is the agent's alone) and hands it to the plugin crate's installer
//! (`xdpcni_host::install`), which the node clean-up (`xdpcni uninstall`)
//! shares.

use std::{net::IpAddr, path::Path};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Node;
use serde_json::{json, Value};
use xdpcni_host::{
    install::{InstallPlan, Manifest},
    netconf::{PluginConf, DEFAULT_MTU},
    netlink::Netlink,
    overlay::{self, Underlay},
};

use crate::config::Config;

/// What install-cni reads of its Node.
#[derive(Clone, Debug, Default)]
pub struct NodeFacts {
    /// Its pod CIDRs (IPv4 and/or IPv6).
    pub cidrs: Vec<String>,
    /// Its first InternalIP: the tunnel's underlay address.
    pub internal_ip: Option<IpAddr>,
}

/// The pod CIDRs and the first InternalIP of `node`.
pub async fn node_facts(node: &str) -> Result<NodeFacts> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the API server")?;
    let n = kube::Api::<Node>::all(client)
        .get(node)
        .await
        .with_context(|| format!("reading Node {node}"))?;
    let internal_ip = crate::routes::internal_ips(&n).into_iter().next();
    let spec = n.spec.unwrap_or_default();
    let mut cidrs = spec.pod_cidrs.unwrap_or_default();
    if let Some(c) = spec.pod_cidr {
        if !cidrs.contains(&c) {
            cidrs.push(c);
        }
    }
    if cidrs.is_empty() {
        bail!("Node {node} has no podCIDR yet (is the controller-manager allocating node CIDRs?)");
    }
    Ok(NodeFacts { cidrs, internal_ip })
}

/// The MTU of this node's pods: the config's `mtu` if it names one (refused
/// if it does not fit in the tunnel's), else the underlay interface's MTU
/// less what the routing mode's encapsulation takes
/// ([`xdpcni_host::overlay::pod_mtu`]); with no underlay found (an
/// InternalIP no interface holds), [`DEFAULT_MTU`] less it.
pub fn pod_mtu(cfg: &Config, underlay: Option<&Underlay>) -> Result<u32> {
    let mode = cfg.routing()?.mode;
    Ok(match (cfg.mtu, underlay) {
        (Some(mtu), Some(u)) if mtu > u.pod_mtu(mode) => bail!(
            "datapath.mtu {mtu} does not fit routing.mode {mode} over {} (MTU {}): \
             pods may have at most {}; leave mtu unset to have it computed",
            u.link.name,
            u.link.mtu,
            u.pod_mtu(mode)
        ),
        (Some(mtu), _) => mtu,
        (None, Some(u)) => u.pod_mtu(mode),
        (None, None) => overlay::pod_mtu(mode, DEFAULT_MTU, false),
    })
}

/// The underlay of this node's tunnel: the interface holding `internal_ip`.
pub fn underlay(internal_ip: Option<IpAddr>) -> Result<Option<Underlay>> {
    let Some(ip) = internal_ip else {
        return Ok(None);
    };
    let mut nl = Netlink::new().context("a netlink socket")?;
    Underlay::find(&mut nl, ip).with_context(|| format!("finding the interface holding {ip}"))
}

/// The conflist for a node with `cidrs`: the plugin's entry is the typed
/// [`PluginConf`] the plugin reads back.
pub fn conflist(cfg: &Config, cidrs: &[String], mtu: u32) -> Result<Value> {
    let ranges: Vec<Value> = cidrs.iter().map(|c| json!([{ "subnet": c }])).collect();
    let xdpcni = PluginConf::new(
        Some(mtu),
        cfg.headroom,
        cfg.pin_dir.clone(),
        cfg.state_dir.clone(),
        cfg.ready_file.clone(),
        json!({ "type": "host-local", "ranges": ranges }),
    );
    xdpcni
        .validate()
        .context("the agent's config asks for a pod interface the plugin would refuse")?;
    let xdpcni = serde_json::to_value(&xdpcni).context("encoding the plugin's conflist entry")?;
    Ok(json!({
        // 1.0.0: Debian's portmap (1.1.1) speaks CNI up to 1.0.0.
        "cniVersion": "1.0.0",
        "name": "xdpcni",
        "plugins": [
            xdpcni,
            { "type": "portmap", "capabilities": { "portMappings": true } },
        ],
    }))
}

/// Writes the conflist into `conf_dir` and installs `plugin` (and the
/// reference plugins the node lacks) into `bin_dir`, recording what it
/// created for `xdpcni uninstall`.
pub fn install(
    cfg: &Config,
    cidrs: &[String],
    mtu: u32,
    conf_dir: &Path,
    bin_dir: &Path,
    plugin: &Path,
) -> Result<Manifest> {
    let list = conflist(cfg, cidrs, mtu)?;
    Ok(xdpcni_host::install::install(&InstallPlan {
        conflist: &list,
        conf_dir,
        bin_dir,
        plugin,
        system_plugins: Path::new("/usr/lib/cni"),
        pin_dir: &cfg.pin_dir,
        state_dir: &cfg.state_dir,
    })?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use xdpcni_host::netconf::{DEFAULT_HEADROOM, DEFAULT_STATE_DIR, HEADROOM_RANGE, MTU_RANGE};

    use super::*;
    use xdpcni_host::pod::XdpMode;

    fn chart(file: &str) -> String {
        let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/xdpcni/");
        std::fs::read_to_string(format!("{p}{file}")).unwrap()
    }

    /// `key: value` of the first line under `section:` in values.yaml.
    fn value(yaml: &str, section: &str, key: &str) -> String {
        let mut lines = yaml.lines().skip_while(|l| *l != format!("{section}:"));
        lines
            .find_map(|l| l.trim().strip_prefix(&format!("{key}:")))
            .map(|v| v.split('#').next().unwrap_or_default().trim().to_string())
            .unwrap()
    }

    #[test]
    fn the_conflist_entry_is_what_the_plugin_reads() {
        let cfg: Config = serde_json::from_value(json!({
            "pinDir": "/sys/fs/bpf/x", "stateDir": "/run/x", "readyFile": "/run/r",
            "mtu": 9000,
        }))
        .unwrap();
        let mtu = pod_mtu(&cfg, None).unwrap();
        let list = conflist(&cfg, &["10.1.0.0/24".into(), "fd01::/64".into()], mtu).unwrap();
        let entry = PluginConf::from_json(&list["plugins"][0]).unwrap();
        assert_eq!((entry.mtu, entry.headroom), (9000, DEFAULT_HEADROOM));
        assert_eq!(entry.agent_ready_file.as_deref(), Some(Path::new("/run/r")));
        assert_eq!(entry.ipam_type().unwrap(), Some("host-local"));
        let bad: Config =
            serde_json::from_value(json!({"pinDir": "/", "stateDir": "/", "mtu": 100})).unwrap();
        let e = conflist(&bad, &[], bad.mtu.unwrap()).unwrap_err();
        assert!(format!("{e:#}").contains("mtu"), "{e:#}");
    }

    /// The MTU follows the routing mode: the underlay's less the tunnel's
    /// overhead, and a configured MTU the tunnel cannot carry is refused.
    #[test]
    fn the_pod_mtu_follows_the_routing_mode() {
        let cfg = |v: Value| -> Config { serde_json::from_value(v).unwrap() };
        let link = |mtu| xdpcni_host::netlink::Link {
            index: 2,
            name: "eth0".into(),
            mac: [0; 6],
            mtu,
            up: true,
            oper_up: true,
            headroom: None,
            kind: None,
            peer_index: None,
        };
        let under = |mtu, ip: &str| Underlay {
            address: ip.parse().unwrap(),
            link: link(mtu),
            subnets: vec![],
        };
        let base = json!({"pinDir": "/", "stateDir": "/"});
        let mut hg = base.clone();
        hg["routing"] = json!({"mode": "hostGateway"});
        let mut auto = base.clone();
        auto["routing"] = json!({"mode": "auto"});
        let v4 = under(9000, "192.0.2.1");
        let v6 = under(1500, "2001:db8::1");
        assert_eq!(pod_mtu(&cfg(base.clone()), Some(&v4)).unwrap(), 8950);
        assert_eq!(pod_mtu(&cfg(base.clone()), Some(&v6)).unwrap(), 1430);
        assert_eq!(pod_mtu(&cfg(auto), Some(&v6)).unwrap(), 1430);
        assert_eq!(pod_mtu(&cfg(hg.clone()), Some(&v6)).unwrap(), 1500);
        assert_eq!(pod_mtu(&cfg(base.clone()), None).unwrap(), 1450);
        let mut fixed = base.clone();
        fixed["mtu"] = json!(1500);
        let e = pod_mtu(&cfg(fixed.clone()), Some(&v6)).unwrap_err();
        assert!(format!("{e}").contains("at most 1430"), "{e}");
        fixed["mtu"] = json!(1400);
        assert_eq!(pod_mtu(&cfg(fixed), Some(&v6)).unwrap(), 1400);
        hg["mtu"] = json!(1500);
        assert_eq!(pod_mtu(&cfg(hg), Some(&v6)).unwrap(), 1500);
    }

    /// The chart's defaults and ranges are the plugin's (host/src/netconf.rs).
    #[test]
    fn the_charts_defaults_and_ranges_are_the_plugins() {
        let values = chart("values.yaml");
        assert_eq!(value(&values, "datapath", "mtu"), "auto");
        assert_eq!(
            value(&values, "datapath", "headroom"),
            DEFAULT_HEADROOM.to_string()
        );
        assert_eq!(
            value(&values, "datapath", "pinDir"),
            xdpcni_ebpf::DEFAULT_PIN_DIR
        );
        assert_eq!(value(&values, "cni", "stateDir"), DEFAULT_STATE_DIR);
        let schema: Value = serde_json::from_str(&chart("values.schema.json")).unwrap();
        let props = &schema["properties"]["datapath"]["properties"];
        assert_eq!(props["mtu"]["oneOf"][0]["const"], "auto");
        assert_eq!(props["mtu"]["oneOf"][1]["minimum"], *MTU_RANGE.start());
        assert_eq!(props["mtu"]["oneOf"][1]["maximum"], *MTU_RANGE.end());
        // The routing modes, the default, the VNI and port are the agent's
        // (host/src/overlay.rs).
        let routing = &schema["properties"]["routing"]["properties"];
        let modes: Vec<&str> = overlay::RoutingMode::ALL
            .iter()
            .map(|m| m.as_str())
            .collect();
        assert_eq!(routing["mode"]["enum"], serde_json::json!(modes));
        assert_eq!(
            value(&values, "routing", "mode"),
            overlay::DEFAULT_ROUTING.as_str()
        );
        assert_eq!(
            value(&values, "routing", "vni"),
            overlay::DEFAULT_VNI.to_string()
        );
        assert_eq!(
            value(&values, "routing", "port"),
            overlay::DEFAULT_PORT.to_string()
        );
        assert_eq!(
            routing["vxlan"]["properties"]["vni"]["maximum"],
            *overlay::VNI_RANGE.end()
        );
        assert_eq!(
            value(&values, "routing", "txChecksumOffload"),
            overlay::DEFAULT_TX_CHECKSUM_OFFLOAD.to_string()
        );
        assert_eq!(
            value(&values, "routing", "fastPath"),
            crate::config::RoutingConfig::default()
                .fast_path
                .to_string()
        );
        assert_eq!(props["headroom"]["minimum"], *HEADROOM_RANGE.start());
        assert_eq!(props["headroom"]["maximum"], *HEADROOM_RANGE.end());
        // The modes and the default are the agent's (host/src/pod.rs).
        let modes: Vec<&str> = XdpMode::ALL.iter().map(|m| m.as_str()).collect();
        assert_eq!(props["xdpMode"]["enum"], serde_json::json!(modes));
        assert_eq!(
            value(&values, "datapath", "xdpMode"),
            xdpcni_host::pod::DEFAULT_MODE.as_str()
        );
    }
}
