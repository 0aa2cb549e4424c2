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

/// `SO_NETNS_COOKIE` (linux/socket.h; not in every libc release).
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The cookie of the network namespace at `path`: what
/// `bpf_get_netns_cookie()` gives a program for a socket of that namespace,
/// stable while the namespace lives and never reused.
pub fn netns_cookie(path: &Path) -> io::Result<u64> {
    in_netns(path, || {
        // SAFETY: plain socket(2); the fd is closed below on every path.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: `cookie` and `len` are valid for the getsockopt's writes.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                SO_NETNS_COOKIE,
                (&mut cookie as *mut u64).cast(),
                &mut len,
            )
        };
        let err = io::Error::last_os_error();
        // SAFETY: fd is ours and open.
        unsafe { libc::close(fd) };
        if r != 0 {
            return Err(err);
        }
        Ok(cookie)
    })
}
