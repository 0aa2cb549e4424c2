//! One record per attachment (container ID + interface) under the state
//! directory: what ADD built, so DEL, CHECK and GC know what to undo or check
//! even when the runtime sends no prevResult, and so the node agent can map
//! host veths to pods.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::pod::Mac;

/// Failures reading or writing records.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The file system refused.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A record is not JSON of the expected shape.
    #[error("decoding a pod record: {0}")]
    Decode(String),
}

impl StateError {
    fn io(op: String, source: std::io::Error) -> Self {
        Self::Io { op, source }
    }
}

type Error = StateError;
type Result<T> = std::result::Result<T, StateError>;

/// The first letters of every host veth xdpcni makes (the IPv6 source
/// check's rule matches `xdp+`).
pub const HOST_VETH_PREFIX: &str = "xdp";

/// What ADD built for one attachment. The fast path (mode, redirect,
/// endpoint records) is the agent's, not part of the record: ADD leaves the
/// pod on kernel routing (or held, see [`crate::gate`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// CNI_CONTAINERID.
    pub container_id: String,
    /// CNI_IFNAME.
    pub ifname: String,
    /// CNI_NETNS at ADD.
    pub netns: String,
    /// Host-side veth.
    pub host_veth: String,
    /// Its ifindex (in the host namespace).
    pub host_ifindex: u32,
    /// Its MAC.
    pub host_mac: Mac,
    /// The pod interface's MAC.
    pub pod_mac: Mac,
    /// The pod's addresses.
    pub ips: Vec<IpAddr>,
    /// MTU of both ends.
    pub mtu: u32,
    /// Headroom asked for.
    pub headroom_requested: u16,
    /// Headroom the kernel reports on the host veth (`IFLA_HEADROOM`), if any.
    pub headroom_effective: Option<u16>,
    /// K8S_POD_NAMESPACE, when the runtime gave it.
    #[serde(default)]
    pub pod_namespace: String,
    /// K8S_POD_NAME, when the runtime gave it.
    #[serde(default)]
    pub pod_name: String,
    /// Set by DEL before it removes anything: the pod is going, and a veth
    /// found missing is its DEL's doing, not a deletion behind the CNI's
    /// back (the agent reports only the latter).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleting: bool,
}

/// The record file of an attachment.
pub fn path(dir: &Path, container_id: &str, ifname: &str) -> PathBuf {
    dir.join(format!("{container_id}_{ifname}.json"))
}

/// Writes a record atomically (temporary file, then rename).
pub fn save(dir: &Path, rec: &Record) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let final_path = path(dir, &rec.container_id, &rec.ifname);
    let tmp = final_path.with_extension(format!("tmp{}", std::process::id()));
    let bytes = serde_json::to_vec_pretty(rec).map_err(|e| Error::Decode(e.to_string()))?;
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, &final_path)
        .map_err(|e| Error::io(format!("renaming {}", tmp.display()), e))
}

impl Record {
    /// A record from the bytes of its file.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// Whether `e` says there is no such record: no file, or no directory
/// where the records should be (its path taken by a file).
fn absent(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
    )
}

/// Loads the record of an attachment, if there is one.
pub fn load(dir: &Path, container_id: &str, ifname: &str) -> Result<Option<Record>> {
    let p = path(dir, container_id, ifname);
    match std::fs::read(&p) {
        Ok(bytes) => Record::parse(&bytes)
            .map(Some)
            .map_err(|e| Error::Decode(format!("{}: {e}", p.display()))),
        Err(e) if absent(&e) => Ok(None),
        Err(e) => Err(Error::io(format!("reading {}", p.display()), e)),
    }
}

/// Removes the record of an attachment; fine if there is none.
pub fn remove(dir: &Path, container_id: &str, ifname: &str) -> Result<()> {
    let p = path(dir, container_id, ifname);
    match std::fs::remove_file(&p) {
        Ok(()) => Ok(()),
        Err(e) if absent(&e) => Ok(()),
        Err(e) => Err(Error::io(format!("removing {}", p.display()), e)),
    }
}

/// Every record in `dir` (unreadable files are skipped, not fatal; see
/// [`list_all`] for what was skipped).
pub fn list(dir: &Path) -> Result<Vec<Record>> {
    list_all(dir).map(|(records, _)| records)
}

/// Every record in `dir`, and each file that could not be read or parsed
/// with the reason (`path: why`).
pub fn list_all(dir: &Path) -> Result<(Vec<Record>, Vec<String>)> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
        Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
    };
    let (mut out, mut bad) = (Vec::new(), Vec::new());
    for entry in entries.flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "json") {
            match std::fs::read(&p).map(|b| Record::parse(&b)) {
                Ok(Ok(rec)) => out.push(rec),
                // Removed between the listing and the read: a DEL.
                Err(e) if absent(&e) => {}
                Err(e) => bad.push(format!("{}: {e}", p.display())),
                Ok(Err(e)) => bad.push(format!("{}: {e}", p.display())),
            }
        }
    }
    Ok((out, bad))
}

/// The host veth name of an attachment: `xdp` + 12 hex digits of a 64-bit
/// FNV-1a hash of container ID and interface (15 bytes, the kernel's limit).
pub fn host_veth_name(container_id: &str, ifname: &str) -> String {
    // HOST_VETH_PREFIX + 12 hex digits: 15 bytes, IFNAMSIZ - 1.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in container_id.bytes().chain([0]).chain(ifname.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{HOST_VETH_PREFIX}{:012x}", h >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records are typed (MACs) and read the JSON written before: the same
    /// strings, and the mode and redirect that ADD chose before the agent
    /// became the only writer of the fast path are ignored.
    #[test]
    fn records_are_typed_and_read_the_old_json() {
        let old = serde_json::json!({
            "containerId": "c1", "ifname": "eth0", "netns": "/run/netns/x",
            "hostVeth": "xdpabc", "hostIfindex": 7,
            "hostMac": "02:00:00:00:00:01", "podMac": "0a:58:0a:01:00:02",
            "ips": ["10.1.0.2"], "mtu": 1500, "headroomRequested": 256,
            "headroomEffective": null, "xdpMode": "none", "redirect": "cpumap",
        });
        let rec: Record = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(rec.host_mac, Mac([2, 0, 0, 0, 0, 1]));
        assert_eq!(rec.pod_mac.to_string(), "0a:58:0a:01:00:02");
        assert_eq!(rec.pod_name, "", "absent pod fields default to empty");
        let back = serde_json::to_value(&rec).unwrap();
        assert_eq!(back["hostMac"], "02:00:00:00:00:01");
        assert!(back.get("xdpMode").is_none() && back.get("redirect").is_none());
        for (field, bad) in [("hostMac", "02:00:00:00:00"), ("podMac", "zz")] {
            let mut v = old.clone();
            v[field] = serde_json::json!(bad);
            let err = serde_json::from_value::<Record>(v).unwrap_err().to_string();
            assert!(err.contains(bad), "{field}: {err}");
        }
    }

    #[test]
    fn host_veth_names_are_stable_short_and_distinct() {
        let a = host_veth_name("abc", "eth0");
        assert_eq!(a, host_veth_name("abc", "eth0"));
        assert_eq!(a.len(), 15);
        assert_ne!(a, host_veth_name("abc", "eth1"));
        assert_ne!(a, host_veth_name("abd", "eth0"));
        let names: std::collections::HashSet<_> = (0..10_000)
            .map(|i| host_veth_name(&format!("{i:064x}"), "eth0"))
            .collect();
        assert_eq!(names.len(), 10_000);
    }
}
