//! What a killed test run left behind, found by its name and removed.
//!
//! Every namespace, veth, pin directory, cgroup and temporary directory a
//! test makes is named by [`unique_name`](crate::unique_name): its prefix
//! (`x...`), the PID of the process that made it, `_`, a counter. Drop
//! removes it; a run killed before its Drops (SIGKILL, a CI timeout) leaves
//! it. [`sweep`] removes every such resource whose PID is no longer a live
//! process, and the processes still running in such a namespace or cgroup
//! (started by that run). The first unique name a test binary takes runs it
//! once ([`sweep_once`]); `scripts/test.sh` runs it before the tests
//! (`cargo run -p xdpcni-e2e --bin sweep`). A live run's resources are never
//! touched: their PID is alive.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Once,
};

use crate::netns::run;

/// The PID a name made by `unique_name` carries: `x[a-z-]*<pid>_<n>`.
pub fn owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('x')?;
    let (head, counter) = rest.rsplit_once('_')?;
    if counter.is_empty() || !counter.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = head.len() - head.bytes().rev().take_while(u8::is_ascii_digit).count();
    let (prefix, pid) = head.split_at(digits);
    if pid.is_empty() || !prefix.bytes().all(|b| b.is_ascii_lowercase() || b == b'-') {
        return None;
    }
    pid.parse().ok()
}

/// Whether `pid` is a live process.
fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Whether `name` is a test resource whose maker is gone.
fn orphaned(name: &str) -> bool {
    owner(name).is_some_and(|pid| !alive(pid))
}

/// What one sweep removed, by kind.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub netns: Vec<String>,
    pub links: Vec<String>,
    pub pins: Vec<String>,
    pub cgroups: Vec<String>,
    pub dirs: Vec<String>,
    pub processes: Vec<u32>,
}

impl Swept {
    /// Whether nothing was left behind.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// The names in `dir` a dead test run made.
fn orphans_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| orphaned(n))
        .collect();
    names.sort();
    names
}

/// SIGKILLs every process whose `ns` namespace file is `target`'s (same device and inode).
fn kill_in_namespace(target: &Path, ns: &str, out: &mut Vec<u32>) {
    let Ok(want) = std::fs::metadata(target) else {
        return;
    };
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(have) = std::fs::metadata(p.path().join("ns").join(ns)) else {
            continue;
        };
        if have.dev() == want.dev() && have.ino() == want.ino() {
            kill(pid, out);
        }
    }
}

fn kill(pid: u32, out: &mut Vec<u32>) {
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) with a PID and a signal number; no memory is shared.
    if unsafe { libc::kill(raw, libc::SIGKILL) } == 0 {
        out.push(pid);
    }
}

/// Removes what dead test runs left: namespaces (and the processes in
/// them), veths in this namespace, pin directories, cgroups (and their
/// processes), temporary directories.
pub fn sweep() -> Swept {
    let mut s = Swept::default();
    let netns_dir = Path::new("/run/netns");
    for name in orphans_in(netns_dir) {
        kill_in_namespace(&netns_dir.join(&name), "net", &mut s.processes);
        if run(&["ip", "netns", "del", &name]).is_ok() {
            s.netns.push(name);
        }
    }
    for name in orphans_in(Path::new("/sys/class/net")) {
        if run(&["ip", "link", "del", &name]).is_ok() {
            s.links.push(name);
        }
    }
    let bpffs = Path::new("/sys/fs/bpf");
    for name in orphans_in(bpffs) {
        let path = bpffs.join(&name);
        // Uninstall detaches and unpins what is there (and may remove the directory).
        let _ = xdpcni_ebpf::Datapath::uninstall(&path);
        let _ = std::fs::remove_dir_all(&path);
        if !path.exists() {
            s.pins.push(name);
        }
    }
    if let Ok(root) = crate::cgroup::cgroup2_root() {
        for name in orphans_in(&root) {
            let dir = root.join(&name);
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                kill(pid, &mut s.processes);
            }
            if remove_cgroup(&dir) {
                s.cgroups.push(name);
            }
        }
    }
    let tmp: PathBuf = std::env::temp_dir();
    for name in orphans_in(&tmp) {
        if std::fs::remove_dir_all(tmp.join(&name)).is_ok() {
            s.dirs.push(name);
        }
    }
    s
}

/// rmdir of a cgroup, retried while its killed processes exit.
fn remove_cgroup(dir: &Path) -> bool {
    for _ in 0..50 {
        if std::fs::remove_dir(dir).is_ok() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    false
}

static SWEEP: Once = Once::new();

/// [`sweep`], once per process, saying what it removed.
pub fn sweep_once() {
    SWEEP.call_once(|| {
        let s = sweep();
        if !s.is_empty() {
            eprintln!("swept what killed test runs left: {s:?}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::owner;

    #[test]
    fn sweep_names_parse_back_to_their_pid() {
        assert_eq!(owner("xp1234_0"), Some(1234));
        assert_eq!(owner("xdpcni-test-98_12"), Some(98));
        assert_eq!(owner("xh4194303_999"), Some(4_194_303));
        // Not ours: no x, no separator, no PID, no counter, other characters.
        for name in [
            "p1234_0", "xp1234", "xp_0", "xp12_", "xP12_0", "eth0", "xp12_0a", "x1_2_3",
        ] {
            assert_eq!(owner(name), None, "{name}");
        }
    }
}
