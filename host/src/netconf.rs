//! The xdpcni entry of the node's CNI conflist, typed once for its writer
//! (the agent's `install-cni`) and its reader (the plugin, from stdin), with
//! the defaults and ranges of its settings. The chart's `datapath.mtu` and
//! `datapath.headroom` feed [`PluginConf::new`]; its schema carries the same
//! ranges (a test compares them).
//!
//! Unknown fields are refused, naming the field: a misspelt `"mtuu"` would
//! otherwise give every pod the default MTU in silence. The fields a runtime
//! adds (spec 1.1: `cniVersion`, `name`, `prevResult`, `runtimeConfig`,
//! `args`, `capabilities`, `dns`, `cni.dev/valid-attachments`) are known,
//! and so are the fast-path settings an older conflist carried (`xdpMode`,
//! `redirect`, `cpus`: the agent's alone now), which are read and ignored.

use std::{ops::RangeInclusive, path::PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The plugin's `type`.
pub const PLUGIN_TYPE: &str = "xdpcni";
/// MTU of both veth ends when the conflist names none.
pub const DEFAULT_MTU: u32 = 1500;
/// MTUs a pod may be given: from the smallest every IPv4 host must accept
/// (RFC 791: 576) to the largest a veth takes.
pub const MTU_RANGE: RangeInclusive<u32> = 576..=65535;
/// Headroom asked of a pod's veth (XDP_PACKET_HEADROOM) when none is named.
pub const DEFAULT_HEADROOM: u16 = 256;
/// Headrooms that may be asked (the kernel grants what it can; the plugin
/// measures and reports it).
pub const HEADROOM_RANGE: RangeInclusive<u16> = 0..=1024;
/// Directory of the per-attachment records when none is named.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/cni/xdpcni";

fn default_mtu() -> u32 {
    DEFAULT_MTU
}
fn default_headroom() -> u16 {
    DEFAULT_HEADROOM
}
fn default_pin_dir() -> PathBuf {
    xdpcni_ebpf::DEFAULT_PIN_DIR.into()
}
fn default_state_dir() -> PathBuf {
    DEFAULT_STATE_DIR.into()
}

/// One attachment the runtime still has (GC's `cni.dev/valid-attachments`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ValidAttachment {
    /// The container.
    #[serde(rename = "containerID")]
    pub container_id: String,
    /// Its interface.
    pub ifname: String,
}

/// The xdpcni plugin's entry of the conflist, as the runtime hands it over.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PluginConf {
    /// `"xdpcni"`.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// MTU of both veth ends.
    #[serde(default = "default_mtu")]
    pub mtu: u32,
    /// Headroom asked of the veth.
    #[serde(default = "default_headroom")]
    pub headroom: u16,
    /// Datapath pin directory.
    #[serde(default = "default_pin_dir")]
    pub pin_dir: PathBuf,
    /// Per-attachment records.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Log file; stderr when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_file: Option<PathBuf>,
    /// A file the node agent creates when ready; STATUS requires it if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_ready_file: Option<PathBuf>,
    /// The IPAM plugin's section, handed to it as is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam: Option<Value>,

    /// Added by the runtime from the conflist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cni_version: Option<String>,
    /// Added by the runtime from the conflist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The previous plugin's result (CHECK, and after a chained plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev_result: Option<Value>,
    /// Capability arguments (this plugin declares none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_config: Option<Value>,
    /// Conventions' `args`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
    /// Declared capabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Value>,
    /// DNS settings (passed through; the runtime writes resolv.conf).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<Value>,
    /// GC: the attachments the runtime still has.
    #[serde(
        default,
        rename = "cni.dev/valid-attachments",
        skip_serializing_if = "Option::is_none"
    )]
    pub valid_attachments: Option<Vec<ValidAttachment>>,

    /// Legacy (a conflist written for an older plugin): read, ignored.
    #[serde(default, skip_serializing)]
    pub xdp_mode: Option<Value>,
    /// Legacy: read, ignored.
    #[serde(default, skip_serializing)]
    pub redirect: Option<Value>,
    /// Legacy: read, ignored.
    #[serde(default, skip_serializing)]
    pub cpus: Option<Value>,
}

/// Why a conf is refused: the field (a JSON path) and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct ConfError {
    /// The field, e.g. `mtu` or `cni.dev/valid-attachments[0].ifname`.
    pub field: String,
    /// Why.
    pub why: String,
}

impl ConfError {
    fn new(field: impl Into<String>, why: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            why: why.into(),
        }
    }
}

impl PluginConf {
    /// What `install-cni` writes for a node: `mtu` and `headroom` as the
    /// chart sets them (the defaults when absent), IPAM by host-local over
    /// `ranges`.
    pub fn new(
        mtu: Option<u32>,
        headroom: Option<u16>,
        pin_dir: PathBuf,
        state_dir: PathBuf,
        agent_ready_file: Option<PathBuf>,
        ipam: Value,
    ) -> Self {
        Self {
            plugin_type: PLUGIN_TYPE.into(),
            mtu: mtu.unwrap_or(DEFAULT_MTU),
            headroom: headroom.unwrap_or(DEFAULT_HEADROOM),
            pin_dir,
            state_dir,
            log_file: None,
            agent_ready_file,
            ipam: Some(ipam),
            cni_version: None,
            name: None,
            prev_result: None,
            runtime_config: None,
            args: None,
            capabilities: None,
            dns: None,
            valid_attachments: None,
            xdp_mode: None,
            redirect: None,
            cpus: None,
        }
    }

    /// Parses a conf from JSON: an unknown field, a value of the wrong type
    /// or out of range is an error naming its field.
    pub fn from_json(v: &Value) -> Result<Self, ConfError> {
        let conf: Self = serde_path_to_error::deserialize(v).map_err(|e| {
            let path = e.path().to_string();
            let why = e.into_inner().to_string();
            // An unknown field's path is its parent's ("."): name it.
            let field = match why.strip_prefix("unknown field `") {
                Some(rest) => rest.split('`').next().unwrap_or_default().to_string(),
                None => path,
            };
            ConfError::new(field, why)
        })?;
        conf.validate()?;
        Ok(conf)
    }

    /// The ranges and names serde does not check.
    pub fn validate(&self) -> Result<(), ConfError> {
        if !MTU_RANGE.contains(&self.mtu) {
            return Err(ConfError::new(
                "mtu",
                format!(
                    "{} is outside {}..{}",
                    self.mtu,
                    MTU_RANGE.start(),
                    MTU_RANGE.end()
                ),
            ));
        }
        if !HEADROOM_RANGE.contains(&self.headroom) {
            return Err(ConfError::new(
                "headroom",
                format!("{} is above {}", self.headroom, HEADROOM_RANGE.end()),
            ));
        }
        Ok(())
    }

    /// The IPAM plugin's type: `None` without an `ipam` section.
    pub fn ipam_type(&self) -> Result<Option<&str>, ConfError> {
        let Some(ipam) = self.ipam.as_ref().filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        match ipam.get("type") {
            Some(Value::String(t)) if !t.is_empty() && !t.contains('/') => Ok(Some(t)),
            Some(Value::String(t)) => Err(ConfError::new(
                "ipam.type",
                format!("{t:?} is not a plugin name"),
            )),
            _ => Err(ConfError::new("ipam.type", "missing or not a string")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use serde_json::json;

    use super::*;

    fn base() -> Value {
        json!({"cniVersion": "1.1.0", "name": "n", "type": "xdpcni", "ipam": {"type": "host-local"}})
    }

    #[test]
    fn what_install_cni_writes_the_plugin_reads_back_unchanged() {
        let written = PluginConf::new(
            Some(9000),
            None,
            "/sys/fs/bpf/x".into(),
            "/var/lib/x".into(),
            Some("/run/ready".into()),
            json!({"type": "host-local", "ranges": [[{"subnet": "10.0.0.0/24"}]]}),
        );
        let v = serde_json::to_value(&written).unwrap();
        assert_eq!(v["headroom"], DEFAULT_HEADROOM);
        assert!(v.get("xdpMode").is_none() && v.get("prevResult").is_none());
        let read = PluginConf::from_json(&v).unwrap();
        assert_eq!(read, written);
        assert_eq!(read.ipam_type().unwrap(), Some("host-local"));
    }

    #[test]
    fn unknown_fields_are_refused_by_name_and_legacy_ones_ignored() {
        let mut v = base();
        v["mtuu"] = json!(9000);
        let e = PluginConf::from_json(&v).unwrap_err();
        assert_eq!(e.field, "mtuu", "{e}");
        let mut v = base();
        v["xdpMode"] = json!("turbo");
        v["redirect"] = json!(7);
        v["cpus"] = json!("3-1");
        let c = PluginConf::from_json(&v).unwrap();
        let out = serde_json::to_value(&c).unwrap();
        assert!(
            out.get("xdpMode").is_none(),
            "legacy fields are not written back"
        );
    }

    #[test]
    fn the_fields_a_runtime_adds_are_known() {
        let mut v = base();
        v["prevResult"] = json!({"cniVersion": "1.1.0"});
        v["runtimeConfig"] = json!({});
        v["args"] = json!({"cni": {}});
        v["capabilities"] = json!({});
        v["dns"] = json!({});
        v["cni.dev/valid-attachments"] = json!([{"containerID": "c", "ifname": "eth0"}]);
        let c = PluginConf::from_json(&v).unwrap();
        assert_eq!(
            c.valid_attachments.unwrap(),
            [ValidAttachment {
                container_id: "c".into(),
                ifname: "eth0".into()
            }]
        );
    }

    #[test]
    fn wrong_types_and_ranges_name_their_field() {
        for (field, value, want) in [
            ("mtu", json!("big"), "mtu"),
            ("mtu", json!(100), "mtu"),
            ("headroom", json!(4096), "headroom"),
            ("headroom", json!(-1), "headroom"),
            ("pinDir", json!(1), "pinDir"),
            (
                "cni.dev/valid-attachments",
                json!([{"containerID": "c"}]),
                "cni.dev/valid-attachments[0]",
            ),
        ] {
            let mut v = base();
            v[field] = value;
            let e = PluginConf::from_json(&v).unwrap_err();
            assert!(e.field.starts_with(want), "{field}: {e}");
        }
    }
}
