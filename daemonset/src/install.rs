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
use xdpcni_host::install::{InstallPlan, Manifest};

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

/// The conflist for a node with `cidrs`.
pub fn conflist(cfg: &Config, cidrs: &[String]) -> Value {
    let ranges: Vec<Value> = cidrs.iter().map(|c| json!([{ "subnet": c }])).collect();
    let mut xdpcni = json!({
        "type": "xdpcni",
        "mtu": cfg.mtu.unwrap_or(1500),
        "headroom": cfg.headroom.unwrap_or(256),
        "pinDir": cfg.pin_dir,
        "stateDir": cfg.state_dir,
        "ipam": { "type": "host-local", "ranges": ranges },
    });
    if let Some(r) = &cfg.ready_file {
        xdpcni["agentReadyFile"] = json!(r);
    }
    json!({
        // 1.0.0: Debian's portmap (1.1.1) speaks CNI up to 1.0.0.
        "cniVersion": "1.0.0",
        "name": "xdpcni",
        "plugins": [
            xdpcni,
            { "type": "portmap", "capabilities": { "portMappings": true } },
        ],
    })
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
    let list = conflist(cfg, cidrs);
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
