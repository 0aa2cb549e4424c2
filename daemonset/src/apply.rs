//! Bringing one pod to its mode: the only place that turns what the agent
//! decided for a pod (its hold, its wish, or kernel-only) into datapath
//! state (the reconciler's pods, `reconciler/pods.rs`, call it), through
//! the datapath's verbs (which keep the order the programs rely on) and the
//! pod's offloads, in an order that never breaks traffic in flight.
//!
//! Order of a mode switch: first the offload restrictions both the old and
//! the new mode tolerate (native needs tx checksum off), then the records,
//! then the attach (the old mode's link goes, the new one comes: between the
//! two, packets take kernel routing), then the relaxations the new mode
//! allows. A kernel refusal walks the fallback order (native -> tc ->
//! generic -> off); a full map leaves the pod on kernel routing without
//! records until there is room.

use std::{net::IpAddr, path::Path};

use xdpcni_ebpf::{
    abi::{EndpointInfo, RedirectPolicy},
    Datapath,
};
use xdpcni_host::{
    ethtool::Offload,
    hook,
    pod::{after, before, fallback, offloads, set_offloads, XdpMode},
    state::Record,
};

use tracing::{info, warn};

use crate::{
    reconciler::Hold,
    wish::{Problem, Wish},
};

/// Failures bringing a pod to its mode (retried by the caller).
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The datapath refused an update or a detach.
    #[error("datapath: {0}")]
    Datapath(#[from] xdpcni_ebpf::Error),
    /// Offloads inside the pod could not be set.
    #[error("offloads of {ifname} in {netns}: {source}")]
    Offloads {
        /// The pod's netns.
        netns: String,
        /// The pod's interface.
        ifname: String,
        /// The error.
        source: std::io::Error,
    },
}

impl ApplyError {
    /// The `kind` label of `xdpcni_reconcile_retries_total`.
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Datapath(_) => "datapath",
            Self::Offloads { .. } => "offloads",
        }
    }
}

/// What a pod ended up with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The mode attached now.
    pub mode: XdpMode,
    /// Whether anything was attached, detached or re-flagged.
    pub changed: bool,
    /// Kernel refusals and the fallback taken, a full map.
    pub problems: Vec<Problem>,
    /// On kernel routing because a datapath map is full (the error).
    pub map_full: Option<String>,
    /// The first mode the kernel refused, and its answer.
    pub refused: Option<(XdpMode, String)>,
}

impl Applied {
    /// Nothing applied: a pod without a veth to attach to (off).
    pub fn nothing() -> Self {
        Self::reached(XdpMode::Off)
    }

    fn reached(mode: XdpMode) -> Self {
        Self {
            mode,
            changed: false,
            problems: Vec::new(),
            map_full: None,
            refused: None,
        }
    }
}

/// The endpoint record of a pod's addresses (flags are left to the verbs).
pub fn endpoint_info(rec: &Record, want: &Wish) -> EndpointInfo {
    EndpointInfo {
        ifindex: rec.host_ifindex,
        pod_mac: rec.pod_mac.0,
        host_mac: rec.host_mac.0,
        flags: 0,
        redirect: want.redirect.as_raw(),
        mtu: rec.mtu,
        stats_slot: 0,
        cpu_mask: want.cpu_mask,
    }
}

/// Brings the pod of `rec` to `want`; `kernel_only` forces kernel routing
/// both ways (a NetworkPolicy isolates it, a FORWARD rule names it, it is
/// held); `policy`: the datapath enforces the policies that isolate it (its
/// records say `EP_KERNEL_ONLY | EP_POLICY`: programs that do not know the
/// second flag leave it to the kernel path).
pub fn apply(
    dp: &mut Datapath,
    rec: &Record,
    want: &Wish,
    kernel_only: bool,
    policy: bool,
) -> Result<Applied, ApplyError> {
    if want.redirect == RedirectPolicy::Cpumap {
        dp.enable_cpus(want.cpu_mask)?;
    }
    let mut info = endpoint_info(rec, want);
    if policy && !kernel_only {
        info.flags = xdpcni_ebpf::abi::EP_KERNEL_ONLY | xdpcni_ebpf::abi::EP_POLICY;
    }
    let pod = Pod { rec, info };
    let target = if kernel_only { XdpMode::Off } else { want.mode };
    match pod.converge(dp, target) {
        Err(ApplyError::Datapath(e @ xdpcni_ebpf::Error::MapFull { .. })) => {
            // No room for the pod's records: kernel routing, where a pod
            // needs none (frames to it miss the endpoint maps and go to the
            // kernel too). The next reconcile tries again.
            dp.drop_records(rec.host_ifindex)?;
            pod.offloads(&offloads(XdpMode::Off))?;
            let full = e.to_string();
            Ok(Applied {
                changed: true,
                problems: vec![Problem::map_full(target.as_str(), &full)],
                map_full: Some(full),
                ..Applied::reached(XdpMode::Off)
            })
        }
        other => other,
    }
}

/// A pod as [`apply`] converges it.
struct Pod<'a> {
    rec: &'a Record,
    info: EndpointInfo,
}

impl Pod<'_> {
    fn ifindex(&self) -> u32 {
        self.rec.host_ifindex
    }

    fn ips(&self) -> &[IpAddr] {
        &self.rec.ips
    }

    /// Sets `settings` on the pod's interface.
    fn offloads(&self, settings: &[(Offload, bool)]) -> Result<(), ApplyError> {
        let netns = Path::new(&self.rec.netns);
        set_offloads(netns, &self.rec.ifname, settings).map_err(|source| ApplyError::Offloads {
            netns: self.rec.netns.clone(),
            ifname: self.rec.ifname.clone(),
            source,
        })
    }

    /// The mode attached now.
    fn current(&self, dp: &Datapath) -> Result<XdpMode, ApplyError> {
        Ok(dp
            .attachment(self.ifindex())?
            .map_or(XdpMode::Off, |a| XdpMode::from(a.mode)))
    }

    /// Tries `want`, then its fallbacks, until one is in place.
    fn converge(&self, dp: &mut Datapath, want: XdpMode) -> Result<Applied, ApplyError> {
        let mut out = Applied::reached(want);
        let mut target = want;
        while let Some(mode) = target.attach() {
            // Re-read each round: a refused attach may have removed the old link.
            let current = self.current(dp)?;
            if current == target {
                out.changed |= dp.set_endpoint(self.ifindex(), self.ips(), &self.info)?;
                // The link is right; the offloads may still be those of a
                // switch killed between its attach and its relaxations.
                self.offloads(&offloads(target))?;
                out.mode = target;
                return Ok(out);
            }
            self.offloads(&before(target))?;
            hook::stop_point("converge:offloads");
            // Records first: the new link drops sources it has no record of.
            dp.set_endpoint(self.ifindex(), self.ips(), &self.info)?;
            hook::stop_point("converge:records");
            match dp.switch_mode(self.ifindex(), mode) {
                Ok(_) => {
                    hook::stop_point("converge:attached");
                    self.offloads(&after(target))?;
                    out.changed = true;
                    out.mode = target;
                    return Ok(out);
                }
                Err(error) => {
                    let next = fallback(target);
                    out.problems.push(Problem::attach_refused(
                        mode.as_str(),
                        &error.to_string(),
                        next.as_str(),
                    ));
                    out.refused
                        .get_or_insert_with(|| (target, error.to_string()));
                    target = next;
                }
            }
        }
        self.kernel_only(dp, &mut out)?;
        Ok(out)
    }

    /// Kernel routing both ways: flagged kernel-only, then detached.
    fn kernel_only(&self, dp: &mut Datapath, out: &mut Applied) -> Result<(), ApplyError> {
        let (flagged, detached) = dp.make_kernel_only(self.ifindex(), self.ips(), &self.info)?;
        out.changed |= flagged;
        if detached || out.refused.is_some() {
            hook::stop_point("converge:detached");
            self.offloads(&after(XdpMode::Off))?;
            out.changed = true;
        } else {
            // Already off: the offloads may still be a killed switch's.
            self.offloads(&offloads(XdpMode::Off))?;
        }
        out.mode = XdpMode::Off;
        Ok(())
    }
}

/// Brings the hold of the pod of `rec` to what `want` says: a
/// classified pod's hold (the CNI's, at ADD) goes, and the pod takes
/// kernel routing until the rest of its reconcile attaches its mode; a
/// pod whose policies cannot be put in force is held (its records
/// flagged kernel-only first). Whether it is held now.
pub fn hold(dp: &mut Datapath, rec: &Record, want: Hold) -> Result<bool, xdpcni_ebpf::Error> {
    match want {
        Hold::Keep => {}
        Hold::Release => {
            if dp.release_hold(rec.host_ifindex)? {
                info!(host_veth = %rec.host_veth, "hold released: the pod is classified");
            }
        }
        Hold::Hold => {
            if dp.hold_pod(rec.host_ifindex, &rec.host_veth, &rec.ips)? {
                warn!(
                    host_veth = %rec.host_veth,
                    "held: the NetworkPolicy rules that select the pod are not in force"
                );
            }
        }
    }
    Ok(dp.is_held(rec.host_ifindex))
}
