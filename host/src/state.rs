//! One record per attachment (container ID + interface) under the state
//! directory: what ADD built, so DEL, CHECK and GC know what to undo or check
//! even when the runtime sends no prevResult, and so the node agent can map
//! host veths to pods.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
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
    /// The pod network namespace's cookie (`SO_NETNS_COOKIE`), read at ADD:
    /// how the Service programs know this pod's sockets. None in records of
    /// releases before it (the agent then reads it from `netns`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_cookie: Option<u64>,
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

/// What [`Cache::get`] answers: every record of the directory, the files
/// that could not be read (as [`list_all`]), and a generation that changes
/// whenever either did.
#[derive(Clone, Debug, Default)]
pub struct Listing {
    /// The records.
    pub records: Arc<Vec<Record>>,
    /// `path: why` of each unreadable file.
    pub bad: Arc<Vec<String>>,
    /// Bumped each time the records or the unreadable files differ from
    /// the previous listing.
    pub generation: u64,
}

/// The records of a state directory, read again only when the directory
/// changed: every writer (ADD, DEL, GC) creates, renames or removes a file
/// in it, which moves the directory's mtime. A reader that asks once per
/// pod reconcile (N pods: N reads of N files) reads each change once.
///
/// The mtime is trusted only when the listing was taken well after it
/// ([`Cache::SETTLE`]): two changes within one tick of the file system's
/// clock leave one mtime, so a listing taken in that tick is read again
/// next time. Whatever the mtime says, a listing older than
/// [`Cache::MAX_AGE`] is read again (a file edited in place by hand).
#[derive(Debug)]
pub struct Cache {
    dir: PathBuf,
    last: Option<Cached>,
    generation: u64,
}

#[derive(Debug)]
struct Cached {
    mtime: Option<SystemTime>,
    trusted: bool,
    at: Instant,
    listing: Listing,
}

impl Cache {
    /// How long after the directory's mtime a listing must be taken for the
    /// mtime to tell every later change (file system clocks tick at most
    /// every 10 ms).
    pub const SETTLE: Duration = Duration::from_millis(100);
    /// How old a listing may be before it is read again regardless.
    pub const MAX_AGE: Duration = Duration::from_secs(30);

    /// A cache of `dir` (nothing read yet).
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            last: None,
            generation: 0,
        }
    }

    fn mtime(&self) -> Result<Option<SystemTime>> {
        match std::fs::metadata(&self.dir) {
            Ok(m) => m
                .modified()
                .map(Some)
                .map_err(|e| Error::io(format!("mtime of {}", self.dir.display()), e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(format!("stat {}", self.dir.display()), e)),
        }
    }

    /// The records, from the last listing when the directory has not
    /// changed since, else read again.
    pub fn get(&mut self) -> Result<Listing> {
        let mtime = self.mtime()?;
        if let Some(c) = &self.last {
            if c.trusted && c.mtime == mtime && c.at.elapsed() < Self::MAX_AGE {
                return Ok(c.listing.clone());
            }
        }
        let now = SystemTime::now();
        let (mut records, bad) = list_all(&self.dir)?;
        records.sort_by(|a, b| (&a.container_id, &a.ifname).cmp(&(&b.container_id, &b.ifname)));
        let changed = self
            .last
            .as_ref()
            .is_none_or(|c| *c.listing.records != records || *c.listing.bad != bad);
        if changed {
            self.generation += 1;
        }
        let trusted = mtime.is_some_and(|m| now.duration_since(m).is_ok_and(|d| d > Self::SETTLE));
        let listing = Listing {
            records: Arc::new(records),
            bad: Arc::new(bad),
            generation: self.generation,
        };
        self.last = Some(Cached {
            mtime,
            trusted,
            at: Instant::now(),
            listing: listing.clone(),
        });
        Ok(listing)
    }
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

    /// The cache reads a directory again only when a writer changed it: a
    /// file edited in place (no rename) after a trusted listing is not seen
    /// until the next save or remove, which are.
    #[test]
    fn the_cache_reads_again_only_what_writers_changed() {
        let dir = std::env::temp_dir().join(format!("xdpcni-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rec = |id: &str| -> Record {
            serde_json::from_value(serde_json::json!({
                "containerId": id, "ifname": "eth0", "netns": "/run/netns/x",
                "hostVeth": "xdpabc", "hostIfindex": 7,
                "hostMac": "02:00:00:00:00:01", "podMac": "0a:58:0a:01:00:02",
                "ips": ["10.1.0.2"], "mtu": 1500, "headroomRequested": 256,
                "headroomEffective": null,
            }))
            .unwrap()
        };
        // The directory's mtime a second back: a listing now is trusted.
        let age = |dir: &Path| {
            let past = SystemTime::now() - Duration::from_secs(1);
            std::fs::File::open(dir)
                .unwrap()
                .set_modified(past)
                .unwrap();
        };
        save(&dir, &rec("a")).unwrap();
        age(&dir);
        let mut cache = Cache::new(&dir);
        let first = cache.get().unwrap();
        assert_eq!(first.records.len(), 1);
        // Edited in place: the directory did not change, nor the answer.
        let file = path(&dir, "a", "eth0");
        let mut edited = rec("a");
        edited.mtu = 9000;
        std::fs::write(&file, serde_json::to_vec(&edited).unwrap()).unwrap();
        let again = cache.get().unwrap();
        assert_eq!(again.generation, first.generation);
        assert_eq!(again.records[0].mtu, 1500, "answered from the cache");
        // A save (rename into the directory) is seen, with the edit.
        save(&dir, &rec("b")).unwrap();
        let now = cache.get().unwrap();
        assert_eq!(now.records.len(), 2);
        assert_eq!(now.records[0].mtu, 9000);
        assert!(now.generation > first.generation);
        // Read within SETTLE of the change: not trusted, read again, and a
        // removal right after is seen although the mtime may not move.
        remove(&dir, "b", "eth0").unwrap();
        assert_eq!(cache.get().unwrap().records.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
