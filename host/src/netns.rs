//! Running code inside a pod's network namespace, on a dedicated OS thread,
//! so the calling thread never changes namespace (no guard to forget, no `?`
//! that skips the switch back).

use std::{fs::File, io, os::fd::AsRawFd, path::Path};

/// Runs `f` on a new thread that has joined the network namespace at `path`
/// (only the network namespace: mounts, and so bpffs, stay as they are).
pub fn in_netns<T: Send, E: Send + From<io::Error>>(
    path: &Path,
    f: impl FnOnce() -> Result<T, E> + Send,
) -> Result<T, E> {
    let ns = File::open(path)?;
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: `ns` is an open namespace file; this thread is ours and
            // ends when `f` returns.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error().into());
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("namespace thread panicked").into()))
    })
}
