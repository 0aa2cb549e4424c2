//! Where the Service programs attach.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The cgroup v2 root under `configured`, where the programs attach: the
/// path itself if it is a cgroup2 mount (a v2-only host), else its
/// `unified` child (a hybrid host, such as this project's test machines).
/// The root, because a cgroup program runs for the sockets of every process
/// beneath it and pods' processes may sit anywhere in the v2 tree (with a v1
/// cgroup driver they all sit at its root: docs/services.md); the programs
/// keep to the node's pods by network namespace.
pub fn cgroup2_root(configured: &Path) -> Result<PathBuf> {
    [configured.to_path_buf(), configured.join("unified")]
        .into_iter()
        .find(|p| crate::bpffs::is_cgroup2(p).unwrap_or(false))
        .ok_or_else(|| Error::Invalid {
            what: "cgroup",
            why: format!(
                "no cgroup v2 hierarchy at {0} nor at {0}/unified: mount one there \
                 (Service translation attaches to it) or set services.cgroup",
                configured.display()
            ),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_with_no_cgroup2_mount_is_refused_naming_it() {
        let dir = std::env::temp_dir();
        let e = cgroup2_root(&dir).unwrap_err().to_string();
        assert!(e.contains(&dir.display().to_string()), "{e}");
        assert!(e.contains("services.cgroup"), "{e}");
    }

    #[test]
    fn this_machines_cgroup2_is_found_under_sys_fs_cgroup() {
        // Debian 12 with v1 controllers mounts v2 at /sys/fs/cgroup/unified,
        // a v2-only host at /sys/fs/cgroup itself: either is found.
        let root = cgroup2_root(Path::new("/sys/fs/cgroup")).unwrap();
        assert!(crate::bpffs::is_cgroup2(&root).unwrap());
        assert!(root.starts_with("/sys/fs/cgroup"));
    }
}
