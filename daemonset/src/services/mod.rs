//! Services translated at the socket for this node's pods (issue 34; see
//! ebpf/src/services.bpf.c): what the cluster's Services mean for this
//! node ([`model`]), as the Service maps' writer wants it ([`wants`]),
//! which network namespaces are this node's pods ([`pod_netns`]), and the
//! connected UDP sockets a gone backend leaves ([`connected_to`], [`close`]).

pub mod model;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
};

use tracing::{debug, warn};
use xdpcni_ebpf::{abi::SvcAddr, abi::SVC_AFFINITY, ServiceWant};
use xdpcni_host::{
    netns::in_netns,
    sockets::{self, ConnectedUdp},
    state::Record,
};

use self::model::Frontend;

/// The writer's wants: each frontend with its backends keyed as the
/// programs read them. A frontend in two Services (never, for cluster IPs)
/// keeps the first.
pub fn wants(frontends: &[Frontend]) -> BTreeMap<SvcAddr, ServiceWant> {
    let mut out = BTreeMap::new();
    for f in frontends {
        let p = f.proto.number();
        out.entry(SvcAddr::new(f.addr, p))
            .or_insert_with(|| ServiceWant {
                flags: if f.affinity.is_some() {
                    SVC_AFFINITY
                } else {
                    0
                },
                affinity_timeout: f.affinity.unwrap_or(0),
                backends: f.backends.iter().map(|b| SvcAddr::new(*b, p)).collect(),
            });
    }
    out
}

/// The node's live pods as the Service programs scope them: each pod's
/// network namespace cookie with the pod's own addresses (a backend that is
/// the caller itself is left to kube-proxy).
pub type PodNamespaces = BTreeMap<u64, BTreeSet<IpAddr>>;

/// The network namespaces of this node's live pods, with their addresses:
/// each cookie from its record, or read from its namespace where an older
/// plugin wrote none (skipped when that namespace is gone: its pod is going).
pub fn pod_netns(records: &[Record]) -> PodNamespaces {
    let mut out = PodNamespaces::new();
    for r in records.iter().filter(|r| !r.deleting) {
        let cookie = r
            .netns_cookie
            .or_else(|| xdpcni_host::netns::netns_cookie(Path::new(&r.netns)).ok());
        if let Some(c) = cookie {
            out.entry(c).or_default().extend(r.ips.iter().copied());
        }
    }
    out
}

/// The network namespaces of this node's live pods, by path.
pub fn pod_netns_paths(records: &[Record]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = records
        .iter()
        .filter(|r| !r.deleting)
        .map(|r| PathBuf::from(&r.netns))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The connected UDP sockets, in each of `namespaces`, whose peer is one of
/// `backends` (UDP [`SvcAddr`]s). A namespace that cannot be read (its pod
/// is going) is skipped.
pub fn connected_to(
    namespaces: &[PathBuf],
    backends: &BTreeSet<SvcAddr>,
) -> Vec<(PathBuf, ConnectedUdp)> {
    let mut out = Vec::new();
    for ns in namespaces {
        match in_netns(ns, sockets::connected_udp) {
            Ok(found) => out.extend(
                found
                    .into_iter()
                    .filter(|s| backends.contains(&SvcAddr::new(s.peer, UDP)))
                    .map(|s| (ns.clone(), s)),
            ),
            Err(e) => debug!(netns = %ns.display(), error = %e, "listing UDP sockets"),
        }
    }
    out
}

/// Closes `doomed` in their namespaces; returns how many were closed.
pub fn close(doomed: Vec<(PathBuf, ConnectedUdp)>) -> usize {
    let mut by_ns: BTreeMap<PathBuf, Vec<ConnectedUdp>> = BTreeMap::new();
    for (ns, s) in doomed {
        by_ns.entry(ns).or_default().push(s);
    }
    let mut closed = 0;
    for (ns, list) in by_ns {
        match in_netns(&ns, || sockets::destroy(&list)) {
            Ok(n) => closed += n,
            Err(e) => {
                warn!(netns = %ns.display(), error = %e, "closing UDP sockets of a gone backend")
            }
        }
    }
    closed
}

/// `IPPROTO_UDP`.
const UDP: u8 = 17;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::test_record;
    use xdpcni_ebpf::L4Proto;

    #[test]
    fn wants_key_frontends_and_backends_with_the_protocol_and_affinity() {
        let f = Frontend {
            addr: "10.96.0.10:53".parse().unwrap(),
            proto: L4Proto::Udp,
            affinity: Some(60),
            backends: vec!["10.244.0.5:5353".parse().unwrap()],
            service: "ns/dns".into(),
        };
        let w = wants(&[f]);
        let (fe, want) = w.iter().next().unwrap();
        assert_eq!(fe.proto, 17);
        assert_eq!(fe.port, 53u16.to_be());
        assert_eq!((want.flags, want.affinity_timeout), (SVC_AFFINITY, 60));
        assert_eq!(want.backends[0].proto, 17);
        assert_eq!(want.backends[0].port, 5353u16.to_be());
    }

    #[test]
    fn pod_netns_takes_recorded_cookies_with_addresses_and_skips_pods_being_deleted() {
        let ip: IpAddr = "10.1.0.2".parse().unwrap();
        let mut a = test_record("ns", "a", "ca", vec![ip]);
        a.netns_cookie = Some(7);
        let mut b = test_record("ns", "b", "cb", vec![]);
        b.netns_cookie = Some(8);
        b.deleting = true;
        // No cookie and a namespace path that does not exist: skipped.
        let mut c = test_record("ns", "c", "cc", vec![]);
        c.netns = "/nonexistent/netns".into();
        assert_eq!(
            pod_netns(&[a, b, c]),
            PodNamespaces::from([(7, BTreeSet::from([ip]))])
        );
    }
}
