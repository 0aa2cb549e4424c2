//! Putting xdpcni on a node and taking it off again.
//!
//! [`install`] is what the chart's `install-cni` init container runs (through
//! `xdpcni-agent install-cni`): it writes the conflist and copies the plugin,
//! and the reference plugins the conflist and every runtime need (`host-local`,
//! `portmap`, `loopback`) when the node lacks them, each atomically (a
//! temporary file renamed into place, so a runtime never reads half a file).
//! What it created is written to a manifest in the state directory.
//!
//! [`uninstall`] is the node clean-up after `helm uninstall`: run on the node
//! as `/opt/cni/bin/xdpcni uninstall`, it detaches and unpins the datapath and
//! removes exactly what the manifest lists (never a plugin the node had
//! before), so the node is left as it was found.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The conflist file name: sorts before most others, as a runtime takes the
/// first file.
pub const CONFLIST_NAME: &str = "10-xdpcni.conflist";

/// The reference plugins installed next to `xdpcni` when the node lacks them:
/// the conflist chains `host-local` (IPAM) and `portmap`, and every runtime
/// calls `loopback` for the pod's `lo` before the network's plugins.
pub const COMPANION_PLUGINS: [&str; 3] = ["host-local", "portmap", "loopback"];

/// The manifest's file name in the state directory (not `.json`: the state
/// directory's `*.json` files are attachment records).
pub const MANIFEST_NAME: &str = "installed.manifest";

/// Where the manifest of an installation with `state_dir` lives.
pub fn manifest_path(state_dir: &Path) -> PathBuf {
    state_dir.join(MANIFEST_NAME)
}

/// What [`install`] put on the node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// The conflist written.
    pub conflist: PathBuf,
    /// Files created in the CNI bin dir (the plugin, and companions the
    /// node lacked).
    pub binaries: Vec<PathBuf>,
    /// The datapath's pin directory.
    pub pin_dir: PathBuf,
    /// The plugin's state directory (attachment records and this manifest).
    pub state_dir: PathBuf,
}

/// Failures of install and uninstall.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A companion plugin is missing on the node and has no source.
    #[error("the node has no {name} in {bin_dir} and none was found in {searched}")]
    MissingPlugin {
        /// The plugin.
        name: &'static str,
        /// The node's CNI bin dir.
        bin_dir: PathBuf,
        /// Where it was looked for.
        searched: String,
    },
    /// The manifest does not decode.
    #[error("manifest {path}: {why}")]
    Manifest {
        /// Its path.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The datapath could not be detached and unpinned.
    #[error("detaching the datapath at {pin_dir}: {source}")]
    Datapath {
        /// The pin directory.
        pin_dir: PathBuf,
        /// The loader's error.
        source: xdpcni_ebpf::Error,
    },
    /// Some steps of an uninstall failed (each one listed); the others ran.
    #[error("uninstall left work undone: {}", .0.join("; "))]
    Incomplete(Vec<String>),
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> InstallError + 'a {
    move |source| InstallError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `dest` through a temporary file in the same directory.
pub fn atomic_write(dest: &Path, bytes: &[u8], mode: u32) -> Result<(), InstallError> {
    use std::os::unix::fs::PermissionsExt;
    let dir = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        dest.file_name().and_then(|n| n.to_str()).unwrap_or("x"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).map_err(io("writing", &tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(io("chmod", &tmp))?;
    std::fs::rename(&tmp, dest).map_err(io("renaming into", dest))
}

/// Where [`install`] takes its files from and puts them.
#[derive(Clone, Debug)]
pub struct InstallPlan<'a> {
    /// The conflist to write (JSON).
    pub conflist: &'a serde_json::Value,
    /// The node's CNI conf dir.
    pub conf_dir: &'a Path,
    /// The node's CNI bin dir.
    pub bin_dir: &'a Path,
    /// The `xdpcni` binary to install; companions are looked for next to it,
    /// then in `system_plugins`.
    pub plugin: &'a Path,
    /// Where the node's distribution keeps the reference plugins (Debian:
    /// `/usr/lib/cni`), searched after the plugin's own directory.
    pub system_plugins: &'a Path,
    /// The datapath's pin directory (recorded for uninstall).
    pub pin_dir: &'a Path,
    /// The plugin's state directory (the manifest goes there).
    pub state_dir: &'a Path,
}

/// Installs the plugin, the companions the node lacks, and the conflist, and
/// records what it created. Re-running it (every agent pod start) updates the
/// plugin and conflist and keeps the record of companions it created before.
pub fn install(plan: &InstallPlan<'_>) -> Result<Manifest, InstallError> {
    let previous = read_manifest(plan.state_dir)?.unwrap_or_default();
    let mut binaries = Vec::new();
    let plugin_dest = plan.bin_dir.join("xdpcni");
    let bin = std::fs::read(plan.plugin).map_err(io("reading", plan.plugin))?;
    atomic_write(&plugin_dest, &bin, 0o755)?;
    binaries.push(plugin_dest);
    for name in COMPANION_PLUGINS {
        let dest = plan.bin_dir.join(name);
        if dest.exists() {
            if previous.binaries.contains(&dest) {
                binaries.push(dest);
            }
            continue;
        }
        let candidates = [
            plan.plugin.with_file_name(name),
            plan.system_plugins.join(name),
        ];
        let src =
            candidates
                .iter()
                .find(|p| p.is_file())
                .ok_or_else(|| InstallError::MissingPlugin {
                    name,
                    bin_dir: plan.bin_dir.to_path_buf(),
                    searched: candidates
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
        let bytes = std::fs::read(src).map_err(io("reading", src))?;
        atomic_write(&dest, &bytes, 0o755)?;
        binaries.push(dest);
    }
    let conflist = plan.conf_dir.join(CONFLIST_NAME);
    let text = serde_json::to_string_pretty(plan.conflist).map_err(|e| InstallError::Manifest {
        path: conflist.clone(),
        why: e.to_string(),
    })?;
    atomic_write(&conflist, text.as_bytes(), 0o644)?;
    let manifest = Manifest {
        conflist,
        binaries,
        pin_dir: plan.pin_dir.to_path_buf(),
        state_dir: plan.state_dir.to_path_buf(),
    };
    let path = manifest_path(plan.state_dir);
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| InstallError::Manifest {
        path: path.clone(),
        why: e.to_string(),
    })?;
    atomic_write(&path, &bytes, 0o644)?;
    Ok(manifest)
}

/// The manifest of the installation with `state_dir`, if there is one.
pub fn read_manifest(state_dir: &Path) -> Result<Option<Manifest>, InstallError> {
    let path = manifest_path(state_dir);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| InstallError::Manifest {
                path,
                why: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(InstallError::Io {
            op: "reading",
            path,
            source: e,
        }),
    }
}

/// What [`uninstall`] or [`uninstall_node`] did.
#[derive(Debug, Default)]
pub struct Removed {
    /// Files and directories removed.
    pub paths: Vec<PathBuf>,
    /// Attachment records of pods still on the node (they keep kernel
    /// routing until they are deleted).
    pub pods_left: Vec<String>,
    /// Copies of the IPv6 source-check rule removed (only once no pod is
    /// left: the rule protects their kernel path).
    pub source_rules: usize,
    /// Whether the NetworkPolicy table (`inet xdpcni`) was there and went.
    pub policy_table: bool,
    /// The VXLAN device and the routes to other nodes' pods.
    pub overlay: crate::overlay::TunnelRemoved,
}

impl Removed {
    /// What was removed, one line each, as both binaries' `uninstall` print it.
    pub fn lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .paths
            .iter()
            .map(|p| format!("removed {}", p.display()))
            .collect();
        if self.policy_table {
            out.push(format!(
                "removed the NetworkPolicy table inet {}",
                crate::nftable::TABLE
            ));
        }
        if self.overlay.device {
            out.push(format!(
                "removed the VXLAN device {} (its FDB, neighbour and route entries)",
                crate::overlay::DEVICE
            ));
        }
        if self.overlay.routes > 0 {
            out.push(format!(
                "removed {} routes to other nodes' pods",
                self.overlay.routes
            ));
        }
        if self.source_rules > 0 {
            out.push(format!(
                "removed {} copies of the IPv6 source-check rule",
                self.source_rules
            ));
        }
        for pod in &self.pods_left {
            out.push(format!(
                "pod {pod} is still on the node (kernel routing until it is deleted)"
            ));
        }
        out
    }
}

/// Takes xdpcni off the node: detaches and unpins the datapath, removes the
/// NetworkPolicy table, the VXLAN device and the routes to other nodes'
/// pods, the conflist and the binaries [`install`] created,
/// and the state directory
/// once no pod record is left in it. Every step runs even when one fails;
/// the failures are returned together. Nothing to remove is success.
pub fn uninstall(state_dir: &Path) -> Result<Removed, InstallError> {
    let Some(m) = read_manifest(state_dir)? else {
        return Ok(Removed::default());
    };
    let mut removed = Removed::default();
    let mut failed = Vec::new();
    remove_node_state(&m.pin_dir, &mut removed, &mut failed);
    for p in std::iter::once(&m.conflist).chain(m.binaries.iter()) {
        match std::fs::remove_file(p) {
            Ok(()) => removed.paths.push(p.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => failed.push(format!("removing {}: {e}", p.display())),
        }
    }
    // An unreadable state dir is not an empty one: keep it, say why.
    let records = match crate::state::list(&m.state_dir) {
        Ok(r) => Some(r),
        Err(e) => {
            failed.push(format!(
                "listing pod records in {}: {e}",
                m.state_dir.display()
            ));
            None
        }
    };
    removed.pods_left = records
        .iter()
        .flatten()
        .map(|r| format!("{}/{}", r.pod_namespace, r.pod_name))
        .collect();
    if records.as_ref().is_some_and(Vec::is_empty) {
        match crate::source_check::remove_ipv6() {
            Ok(n) => removed.source_rules = n,
            Err(e) => failed.push(format!("removing the IPv6 source check: {e}")),
        }
        match std::fs::remove_dir_all(&m.state_dir) {
            Ok(()) => removed.paths.push(m.state_dir.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => failed.push(format!("removing {}: {e}", m.state_dir.display())),
        }
    } else if records.is_some() {
        // Pods are left: their records stay, the installation is gone. (An
        // unreadable state dir keeps the manifest, so a retry can finish.)
        if let Err(e) = std::fs::remove_file(manifest_path(&m.state_dir)) {
            failed.push(format!("removing the manifest: {e}"));
        }
    }
    finish(removed, failed)
}

/// Takes xdpcni's node-wide state off the node without a manifest (the
/// agent's `uninstall`): the datapath at `pin_dir` (every link detached,
/// every pin removed), the NetworkPolicy table, the VXLAN device and the
/// routes to other nodes' pods. Every step runs even when one fails; the
/// failures are returned together. Nothing to remove is success.
pub fn uninstall_node(pin_dir: &Path) -> Result<Removed, InstallError> {
    let mut removed = Removed::default();
    let mut failed = Vec::new();
    remove_node_state(pin_dir, &mut removed, &mut failed);
    finish(removed, failed)
}

/// The node-wide part of both uninstalls, collecting what failed.
fn remove_node_state(pin_dir: &Path, removed: &mut Removed, failed: &mut Vec<String>) {
    match xdpcni_ebpf::Datapath::uninstall(pin_dir) {
        Ok(()) => removed.paths.push(pin_dir.to_path_buf()),
        Err(source) => failed.push(
            InstallError::Datapath {
                pin_dir: pin_dir.to_path_buf(),
                source,
            }
            .to_string(),
        ),
    }
    match crate::nftable::remove_table() {
        Ok(gone) => removed.policy_table = gone,
        Err(e) => failed.push(format!(
            "removing the NetworkPolicy table inet {}: {e}",
            crate::nftable::TABLE
        )),
    }
    match crate::netlink::Netlink::new().and_then(|mut nl| crate::overlay::remove(&mut nl)) {
        Ok(o) => removed.overlay = o,
        Err(e) => failed.push(format!(
            "removing the VXLAN device {} and the node routes: {e}",
            crate::overlay::DEVICE
        )),
    }
}

fn finish(removed: Removed, failed: Vec<String>) -> Result<Removed, InstallError> {
    if failed.is_empty() {
        Ok(removed)
    } else {
        Err(InstallError::Incomplete(failed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "xdpcni-install-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn install_then_uninstall_leaves_the_node_as_found() {
        let d = tmp("roundtrip");
        let src = d.join("src");
        std::fs::create_dir_all(&src).unwrap();
        for f in ["xdpcni", "host-local", "portmap", "loopback"] {
            std::fs::write(src.join(f), f).unwrap();
        }
        let bin_dir = d.join("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        // The node already has its own loopback: it must survive uninstall.
        std::fs::write(bin_dir.join("loopback"), "node's own").unwrap();
        let conf_dir = d.join("net.d");
        let state_dir = d.join("state");
        let conflist = serde_json::json!({"name": "xdpcni"});
        let plan = InstallPlan {
            conflist: &conflist,
            conf_dir: &conf_dir,
            bin_dir: &bin_dir,
            plugin: &src.join("xdpcni"),
            system_plugins: &d.join("none"),
            pin_dir: &d.join("pins-absent"),
            state_dir: &state_dir,
        };
        let m = install(&plan).unwrap();
        assert_eq!(
            m.binaries,
            vec![
                bin_dir.join("xdpcni"),
                bin_dir.join("host-local"),
                bin_dir.join("portmap")
            ]
        );
        assert_eq!(
            std::fs::read_to_string(bin_dir.join("portmap")).unwrap(),
            "portmap"
        );
        assert_eq!(
            std::fs::read_to_string(bin_dir.join("loopback")).unwrap(),
            "node's own"
        );
        assert!(conf_dir.join(CONFLIST_NAME).is_file());
        // Again (an agent pod restart): the same manifest, companions kept.
        assert_eq!(install(&plan).unwrap(), m);

        let removed = uninstall(&state_dir).unwrap();
        assert!(removed.pods_left.is_empty());
        let mut left: Vec<_> = std::fs::read_dir(&bin_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, vec!["loopback"]);
        assert!(!conf_dir.join(CONFLIST_NAME).exists());
        assert!(!state_dir.exists());
        // Nothing left to remove is success.
        assert!(uninstall(&state_dir).unwrap().paths.is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_missing_companion_without_source_is_a_clear_error() {
        let d = tmp("missing");
        std::fs::write(d.join("xdpcni"), "x").unwrap();
        let conflist = serde_json::json!({});
        let err = install(&InstallPlan {
            conflist: &conflist,
            conf_dir: &d.join("net.d"),
            bin_dir: &d.join("bin"),
            plugin: &d.join("xdpcni"),
            system_plugins: &d.join("none"),
            pin_dir: &d.join("pins"),
            state_dir: &d.join("state"),
        })
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("the node has no host-local in"), "{msg}");
        // Nothing half-done is recorded as installed.
        assert!(read_manifest(&d.join("state")).unwrap().is_none());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
