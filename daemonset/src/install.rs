//! `install-cni`: what the chart's init container runs on every node. Builds
//! the CNI conflist for this node (its pod CIDRs from the Node object, the
//! veth settings and the paths it shares with the agent; the fast path's
//! mode is the agent's alone) and hands it to the plugin crate's installer
//! (`xdpcni_host::install`), which the node clean-up (`xdpcni uninstall`)
//! shares.

use std::path::Path;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Node;
use serde_json::{json, Value};
use xdpcni_host::{
    install::{InstallPlan, Manifest},
    netconf::PluginConf,
};

use crate::config::Config;

/// The pod CIDRs of `node` (IPv4 and/or IPv6).
pub async fn node_pod_cidrs(node: &str) -> Result<Vec<String>> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the API server")?;
    let n = kube::Api::<Node>::all(client)
        .get(node)
        .await
        .with_context(|| format!("reading Node {node}"))?;
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
    Ok(cidrs)
}

/// The conflist for a node with `cidrs`: the plugin's entry is the typed
/// [`PluginConf`] the plugin reads back.
pub fn conflist(cfg: &Config, cidrs: &[String]) -> Result<Value> {
    let ranges: Vec<Value> = cidrs.iter().map(|c| json!([{ "subnet": c }])).collect();
    let xdpcni = PluginConf::new(
        cfg.mtu,
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
    conf_dir: &Path,
    bin_dir: &Path,
    plugin: &Path,
) -> Result<Manifest> {
    let list = conflist(cfg, cidrs)?;
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

    use xdpcni_host::netconf::{
        DEFAULT_HEADROOM, DEFAULT_MTU, DEFAULT_STATE_DIR, HEADROOM_RANGE, MTU_RANGE,
    };

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
        let list = conflist(&cfg, &["10.1.0.0/24".into(), "fd01::/64".into()]).unwrap();
        let entry = PluginConf::from_json(&list["plugins"][0]).unwrap();
        assert_eq!((entry.mtu, entry.headroom), (9000, DEFAULT_HEADROOM));
        assert_eq!(entry.agent_ready_file.as_deref(), Some(Path::new("/run/r")));
        assert_eq!(entry.ipam_type().unwrap(), Some("host-local"));
        let bad: Config =
            serde_json::from_value(json!({"pinDir": "/", "stateDir": "/", "mtu": 100})).unwrap();
        let e = conflist(&bad, &[]).unwrap_err();
        assert!(format!("{e:#}").contains("mtu"), "{e:#}");
    }

    /// The chart's defaults and ranges are the plugin's (host/src/netconf.rs).
    #[test]
    fn the_charts_defaults_and_ranges_are_the_plugins() {
        let values = chart("values.yaml");
        assert_eq!(value(&values, "datapath", "mtu"), DEFAULT_MTU.to_string());
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
        assert_eq!(props["mtu"]["minimum"], *MTU_RANGE.start());
        assert_eq!(props["mtu"]["maximum"], *MTU_RANGE.end());
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
