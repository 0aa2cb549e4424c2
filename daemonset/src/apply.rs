//! Applying a pod's policy to the datapath: endpoint records, cpumap CPUs, the
//! XDP attachment of its host veth, and the offloads each mode needs inside
//! the pod, in an order that never breaks traffic in flight.
//!
//! Order of a mode switch: first the offload restrictions both the old and
//! the new mode tolerate (native needs tx checksum off, generic TSO off), then
//! the attach (the old mode's link goes, the new one comes: between the two,
//! packets take kernel routing), then the relaxations the new mode allows.

use std::path::Path;

use xdpcni_ebpf::{
    abi::{EndpointInfo, EP_KERNEL_ONLY, MAX_CPUS},
    AttachMode, Datapath,
};
use xdpcni_plugin::{
    config::XdpMode,
    ethtool::{self, Offload},
    netns::in_netns,
    state::Record,
};

use crate::policy::{fallback, Policy, Problem};

/// cpumap queue size used when the agent enables a CPU.
const CPUMAP_QUEUE: u32 = 2048;

/// Failures applying a policy.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The datapath refused an update.
    #[error("datapath: {0}")]
    Datapath(#[from] xdpcni_ebpf::Error),
    /// Offloads inside the pod could not be set.
    #[error("offloads in {netns}: {source}")]
    Offloads {
        /// The pod's netns.
        netns: String,
        /// The error.
        source: std::io::Error,
    },
    /// A record is unusable.
    #[error("record of {0}: {1}")]
    Record(String, String),
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
}

fn mac(s: &str) -> Option<[u8; 6]> {
    let mut m = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut m {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(m)
}

/// The mode attached to `ifindex` now.
pub fn current_mode(dp: &Datapath, ifindex: u32) -> Result<XdpMode, ApplyError> {
    Ok(dp
        .attachment(ifindex)?
        .map_or(XdpMode::Off, |a| XdpMode::Xdp(a.mode)))
}

fn offloads(netns: &Path, ifname: &str, settings: &[(Offload, bool)]) -> Result<(), ApplyError> {
    if settings.is_empty() {
        return Ok(());
    }
    let ifname = ifname.to_string();
    in_netns(netns, || -> std::io::Result<()> {
        for (o, on) in settings {
            ethtool::ensure(&ifname, *o, *on)?;
        }
        Ok(())
    })
    .map_err(|source| ApplyError::Offloads {
        netns: netns.display().to_string(),
        source,
    })
}

/// Restrictions to apply before switching to `target`.
fn before(target: XdpMode) -> Vec<(Offload, bool)> {
    match target {
        XdpMode::Xdp(AttachMode::Native) => {
            vec![(Offload::Gro, true), (Offload::TxChecksum, false)]
        }
        XdpMode::Xdp(AttachMode::Generic) => vec![(Offload::Gro, true)],
        XdpMode::Off => vec![],
    }
}

/// Relaxations `target` allows once it is in place.
fn after(target: XdpMode) -> Vec<(Offload, bool)> {
    match target {
        XdpMode::Xdp(AttachMode::Native) => vec![],
        // Hybrid: TSO and checksum offload back on (native had them off);
        // the datapath passes GSO super-packets to the kernel (pass_gso).
        XdpMode::Xdp(AttachMode::Generic) => {
            vec![(Offload::TxChecksum, true), (Offload::Tso, true)]
        }
        XdpMode::Off => vec![(Offload::TxChecksum, true), (Offload::Tso, true)],
    }
}

/// Applies `want` to the pod of `rec`; `kernel_only` forces kernel routing
/// both ways (e.g. the pod is selected by a NetworkPolicy).
pub fn apply(
    dp: &mut Datapath,
    rec: &Record,
    want: &Policy,
    kernel_only: bool,
) -> Result<Applied, ApplyError> {
    let netns = Path::new(&rec.netns);
    let (pod_mac, host_mac) = match (mac(&rec.pod_mac), mac(&rec.host_mac)) {
        (Some(p), Some(h)) => (p, h),
        _ => {
            return Err(ApplyError::Record(
                rec.container_id.clone(),
                "unreadable MAC".into(),
            ))
        }
    };
    let mut changed = false;
    let mut problems = Vec::new();
    let target0 = if kernel_only { XdpMode::Off } else { want.mode };
    let mut info = EndpointInfo {
        ifindex: rec.host_ifindex,
        pod_mac,
        host_mac,
        flags: 0,
        redirect: want.redirect.as_raw(),
        mtu: rec.mtu,
        stats_slot: 0,
        cpu_mask: want.cpu_mask,
    };
    let upsert = |dp: &mut Datapath, info: &EndpointInfo| -> Result<bool, ApplyError> {
        let mut any = false;
        for ip in &rec.ips {
            if !dp
                .maps()
                .endpoint(*ip)?
                .is_some_and(|have| have.same_policy(info))
            {
                dp.maps_mut().upsert_endpoint(*ip, info)?;
                any = true;
            }
        }
        if !dp.maps().has_tx_port(rec.host_ifindex)? {
            dp.maps_mut().add_tx_port(rec.host_ifindex)?;
            any = true;
        }
        Ok(any)
    };
    if want.redirect == xdpcni_ebpf::abi::RedirectPolicy::Cpumap {
        for cpu in (0..MAX_CPUS).filter(|c| want.cpu_mask & (1 << c) != 0) {
            if dp.maps().cpu_queue_size(cpu)?.is_none() {
                dp.enable_cpu(cpu, CPUMAP_QUEUE)?;
            }
        }
    }

    let mut target = target0;
    loop {
        // Re-read each round: a refused attach may have removed the old link.
        let current = current_mode(dp, rec.host_ifindex)?;
        if target == XdpMode::Off {
            // Others stop redirecting to it first, then its own link goes.
            info.flags = EP_KERNEL_ONLY;
            changed |= upsert(dp, &info)?;
            if current != XdpMode::Off {
                dp.detach(rec.host_ifindex)?;
                offloads(netns, &rec.ifname, &after(XdpMode::Off))?;
                changed = true;
            }
            break;
        }
        let XdpMode::Xdp(mode) = target else {
            break;
        };
        if current == target {
            info.flags = 0;
            changed |= upsert(dp, &info)?;
            break;
        }
        offloads(netns, &rec.ifname, &before(target))?;
        match dp.attach(rec.host_ifindex, mode) {
            Ok(_) => {
                offloads(netns, &rec.ifname, &after(target))?;
                info.flags = 0;
                upsert(dp, &info)?;
                changed = true;
                break;
            }
            Err(e) => {
                let next = fallback(target);
                problems.push(Problem {
                    key: "attach".into(),
                    value: target.as_str().into(),
                    why: format!("the kernel refused {} XDP: {e}", mode.as_str()),
                    fallback: next.as_str().into(),
                });
                target = next;
            }
        }
    }
    Ok(Applied {
        mode: target,
        changed,
        problems,
    })
}
