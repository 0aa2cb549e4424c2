//! Applying a pod's policy to the datapath: endpoint records, cpumap CPUs, the
//! XDP attachment of its host veth, and the offloads each mode needs inside
//! the pod, in an order that never breaks traffic in flight.
//!
//! Order of a mode switch: first the offload restrictions both the old and
//! the new mode tolerate (native needs tx checksum off, generic TSO off), then
//! the attach (the old mode's link goes, the new one comes: between the two,
//! packets take kernel routing), then the relaxations the new mode allows.

use std::path::Path;

use xdpcni_ebpf::Datapath;
use xdpcni_host::{
    pod::{self, fallback, PodAttachment, XdpMode},
    state::Record,
};

use crate::policy::{Policy, Problem};

/// Failures applying a policy.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The datapath refused an update.
    #[error("datapath: {0}")]
    Datapath(#[from] xdpcni_ebpf::Error),
    /// The mode could not be reached (datapath or offloads in the pod).
    #[error("{0}")]
    Converge(#[from] pod::ConvergeError),
}

/// What a pod ended up with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The mode attached now.
    pub mode: XdpMode,
    /// Whether anything changed.
    pub changed: bool,
    /// Kernel refusals and the fallback taken.
    pub problems: Vec<Problem>,
    /// On kernel routing because a datapath map is full (the error).
    pub map_full: Option<String>,
    /// The first mode the kernel refused, and its answer.
    pub refused: Option<(XdpMode, String)>,
}

impl Applied {
    /// Nothing applied: a pod without a veth to attach to (off).
    pub fn nothing() -> Self {
        Self {
            mode: XdpMode::Off,
            changed: false,
            problems: Vec::new(),
            map_full: None,
            refused: None,
        }
    }
}

/// Applies `want` to the pod of `rec`; `kernel_only` forces kernel routing
/// both ways (e.g. the pod is selected by a NetworkPolicy). The decisions
/// (offloads per mode, fallback order, endpoint flags) are `pod::converge`'s,
/// the same the CNI plugin makes at ADD.
pub fn apply(
    dp: &mut Datapath,
    rec: &Record,
    want: &Policy,
    kernel_only: bool,
) -> Result<Applied, ApplyError> {
    let mut changed = false;
    if !dp.maps().has_tx_port(rec.host_ifindex)? {
        dp.maps_mut().add_tx_port(rec.host_ifindex)?;
        changed = true;
    }
    pod::enable_cpus(dp, want.redirect, want.cpu_mask)?;
    let attachment = PodAttachment {
        netns: Path::new(&rec.netns),
        ifname: &rec.ifname,
        host_ifindex: rec.host_ifindex,
        ips: &rec.ips,
        info: pod::endpoint_info(
            rec.host_ifindex,
            rec.pod_mac,
            rec.host_mac,
            want.redirect,
            rec.mtu,
            want.cpu_mask,
        ),
    };
    let target = if kernel_only { XdpMode::Off } else { want.mode };
    let done = pod::converge(dp, &attachment, target)?;
    let mut problems: Vec<Problem> = done
        .refused
        .iter()
        .map(|r| {
            Problem::attach_refused(
                r.mode.as_str(),
                &r.error.to_string(),
                fallback(XdpMode::Xdp(r.mode)).as_str(),
            )
        })
        .collect();
    if let Some(full) = &done.map_full {
        problems.push(Problem::map_full(target.as_str(), full));
    }
    Ok(Applied {
        mode: done.mode,
        changed: changed || done.changed,
        problems,
        refused: done
            .refused
            .first()
            .map(|r| (XdpMode::Xdp(r.mode), r.error.to_string())),
        map_full: done.map_full,
    })
}
