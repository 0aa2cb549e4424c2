//! `install-cni`: what the chart's init container runs on every node. Writes
//! the CNI conflist for this node (its pod CIDRs from the Node object, the
//! agent's datapath settings) and installs the `xdpcni` binary, each
//! atomically (a temporary file renamed into place), so a runtime never reads
//! half a file.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Node;
use serde_json::{json, Value};

use crate::standalone::Config;

/// The conflist file name: sorts before most others, as the runtime takes
/// the first file.
pub const CONFLIST_NAME: &str = "10-xdpcni.conflist";

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
        "xdpMode": cfg.xdp_mode,
        "redirect": cfg.redirect,
        "stateDir": cfg.state_dir,
        "ipam": { "type": "host-local", "ranges": ranges },
    });
    if !cfg.cpus.is_empty() {
        xdpcni["cpus"] = json!(cfg.cpus);
    }
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

fn atomic_write(dest: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = dest.parent().context("destination has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        dest.file_name().and_then(|n| n.to_str()).unwrap_or("x"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, dest).with_context(|| format!("renaming to {}", dest.display()))
}

/// Writes the conflist into `conf_dir` and copies `plugin` into `bin_dir`.
pub fn install(
    cfg: &Config,
    cidrs: &[String],
    conf_dir: &Path,
    bin_dir: &Path,
    plugin: &Path,
) -> Result<PathBuf> {
    let bin = std::fs::read(plugin).with_context(|| format!("reading {}", plugin.display()))?;
    atomic_write(&bin_dir.join("xdpcni"), &bin, 0o755)?;
    // The conflist also names host-local and portmap: install them from the
    // image (next to the plugin) or Debian's package when the node lacks them.
    for extra in ["host-local", "portmap"] {
        if bin_dir.join(extra).exists() {
            continue;
        }
        let candidates = [
            plugin.with_file_name(extra),
            Path::new("/usr/lib/cni").join(extra),
        ];
        if let Some(src) = candidates.iter().find(|p| p.is_file()) {
            let bytes = std::fs::read(src).with_context(|| format!("reading {}", src.display()))?;
            atomic_write(&bin_dir.join(extra), &bytes, 0o755)?;
        }
    }
    let list = conflist(cfg, cidrs);
    let dest = conf_dir.join(CONFLIST_NAME);
    atomic_write(
        &dest,
        serde_json::to_string_pretty(&list)?.as_bytes(),
        0o644,
    )?;
    Ok(dest)
}
