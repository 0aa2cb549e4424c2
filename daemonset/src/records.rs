//! A pod's CNI record and what names it: its key, whether it is still
//! there (its netns, its host veth), which records no listed pod claims.
//! Facts read from the record and the kernel, shared by every part of the
//! agent; nothing here writes.

use std::collections::{BTreeMap, HashSet};

use xdpcni_host::state::{self, Record};

/// Annotations of a pod.
pub type Annotations = BTreeMap<String, String>;

/// (namespace, name) of a pod; ("", container ID) for a record without one.
pub type PodKey = (String, String);

/// (namespace, name) of a record: the pod's, or ("", container ID).
pub fn pod_key(rec: &Record) -> PodKey {
    if rec.pod_name.is_empty() {
        (String::new(), rec.container_id.clone())
    } else {
        (rec.pod_namespace.clone(), rec.pod_name.clone())
    }
}

/// The records no listed pod claims, which get the node defaults. `listed`
/// is None until the first complete list of pods has arrived: before it, a
/// record's pod may simply not be known yet, and the defaults would undo the
/// mode its annotations chose (after an agent restart, say), so none is an
/// orphan yet.
pub fn orphans<'a>(records: &'a [Record], listed: Option<&HashSet<PodKey>>) -> Vec<&'a Record> {
    let Some(listed) = listed else {
        return Vec::new();
    };
    records
        .iter()
        .filter(|r| !listed.contains(&pod_key(r)))
        .collect()
}

/// Whether a record's pod is still there: its DEL has not started and its
/// netns exists. A pod whose netns is gone is being deleted; its DEL cleans
/// up.
pub fn is_live(rec: &Record) -> bool {
    !rec.deleting && std::path::Path::new(&rec.netns).exists()
}

/// The name of the device with `ifindex` in this network namespace, if any.
pub(crate) fn link_name(ifindex: u32) -> Option<String> {
    xdpcni_ebpf::ifname(ifindex).ok()
}

/// Whether the record's pod is being deleted: its DEL marked the record,
/// or already removed it (read again from disk: the caller's copy may
/// predate the DEL).
pub(crate) fn being_deleted(state_dir: &std::path::Path, rec: &Record) -> bool {
    match state::load(state_dir, &rec.container_id, &rec.ifname) {
        Ok(Some(now)) => now.deleting,
        Ok(None) => true,
        Err(_) => false,
    }
}

/// Whether the record's host veth is still there (its ifindex still names
/// it): one ioctl, so standalone mode can skip a pod that did not change
/// and still learn at once of a veth deleted behind the CNI's back.
pub fn veth_present(rec: &Record) -> bool {
    link_name(rec.host_ifindex).is_some_and(|n| n == rec.host_veth)
}

/// Whether a device with `ifindex` exists in this network namespace.
pub(crate) fn link_exists(ifindex: u32) -> bool {
    link_name(ifindex).is_some()
}

/// A record of pod `ns/name` (container `id`) with `ips`, for unit tests.
#[cfg(test)]
pub(crate) fn test_record(ns: &str, name: &str, id: &str, ips: Vec<std::net::IpAddr>) -> Record {
    Record {
        container_id: id.into(),
        ifname: "eth0".into(),
        netns: String::new(),
        host_veth: String::new(),
        host_ifindex: 1,
        host_mac: Default::default(),
        pod_mac: Default::default(),
        ips,
        mtu: 1500,
        headroom_requested: 256,
        headroom_effective: None,
        pod_namespace: ns.into(),
        pod_name: name.into(),
        netns_cookie: None,
        deleting: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ns: &str, name: &str, id: &str) -> Record {
        test_record(ns, name, id, vec![])
    }

    #[test]
    fn no_record_is_an_orphan_before_the_first_complete_list() {
        let records = vec![rec("default", "a", "c1"), rec("", "", "c2")];
        assert!(orphans(&records, None).is_empty(), "nothing is known yet");
        let listed: HashSet<PodKey> = [("default".to_string(), "a".to_string())].into();
        let got: Vec<_> = orphans(&records, Some(&listed))
            .iter()
            .map(|r| r.container_id.clone())
            .collect();
        assert_eq!(got, vec!["c2"], "only the record no listed pod claims");
        assert_eq!(orphans(&records, Some(&HashSet::new())).len(), 2);
    }

    #[test]
    fn records_are_keyed_by_pod_or_container() {
        assert_eq!(
            pod_key(&rec("ns", "p", "c")),
            ("ns".to_string(), "p".to_string())
        );
        assert_eq!(pod_key(&rec("", "", "c")), (String::new(), "c".to_string()));
    }
}
