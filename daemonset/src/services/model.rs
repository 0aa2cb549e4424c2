//! What the Services of the cluster mean for this node's clients: for each
//! ClusterIP frontend (each cluster IP of a Service, each TCP or UDP port),
//! the backends a connect may be translated to, read as kube-proxy reads
//! them. The two sources of backends (EndpointSlices, and Endpoints on
//! servers without `discovery.k8s.io/v1`) become the same [`Group`]s first,
//! so one reading of a Service serves both.
//!
//! Only ready endpoints are chosen. A frontend with none (no ready endpoint,
//! or none on this node under `internalTrafficPolicy: Local`) keeps an empty
//! backend list: the programs leave its connects to the kernel path, where
//! kube-proxy refuses or drops them as it always did.

use ipnet::IpNet;
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use k8s_openapi::api::{
    core::v1::{Endpoints, Service},
    discovery::v1::EndpointSlice,
};
use xdpcni_ebpf::L4Proto;

/// kube-proxy's default ClientIP affinity timeout (3 hours).
pub const DEFAULT_AFFINITY_SECS: u32 = 10800;

/// One endpoint address of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpAddr {
    /// Its address.
    pub ip: IpAddr,
    /// Ready (EndpointSlice `conditions.ready` unset or true; an Endpoints
    /// `addresses` entry, not `notReadyAddresses`).
    pub ready: bool,
    /// The node it runs on, if the source says.
    pub node: Option<String>,
}

/// Endpoint addresses that share their ports: an EndpointSlice, or one
/// subset of an Endpoints object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Group {
    /// (port name, protocol, number): the name is the Service port's.
    pub ports: Vec<(String, L4Proto, u16)>,
    /// The addresses.
    pub addrs: Vec<EpAddr>,
}

/// What kind of address of a Service a frontend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKind {
    /// A cluster IP and the Service port.
    ClusterIp,
    /// The node port, at an address of this node (the model gives the
    /// family's unspecified address; `services::scope` puts each node
    /// address in its place).
    NodePort,
    /// An `externalIPs` address and the Service port.
    ExternalIp,
    /// A LoadBalancer ingress IP (`status.loadBalancer.ingress`) and the
    /// Service port.
    LoadBalancer,
}

impl FrontendKind {
    /// As the status says it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ClusterIp => "ClusterIP",
            Self::NodePort => "NodePort",
            Self::ExternalIp => "externalIP",
            Self::LoadBalancer => "LoadBalancer",
        }
    }
}

/// Whether kube-proxy (1.20, iptables, clusterCIDR detection) masquerades
/// a call of the node's own to a frontend, by the call's source (the
/// route's toward the frontend): its rules per kind of frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeMasquerade {
    /// A ClusterIP: a source outside the clusterCIDR of its family; none
    /// when there is no clusterCIDR of that family.
    OutsideClusterCidr,
    /// A NodePort or LoadBalancer IP under `externalTrafficPolicy: Local`
    /// (its XLB chain): every source but one inside a clusterCIDR of its
    /// family.
    UnlessInClusterCidr,
    /// A NodePort or LoadBalancer IP under `externalTrafficPolicy:
    /// Cluster`, and an externalIP (one of the node's own addresses: the
    /// node's calls to any other externalIP kube-proxy 1.20 does not serve).
    Always,
}

/// A frontend and what a connect to it chooses among.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Frontend {
    /// Its address (a cluster IP, a node address, an external or
    /// LoadBalancer IP) and port.
    pub addr: SocketAddr,
    /// Protocol.
    pub proto: L4Proto,
    /// sessionAffinity ClientIP: its timeout in seconds.
    pub affinity: Option<u32>,
    /// Ready backends, sorted; empty leaves the frontend to the kernel path.
    pub backends: Vec<SocketAddr>,
    /// Those of `backends` on this node by their endpoint's `nodeName`, as
    /// kube-proxy tells local ones (`externalTrafficPolicy: Local`).
    pub local: Vec<SocketAddr>,
    /// "namespace/name" of the Service.
    pub service: String,
    /// What kind of address `addr` is: all but a cluster IP are translated
    /// for the node's own sockets alone.
    pub kind: FrontendKind,
    /// `externalTrafficPolicy: Local`.
    pub external_local: bool,
    /// For clients outside the node (north-south, at the uplink's program:
    /// `services::outside_frontends`), not for sockets.
    pub outside: bool,
    /// A LoadBalancer IP's `loadBalancerSourceRanges` (network addresses):
    /// outside clients from elsewhere are refused, as kube-proxy's
    /// firewall chain refuses them; the node's own calls to such an IP stay
    /// kube-proxy's.
    pub source_ranges: Vec<IpNet>,
}

impl Frontend {
    /// How kube-proxy decides to masquerade the node's own calls to it.
    pub fn node_masquerade(&self) -> NodeMasquerade {
        match self.kind {
            FrontendKind::ClusterIp => NodeMasquerade::OutsideClusterCidr,
            FrontendKind::ExternalIp => NodeMasquerade::Always,
            FrontendKind::NodePort | FrontendKind::LoadBalancer if self.external_local => {
                NodeMasquerade::UnlessInClusterCidr
            }
            FrontendKind::NodePort | FrontendKind::LoadBalancer => NodeMasquerade::Always,
        }
    }
}

/// The protocol of a Service, EndpointSlice or Endpoints port (TCP when
/// unset), if it is one the datapath handles.
pub(crate) fn proto(p: Option<&str>) -> Option<L4Proto> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(L4Proto::Tcp),
        "UDP" => Some(L4Proto::Udp),
        _ => None, // SCTP: kube-proxy's alone
    }
}

/// The groups of a Service's EndpointSlices (those whose address type is
/// IPv4 or IPv6; FQDN slices carry no address to translate to).
pub fn groups_from_slices<'a>(slices: impl IntoIterator<Item = &'a EndpointSlice>) -> Vec<Group> {
    slices
        .into_iter()
        .filter(|s| matches!(s.address_type.as_str(), "IPv4" | "IPv6"))
        .map(|s| Group {
            ports: s
                .ports
                .iter()
                .flatten()
                .filter_map(|p| {
                    let port = u16::try_from(p.port?).ok()?;
                    Some((
                        p.name.clone().unwrap_or_default(),
                        proto(p.protocol.as_deref())?,
                        port,
                    ))
                })
                .collect(),
            addrs: s
                .endpoints
                .iter()
                .flat_map(|e| {
                    let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
                    e.addresses.iter().filter_map(move |a| {
                        Some(EpAddr {
                            ip: a.parse().ok()?,
                            ready,
                            node: e.node_name.clone(),
                        })
                    })
                })
                .collect(),
        })
        .collect()
}

/// The groups of an Endpoints object: one per subset. An Endpoints object
/// holds one family, as the endpoints controller writes it (the Service's
/// primary one) and as kube-proxy reads it: the family of its first address
/// (the first subset's first ready address, else its first not-ready one);
/// addresses of the other family are ignored. A dual-stack Service's other
/// family has its backends in EndpointSlices alone.
pub fn groups_from_endpoints(ep: &Endpoints) -> Vec<Group> {
    let first = ep.subsets.iter().flatten().next().and_then(|s| {
        let ready = s.addresses.iter().flatten().next();
        ready
            .or_else(|| s.not_ready_addresses.iter().flatten().next())
            .and_then(|a| a.ip.parse::<IpAddr>().ok())
    });
    let Some(first) = first else {
        return Vec::new();
    };
    ep.subsets
        .iter()
        .flatten()
        .map(|s| {
            let addrs = |list: &Option<Vec<_>>, ready: bool| -> Vec<EpAddr> {
                list.iter()
                    .flatten()
                    .filter_map(|a: &k8s_openapi::api::core::v1::EndpointAddress| {
                        let ip: IpAddr = a.ip.parse().ok()?;
                        Some(EpAddr {
                            ip: (ip.is_ipv6() == first.is_ipv6()).then_some(ip)?,
                            ready,
                            node: a.node_name.clone(),
                        })
                    })
                    .collect()
            };
            let mut all = addrs(&s.addresses, true);
            all.extend(addrs(&s.not_ready_addresses, false));
            Group {
                ports: s
                    .ports
                    .iter()
                    .flatten()
                    .filter_map(|p| {
                        let port = u16::try_from(p.port).ok()?;
                        Some((
                            p.name.clone().unwrap_or_default(),
                            proto(p.protocol.as_deref())?,
                            port,
                        ))
                    })
                    .collect(),
                addrs: all,
            }
        })
        .collect()
}

/// The label naming the proxy that serves a Service: kube-proxy serves
/// only Services without it (and so do we, unless it names us).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// The label that says a Service needs no proxy at all.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// Whether this node's proxy serves `svc`, as kube-proxy decides it by its
/// watch's label selector (`!service-proxy-name,!headless`): a Service with
/// either label, whatever its value (an empty one too), is another proxy's
/// or none's. `proxy_name` (the config's `services.proxyName`) is a name
/// this agent answers to: a Service whose label names it is served.
pub fn served(svc: &Service, proxy_name: Option<&str>) -> bool {
    let labels = svc.metadata.labels.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    if label(HEADLESS_LABEL).is_some() {
        return false;
    }
    match label(SERVICE_PROXY_NAME_LABEL) {
        None => true,
        Some(name) => proxy_name.is_some_and(|ours| !ours.is_empty() && ours == name),
    }
}

/// The frontends of `svc` on node `node`, given its endpoint groups. None
/// for a Service without a cluster IP (headless, ExternalName).
pub fn frontends(svc: &Service, groups: &[Group], node: &str) -> Vec<Frontend> {
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    let name = format!(
        "{}/{}",
        svc.metadata.namespace.as_deref().unwrap_or_default(),
        svc.metadata.name.as_deref().unwrap_or_default()
    );
    let ips: Vec<IpAddr> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.iter().filter_map(|i| i.parse().ok()).collect(),
        _ => spec
            .cluster_ip
            .iter()
            .filter_map(|i| i.parse().ok())
            .collect(),
    };
    let affinity = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(DEFAULT_AFFINITY_SECS)
    });
    let local_only = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_local = spec.external_traffic_policy.as_deref() == Some("Local");
    // The node's own calls to a node port, an external or a LoadBalancer
    // IP go to every ready backend (kube-proxy 1.20 sends a local source
    // to the Service's chain, not the local-only one).
    let node_ports = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let external: Vec<IpAddr> = spec
        .external_ips
        .iter()
        .flatten()
        .filter_map(|i| i.parse().ok())
        .collect();
    // A balancer IP whose Service is not of that type any more is not
    // served; its source ranges as kube-proxy reads them (trimmed, the
    // host bits cleared; the API server refuses a range that is no CIDR).
    let source_ranges: Vec<IpNet> = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .filter_map(|r| r.trim().parse::<IpNet>().ok())
        .map(|n| n.trunc())
        .collect();
    let balancers: Vec<IpAddr> = if spec.type_.as_deref() == Some("LoadBalancer") {
        svc.status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|l| l.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|i| i.ip.as_deref().and_then(|ip| ip.parse().ok()))
            .collect()
    } else {
        Vec::new()
    };
    let mut out = Vec::new();
    for port in spec.ports.iter().flatten() {
        let (Some(p), Ok(number)) = (proto(port.protocol.as_deref()), u16::try_from(port.port))
        else {
            continue;
        };
        let port_name = port.name.clone().unwrap_or_default();
        // Per backend address, the number its group gives this port's name
        // (all ready ones, and those internalTrafficPolicy lets a cluster
        // IP choose).
        let (mut all, mut by_ip, mut here): (
            BTreeMap<IpAddr, u16>,
            BTreeMap<IpAddr, u16>,
            BTreeMap<IpAddr, u16>,
        ) = Default::default();
        for g in groups {
            let Some(&(_, _, target)) = g
                .ports
                .iter()
                .find(|(n, gp, _)| *n == port_name && *gp == p)
            else {
                continue;
            };
            for a in g.addrs.iter().filter(|a| a.ready) {
                all.insert(a.ip, target);
                if a.node.as_deref() == Some(node) {
                    here.insert(a.ip, target);
                }
                if !local_only || a.node.as_deref() == Some(node) {
                    by_ip.insert(a.ip, target);
                }
            }
        }
        let of_family = |m: &BTreeMap<IpAddr, u16>, v4: bool| -> Vec<SocketAddr> {
            m.iter()
                .filter(|(b, _)| b.is_ipv4() == v4)
                .map(|(b, t)| SocketAddr::new(*b, *t))
                .collect()
        };
        let mut push = |addr: SocketAddr, kind: FrontendKind, backends: Vec<SocketAddr>| {
            let local = backends
                .iter()
                .filter(|b| here.contains_key(&b.ip()))
                .copied()
                .collect();
            out.push(Frontend {
                addr,
                proto: p,
                affinity,
                backends,
                local,
                service: name.clone(),
                kind,
                external_local,
                outside: false,
                source_ranges: if kind == FrontendKind::LoadBalancer {
                    source_ranges.clone()
                } else {
                    Vec::new()
                },
            })
        };
        for ip in &ips {
            push(
                SocketAddr::new(*ip, number),
                FrontendKind::ClusterIp,
                of_family(&by_ip, ip.is_ipv4()),
            );
        }
        let node_port = port.node_port.and_then(|n| u16::try_from(n).ok());
        if let (true, Some(np)) = (node_ports, node_port) {
            for ip in &ips {
                let any = if ip.is_ipv4() {
                    IpAddr::from([0u8; 4])
                } else {
                    IpAddr::from([0u8; 16])
                };
                push(
                    SocketAddr::new(any, np),
                    FrontendKind::NodePort,
                    of_family(&all, ip.is_ipv4()),
                );
            }
        }
        for ip in &external {
            push(
                SocketAddr::new(*ip, number),
                FrontendKind::ExternalIp,
                of_family(&all, ip.is_ipv4()),
            );
        }
        for ip in &balancers {
            push(
                SocketAddr::new(*ip, number),
                FrontendKind::LoadBalancer,
                of_family(&all, ip.is_ipv4()),
            );
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn services_labelled_for_another_proxy_or_headless_are_not_served() {
        let labelled = |labels: serde_json::Value| {
            let mut s = web(json!({}));
            s.metadata.labels = serde_json::from_value(labels).ok();
            s
        };
        assert!(served(&web(json!({})), None));
        assert!(served(&labelled(json!({"app": "web"})), None));
        // kube-proxy's selector is "does not exist": an empty value too.
        for v in ["foo-bar", ""] {
            let s = labelled(json!({ SERVICE_PROXY_NAME_LABEL: v }));
            assert!(!served(&s, None), "{v:?}");
            assert!(!served(&s, Some("other")), "{v:?}");
        }
        let ours = labelled(json!({ SERVICE_PROXY_NAME_LABEL: "xdpcni" }));
        assert!(served(&ours, Some("xdpcni")));
        assert!(!served(&ours, Some("")));
        for v in ["", "true"] {
            let h = labelled(json!({ HEADLESS_LABEL: v }));
            assert!(!served(&h, None));
            assert!(!served(&h, Some("xdpcni")));
        }
    }

    fn svc(v: serde_json::Value) -> Service {
        serde_json::from_value(v).expect("a Service")
    }

    fn web(extra: serde_json::Value) -> Service {
        let mut v = json!({
            "metadata": {"namespace": "ns", "name": "web"},
            "spec": {
                "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd96::10"],
                "ports": [
                    {"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP"},
                    {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"},
                    {"name": "sctp", "port": 99, "protocol": "SCTP"}
                ]
            }
        });
        if let (Some(spec), Some(more)) = (v["spec"].as_object_mut(), extra.as_object()) {
            spec.extend(more.clone());
        }
        svc(v)
    }

    /// Two slices (as the controller makes them for a named targetPort that
    /// two pods resolve differently), one IPv6 slice, one not-ready endpoint.
    fn slices() -> Vec<EndpointSlice> {
        let slice = |family: &str, http: u16, eps: serde_json::Value| -> EndpointSlice {
            serde_json::from_value(json!({
                "metadata": {"namespace": "ns", "name": format!("web-{family}-{http}")},
                "addressType": family,
                "ports": [
                    {"name": "http", "port": http, "protocol": "TCP"},
                    {"name": "dns", "port": 5353, "protocol": "UDP"}
                ],
                "endpoints": eps
            }))
            .expect("an EndpointSlice")
        };
        vec![
            slice(
                "IPv4",
                8080,
                json!([
                    {"addresses": ["10.244.0.5"], "conditions": {"ready": true}, "nodeName": "n1"},
                    {"addresses": ["10.244.0.6"], "conditions": {"ready": false}, "nodeName": "n1"}
                ]),
            ),
            slice(
                "IPv4",
                9090,
                json!([{"addresses": ["10.244.1.7"], "nodeName": "n2"}]),
            ),
            slice(
                "IPv6",
                8080,
                json!([{"addresses": ["fd00::5"], "conditions": {"ready": true}, "nodeName": "n1"}]),
            ),
        ]
    }

    fn find<'a>(f: &'a [Frontend], addr: &str, p: L4Proto) -> &'a Frontend {
        let addr: SocketAddr = addr.parse().expect("an address");
        f.iter()
            .find(|x| x.addr == addr && x.proto == p)
            .unwrap_or_else(|| panic!("no frontend {addr} in {f:?}"))
    }

    fn addrs(v: &[&str]) -> Vec<SocketAddr> {
        v.iter().map(|a| a.parse().expect("an address")).collect()
    }

    #[test]
    fn every_cluster_ip_and_tcp_udp_port_with_its_ready_backends_by_port_name() {
        let f = frontends(&web(json!({})), &groups_from_slices(&slices()), "n1");
        // 2 cluster IPs x (TCP 80, UDP 53); SCTP stays kube-proxy's.
        assert_eq!(f.len(), 4, "{f:?}");
        assert_eq!(
            find(&f, "10.96.0.10:80", L4Proto::Tcp).backends,
            addrs(&["10.244.0.5:8080", "10.244.1.7:9090"]),
            "each backend on the number its slice gives the port name; not-ready left out"
        );
        assert_eq!(
            find(&f, "[fd96::10]:80", L4Proto::Tcp).backends,
            addrs(&["[fd00::5]:8080"])
        );
        assert_eq!(
            find(&f, "10.96.0.10:53", L4Proto::Udp).backends,
            addrs(&["10.244.0.5:5353", "10.244.1.7:5353"])
        );
        assert!(f
            .iter()
            .all(|x| x.affinity.is_none() && x.service == "ns/web"));
    }

    #[test]
    fn internal_traffic_policy_local_keeps_this_nodes_backends_only() {
        let f = frontends(
            &web(json!({"internalTrafficPolicy": "Local"})),
            &groups_from_slices(&slices()),
            "n2",
        );
        assert_eq!(
            find(&f, "10.96.0.10:80", L4Proto::Tcp).backends,
            addrs(&["10.244.1.7:9090"])
        );
        assert!(find(&f, "[fd96::10]:80", L4Proto::Tcp).backends.is_empty());
    }

    #[test]
    fn node_ports_external_and_balancer_ips_choose_every_ready_backend() {
        let mut lb = web(json!({
            "type": "LoadBalancer",
            "externalIPs": ["192.0.2.7"],
            "internalTrafficPolicy": "Local",
            "externalTrafficPolicy": "Local",
            "ports": [{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP", "nodePort": 30080}]
        }));
        lb.status = serde_json::from_value(
            json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.9"}, {"hostname": "lb.example"}]}}),
        )
        .ok();
        let f = frontends(&lb, &groups_from_slices(&slices()), "n2");
        let kinds: Vec<(String, FrontendKind)> =
            f.iter().map(|x| (x.addr.to_string(), x.kind)).collect();
        assert_eq!(
            kinds,
            [
                ("0.0.0.0:30080".to_string(), FrontendKind::NodePort),
                ("10.96.0.10:80".to_string(), FrontendKind::ClusterIp),
                ("192.0.2.7:80".to_string(), FrontendKind::ExternalIp),
                ("198.51.100.9:80".to_string(), FrontendKind::LoadBalancer),
                ("[::]:30080".to_string(), FrontendKind::NodePort),
                ("[fd96::10]:80".to_string(), FrontendKind::ClusterIp),
            ]
        );
        // The cluster IP keeps internalTrafficPolicy; the node's calls to
        // the others go to every ready backend (kube-proxy 1.20 sends a
        // local source to the Service's chain).
        let all = find(
            &frontends(&web(json!({})), &groups_from_slices(&slices()), "n2"),
            "10.96.0.10:80",
            L4Proto::Tcp,
        )
        .backends
        .clone();
        assert_eq!(
            find(&f, "10.96.0.10:80", L4Proto::Tcp).backends,
            addrs(&["10.244.1.7:9090"])
        );
        for a in ["0.0.0.0:30080", "192.0.2.7:80", "198.51.100.9:80"] {
            assert_eq!(find(&f, a, L4Proto::Tcp).backends, all, "{a}");
        }
        // Under externalTrafficPolicy Local, node ports and balancer IPs
        // keep a source in the clusterCIDR (their XLB chain).
        for a in ["0.0.0.0:30080", "198.51.100.9:80"] {
            assert_eq!(
                find(&f, a, L4Proto::Tcp).node_masquerade(),
                NodeMasquerade::UnlessInClusterCidr,
                "{a}"
            );
        }
        // Under Cluster, node ports and balancer IPs are always masqueraded;
        // with source ranges a balancer IP is kube-proxy's alone.
        lb.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
        let f = frontends(&lb, &groups_from_slices(&slices()), "n2");
        assert_eq!(
            find(&f, "198.51.100.9:80", L4Proto::Tcp).node_masquerade(),
            NodeMasquerade::Always
        );
        assert_eq!(
            find(&f, "192.0.2.7:80", L4Proto::Tcp).node_masquerade(),
            NodeMasquerade::Always
        );
        lb.spec.as_mut().unwrap().load_balancer_source_ranges =
            Some(vec![" 10.1.2.3/8".into(), "2001:db8::/32".into()]);
        let f = frontends(&lb, &groups_from_slices(&slices()), "n2");
        let ranges: Vec<IpNet> = vec![
            "10.0.0.0/8".parse().unwrap(),
            "2001:db8::/32".parse().unwrap(),
        ];
        assert_eq!(
            find(&f, "198.51.100.9:80", L4Proto::Tcp).source_ranges,
            ranges
        );
        assert!(f
            .iter()
            .filter(|x| x.kind != FrontendKind::LoadBalancer)
            .all(|x| x.source_ranges.is_empty()));
        // A ClusterIP Service has no node port even if one is left in it.
        let f = frontends(
            &web(json!({"ports": [{"name": "http", "port": 80, "nodePort": 30080}]})),
            &[],
            "n2",
        );
        assert!(f.iter().all(|x| x.kind == FrontendKind::ClusterIp));
    }

    #[test]
    fn client_ip_affinity_with_its_timeout_or_kube_proxys_default() {
        let f = frontends(
            &web(json!({"sessionAffinity": "ClientIP"})),
            &groups_from_slices(&slices()),
            "n1",
        );
        assert!(f.iter().all(|x| x.affinity == Some(DEFAULT_AFFINITY_SECS)));
        let f = frontends(
            &web(json!({"sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}})),
            &groups_from_slices(&slices()),
            "n1",
        );
        assert!(f.iter().all(|x| x.affinity == Some(60)));
    }

    #[test]
    fn endpoints_and_endpoint_slices_give_the_same_frontends() {
        let ep: Endpoints = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": "web"},
            "subsets": [
                {"addresses": [{"ip": "10.244.0.5", "nodeName": "n1"}],
                 "notReadyAddresses": [{"ip": "10.244.0.6", "nodeName": "n1"}],
                 "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                           {"name": "dns", "port": 5353, "protocol": "UDP"}]},
                {"addresses": [{"ip": "10.244.1.7", "nodeName": "n2"}],
                 "ports": [{"name": "http", "port": 9090, "protocol": "TCP"},
                           {"name": "dns", "port": 5353, "protocol": "UDP"}]},
                {"addresses": [{"ip": "fd00::5", "nodeName": "n1"}],
                 "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                           {"name": "dns", "port": 5353, "protocol": "UDP"}]}
            ]
        }))
        .expect("an Endpoints");
        // The Endpoints object holds the primary family (IPv4, its first
        // address's) alone, as kube-proxy reads it: its IPv6 subset is
        // ignored, and the IPv6 frontends have backends from the slices only.
        for node in ["n1", "n2"] {
            for extra in [json!({}), json!({"internalTrafficPolicy": "Local"})] {
                let s = web(extra);
                let from_ep = frontends(&s, &groups_from_endpoints(&ep), node);
                let from_slices = frontends(&s, &groups_from_slices(&slices()), node);
                let (v4, v6): (Vec<_>, Vec<_>) =
                    from_ep.into_iter().partition(|f| f.addr.is_ipv4());
                let v4_slices: Vec<_> = from_slices
                    .iter()
                    .filter(|f| f.addr.is_ipv4())
                    .cloned()
                    .collect();
                assert_eq!(v4, v4_slices, "node {node}");
                assert_eq!(v6.len(), 2, "node {node}");
                assert!(v6.iter().all(|f| f.backends.is_empty()), "{v6:?}");
            }
        }
    }

    #[test]
    fn endpoints_hold_the_family_of_their_first_address() {
        let ep = |subsets: serde_json::Value| -> Endpoints {
            serde_json::from_value(json!({"metadata": {"name": "web"}, "subsets": subsets}))
                .expect("an Endpoints")
        };
        let ips = |g: &[Group]| -> Vec<String> {
            g.iter()
                .flat_map(|g| g.addrs.iter().map(|a| a.ip.to_string()))
                .collect()
        };
        let port = json!([{"name": "http", "port": 80}]);
        // IPv6 first (an IPv6-primary Service): the IPv4 addresses go.
        let v6 = ep(json!([
            {"addresses": [{"ip": "fd00::5"}, {"ip": "10.0.0.5"}], "ports": port},
            {"notReadyAddresses": [{"ip": "10.0.0.6"}, {"ip": "fd00::6"}], "ports": port}
        ]));
        assert_eq!(ips(&groups_from_endpoints(&v6)), ["fd00::5", "fd00::6"]);
        // No ready address: the first not-ready one decides.
        let nr = ep(
            json!([{"notReadyAddresses": [{"ip": "10.0.0.6"}, {"ip": "fd00::6"}],
                            "ports": port}]),
        );
        assert_eq!(ips(&groups_from_endpoints(&nr)), ["10.0.0.6"]);
        assert!(groups_from_endpoints(&ep(json!([]))).is_empty());
    }

    #[test]
    fn headless_and_external_name_services_have_no_frontend_and_no_ready_endpoint_none_chosen() {
        let headless = svc(json!({"metadata": {"namespace": "ns", "name": "h"},
            "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}));
        assert!(frontends(&headless, &groups_from_slices(&slices()), "n1").is_empty());
        let external = svc(json!({"metadata": {"namespace": "ns", "name": "e"},
            "spec": {"type": "ExternalName", "externalName": "example.org"}}));
        assert!(frontends(&external, &[], "n1").is_empty());
        let f = frontends(&web(json!({})), &[], "n1");
        assert_eq!(f.len(), 4);
        assert!(
            f.iter().all(|x| x.backends.is_empty()),
            "no endpoints: the kernel path decides"
        );
    }
}
