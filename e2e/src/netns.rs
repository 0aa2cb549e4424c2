//! Namespaces, commands and pin directories owned by one test.

use std::{
    fs::File,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, Context, Result};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A name no other test (or other run of this binary) uses: `prefix` (`x`
/// and lowercase letters or `-`), the PID, `_`, a counter. The PID parses
/// back ([`crate::sweep::owner`]), so what a killed run left is found and
/// removed: the first name a process takes sweeps ([`crate::sweep`]). Short
/// enough for veth names derived from it (15 bytes).
pub fn unique_name(prefix: &str) -> String {
    debug_assert!(
        prefix.starts_with('x') && prefix.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'),
        "a test resource's prefix is x and lowercase letters: {prefix}"
    );
    crate::sweep::sweep_once();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}_{n}", std::process::id())
}

/// Runs a command, failing with its output if it fails.
pub fn run(args: &[&str]) -> Result<()> {
    run_out(args).map(drop)
}

/// Runs a command and returns its stdout.
pub fn run_out(args: &[&str]) -> Result<String> {
    let (cmd, rest) = args.split_first().context("empty command")?;
    let out: Output = Command::new(cmd)
        .args(rest)
        .output()
        .with_context(|| format!("spawning {args:?}"))?;
    if !out.status.success() {
        bail!(
            "{args:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A network namespace made with `ip netns add`, deleted on Drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace named `unique_name(prefix)`, with lo up.
    pub fn new(prefix: &str) -> Result<Self> {
        let name = unique_name(prefix);
        run(&["ip", "netns", "add", &name])?;
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its bind-mount path.
    pub fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    /// `ip -n NAME args...`
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["ip", "-n", &self.name];
        full.extend_from_slice(args);
        run_out(&full)
    }

    /// A veth pair: `name` here, `peer` in `peer_ns` (here when `None`).
    pub fn add_veth(&self, name: &str, peer: &str, peer_ns: Option<&Netns>) -> Result<()> {
        let mut args = vec!["link", "add", name, "type", "veth", "peer", "name", peer];
        if let Some(ns) = peer_ns {
            args.extend(["netns", ns.name()]);
        }
        self.ip(&args).map(drop)
    }

    /// `ip netns exec NAME args...`
    pub fn exec(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        run_out(&full)
    }

    /// Writes a sysctl inside the namespace (namespaced sysctls only).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec(&["sysctl", "-qw", &format!("{key}={value}")])
            .map(drop)
    }

    /// What a differential test needs of a namespace's stack so that what it
    /// sends depends on the path, not on timing: ICMP errors by count (no
    /// rate limits) and incomplete fragment queues expired after 1 s (a
    /// run's must not meet the next run's, nor outlive it).
    pub fn for_differential_tests(&self) -> Result<()> {
        for (key, value) in [
            ("net.ipv4.icmp_ratelimit", "0"),
            ("net.ipv4.icmp_msgs_per_sec", "100000"),
            ("net.ipv6.icmp.ratelimit", "0"),
            ("net.ipv4.ipfrag_time", "1"),
            ("net.ipv6.ip6frag_time", "1"),
        ] {
            self.sysctl(key, value)?;
        }
        Ok(())
    }

    /// Reads a sysctl inside the namespace.
    pub fn sysctl_get(&self, key: &str) -> Result<String> {
        Ok(self.exec(&["sysctl", "-n", key])?.trim().to_string())
    }

    /// Ifindex of `dev` in this namespace.
    pub fn ifindex(&self, dev: &str) -> Result<u32> {
        let v = self.link_json(dev)?;
        v["ifindex"]
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .with_context(|| format!("no ifindex for {dev}"))
    }

    /// MAC of `dev` in this namespace.
    pub fn mac(&self, dev: &str) -> Result<[u8; 6]> {
        let v = self.link_json(dev)?;
        let s = v["address"].as_str().context("no address")?;
        parse_mac(s)
    }

    /// `ip -d -j link show dev` as JSON.
    pub fn link_json(&self, dev: &str) -> Result<serde_json::Value> {
        let out = self.ip(&["-d", "-j", "link", "show", "dev", dev])?;
        let v: serde_json::Value = serde_json::from_str(&out)?;
        v.get(0).cloned().context("empty link dump")
    }

    /// The XDP program attached to `dev` as netlink reports it: (mode, prog id).
    /// Mode is `xdp` (native), `xdpgeneric`, or `None` when nothing is attached.
    pub fn xdp_attached(&self, dev: &str) -> Result<Option<(String, u64)>> {
        let v = self.link_json(dev)?;
        let Some(xdp) = v.get("xdp") else {
            return Ok(None);
        };
        let mode = match xdp["mode"].as_u64() {
            Some(1) => "xdp",
            Some(2) => "xdpgeneric",
            Some(3) => "xdpoffload",
            Some(4) => "multi",
            _ => return Ok(None),
        };
        let id = xdp["prog"]["id"].as_u64().context("xdp without prog id")?;
        Ok(Some((mode.to_string(), id)))
    }

    /// The programs on `dev`'s tcx ingress, in order, as the kernel lists
    /// them (BPF_PROG_QUERY): name (truncated to 15 bytes) and id.
    pub fn tcx_ingress(&self, dev: &str) -> Result<Vec<(String, u32)>> {
        let dev = dev.to_string();
        in_netns(self, move || {
            let (_, progs) = aya::programs::SchedClassifier::query_tcx(
                &dev,
                aya::programs::TcAttachType::Ingress,
            )?;
            Ok(progs
                .iter()
                .map(|p| (p.name_as_str().unwrap_or_default().to_string(), p.id()))
                .collect())
        })
    }

    /// One offload feature of `dev` as `ethtool -k` prints it (`on`/`off`).
    pub fn offload(&self, dev: &str, feature: &str) -> Result<String> {
        let out = self.exec(&["ethtool", "-k", dev])?;
        for line in out.lines() {
            if let Some(rest) = line.trim().strip_prefix(&format!("{feature}:")) {
                return Ok(rest.split_whitespace().next().unwrap_or("").to_string());
            }
        }
        bail!("ethtool -k {dev} has no {feature}")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    s.parse::<xdpcni_host::pod::Mac>()
        .map(|m| m.0)
        .map_err(anyhow::Error::msg)
}

/// Runs `f` on a fresh OS thread that has entered `ns`'s network namespace
/// (only the network namespace, so bpffs under /sys stays visible). The
/// caller's thread never changes namespace.
pub fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let path = ns.path();
    std::thread::scope(|s| {
        s.spawn(move || -> Result<T> {
            let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: a valid namespace fd; the thread is ours and exits after f.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!(
                    "setns {}: {}",
                    path.display(),
                    std::io::Error::last_os_error()
                );
            }
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("thread in netns {} panicked", ns.name()))?
    })
}

/// A unique directory on bpffs for a test's pins, removed (links detached,
/// maps unpinned) on Drop.
#[derive(Debug)]
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    /// Creates `/sys/fs/bpf/<unique>`; fails if bpffs is not mounted there.
    pub fn new(prefix: &str) -> Result<Self> {
        let root = Path::new("/sys/fs/bpf");
        let mounts = std::fs::read_to_string("/proc/self/mounts")?;
        if !mounts
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf") && l.contains(" bpf "))
        {
            bail!("bpffs is not mounted at /sys/fs/bpf (mount -t bpf bpf /sys/fs/bpf)");
        }
        let path = root.join(unique_name(prefix));
        Ok(Self { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = xdpcni_ebpf::Datapath::uninstall(&self.path);
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
