//! CNI results: one internal shape, printed in the shape of the version the
//! caller asked for (0.3.x/0.4.0 carry "version" per IP; 1.x does not).

use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Every version this plugin answers, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The newest.
pub const LATEST: &str = "1.1.0";

/// Whether `v` is a version we speak.
pub fn supported(v: &str) -> bool {
    SUPPORTED_VERSIONS.contains(&v)
}

/// The `cniVersion` of a config on `stdin` when it is one this plugin
/// speaks, else the latest: the version of an answer (VERSION's, or an
/// error's when the config cannot be read).
pub fn asked_version(stdin: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(stdin)
        .ok()
        .and_then(|v| {
            v.get("cniVersion")
                .and_then(|s| s.as_str())
                .map(str::to_string)
        })
        .filter(|v| supported(v))
        .unwrap_or_else(|| LATEST.to_string())
}

/// `(major, minor, patch)` of a version string, for comparisons.
pub fn version_tuple(v: &str) -> (u32, u32, u32) {
    let mut it = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (
        it.next().unwrap_or(0),
        it.next().unwrap_or(0),
        it.next().unwrap_or(0),
    )
}

/// An IP address with its prefix length, as CNI writes it (`10.0.0.2/24`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    /// The address.
    pub ip: IpAddr,
    /// The prefix length.
    pub prefix: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (ip, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} has no /prefix"))?;
        let ip: IpAddr = ip.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let prefix: u8 = prefix.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("{s:?}: prefix longer than {max}"));
        }
        Ok(Self { ip, prefix })
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// An interface of a result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interface {
    /// Name.
    pub name: String,
    /// MAC, `aa:bb:..`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    /// MTU (1.1.0 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// The netns path for interfaces inside the container, empty on the host.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sandbox: String,
}

/// An IP configuration of a result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpConfig {
    /// Address with prefix.
    pub address: Cidr,
    /// Gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<usize>,
}

/// A route of a result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    /// Destination.
    pub dst: Cidr,
    /// Gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<IpAddr>,
}

/// A CNI result, in the 1.x shape.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniResult {
    /// Interfaces.
    #[serde(default)]
    pub interfaces: Vec<Interface>,
    /// IPs.
    #[serde(default)]
    pub ips: Vec<IpConfig>,
    /// Routes.
    #[serde(default)]
    pub routes: Vec<Route>,
    /// DNS, passed through from IPAM.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub dns: Value,
}

impl CniResult {
    /// Parses a result of any supported version (IPAM answers, prevResult).
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let mut r = v.clone();
        // 0.3.x/0.4.0 put "version" on each IP; 1.x does not. Drop it.
        if let Some(ips) = r.get_mut("ips").and_then(Value::as_array_mut) {
            for ip in ips {
                if let Some(o) = ip.as_object_mut() {
                    o.remove("version");
                }
            }
        }
        if let Some(o) = r.as_object_mut() {
            o.remove("cniVersion");
        }
        serde_json::from_value(r).map_err(|e| e.to_string())
    }

    /// The JSON of this result for `version`.
    pub fn to_json(&self, version: &str) -> Value {
        let old = version_tuple(version) < (1, 0, 0);
        let with_mtu = version_tuple(version) >= (1, 1, 0);
        let interfaces: Vec<Value> = self
            .interfaces
            .iter()
            .map(|i| {
                let mut v = json!({ "name": i.name });
                if !i.mac.is_empty() {
                    v["mac"] = json!(i.mac);
                }
                if let (true, Some(mtu)) = (with_mtu, i.mtu) {
                    v["mtu"] = json!(mtu);
                }
                if !i.sandbox.is_empty() {
                    v["sandbox"] = json!(i.sandbox);
                }
                v
            })
            .collect();
        let ips: Vec<Value> = self
            .ips
            .iter()
            .map(|ip| {
                let mut v = json!({ "address": ip.address.to_string() });
                if old {
                    v["version"] = json!(if ip.address.ip.is_ipv4() { "4" } else { "6" });
                }
                if let Some(gw) = ip.gateway {
                    v["gateway"] = json!(gw.to_string());
                }
                if let Some(i) = ip.interface {
                    v["interface"] = json!(i);
                }
                v
            })
            .collect();
        let mut out = json!({
            "cniVersion": version,
            "interfaces": interfaces,
            "ips": ips,
            "routes": self.routes,
        });
        if !self.dns.is_null() {
            out["dns"] = self.dns.clone();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CniResult {
        CniResult {
            interfaces: vec![
                Interface {
                    name: "xdpabc".into(),
                    mac: "aa:bb:cc:dd:ee:ff".into(),
                    mtu: Some(1500),
                    sandbox: String::new(),
                },
                Interface {
                    name: "eth0".into(),
                    mac: "11:22:33:44:55:66".into(),
                    mtu: Some(1500),
                    sandbox: "/var/run/netns/x".into(),
                },
            ],
            ips: vec![
                IpConfig {
                    address: "10.1.0.5/32".parse().unwrap(),
                    gateway: Some("169.254.1.1".parse().unwrap()),
                    interface: Some(1),
                },
                IpConfig {
                    address: "fd00::5/128".parse().unwrap(),
                    gateway: Some("fe80::1".parse().unwrap()),
                    interface: Some(1),
                },
            ],
            routes: vec![Route {
                dst: "0.0.0.0/0".parse().unwrap(),
                gw: Some("169.254.1.1".parse().unwrap()),
            }],
            dns: Value::Null,
        }
    }

    #[test]
    fn old_versions_carry_ip_version_and_no_mtu() {
        let v = sample().to_json("0.3.1");
        assert_eq!(v["cniVersion"], "0.3.1");
        assert_eq!(v["ips"][0]["version"], "4");
        assert_eq!(v["ips"][1]["version"], "6");
        assert!(v["interfaces"][0].get("mtu").is_none());
        let v = sample().to_json("1.0.0");
        assert!(v["ips"][0].get("version").is_none());
        assert!(v["interfaces"][1].get("mtu").is_none());
        let v = sample().to_json("1.1.0");
        assert_eq!(v["interfaces"][1]["mtu"], 1500);
        assert_eq!(v["interfaces"][1]["sandbox"], "/var/run/netns/x");
    }

    #[test]
    fn results_round_trip_through_every_version() {
        for ver in SUPPORTED_VERSIONS {
            let back = CniResult::from_json(&sample().to_json(ver)).unwrap();
            assert_eq!(back.ips, sample().ips, "{ver}");
            assert_eq!(back.routes, sample().routes, "{ver}");
        }
    }

    #[test]
    fn cidr_parsing_rejects_nonsense() {
        assert!("10.0.0.1".parse::<Cidr>().is_err());
        assert!("10.0.0.1/33".parse::<Cidr>().is_err());
        assert!("fd00::1/129".parse::<Cidr>().is_err());
        assert!("x/3".parse::<Cidr>().is_err());
        assert_eq!("fd00::1/64".parse::<Cidr>().unwrap().prefix, 64);
    }

    #[test]
    fn version_ordering() {
        assert!(version_tuple("0.4.0") < version_tuple("1.0.0"));
        assert!(version_tuple("1.1.0") > version_tuple("1.0.0"));
        assert!(supported("0.3.0") && !supported("0.2.0") && !supported("2.0.0"));
    }
}
