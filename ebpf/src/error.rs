//! Errors of the datapath loader.

use std::{io, path::PathBuf};

/// What can go wrong loading, attaching or updating the datapath.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pin directory is not on a bpffs mount.
    #[error("{0} is not on a bpffs mount (mount -t bpf bpf /sys/fs/bpf)")]
    NotBpffs(PathBuf),
    /// A filesystem operation on the pin directory failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The BPF object could not be loaded (maps created or reused).
    #[error("loading the datapath object: {0}")]
    Load(#[from] Box<aya::EbpfError>),
    /// The object lacks a program or map this crate expects.
    #[error("the datapath object has no {kind} named {name}")]
    Missing {
        /// "program" or "map".
        kind: &'static str,
        /// Its name.
        name: &'static str,
    },
    /// A program operation (load, attach, pin, test run) failed.
    #[error("{op}: {source}")]
    Program {
        /// What was being done.
        op: String,
        /// The aya error.
        source: Box<aya::programs::ProgramError>,
    },
    /// A map operation failed.
    #[error("{op}: {source}")]
    Map {
        /// What was being done.
        op: String,
        /// The aya error.
        source: Box<aya::maps::MapError>,
    },
    /// A devmap or cpumap operation failed.
    #[error("{op}: {source}")]
    XdpMap {
        /// What was being done.
        op: String,
        /// The aya error.
        source: Box<aya::maps::xdp::XdpMapError>,
    },
    /// A map update was refused because the map is full.
    #[error("map {map} is full ({capacity} entries): {op}")]
    MapFull {
        /// Which map.
        map: &'static str,
        /// Its capacity.
        capacity: u32,
        /// What was being done.
        op: String,
    },
    /// A pinned link could not be created, read or removed.
    #[error("{op} {path}: {message}")]
    Link {
        /// What was being done.
        op: &'static str,
        /// The pin.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// This build's layout is pinned but not complete: being created, or
    /// filled from an older layout by the agent.
    #[error("the datapath is not ready: {0}")]
    NotReady(String),
    /// A migration from an older layout could not go on.
    #[error("migrating the datapath from layout {from}: {why}")]
    Migration {
        /// The older layout.
        from: u32,
        /// Why.
        why: String,
    },
    /// A value given by the caller is out of range.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// What was invalid.
        what: &'static str,
        /// Why.
        why: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn program(op: impl Into<String>, source: aya::programs::ProgramError) -> Self {
        Self::Program {
            op: op.into(),
            source: Box::new(source),
        }
    }

    pub(crate) fn map(op: impl Into<String>, source: aya::maps::MapError) -> Self {
        Self::Map {
            op: op.into(),
            source: Box::new(source),
        }
    }
}
