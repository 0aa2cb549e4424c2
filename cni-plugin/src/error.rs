//! Errors of the plugin and their CNI error codes (mapped in one place).

use serde::Serialize;

use xdpcni_host::netlink::NetlinkError;

/// A CNI error, as printed on stdout.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct CniErrorJson {
    /// The version the caller asked for (or the newest we speak).
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    /// The spec's code.
    pub code: u32,
    /// One-line message.
    pub msg: String,
    /// More context.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

/// Everything that can fail in the plugin.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The requested cniVersion is not one we speak, or too old for the command.
    #[error("incompatible CNI version {0}")]
    IncompatibleVersion(String),
    /// The container (its network namespace) does not exist.
    #[error("container unknown: {0}")]
    ContainerUnknown(String),
    /// A required CNI_* variable is missing or invalid.
    #[error("invalid environment variable {var}: {why}")]
    InvalidEnv {
        /// Which variable.
        var: &'static str,
        /// Why.
        why: String,
    },
    /// I/O failure (state files, log file, /proc/sys).
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The configuration is not JSON we can decode.
    #[error("failed to decode network config: {0}")]
    Decode(String),
    /// The configuration decodes but a value is invalid.
    #[error("invalid network config: field {field}: {why}")]
    InvalidConfig {
        /// The field (JSON path).
        field: String,
        /// Why.
        why: String,
    },
    /// Transient: try again.
    #[error("try again later: {0}")]
    TryAgain(String),
    /// The plugin cannot serve ADDs now (STATUS).
    #[error("plugin not available: {0}")]
    Unavailable(String),
    /// The delegated IPAM plugin failed; its own error is passed through.
    #[error("IPAM plugin {plugin}: {msg}")]
    Ipam {
        /// The IPAM plugin.
        plugin: String,
        /// Its code.
        code: u32,
        /// Its message.
        msg: String,
        /// Its details.
        details: String,
    },
    /// The interface name is already taken inside the pod.
    #[error("interface {0} already exists in the container")]
    InterfaceExists(String),
    /// The host-side veth name is already taken.
    #[error("host interface {0} already exists")]
    HostInterfaceExists(String),
    /// A netlink request failed.
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    /// The datapath maps or programs could not be used.
    #[error("datapath: {0}")]
    Datapath(#[from] xdpcni_ebpf::Error),
    /// CHECK found something different from prevResult.
    #[error("check failed: {0}")]
    CheckFailed(String),
    /// A failure injected by XDPCNI_TEST_FAIL_AFTER (tests only).
    #[error("injected failure after {0}")]
    Injected(String),
    /// Several errors (DEL and GC go on after a failure).
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Many(Vec<Error>),
}

impl From<xdpcni_host::state::StateError> for Error {
    fn from(e: xdpcni_host::state::StateError) -> Self {
        match e {
            xdpcni_host::state::StateError::Io { op, source } => Self::Io { op, source },
            xdpcni_host::state::StateError::Decode(why) => Self::Decode(why),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(source: std::io::Error) -> Self {
        Self::Io {
            op: "I/O".into(),
            source,
        }
    }
}

/// Plugin-specific codes (the spec reserves 100 and up for plugins).
pub mod codes {
    /// Generic failure setting up the network.
    pub const SETUP_FAILED: u32 = 100;
    /// Interface name taken in the pod.
    pub const INTERFACE_EXISTS: u32 = 101;
    /// Host veth name taken.
    pub const HOST_INTERFACE_EXISTS: u32 = 102;
    /// The datapath refused an update.
    pub const DATAPATH: u32 = 103;
    /// CHECK mismatch.
    pub const CHECK_FAILED: u32 = 104;
}

impl Error {
    /// The CNI error code.
    pub fn code(&self) -> u32 {
        match self {
            Self::IncompatibleVersion(_) => 1,
            Self::ContainerUnknown(_) => 3,
            Self::InvalidEnv { .. } => 4,
            Self::Io { .. } => 5,
            Self::Decode(_) => 6,
            Self::InvalidConfig { .. } => 7,
            Self::TryAgain(_) => 11,
            Self::Unavailable(_) => 50,
            Self::Ipam { code, .. } => *code,
            Self::InterfaceExists(_) => codes::INTERFACE_EXISTS,
            Self::HostInterfaceExists(_) => codes::HOST_INTERFACE_EXISTS,
            Self::Netlink(_) | Self::Injected(_) => codes::SETUP_FAILED,
            Self::Datapath(xdpcni_ebpf::Error::MapFull { .. }) => 11,
            Self::Datapath(xdpcni_ebpf::Error::NotReady(_)) => 11,
            Self::Datapath(_) => codes::DATAPATH,
            Self::CheckFailed(_) => codes::CHECK_FAILED,
            Self::Many(errors) => errors.first().map_or(codes::SETUP_FAILED, Self::code),
        }
    }

    /// The error JSON for `cni_version`.
    pub fn to_json(&self, cni_version: &str) -> CniErrorJson {
        let (msg, details) = match self {
            Self::Ipam {
                plugin,
                msg,
                details,
                ..
            } => (format!("IPAM plugin {plugin}: {msg}"), details.clone()),
            Self::Many(errors) => (format!("{} errors", errors.len()), self.to_string()),
            _ => (self.to_string(), String::new()),
        };
        CniErrorJson {
            cni_version: cni_version.to_string(),
            code: self.code(),
            msg,
            details,
        }
    }

    /// `Ok` for no errors, the error itself for one, `Many` for several.
    pub(crate) fn from_list(mut errors: Vec<Error>) -> Result<()> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(Self::Many(errors)),
        }
    }

    pub(crate) fn io(op: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            op: op.into(),
            source,
        }
    }

    pub(crate) fn config(field: impl Into<String>, why: impl Into<String>) -> Self {
        Self::InvalidConfig {
            field: field.into(),
            why: why.into(),
        }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
