//! The bpf(2) calls aya 0.14 does not expose: reading which ifindex an XDP
//! or tcx link is attached to (0 once its device is gone), to tell a live
//! pinned link from a defunct one, detaching a pinned link at once, making
//! a pinned map of a size chosen at run time before any object is loaded;
//! and the one name lookup of a device by ifindex that every binary uses.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_DETACH: libc::c_long = 34;
/// `union bpf_attr` is larger than any member we set; zeroed tail is required.
const ATTR_SIZE: usize = 128;

/// What the kernel says of an XDP or tcx bpf_link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkState {
    /// The link's id.
    pub link_id: u32,
    /// The attached program's id.
    pub prog_id: u32,
    /// The device it is attached to; 0 when the device was removed.
    pub ifindex: u32,
}

fn bpf(cmd: libc::c_long, attr: &mut [u8; ATTR_SIZE]) -> io::Result<libc::c_long> {
    // SAFETY: attr is a valid, writable buffer of ATTR_SIZE bytes that outlives
    // the call, and every pointer stored in it points to live memory.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), ATTR_SIZE) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret)
}

pub(crate) fn open_pin(path: &Path) -> io::Result<OwnedFd> {
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = [0u8; ATTR_SIZE];
    attr[..8].copy_from_slice(&(cpath.as_ptr() as u64).to_ne_bytes());
    let raw = bpf(BPF_OBJ_GET, &mut attr)?;
    let raw = i32::try_from(raw).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    // SAFETY: BPF_OBJ_GET returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Detaches the link pinned at `path` now (BPF_LINK_DETACH), whoever else
/// holds it. Unpinning alone releases the link only when its last reference
/// goes, which for a bpffs inode happens later, from an RCU callback.
pub fn detach_pinned_link(path: &Path) -> io::Result<()> {
    let fd = open_pin(path)?;
    let mut attr = [0u8; ATTR_SIZE];
    attr[..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
    match bpf(BPF_LINK_DETACH, &mut attr) {
        // A defunct link (its device is gone) has nothing left to detach.
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => Ok(()),
        Err(e) => Err(e),
    }
}

/// `BPF_LINK_TYPE_XDP`.
const BPF_LINK_TYPE_XDP: u32 = 6;
/// `BPF_LINK_TYPE_TCX`.
const BPF_LINK_TYPE_TCX: u32 = 11;

/// Reads the state of the XDP link pinned at `path`.
pub fn pinned_xdp_link(path: &Path) -> io::Result<LinkState> {
    pinned_link(path, BPF_LINK_TYPE_XDP, "an XDP")
}

/// Reads the state of the tcx link pinned at `path`.
pub fn pinned_tcx_link(path: &Path) -> io::Result<LinkState> {
    pinned_link(path, BPF_LINK_TYPE_TCX, "a tcx")
}

fn pinned_link(path: &Path, want_type: u32, what: &str) -> io::Result<LinkState> {
    let fd = open_pin(path)?;

    // struct bpf_link_info { u32 type, id, prog_id; union { ... xdp { u32 ifindex };
    // tcx { u32 ifindex; u32 attach_type } } }. The union is 8-aligned, so the
    // ifindex of both sits at offset 16.
    let mut info = [0u8; 24];
    let mut attr = [0u8; ATTR_SIZE];
    attr[..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(info.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(info.as_mut_ptr() as u64).to_ne_bytes());
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let word = |at: usize| u32::from_ne_bytes([info[at], info[at + 1], info[at + 2], info[at + 3]]);
    if word(0) != want_type {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not {what} link (type {})", path.display(), word(0)),
        ));
    }
    Ok(LinkState {
        link_id: word(4),
        prog_id: word(8),
        ifindex: word(16),
    })
}

const BPF_LINK_UPDATE: libc::c_long = 29;

/// Moves the link pinned at `path` to the program `prog` (BPF_LINK_UPDATE):
/// atomically, whatever the link's type (XDP, tcx).
pub fn update_pinned_link(path: &Path, prog: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    let fd = open_pin(path)?;
    // struct { u32 link_fd; u32 new_prog_fd; u32 flags; u32 old_prog_fd; }
    let mut attr = [0u8; ATTR_SIZE];
    attr[..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&prog) as u32).to_ne_bytes());
    bpf(BPF_LINK_UPDATE, &mut attr)?;
    Ok(())
}

const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;

/// The kernel id of the program or map pinned at `path` (both info structs
/// begin with `u32 type; u32 id;`).
pub fn pinned_id(path: &Path) -> io::Result<u32> {
    let fd = open_pin(path)?;
    let mut info = [0u8; 8];
    let mut attr = [0u8; ATTR_SIZE];
    attr[..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(info.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(info.as_mut_ptr() as u64).to_ne_bytes());
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(u32::from_ne_bytes([info[4], info[5], info[6], info[7]]))
}

/// Whether the kernel still has the program (`map` false) or map (`map`
/// true) of this id: what was freed once nothing referenced it.
pub fn object_exists(id: u32, map: bool) -> io::Result<bool> {
    let mut attr = [0u8; ATTR_SIZE];
    attr[..4].copy_from_slice(&id.to_ne_bytes());
    let cmd = if map {
        BPF_MAP_GET_FD_BY_ID
    } else {
        BPF_PROG_GET_FD_BY_ID
    };
    match bpf(cmd, &mut attr) {
        Ok(fd) => {
            let fd =
                i32::try_from(fd).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            // SAFETY: the call returned a new descriptor that nothing else owns.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            Ok(true)
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

const BPF_OBJ_PIN: libc::c_long = 6;

/// Pins the object pinned at `from` at `to` as well (BPF_OBJ_PIN of a
/// descriptor of it): one map or program, two names.
pub fn pin_again(from: &Path, to: &Path) -> io::Result<()> {
    pin_fd(&open_pin(from)?, to)
}

/// Pins the object of descriptor `fd` at `to` (BPF_OBJ_PIN).
fn pin_fd(fd: &OwnedFd, to: &Path) -> io::Result<()> {
    let cpath = CString::new(to.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // struct { u64 pathname; u32 bpf_fd; u32 file_flags; }
    let mut attr = [0u8; ATTR_SIZE];
    attr[..8].copy_from_slice(&(cpath.as_ptr() as u64).to_ne_bytes());
    attr[8..12].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(fd) as u32).to_ne_bytes());
    bpf(BPF_OBJ_PIN, &mut attr)?;
    Ok(())
}

const BPF_MAP_DELETE_ELEM: libc::c_long = 3;

/// Deletes key `key` (a `u32` index) of the map `map`: for an array of maps,
/// empties the slot (aya 0.14's `ArrayOfMaps` has no delete). `Ok(false)`
/// when it was empty already.
pub fn map_delete_index(map: std::os::fd::BorrowedFd<'_>, key: u32) -> io::Result<bool> {
    // struct { u32 map_fd; u64 key (8-aligned); ... }
    let mut attr = [0u8; ATTR_SIZE];
    attr[..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&map) as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(&key as *const u32 as u64).to_ne_bytes());
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Sets `keys[i]` to `values[i]` in the map `map` in one call
/// (BPF_MAP_UPDATE_BATCH): for an array of maps, `values` are inner map
/// descriptors, and the kernel waits for one grace period for the whole
/// batch instead of one per element.
pub fn map_update_batch(
    map: std::os::fd::BorrowedFd<'_>,
    keys: &[u32],
    values: &[u32],
) -> io::Result<()> {
    if keys.len() != values.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "as many keys as values",
        ));
    }
    if keys.is_empty() {
        return Ok(());
    }
    let count =
        u32::try_from(keys.len()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // struct { u64 in_batch, out_batch, keys, values; u32 count, map_fd; u64 elem_flags, flags; }
    let mut attr = [0u8; ATTR_SIZE];
    attr[16..24].copy_from_slice(&(keys.as_ptr() as u64).to_ne_bytes());
    attr[24..32].copy_from_slice(&(values.as_ptr() as u64).to_ne_bytes());
    attr[32..36].copy_from_slice(&count.to_ne_bytes());
    attr[36..40].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&map) as u32).to_ne_bytes());
    bpf(BPF_MAP_UPDATE_BATCH, &mut attr)?;
    Ok(())
}

const BPF_MAP_CREATE: libc::c_long = 0;

/// The shape of a map [`create_pinned_map`] makes.
#[derive(Clone, Copy, Debug)]
pub struct MapShape {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key bytes.
    pub key_size: u32,
    /// Value bytes.
    pub value_size: u32,
    /// Entries.
    pub max_entries: u32,
}

/// Makes a map of `shape` named `name` (at most 15 bytes) and pins it at
/// `path`, where a loader's object finds it by name and reuses it: how a
/// size chosen by the operator reaches a map the objects define.
pub fn create_pinned_map(path: &Path, name: &str, shape: MapShape) -> io::Result<()> {
    // struct { u32 map_type, key_size, value_size, max_entries, map_flags,
    // inner_map_fd, numa_node; char map_name[16]; ... }
    let mut attr = [0u8; ATTR_SIZE];
    attr[..4].copy_from_slice(&shape.map_type.to_ne_bytes());
    attr[4..8].copy_from_slice(&shape.key_size.to_ne_bytes());
    attr[8..12].copy_from_slice(&shape.value_size.to_ne_bytes());
    attr[12..16].copy_from_slice(&shape.max_entries.to_ne_bytes());
    let n = name.len().min(15);
    attr[28..28 + n].copy_from_slice(&name.as_bytes()[..n]);
    let raw = bpf(BPF_MAP_CREATE, &mut attr)?;
    let raw = i32::try_from(raw).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    // SAFETY: BPF_MAP_CREATE returned a new file descriptor that nothing else owns.
    pin_fd(&unsafe { OwnedFd::from_raw_fd(raw) }, path)
}

/// The name of the device with `ifindex` in the calling thread's network
/// namespace (`if_indextoname(3)`): the error when there is none.
pub fn ifname(ifindex: u32) -> io::Result<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf holds IF_NAMESIZE bytes, as if_indextoname(3) requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into buf.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}
