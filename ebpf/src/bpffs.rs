//! The BPF filesystem the datapath is pinned on, and the cgroup v2
//! filesystem the Service programs attach to.

use std::{ffi::CString, os::unix::ffi::OsStrExt, path::Path};

use crate::{Error, Result};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|e| Error::Invalid {
        what: "path",
        why: e.to_string(),
    })
}

/// Whether `path` lies on a bpffs.
pub fn is_bpffs(path: &Path) -> Result<bool> {
    Ok(fs_magic(path)? == BPF_FS_MAGIC)
}

/// Whether `path` lies on a cgroup v2 filesystem.
pub fn is_cgroup2(path: &Path) -> Result<bool> {
    Ok(fs_magic(path)? == CGROUP2_SUPER_MAGIC)
}

/// The type of the filesystem `path` lies on (statfs's `f_type`).
fn fs_magic(path: &Path) -> Result<i64> {
    let c = c_path(path)?;
    // SAFETY: statfs is plain old data; zeroed is a valid initial value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and st a valid out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::io("statfs", path, std::io::Error::last_os_error()));
    }
    // f_type's integer type differs between targets.
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64)
}

/// Mounts a bpffs on `path` (created if missing) unless one is there.
/// `Ok(true)` if it mounted one.
pub fn mount_bpffs(path: &Path) -> Result<bool> {
    std::fs::create_dir_all(path).map_err(|e| Error::io("creating", path, e))?;
    if is_bpffs(path)? {
        return Ok(false);
    }
    let target = c_path(path)?;
    let fstype = c"bpf";
    let opts = c"mode=0700";
    // SAFETY: every pointer is a valid NUL-terminated string for the call.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            opts.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(Error::io(
            "mounting bpffs on",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(true)
}

/// `Ok` when `dir` (or, not made yet, its parent) is on a bpffs: where
/// anything is pinned, checked before anything is made there.
pub(crate) fn ensure_bpffs(dir: &Path) -> Result<()> {
    let probe = if dir.exists() {
        dir
    } else {
        dir.parent().unwrap_or(dir)
    };
    if !is_bpffs(probe)? {
        return Err(Error::NotBpffs(probe.to_path_buf()));
    }
    Ok(())
}
