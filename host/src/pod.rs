//! What a pod's attachment should be, and how to get there: decided here
//! once, used by the CNI plugin at ADD and by the agent on a mode change.

use std::{fmt, net::IpAddr, path::Path};

use xdpcni_ebpf::{
    abi::{EndpointInfo, RedirectPolicy, EP_KERNEL_ONLY, MAX_CPUS},
    AttachMode, Datapath,
};

use crate::{
    ethtool::{self, Offload},
    hook,
    netns::in_netns,
};

/// cpumap queue size of a CPU enabled for a pod.
pub const CPUMAP_QUEUE: u32 = 2048;

/// The mode asked for a pod: an attach mode of the datapath (XDP native or
/// generic, or the tc hook), or kernel routing only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpMode {
    /// Attach in this mode.
    Xdp(AttachMode),
    /// Kernel routing only.
    Off,
}

/// The node default of a pod without annotations: tc, the fastest into
/// sockets and skb consumers on every workload of docs/bench.md (UDP small
/// packets, TCP with GSO kept, raw forwarding); native XDP leads only where
/// the destination consumes in XDP, which a pod asks for by annotation. On a
/// kernel without tcx (before 6.6) it falls back to generic.
pub const DEFAULT_MODE: XdpMode = XdpMode::Xdp(AttachMode::Tc);

impl XdpMode {
    /// Every mode, in the fallback order: native XDP (the fastest where
    /// the destination consumes in XDP), the tc hook (the fastest into
    /// sockets; needs tcx, kernel 6.6), generic XDP (any kernel with XDP),
    /// kernel routing (always works).
    pub const ALL: [XdpMode; 4] = [
        Self::Xdp(AttachMode::Native),
        Self::Xdp(AttachMode::Tc),
        Self::Xdp(AttachMode::Generic),
        Self::Off,
    ];

    /// Parses `native`, `tc`, `generic` or `off`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    /// The modes, as an error message lists them.
    pub fn names() -> String {
        let names: Vec<&str> = Self::ALL.iter().map(|m| m.as_str()).collect();
        names.join(", ")
    }

    /// `native`, `tc`, `generic` or `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Xdp(m) => m.as_str(),
            Self::Off => "off",
        }
    }
}

impl fmt::Display for XdpMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for XdpMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Reads `native`, `tc`, `generic` or `off`; also `none`, which records written
/// before the mode was typed used for "no datapath pinned" (kernel routing).
impl<'de> serde::Deserialize<'de> for XdpMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "none" => Ok(Self::Off),
            s => Self::parse(s).ok_or_else(|| {
                serde::de::Error::custom(format!("mode {s:?} is not one of {}", Self::names()))
            }),
        }
    }
}

/// The next mode to try when the kernel refuses `mode`: native, then tc,
/// then generic, then kernel routing, which always works.
pub fn fallback(mode: XdpMode) -> XdpMode {
    match mode {
        XdpMode::Xdp(AttachMode::Native) => XdpMode::Xdp(AttachMode::Tc),
        XdpMode::Xdp(AttachMode::Tc) => XdpMode::Xdp(AttachMode::Generic),
        XdpMode::Xdp(AttachMode::Generic) | XdpMode::Off => XdpMode::Off,
    }
}

/// The offloads of the pod's eth0 in `mode` (what ADD sets, CHECK and the
/// tests assert). GRO always: a veth only accepts redirected frames with GRO
/// or XDP on the peer. Native: tx checksum off (an `xdp_frame` has no
/// CHECKSUM_PARTIAL state; the kernel strips TSO itself while native XDP is
/// attached). Generic is the hybrid: TSO and checksum offload on, the
/// datapath passes GSO super-packets to the kernel (`pass_gso`). tc keeps
/// every offload and redirects the super-packets whole.
pub fn offloads(mode: XdpMode) -> Vec<(Offload, bool)> {
    let mut v = before(mode);
    v.extend(after(mode));
    v
}

/// The restrictions `target` needs before its link comes (a mode switch
/// first applies what both the old and the new mode tolerate).
pub fn before(target: XdpMode) -> Vec<(Offload, bool)> {
    match target {
        XdpMode::Xdp(AttachMode::Native) => {
            vec![(Offload::Gro, true), (Offload::TxChecksum, false)]
        }
        XdpMode::Xdp(AttachMode::Generic | AttachMode::Tc) | XdpMode::Off => {
            vec![(Offload::Gro, true)]
        }
    }
}

/// The relaxations `target` allows once it is in place.
pub fn after(target: XdpMode) -> Vec<(Offload, bool)> {
    match target {
        XdpMode::Xdp(AttachMode::Native) => vec![],
        XdpMode::Xdp(AttachMode::Generic | AttachMode::Tc) | XdpMode::Off => {
            vec![(Offload::TxChecksum, true), (Offload::Tso, true)]
        }
    }
}

/// Sets `settings` on `ifname` in the calling thread's network namespace,
/// reading each back.
pub fn ensure_offloads(ifname: &str, settings: &[(Offload, bool)]) -> std::io::Result<()> {
    for (o, on) in settings {
        ethtool::ensure(ifname, *o, *on).map_err(|e| {
            std::io::Error::new(e.kind(), format!("ethtool {o:?} {on} on {ifname}: {e}"))
        })?;
    }
    Ok(())
}

/// Sets `settings` on `ifname` inside the network namespace at `netns`.
pub fn set_offloads(
    netns: &Path,
    ifname: &str,
    settings: &[(Offload, bool)],
) -> std::io::Result<()> {
    if settings.is_empty() {
        return Ok(());
    }
    let ifname = ifname.to_string();
    in_netns(netns, || ensure_offloads(&ifname, settings))
}

/// The mode attached to `ifindex` now.
pub fn current_mode(dp: &Datapath, ifindex: u32) -> Result<XdpMode, xdpcni_ebpf::Error> {
    Ok(dp
        .attachment(ifindex)?
        .map_or(XdpMode::Off, |a| XdpMode::Xdp(a.mode)))
}

/// A mode the kernel refused, and why.
#[derive(Debug)]
pub struct Refusal {
    /// The mode refused.
    pub mode: AttachMode,
    /// The kernel's answer.
    pub error: xdpcni_ebpf::Error,
}

/// What [`converge`] reached.
#[derive(Debug)]
pub struct Converged {
    /// The mode in place now.
    pub mode: XdpMode,
    /// Whether anything was attached, detached or re-flagged.
    pub changed: bool,
    /// The modes the kernel refused on the way, in order.
    pub refused: Vec<Refusal>,
    /// A datapath map was full (the error): the pod is on kernel routing
    /// without an endpoint record until there is room again.
    pub map_full: Option<String>,
}

/// Failures of [`converge`].
#[derive(Debug, thiserror::Error)]
pub enum ConvergeError {
    /// The datapath refused a map update or a detach.
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

/// A pod's attachment as [`converge`] needs it.
pub struct PodAttachment<'a> {
    /// The pod's network namespace.
    pub netns: &'a Path,
    /// The pod's interface.
    pub ifname: &'a str,
    /// The host veth.
    pub host_ifindex: u32,
    /// The pod's addresses.
    pub ips: &'a [IpAddr],
    /// The endpoint record of its addresses; flags are set here.
    pub info: EndpointInfo,
}

/// Brings the pod of `a` to `want` (`Off` when it must be kernel-only),
/// falling back native -> generic -> off when the kernel refuses, in an
/// order that never breaks traffic in flight: the restrictions of the target
/// mode, the attach (between the old link and the new one packets take
/// kernel routing), then its relaxations; endpoint records are re-flagged
/// only where they differ. An `Off` pod is flagged kernel-only first, so no
/// program redirects to it while its own link goes. A full datapath map
/// leaves the pod on kernel routing without records (`map_full`).
pub fn converge(
    dp: &mut Datapath,
    a: &PodAttachment<'_>,
    want: XdpMode,
) -> Result<Converged, ConvergeError> {
    match converge_in_place(dp, a, want) {
        Err(ConvergeError::Datapath(e @ xdpcni_ebpf::Error::MapFull { .. })) => {
            // No room for the pod's records: kernel routing, where a pod
            // needs none (frames to it miss the endpoint maps and go to the
            // kernel too). The next converge tries again.
            dp.detach(a.host_ifindex)?;
            dp.maps_mut().remove_endpoints_of(a.host_ifindex)?;
            pod_offloads(a, &offloads(XdpMode::Off))?;
            Ok(Converged {
                mode: XdpMode::Off,
                changed: true,
                refused: Vec::new(),
                map_full: Some(e.to_string()),
            })
        }
        other => other,
    }
}

/// Sets `settings` on the pod's interface of `a`.
fn pod_offloads(a: &PodAttachment<'_>, settings: &[(Offload, bool)]) -> Result<(), ConvergeError> {
    set_offloads(a.netns, a.ifname, settings).map_err(|source| ConvergeError::Offloads {
        netns: a.netns.display().to_string(),
        ifname: a.ifname.to_string(),
        source,
    })
}

/// [`converge`]'s steps; a full map's error goes back to it.
fn converge_in_place(
    dp: &mut Datapath,
    a: &PodAttachment<'_>,
    want: XdpMode,
) -> Result<Converged, ConvergeError> {
    let apply = |settings: &[(Offload, bool)]| pod_offloads(a, settings);
    let mut info = a.info;
    let mut out = Converged {
        mode: want,
        changed: false,
        refused: Vec::new(),
        map_full: None,
    };
    let mut target = want;
    loop {
        // Re-read each round: a refused attach may have removed the old link.
        let current = current_mode(dp, a.host_ifindex)?;
        if target == XdpMode::Off {
            info.flags = EP_KERNEL_ONLY;
            out.changed |= upsert(dp, a.ips, &info)?;
            if current != XdpMode::Off || !out.refused.is_empty() {
                dp.detach(a.host_ifindex)?;
                hook::stop_point("converge:detached");
                apply(&after(XdpMode::Off))?;
                out.changed = true;
            } else {
                // Already off: the offloads may still be a killed switch's.
                apply(&offloads(XdpMode::Off))?;
            }
            break;
        }
        let XdpMode::Xdp(mode) = target else {
            break;
        };
        info.flags = 0;
        if current == target {
            out.changed |= upsert(dp, a.ips, &info)?;
            // The link is right; the offloads may still be those of a switch
            // killed between its attach and its relaxations.
            apply(&offloads(target))?;
            break;
        }
        apply(&before(target))?;
        hook::stop_point("converge:offloads");
        // Records first: the new link drops sources it has no record of.
        upsert(dp, a.ips, &info)?;
        hook::stop_point("converge:records");
        match dp.attach(a.host_ifindex, mode) {
            Ok(_) => {
                hook::stop_point("converge:attached");
                apply(&after(target))?;
                out.changed = true;
                break;
            }
            Err(error) => {
                out.refused.push(Refusal { mode, error });
                target = fallback(target);
            }
        }
    }
    out.mode = target;
    Ok(out)
}

/// Writes the records of `ips` that differ from `info`; whether any did.
fn upsert(
    dp: &mut Datapath,
    ips: &[IpAddr],
    info: &EndpointInfo,
) -> Result<bool, xdpcni_ebpf::Error> {
    let mut any = false;
    for ip in ips {
        if !dp
            .maps()
            .endpoint(*ip)?
            .is_some_and(|have| have.same_policy(info))
        {
            dp.maps_mut().upsert_endpoint(*ip, info)?;
            any = true;
        }
    }
    Ok(any)
}

/// The endpoint record of a pod (flags are left to [`converge`]).
pub fn endpoint_info(
    host_ifindex: u32,
    pod_mac: Mac,
    host_mac: Mac,
    redirect: RedirectPolicy,
    mtu: u32,
    cpu_mask: u64,
) -> EndpointInfo {
    EndpointInfo {
        ifindex: host_ifindex,
        pod_mac: pod_mac.0,
        host_mac: host_mac.0,
        flags: 0,
        redirect: redirect.as_raw(),
        mtu,
        stats_slot: 0,
        cpu_mask,
    }
}

/// Enables the cpumap CPUs of `cpu_mask` that are not enabled yet, when the
/// pod's policy is cpumap.
pub fn enable_cpus(
    dp: &mut Datapath,
    redirect: RedirectPolicy,
    cpu_mask: u64,
) -> Result<(), xdpcni_ebpf::Error> {
    if redirect != RedirectPolicy::Cpumap {
        return Ok(());
    }
    for cpu in (0..MAX_CPUS).filter(|c| cpu_mask & (1 << c) != 0) {
        if dp.maps().cpu_queue_size(cpu)?.is_none() {
            dp.enable_cpu(cpu, CPUMAP_QUEUE)?;
        }
    }
    Ok(())
}

/// A MAC address, written `aa:bb:cc:dd:ee:ff`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mac(pub [u8; 6]);

impl std::str::FromStr for Mac {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut m = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut m {
            let p = parts
                .next()
                .ok_or_else(|| format!("MAC {s:?} is too short"))?;
            if p.len() != 2 {
                return Err(format!("MAC {s:?}: {p:?} is not two hex digits"));
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| format!("MAC {s:?}: {p:?} is not hex"))?;
        }
        if parts.next().is_some() {
            return Err(format!("MAC {s:?} is too long"));
        }
        Ok(Self(m))
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl serde::Serialize for Mac {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Mac {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Parses a Linux CPU list (`0`, `0-3`, `0,2-3`) into a mask of the
/// datapath's CPUs.
pub fn parse_cpu_list(s: &str) -> Result<u64, String> {
    let mut mask = 0u64;
    for part in s.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(format!("empty element in CPU list {s:?}"));
        }
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let lo: u32 = lo
            .parse()
            .map_err(|_| format!("{lo:?} is not a CPU number"))?;
        let hi: u32 = hi
            .parse()
            .map_err(|_| format!("{hi:?} is not a CPU number"))?;
        if lo > hi {
            return Err(format!("range {part:?} is reversed"));
        }
        if hi >= MAX_CPUS {
            return Err(format!("CPU {hi} is beyond the datapath's {MAX_CPUS} CPUs"));
        }
        for cpu in lo..=hi {
            mask |= 1 << cpu;
        }
    }
    Ok(mask)
}

/// A CPU mask as a CPU list (`0-3,6`); empty for no CPU.
pub fn format_cpu_list(mask: u64) -> String {
    let mut parts = Vec::new();
    let mut cpu = 0;
    while cpu < 64 {
        if mask & (1 << cpu) == 0 {
            cpu += 1;
            continue;
        }
        let start = cpu;
        while cpu + 1 < 64 && mask & (1 << (cpu + 1)) != 0 {
            cpu += 1;
        }
        parts.push(if start == cpu {
            start.to_string()
        } else {
            format!("{start}-{cpu}")
        });
        cpu += 1;
    }
    parts.join(",")
}

/// The CPUs online now (`/sys/devices/system/cpu/online`); CPU 0 if unreadable.
pub fn online_cpus() -> u64 {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpu_list(s.trim()).ok())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_chain_ends_in_kernel_routing() {
        let m = fallback(XdpMode::Xdp(AttachMode::Native));
        assert_eq!(m, XdpMode::Xdp(AttachMode::Tc));
        let m = fallback(m);
        assert_eq!(m, XdpMode::Xdp(AttachMode::Generic));
        assert_eq!(fallback(m), XdpMode::Off);
        assert_eq!(fallback(XdpMode::Off), XdpMode::Off);
        // The fallback walks XdpMode::ALL in order, so metrics and docs that
        // list ALL list the fallback order.
        for w in XdpMode::ALL.windows(2) {
            assert_eq!(fallback(w[0]), w[1]);
        }
    }

    #[test]
    fn offload_table_per_mode() {
        use Offload::*;
        let native = offloads(XdpMode::Xdp(AttachMode::Native));
        assert_eq!(native, vec![(Gro, true), (TxChecksum, false)]);
        let generic = offloads(XdpMode::Xdp(AttachMode::Generic));
        assert_eq!(generic, vec![(Gro, true), (TxChecksum, true), (Tso, true)]);
        assert_eq!(offloads(XdpMode::Off), generic, "off keeps every offload");
        assert_eq!(
            offloads(XdpMode::Xdp(AttachMode::Tc)),
            generic,
            "tc keeps every offload"
        );
        // A switch never relaxes before the attach what the target forbids.
        for m in XdpMode::ALL {
            for (o, on) in before(m) {
                assert!(!after(m).contains(&(o, !on)), "{m}: {o:?} flips back");
            }
        }
    }

    #[test]
    fn modes_parse_and_print() {
        for s in ["native", "tc", "generic", "off"] {
            assert_eq!(XdpMode::parse(s).map(|m| m.to_string()), Some(s.into()));
        }
        assert_eq!(XdpMode::parse("Native"), None);
    }

    #[test]
    fn macs_parse_and_print() {
        let m: Mac = "02:ab:00:10:ff:01".parse().expect("valid");
        assert_eq!(m.0, [2, 0xab, 0, 0x10, 0xff, 1]);
        assert_eq!(m.to_string(), "02:ab:00:10:ff:01");
        for bad in [
            "",
            "02:ab:00:10:ff",
            "02:ab:00:10:ff:01:02",
            "02:ab:00:10:ff:zz",
            "2:ab:00:10:ff:01",
        ] {
            assert!(bad.parse::<Mac>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cpu_lists_parse_and_print() {
        assert_eq!(parse_cpu_list("0"), Ok(1));
        assert_eq!(parse_cpu_list("0-3"), Ok(0xf));
        assert_eq!(parse_cpu_list("1, 3-4"), Ok(0b11010));
        for bad in ["", "a", "3-1", "0,,1", "64"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?}");
        }
        for mask in [0u64, 1, 0xf, 0b11010, 1 << 63, u64::MAX] {
            let s = format_cpu_list(mask);
            if mask == 0 {
                assert_eq!(s, "");
            } else if mask >> 63 == 0 {
                assert_eq!(parse_cpu_list(&s), Ok(mask), "{s}");
            }
        }
        assert_eq!(format_cpu_list(0b11010), "1,3-4");
    }
}
