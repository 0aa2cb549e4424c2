//! A cgroup v2 directory of a test, for the Service programs (attached
//! there, never at a cgroup the host's own processes use), and a way to run
//! `podtool` inside it or outside it.

use std::{path::PathBuf, process::Command};

use anyhow::{bail, Context, Result};

use crate::netns::unique_name;

/// Where cgroup v2 is mounted (here /sys/fs/cgroup/unified, beside the v1 controllers).
pub fn cgroup2_root() -> Result<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    // mountinfo: ... mount-point ... - fstype source options
    info.lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split_whitespace().next()? == "cgroup2")
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .context("no cgroup2 mount in /proc/self/mountinfo")
}

/// A cgroup v2 directory, uniquely named, removed on Drop (once empty).
#[derive(Debug)]
pub struct TestCgroup {
    /// Its directory.
    pub path: PathBuf,
}

impl TestCgroup {
    /// A new directory under the cgroup v2 mount (wherever it is: here
    /// /sys/fs/cgroup/unified, beside the v1 controllers).
    pub fn new() -> Result<Self> {
        let path = cgroup2_root()?.join(unique_name("xdpcni-svc"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    /// `podtool ARGS` in network namespace `netns`, inside this cgroup when
    /// `inside` (the programs attached here run for it), else outside;
    /// waited for. Its stdout, or its stderr as the error.
    pub fn podtool(&self, inside: bool, netns: &str, args: &[&str]) -> Result<String> {
        let join = if inside {
            format!("echo $$ > {} && ", self.path.join("cgroup.procs").display())
        } else {
            String::new()
        };
        let podtool = crate::cluster::podtool()?;
        let script = format!(
            "{join}exec ip netns exec {netns} {} {}",
            podtool.display(),
            args.join(" ")
        );
        let out = Command::new("sh").args(["-c", &script]).output()?;
        if !out.status.success() {
            bail!(
                "podtool {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Its processes have exited (each client is waited for); a cgroup
        // with none can be removed.
        let _ = std::fs::remove_dir(&self.path);
    }
}
