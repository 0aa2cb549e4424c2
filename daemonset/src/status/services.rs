//! The Services part of the status: what the Service programs translate on
//! this node, or why they translate nothing.

use serde::{Deserialize, Serialize};

/// One frontend the node's pods' sockets are translated for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FrontendStatus {
    /// "namespace/name" of the Service.
    pub service: String,
    /// Cluster IP and port, as clients name it.
    pub frontend: String,
    /// "TCP" or "UDP".
    pub protocol: String,
    /// Ready backends chosen among (0: left to kube-proxy, which refuses).
    pub backends: usize,
    /// "ClusterIP", or (for the node's own sockets alone) "NodePort",
    /// "externalIP", "LoadBalancer".
    #[serde(default)]
    pub kind: String,
    /// Served to clients outside the node at its uplinks (north-south),
    /// not to sockets.
    #[serde(default)]
    pub outside: bool,
}

impl FrontendStatus {
    /// The status line of a frontend.
    pub fn of(f: &crate::services::model::Frontend) -> Self {
        Self {
            service: f.service.clone(),
            frontend: f.addr.to_string(),
            protocol: f.proto.as_str().into(),
            backends: f.backends.len(),
            kind: f.kind.as_str().into(),
            outside: f.outside,
        }
    }
}

/// One health check node port the agent answers (`services.healthCheckNodePorts`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheckStatus {
    /// The Service's `healthCheckNodePort`.
    pub port: u16,
    /// "namespace/name" of the Service.
    pub service: String,
    /// Its ready endpoints on this node (200 when any, else 503).
    pub local_endpoints: usize,
    /// Why the port is not listening, if it is not (tried again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl HealthCheckStatus {
    /// The status line of a health check, and why its port is not open.
    pub fn of(c: &crate::services::health::HealthCheck, error: Option<String>) -> Self {
        Self {
            port: c.port,
            service: format!("{}/{}", c.namespace, c.name),
            local_endpoints: c.local_endpoints,
            error,
        }
    }
}

/// What a write of the Service maps left in them, for the status: the
/// network namespaces translated, whether the node's own among them, the
/// uplinks north-south frontends are served on, every frontend.
pub type Written = (usize, bool, Vec<(u32, String)>, Vec<FrontendStatus>);

/// Who serves one kind of Service traffic on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServedBy {
    /// The kind of traffic.
    pub traffic: String,
    /// Who serves it: the agent's programs, kube-proxy, or nobody.
    pub by: String,
}

/// Service translation on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServicesStatus {
    /// Whether the config asks for translation.
    pub enabled: bool,
    /// The cgroup v2 directory the programs are attached to, once they are.
    pub cgroup: Option<String>,
    /// Why nothing is translated, if so (every Service is then kube-proxy's).
    pub error: Option<String>,
    /// The network namespaces translated (the node's own among them when
    /// `node_sockets`).
    pub namespaces: usize,
    /// Whether the node's own sockets are translated (`services.nodeSockets`,
    /// and the node's namespace read at the last write).
    pub node_sockets: bool,
    /// The uplinks the node device's program serves north-south frontends
    /// on (`services.northSouthDevices` that exist, at the last write).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub north_south: Vec<String>,
    /// The same uplinks with their ifindexes (for their counters).
    #[serde(skip)]
    pub north_south_uplinks: Vec<(u32, String)>,
    /// Every frontend in the maps.
    pub frontends: Vec<FrontendStatus>,
    /// The last write of the maps that failed, if the last one did (the
    /// maps keep what was written: each frontend whole, old or new).
    pub sync_error: Option<String>,
    /// Calls (connect, unconnected sendmsg) translated since the maps were made.
    pub translated: u64,
    /// Calls to a frontend with no ready backend, left to kube-proxy.
    pub no_backend: u64,
    /// Entries in the north-south NAT table, and its size.
    pub nat_entries: u32,
    /// Size of the north-south NAT table.
    pub nat_capacity: u32,
    /// Entries it evicted to make room.
    pub nat_evictions: u64,
    /// Per kind of Service traffic, who serves it ([`ServicesStatus::who_serves`]).
    pub served_by: Vec<ServedBy>,
    /// The health check node ports the agent answers; `None` when
    /// `services.healthCheckNodePorts` is off (kube-proxy answers them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_checks: Option<Vec<HealthCheckStatus>>,
}

impl ServicesStatus {
    /// Translation off (`enabled`: whether the config asks for it), and why.
    pub fn off(enabled: bool, why: Option<&str>) -> Self {
        Self {
            enabled,
            error: why.map(Into::into),
            ..Self::default()
        }
    }

    /// The Service programs attached at the cgroup `Ok(cgroup)`, or why not.
    pub fn opened(&mut self, cgroup: Result<String, String>) {
        self.enabled = true;
        match cgroup {
            Ok(c) => {
                self.cgroup = Some(c);
                self.error = None;
            }
            Err(e) => self.error = Some(e),
        }
    }

    /// A write of the Service maps: `Ok((namespaces, frontends))` what they
    /// hold now, or why the write failed (they keep what they held).
    pub fn synced(&mut self, written: Result<Written, String>) {
        match written {
            Ok((namespaces, node_sockets, north_south, frontends)) => {
                self.namespaces = namespaces;
                self.node_sockets = node_sockets;
                self.north_south = north_south.iter().map(|u| u.1.clone()).collect();
                self.north_south_uplinks = north_south;
                self.frontends = frontends;
                self.sync_error = None;
            }
            Err(e) => self.sync_error = Some(e),
        }
    }

    /// Per kind of Service traffic, who serves it on this node now: the one
    /// list the status, its table and docs/services.md ("Who serves what")
    /// say.
    pub fn who_serves(&self) -> Vec<ServedBy> {
        let outside = if self.north_south.is_empty() {
            "kube-proxy".to_string()
        } else {
            format!(
                "xdpcni, at tc on {} for backends on this node on the tc hook and \
                 on other nodes whose route leaves by one of those devices \
                 with loadBalancerSourceRanges applied (another route, a Local \
                 externalIP, a source outside the ranges, a backend whose policies \
                 the kernel checks, a flow begun before: kube-proxy)",
                self.north_south.join(", ")
            )
        };
        let socket = if self.enabled && self.error.is_none() && self.cgroup.is_some() {
            "xdpcni, at the socket (connect, sendmsg)".to_string()
        } else {
            "kube-proxy (translation off or not attached)".to_string()
        };
        [
            (
                "ClusterIP from this node's pods, TCP and UDP",
                socket.as_str(),
            ),
            (
                "ClusterIP with no ready backend",
                "kube-proxy (its refusal)",
            ),
            (
                "ClusterIP from the node and hostNetwork pods",
                if self.node_sockets && socket.starts_with("xdpcni") {
                    "xdpcni, at the socket, with kube-proxy's source address \
                     (a socket bound to its own source or, where that source is kept, \
                     to a port alone, a backend on the node itself: kube-proxy)"
                } else {
                    "kube-proxy"
                },
            ),
            (
                "NodePort, LoadBalancer, externalIPs from the node and hostNetwork pods",
                if self.node_sockets && socket.starts_with("xdpcni") {
                    "xdpcni, at the socket (a LoadBalancer with source ranges: kube-proxy)"
                } else {
                    "kube-proxy"
                },
            ),
            (
                "NodePort, LoadBalancer, externalIPs from outside the node",
                outside.as_str(),
            ),
            (
                "NodePort, LoadBalancer, externalIPs from this node's pods",
                "kube-proxy",
            ),
            (
                "healthCheckNodePort of LoadBalancers under externalTrafficPolicy Local",
                if self.health_checks.is_some() {
                    "xdpcni, the agent (services.healthCheckNodePorts)"
                } else {
                    "kube-proxy"
                },
            ),
            (
                "SCTP; from outside, IP fragments and IPv6 extension headers; \
                 IPv4-mapped addresses on IPv6 sockets",
                "kube-proxy",
            ),
            (
                "Services labelled service-proxy-name (another proxy's) or headless",
                "nobody, as with kube-proxy",
            ),
        ]
        .into_iter()
        .map(|(traffic, by)| ServedBy {
            traffic: traffic.into(),
            by: by.into(),
        })
        .collect()
    }

    /// The Services line of the status table.
    pub(super) fn summary(&self) -> String {
        if let Some(e) = &self.error {
            return format!("not translated, kube-proxy's: {e}");
        }
        if !self.enabled {
            return "not translated (services.translate false): kube-proxy's".into();
        }
        let Some(cgroup) = &self.cgroup else {
            return "not listed yet: kube-proxy's until then".into();
        };
        let ready = self.frontends.iter().filter(|f| f.backends > 0).count();
        let services: std::collections::BTreeSet<&str> =
            self.frontends.iter().map(|f| f.service.as_str()).collect();
        let failed = self
            .sync_error
            .as_ref()
            .map(|e| format!("; the last write failed: {e}"))
            .unwrap_or_default();
        let nat = if self.north_south.is_empty() {
            String::new()
        } else {
            format!(
                "; north-south NAT table {}/{} entries, {} evicted",
                self.nat_entries, self.nat_capacity, self.nat_evictions
            )
        };
        format!(
            "{} frontends of {} Services translated at the socket ({} with ready backends) \
             for {} network namespaces{}, on {cgroup}; {} calls translated, {} with no ready backend{nat}{failed}",
            self.frontends.len(),
            services.len(),
            ready,
            self.namespaces,
            if self.node_sockets {
                " (the node's own among them)"
            } else {
                ""
            },
            self.translated,
            self.no_backend
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_why_nothing_is_translated_or_what_is() {
        let mut s = ServicesStatus {
            enabled: true,
            ..Default::default()
        };
        assert!(s.summary().contains("not listed yet"));
        s.error = Some("no cgroup v2 hierarchy at /x".into());
        assert!(s.summary().contains("no cgroup v2 hierarchy at /x"));
        s.error = None;
        s.cgroup = Some("/sys/fs/cgroup/unified".into());
        s.namespaces = 3;
        s.translated = 7;
        s.frontends = vec![
            FrontendStatus {
                service: "ns/web".into(),
                frontend: "10.96.0.5:80".into(),
                protocol: "TCP".into(),
                backends: 2,
                kind: "ClusterIP".into(),
                outside: false,
            },
            FrontendStatus {
                service: "ns/web".into(),
                frontend: "[fd00::5]:80".into(),
                protocol: "TCP".into(),
                backends: 0,
                kind: "ClusterIP".into(),
                outside: false,
            },
        ];
        let line = s.summary();
        assert!(line.starts_with("2 frontends of 1 Services"), "{line}");
        assert!(line.contains("(1 with ready backends)"), "{line}");
        assert!(line.contains("3 network namespaces"), "{line}");
        assert!(line.contains("7 calls translated"), "{line}");
        assert!(!line.contains("failed"), "{line}");
        s.sync_error = Some("services map full".into());
        assert!(s
            .summary()
            .ends_with("the last write failed: services map full"));
        assert!(!ServicesStatus::default().summary().contains("frontends"));
    }

    #[test]
    fn who_serves_names_the_programs_only_while_they_are_attached() {
        let by = |s: &ServicesStatus| -> Vec<String> {
            s.who_serves().into_iter().map(|w| w.by).collect()
        };
        let mut s = ServicesStatus::off(true, None);
        assert!(by(&s)[0].starts_with("kube-proxy"));
        s.opened(Ok("/sys/fs/cgroup".into()));
        assert!(by(&s)[0].starts_with("xdpcni"));
        // Everything but pods' ClusterIP connects stays kube-proxy's (or
        // nobody's, for the labelled Services).
        assert!(by(&s)[1..8].iter().all(|b| b.starts_with("kube-proxy")));
        assert!(by(&s)[8].starts_with("nobody"));
        s.synced(Ok((2, true, vec![], vec![])));
        assert!(by(&s)[2].starts_with("xdpcni"));
        assert!(by(&s)[3].starts_with("xdpcni"));
        assert!(by(&s)[4].starts_with("kube-proxy"));
        // North-south: at the uplinks named, once written.
        s.synced(Ok((2, true, vec![(7, "eth1".into())], vec![])));
        assert!(
            by(&s)[4].starts_with("xdpcni, at tc on eth1"),
            "{:?}",
            by(&s)
        );
        assert!(by(&s)[5].starts_with("kube-proxy"));
        // The health check ports: the agent's once it serves them.
        assert!(by(&s)[6].starts_with("kube-proxy"));
        s.health_checks = Some(vec![]);
        assert!(by(&s)[6].starts_with("xdpcni"));
        s.opened(Err("no cgroup v2".into()));
        assert!(by(&s)[2].starts_with("kube-proxy"));
        assert!(by(&s)[0].starts_with("kube-proxy"));
        assert!(!by(&ServicesStatus::off(false, None))[0].starts_with("xdpcni"));
    }
}
