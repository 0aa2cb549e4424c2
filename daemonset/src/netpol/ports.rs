//! The ports of a NetworkPolicy rule: protocols, numeric ranges, and named
//! ports resolved on a pod's containers.

use k8s_openapi::{
    api::{core::v1::Pod, networking::v1::NetworkPolicyPort},
    apimachinery::pkg::util::intstr::IntOrString,
};

/// A transport protocol a policy port names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    /// TCP (the default).
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Proto {
    /// As the API writes it; `None` for a protocol policies cannot name.
    pub fn parse(s: Option<&str>) -> Option<Self> {
        match s.unwrap_or("TCP") {
            "TCP" => Some(Self::Tcp),
            "UDP" => Some(Self::Udp),
            "SCTP" => Some(Self::Sctp),
            _ => None,
        }
    }

    /// The name nftables gives it (`inet_proto`).
    pub const fn nft(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Sctp => "sctp",
        }
    }
}

/// A protocol and an inclusive port range (one port: `lo == hi`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    /// The protocol.
    pub proto: Proto,
    /// First port.
    pub lo: u16,
    /// Last port.
    pub hi: u16,
}

/// The number `pod` gives the port named `name` for `proto`, if any.
pub fn resolve_named_port(pod: &Pod, name: &str, proto: Proto) -> Option<u16> {
    let containers = pod.spec.iter().flat_map(|s| s.containers.iter());
    containers
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| {
            p.name.as_deref() == Some(name) && Proto::parse(p.protocol.as_deref()) == Some(proto)
        })
        .and_then(|p| u16::try_from(p.container_port).ok())
}

/// A policy port: numeric ranges, or a name.
pub(super) enum PortSpec {
    /// Numbers (a range).
    Range(PortRange),
    /// A name, resolved on the destination pod.
    Named(String, Proto),
}

/// The ports of a rule: `None` for every port (no list, or an empty one).
/// An entry policies cannot express (unknown protocol, a port out of range)
/// matches nothing.
pub(super) fn port_specs(ports: Option<&Vec<NetworkPolicyPort>>) -> Option<Vec<PortSpec>> {
    let ports = ports.filter(|p| !p.is_empty())?;
    let mut out = Vec::new();
    for p in ports {
        let Some(proto) = Proto::parse(p.protocol.as_deref()) else {
            continue;
        };
        match &p.port {
            None => out.push(PortSpec::Range(PortRange {
                proto,
                lo: 0,
                hi: u16::MAX,
            })),
            Some(IntOrString::Int(n)) => {
                let Ok(lo) = u16::try_from(*n) else { continue };
                let hi = match p.end_port {
                    Some(e) => match u16::try_from(e) {
                        Ok(hi) if hi >= lo => hi,
                        _ => continue,
                    },
                    None => lo,
                };
                out.push(PortSpec::Range(PortRange { proto, lo, hi }));
            }
            Some(IntOrString::String(name)) => out.push(PortSpec::Named(name.clone(), proto)),
        }
    }
    Some(out)
}
