//! The network configuration on stdin and the CNI_* environment.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use serde_json::Value;

use crate::{
    error::{Error, Result},
    types::{self, CniResult},
};

use xdpcni_host::netconf::{ConfError, PluginConf};

/// Default pin directory of the datapath.
pub const DEFAULT_PIN_DIR: &str = xdpcni_ebpf::DEFAULT_PIN_DIR;

/// The plugin's configuration (a conflist entry of `"type": "xdpcni"`),
/// read through the typed [`PluginConf`] its writer (install-cni) uses:
/// unknown fields are refused by name. The fast path's settings (mode,
/// redirect, CPUs) are the agent's alone: a conflist that still carries
/// `xdpMode`, `redirect` or `cpus` (written for an older plugin) parses,
/// and they are ignored.
#[derive(Clone, Debug)]
pub struct NetConf {
    /// cniVersion.
    pub cni_version: String,
    /// Network name.
    pub name: String,
    /// MTU of both veth ends.
    pub mtu: u32,
    /// Headroom to ask of the veth.
    pub headroom: u16,
    /// Datapath pin directory.
    pub pin_dir: PathBuf,
    /// Per-attachment records.
    pub state_dir: PathBuf,
    /// Log file; stderr when `None`.
    pub log_file: Option<PathBuf>,
    /// A file the node agent creates when ready; STATUS requires it if set.
    pub agent_ready_file: Option<PathBuf>,
    /// The `ipam` section.
    pub ipam: Value,
    /// The IPAM plugin's type.
    pub ipam_type: String,
    /// prevResult, when given.
    pub prev_result: Option<CniResult>,
    /// `cni.dev/valid-attachments` (GC).
    pub valid_attachments: Option<Vec<(String, String)>>,
    /// The raw config, passed to the IPAM plugin as is.
    pub raw: Value,
}

impl From<ConfError> for Error {
    fn from(e: ConfError) -> Self {
        Error::config(e.field, e.why)
    }
}

impl NetConf {
    /// Parses and validates the config bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let raw: Value = serde_json::from_slice(bytes).map_err(|e| Error::Decode(e.to_string()))?;
        if !raw.is_object() {
            return Err(Error::Decode(
                "the network config is not a JSON object".into(),
            ));
        }
        // The version first: a config of a version this plugin does not
        // speak gets that answer (code 1), whatever else it holds.
        let cni_version = match raw.get("cniVersion") {
            Some(Value::String(v)) => v.clone(),
            None | Some(Value::Null) => return Err(Error::config("cniVersion", "missing")),
            Some(other) => {
                return Err(Error::config(
                    "cniVersion",
                    format!("must be a string, got {other}"),
                ))
            }
        };
        if !types::supported(&cni_version) {
            return Err(Error::IncompatibleVersion(format!(
                "{cni_version:?} (supported: {})",
                types::SUPPORTED_VERSIONS.join(", ")
            )));
        }
        let conf = PluginConf::from_json(&raw)?;
        let ipam_type = conf.ipam_type()?.unwrap_or_default().to_string();
        let prev_result = match &conf.prev_result {
            None | Some(Value::Null) => None,
            Some(v) => Some(CniResult::from_json(v).map_err(|e| Error::config("prevResult", e))?),
        };
        Ok(Self {
            cni_version,
            name: conf.name.unwrap_or_default(),
            mtu: conf.mtu,
            headroom: conf.headroom,
            pin_dir: conf.pin_dir,
            state_dir: conf.state_dir,
            log_file: conf.log_file,
            agent_ready_file: conf.agent_ready_file,
            ipam: conf.ipam.unwrap_or(Value::Null),
            ipam_type,
            prev_result,
            valid_attachments: conf
                .valid_attachments
                .map(|l| l.into_iter().map(|a| (a.container_id, a.ifname)).collect()),
            raw,
        })
    }

    /// What is pinned at the pin directory (read without writing anything).
    pub fn pinned(&self) -> xdpcni_ebpf::Result<xdpcni_ebpf::Pinned> {
        xdpcni_ebpf::Pinned::read(&self.pin_dir)
    }

    /// Whether the datapath of this build's layout is pinned and complete:
    /// the only one this plugin writes into.
    pub fn datapath_present(&self) -> bool {
        self.pinned().is_ok_and(|p| p.ready())
    }
}

/// The CNI commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// ADD.
    Add,
    /// DEL.
    Del,
    /// CHECK.
    Check,
    /// VERSION.
    Version,
    /// GC.
    Gc,
    /// STATUS.
    Status,
}

impl Command {
    /// The command CNI_COMMAND names, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "VERSION" => Self::Version,
            "GC" => Self::Gc,
            "STATUS" => Self::Status,
            _ => return None,
        })
    }
}

/// The CNI_* environment.
#[derive(Clone, Debug)]
pub struct CniEnv {
    /// CNI_COMMAND.
    pub command: Command,
    /// CNI_CONTAINERID.
    pub container_id: String,
    /// CNI_NETNS (may be empty on DEL).
    pub netns: Option<PathBuf>,
    /// CNI_IFNAME.
    pub ifname: String,
    /// CNI_ARGS as key/value pairs.
    pub args: HashMap<String, String>,
    /// CNI_PATH entries.
    pub path: Vec<PathBuf>,
}

/// CNI_ARGS: `KEY=VALUE` pairs separated by `;`.
fn parse_args(args: &str) -> Result<HashMap<String, String>> {
    let mut out = HashMap::new();
    for kv in args.split(';').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| Error::InvalidEnv {
            var: "CNI_ARGS",
            why: format!("{kv:?} is not KEY=VALUE"),
        })?;
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}

fn valid_ifname(s: &str) -> bool {
    !s.is_empty()
        && s.len() < 16
        && s != "."
        && s != ".."
        && !s.contains(['/', ':', ' ', '\t', '\n'])
}

impl CniEnv {
    /// Reads the environment through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let invalid = |var: &'static str, why: String| Error::InvalidEnv { var, why };
        let command = match get("CNI_COMMAND") {
            Some(c) => Command::parse(&c)
                .ok_or_else(|| invalid("CNI_COMMAND", format!("unknown command {c:?}")))?,
            None => return Err(invalid("CNI_COMMAND", "not set".into())),
        };
        let path: Vec<PathBuf> = get("CNI_PATH")
            .unwrap_or_default()
            .split(':')
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect();
        let mut env = Self {
            command,
            container_id: get("CNI_CONTAINERID").unwrap_or_default(),
            netns: get("CNI_NETNS")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
            ifname: get("CNI_IFNAME").unwrap_or_default(),
            args: HashMap::new(),
            path,
        };
        env.check()?;
        env.args = parse_args(&get("CNI_ARGS").unwrap_or_default())?;
        Ok(env)
    }

    /// What the spec asks of the variables of this command.
    fn check(&self) -> Result<()> {
        let invalid = |var: &'static str, why: String| Err(Error::InvalidEnv { var, why });
        if matches!(self.command, Command::Add | Command::Del | Command::Check) {
            let id = &self.container_id;
            if id.is_empty()
                || !id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            {
                return invalid(
                    "CNI_CONTAINERID",
                    format!("{id:?} is empty or has characters other than [A-Za-z0-9_.-]"),
                );
            }
            if !valid_ifname(&self.ifname) {
                return invalid(
                    "CNI_IFNAME",
                    format!("{:?} is not a valid interface name", self.ifname),
                );
            }
            if self.command != Command::Del && self.netns.is_none() {
                return invalid("CNI_NETNS", "not set".into());
            }
        }
        if self.command != Command::Version && self.path.is_empty() {
            return invalid("CNI_PATH", "not set".into());
        }
        Ok(())
    }

    /// The first `name` executable found in CNI_PATH.
    pub fn find_plugin(&self, name: &str) -> Option<PathBuf> {
        self.path
            .iter()
            .map(|d| d.join(name))
            .find(|p| is_executable(p))
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(extra: &str) -> Result<NetConf> {
        NetConf::parse(
            format!(
                r#"{{"cniVersion":"1.1.0","name":"n","type":"xdpcni","ipam":{{"type":"host-local"}}{extra}}}"#
            )
            .as_bytes(),
        )
    }

    #[test]
    fn defaults() {
        let c = conf("").unwrap();
        assert_eq!(c.mtu, xdpcni_host::netconf::DEFAULT_MTU);
        assert_eq!(c.headroom, xdpcni_host::netconf::DEFAULT_HEADROOM);
        assert_eq!(c.ipam_type, "host-local");
        assert_eq!(c.pin_dir, PathBuf::from(DEFAULT_PIN_DIR));
    }

    #[test]
    fn invalid_values_name_their_field() {
        for (extra, field, code) in [
            (r#","mtu":10"#, "mtu", 7),
            (r#","mtu":"big""#, "mtu", 7),
            (r#","headroom":9999"#, "headroom", 7),
            (
                r#","prevResult":{"ips":[{"address":"nonsense"}]}"#,
                "prevResult",
                7,
            ),
        ] {
            let e = conf(extra).unwrap_err();
            assert_eq!(e.code(), code, "{extra}");
            assert!(e.to_string().contains(field), "{extra}: {e}");
        }
        let e = NetConf::parse(br#"{"cniVersion":"9.9.9","name":"n"}"#).unwrap_err();
        assert_eq!(e.code(), 1);
        let e = NetConf::parse(b"{not json").unwrap_err();
        assert_eq!(e.code(), 6);
        let e = NetConf::parse(b"[1]").unwrap_err();
        assert_eq!(e.code(), 6);
        let e = NetConf::parse(br#"{"name":"n"}"#).unwrap_err();
        assert_eq!(e.code(), 7);
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let e = conf(r#","somethingNew":{"x":1}"#).unwrap_err();
        assert_eq!(e.code(), 7);
        assert!(e.to_string().contains("somethingNew"), "{e}");
        // The fast path's settings of an older conflist: the agent's now.
        assert!(conf(r#","xdpMode":"turbo","redirect":"bridge","cpus":"3-1""#).is_ok());
    }

    #[test]
    fn env_validation() {
        let env = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            CniEnv::from_lookup(|k| m.get(k).cloned())
        };
        let full = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            (
                "CNI_ARGS",
                "K8S_POD_NAME=p;K8S_POD_NAMESPACE=ns;IgnoreUnknown=1",
            ),
        ];
        let e = env(&full).unwrap();
        assert_eq!(e.args["K8S_POD_NAME"], "p");
        for drop in [
            "CNI_COMMAND",
            "CNI_CONTAINERID",
            "CNI_NETNS",
            "CNI_IFNAME",
            "CNI_PATH",
        ] {
            let partial: Vec<_> = full.iter().copied().filter(|(k, _)| *k != drop).collect();
            let err = env(&partial).unwrap_err();
            assert_eq!(err.code(), 4, "{drop}");
            assert!(err.to_string().contains(drop), "{err}");
        }
        let mut bad = full;
        bad[3] = ("CNI_IFNAME", "a/b");
        assert_eq!(env(&bad).unwrap_err().code(), 4);
        bad = full;
        bad[5] = ("CNI_ARGS", "novalue");
        assert_eq!(env(&bad).unwrap_err().code(), 4);
        // DEL without a netns is fine.
        let del: Vec<_> = full
            .iter()
            .copied()
            .filter(|(k, _)| *k != "CNI_NETNS")
            .map(|(k, v)| {
                if k == "CNI_COMMAND" {
                    (k, "DEL")
                } else {
                    (k, v)
                }
            })
            .collect();
        assert!(env(&del).unwrap().netns.is_none());
    }
}
