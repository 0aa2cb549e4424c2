//! The health check node ports of `externalTrafficPolicy: Local` load
//! balancers, as kube-proxy 1.20 answers them: a cloud's load balancer asks
//! each node on the Service's `healthCheckNodePort` whether it has a local
//! endpoint, and sends the Service's traffic only to nodes that say so.
//! Where the agent replaces kube-proxy, the agent answers them
//! (`daemon/health_checks.rs` serves what this module computes).

use std::{collections::BTreeSet, net::IpAddr};

use k8s_openapi::api::core::v1::Service;

use super::model::Group;

/// One Service's health check port and what it answers.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HealthCheck {
    /// `spec.healthCheckNodePort`.
    pub port: u16,
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub name: String,
    /// Its ready endpoints on this node: distinct addresses, whatever
    /// their ports (kube-proxy counts local endpoint IPs per Service).
    pub local_endpoints: usize,
}

impl HealthCheck {
    /// The HTTP status kube-proxy gives: 200 with a local endpoint, else
    /// 503 (the load balancer leaves the node out).
    pub fn status(&self) -> u16 {
        if self.local_endpoints > 0 {
            200
        } else {
            503
        }
    }

    /// The body kube-proxy writes (tab-indented JSON, no final newline),
    /// with `Content-Type: application/json`.
    pub fn body(&self) -> String {
        format!(
            "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {}\n}}",
            quoted(&self.namespace),
            quoted(&self.name),
            self.local_endpoints
        )
    }
}

/// A name as Go's `%q` writes it; namespace and Service names are DNS
/// labels, which JSON's string escaping writes the same.
fn quoted(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// `svc`'s health check on node `node`, given its endpoint groups: a
/// LoadBalancer under `externalTrafficPolicy: Local` with a
/// `healthCheckNodePort` (the API server allocates one to exactly those).
pub fn health_check(svc: &Service, groups: &[Group], node: &str) -> Option<HealthCheck> {
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() != Some("LoadBalancer")
        || spec.external_traffic_policy.as_deref() != Some("Local")
    {
        return None;
    }
    let port = u16::try_from(spec.health_check_node_port?)
        .ok()
        .filter(|p| *p != 0)?;
    let local: BTreeSet<IpAddr> = groups
        .iter()
        .filter(|g| !g.ports.is_empty())
        .flat_map(|g| &g.addrs)
        .filter(|a| a.ready && a.node.as_deref() == Some(node))
        .map(|a| a.ip)
        .collect();
    Some(HealthCheck {
        port,
        namespace: svc.metadata.namespace.clone().unwrap_or_default(),
        name: svc.metadata.name.clone().unwrap_or_default(),
        local_endpoints: local.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::model::EpAddr;
    use serde_json::json;
    use xdpcni_ebpf::L4Proto;

    fn svc(spec: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"namespace": "shop", "name": "web"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn ep(ip: &str, ready: bool, node: &str) -> EpAddr {
        EpAddr {
            ip: ip.parse().unwrap(),
            ready,
            node: Some(node.into()),
        }
    }

    #[test]
    fn only_local_balancers_have_a_health_check() {
        let lb = |etp: &str, hc: Option<i32>| {
            let mut spec = json!({"type": "LoadBalancer", "externalTrafficPolicy": etp});
            if let Some(p) = hc {
                spec["healthCheckNodePort"] = json!(p);
            }
            svc(spec)
        };
        assert!(health_check(&lb("Local", Some(31000)), &[], "n1").is_some());
        assert!(health_check(&lb("Cluster", Some(31000)), &[], "n1").is_none());
        assert!(health_check(&lb("Local", None), &[], "n1").is_none());
        assert!(health_check(&lb("Local", Some(0)), &[], "n1").is_none());
        let np = svc(json!({"type": "NodePort", "externalTrafficPolicy": "Local",
                            "healthCheckNodePort": 31000}));
        assert!(health_check(&np, &[], "n1").is_none());
    }

    #[test]
    fn local_endpoints_are_distinct_ready_addresses_on_this_node() {
        let s = svc(
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                           "healthCheckNodePort": 31000}),
        );
        let ports = vec![("http".to_string(), L4Proto::Tcp, 8080)];
        let groups = vec![
            Group {
                ports: ports.clone(),
                addrs: vec![
                    ep("10.0.0.1", true, "n1"),
                    ep("10.0.0.2", false, "n1"),
                    ep("10.0.0.3", true, "n2"),
                ],
            },
            // The same address under another port: counted once.
            Group {
                ports: vec![("dns".to_string(), L4Proto::Udp, 53)],
                addrs: vec![ep("10.0.0.1", true, "n1"), ep("10.0.0.4", true, "n1")],
            },
            // A subset without ports gives kube-proxy no endpoint.
            Group {
                ports: vec![],
                addrs: vec![ep("10.0.0.5", true, "n1")],
            },
        ];
        let hc = health_check(&s, &groups, "n1").unwrap();
        assert_eq!(hc.local_endpoints, 2);
        assert_eq!(hc.status(), 200);
        assert_eq!(
            hc.body(),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"shop\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2\n}"
        );
        let none = health_check(&s, &groups, "n3").unwrap();
        assert_eq!((none.local_endpoints, none.status()), (0, 503));
    }
}
