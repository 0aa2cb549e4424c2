//! `prepare-node`: the chart's first init container. Enters the node's mount
//! namespace (through the node's /proc, mounted into the container; see
//! [`host_mount_ns`]) and makes the two host mounts the agent needs exist there, so
//! the chart works on any node, with systemd (every mount shared) or without
//! (every mount private, as on a minimal host):
//!
//! - a bpffs on the pin root (`/sys/fs/bpf`) when none is mounted: the agent
//!   and the CNI plugin (run by the runtime on the host) must share one, and
//!   pins are files in it, so the agent's volume needs no propagation;
//! - the runtime's netns directory (`/run/netns`) as a shared mount point, as
//!   `ip netns` makes it: pod namespaces are mounts created there after the
//!   agent starts, which reach the agent's container only through
//!   HostToContainer propagation, and the runtime accepts that only on a
//!   shared or slave mount.
//!
//! Must run before any other thread exists (setns into a mount namespace
//! refuses a multi-threaded caller).

use std::{
    ffi::CString,
    os::{fd::AsRawFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

/// The node's mount namespace as seen through `host_proc` (the node's /proc):
/// its init's (`1/ns/mnt`) when readable, otherwise that of our nearest
/// ancestor outside this container (the runtime's shim, which runs in the
/// node's mounts). Some hosts refuse even root a look at PID 1's namespaces
/// (a sandboxed VM init, as on the project's CI machines).
pub fn host_mount_ns(host_proc: &Path) -> Result<PathBuf> {
    let ours = std::fs::read_link("/proc/self/ns/mnt").context("reading /proc/self/ns/mnt")?;
    let init = host_proc.join("1/ns/mnt");
    if std::fs::read_link(&init).is_ok_and(|l| l != ours) {
        return Ok(init);
    }
    // Our PID in the node's PID namespace: the process there whose NSpid
    // line ends with our PID and whose mount namespace is ours.
    let me = std::process::id().to_string();
    let mut host_pid = None;
    for entry in
        std::fs::read_dir(host_proc).with_context(|| format!("listing {}", host_proc.display()))?
    {
        let Ok(entry) = entry else { continue };
        let dir = entry.path();
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
            continue;
        };
        let nspid: Vec<&str> = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .map(|l| l.split_whitespace().collect())
            .unwrap_or_default();
        if nspid.len() > 1
            && nspid.last() == Some(&me.as_str())
            && std::fs::read_link(dir.join("ns/mnt")).is_ok_and(|l| l == ours)
        {
            host_pid = Some(dir);
            break;
        }
    }
    let mut dir = host_pid.with_context(|| {
        format!(
            "{} is not the node's /proc (this process is not in it)",
            host_proc.display()
        )
    })?;
    for _ in 0..64 {
        let status = std::fs::read_to_string(dir.join("status"))
            .with_context(|| format!("reading {}/status", dir.display()))?;
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .map(str::trim)
            .context("no PPid in status")?;
        if ppid == "0" {
            break;
        }
        dir = host_proc.join(ppid);
        let ns = dir.join("ns/mnt");
        if std::fs::read_link(&ns).is_ok_and(|l| l != ours) {
            return Ok(ns);
        }
    }
    bail!(
        "no process outside this container's mount namespace is readable in {} (needs a privileged container)",
        host_proc.display()
    )
}

/// Enters the node's mount namespace (see [`host_mount_ns`]).
pub fn enter_host_mounts(host_proc: &Path) -> Result<()> {
    let ns = host_mount_ns(host_proc)?;
    let f = std::fs::File::open(&ns).with_context(|| format!("opening {}", ns.display()))?;
    // SAFETY: a valid open namespace fd; CLONE_NEWNS asks for a mount ns.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNS) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| {
            format!("setns into {} (needs a privileged container)", ns.display())
        });
    }
    tracing::info!(ns = %ns.display(), "entered the node's mount namespace");
    Ok(())
}

fn mount(src: Option<&Path>, target: &Path, flags: libc::c_ulong) -> std::io::Result<()> {
    let t = CString::new(target.as_os_str().as_bytes())?;
    let s = src
        .map(|p| CString::new(p.as_os_str().as_bytes()))
        .transpose()?;
    let none = c"none";
    // SAFETY: valid NUL-terminated strings (or null for the source), as
    // mount(2) takes them for a bind or a propagation change.
    let rc = unsafe {
        libc::mount(
            s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            t.as_ptr(),
            none.as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Makes `dir` a shared mount point (bind-mounted on itself first when it is
/// not a mount point). `Ok(true)` if it had to bind it.
pub fn make_shared_mount(dir: &Path) -> Result<bool> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    match mount(None, dir, libc::MS_SHARED | libc::MS_REC) {
        Ok(()) => Ok(false),
        // EINVAL: not a mount point.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            mount(Some(dir), dir, libc::MS_BIND | libc::MS_REC)
                .with_context(|| format!("bind-mounting {} on itself", dir.display()))?;
            mount(None, dir, libc::MS_SHARED | libc::MS_REC)
                .with_context(|| format!("making {} shared", dir.display()))?;
            Ok(true)
        }
        Err(e) => Err(e).with_context(|| format!("making {} shared", dir.display())),
    }
}

/// The whole init step: enter the node's mounts (unless `host_proc` is
/// `None`: already in them), then bpffs and the netns directory.
pub fn prepare_node(host_proc: Option<&Path>, bpf_root: &Path, netns_dir: &Path) -> Result<()> {
    if !bpf_root.is_absolute() || !netns_dir.is_absolute() {
        bail!("--bpf-root and --netns-dir must be absolute paths");
    }
    if let Some(p) = host_proc {
        enter_host_mounts(p)?;
    }
    let mounted = xdpcni_ebpf::mount_bpffs(bpf_root)
        .with_context(|| format!("bpffs on {}", bpf_root.display()))?;
    tracing::info!(
        bpf_root = %bpf_root.display(),
        "{}",
        if mounted { "mounted bpffs" } else { "bpffs already mounted" }
    );
    let bound = make_shared_mount(netns_dir)?;
    tracing::info!(
        netns_dir = %netns_dir.display(),
        "{}",
        if bound { "made a shared mount point" } else { "already a mount point, now shared" }
    );
    Ok(())
}
