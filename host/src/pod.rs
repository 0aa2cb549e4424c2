//! What a pod's modes are and what each needs of the pod (offloads, the
//! fallback order), its MAC and CPU lists: the words the CNI plugin, the
//! agent and the tests share. Getting a pod to its mode is the agent's
//! (`daemonset/src/apply.rs`), through the datapath's verbs.

use std::{fmt, path::Path};

use xdpcni_ebpf::{abi::MAX_CPUS, AttachMode};

use crate::{
    ethtool::{self, Offload},
    netns::in_netns,
};

/// The mode of a pod (the `xdpcni.io/xdp-mode` annotation's values): one of
/// the datapath's attach modes, or kernel routing only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpMode {
    /// Driver-mode XDP on the host veth.
    Native,
    /// The datapath on the host veth's tcx ingress (`bpf_redirect_peer`).
    Tc,
    /// skb-mode XDP on the host veth.
    Generic,
    /// Kernel routing only.
    Off,
}

impl From<AttachMode> for XdpMode {
    fn from(m: AttachMode) -> Self {
        match m {
            AttachMode::Native => Self::Native,
            AttachMode::Tc => Self::Tc,
            AttachMode::Generic => Self::Generic,
        }
    }
}

/// The node default of a pod without annotations: tc, the fastest into
/// sockets and skb consumers on every workload of docs/bench.md (UDP small
/// packets, TCP with GSO kept, raw forwarding); native XDP leads only where
/// the destination consumes in XDP, which a pod asks for by annotation. On a
/// kernel without tcx (before 6.6) it falls back to generic.
pub const DEFAULT_MODE: XdpMode = XdpMode::Tc;

impl XdpMode {
    /// Every mode, in the fallback order: native XDP (the fastest where
    /// the destination consumes in XDP), the tc hook (the fastest into
    /// sockets; needs tcx, kernel 6.6), generic XDP (any kernel with XDP),
    /// kernel routing (always works).
    pub const ALL: [XdpMode; 4] = [Self::Native, Self::Tc, Self::Generic, Self::Off];

    /// The datapath's attach mode, or `None` for kernel routing.
    pub const fn attach(self) -> Option<AttachMode> {
        match self {
            Self::Native => Some(AttachMode::Native),
            Self::Tc => Some(AttachMode::Tc),
            Self::Generic => Some(AttachMode::Generic),
            Self::Off => None,
        }
    }

    /// Parses `native`, `tc`, `generic` or `off`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    /// The modes, as an error message lists them.
    pub fn names() -> String {
        let names: Vec<&str> = Self::ALL.iter().map(|m| m.as_str()).collect();
        names.join(", ")
    }

    /// `native`, `tc`, `generic` or `off`: the attach mode's name, or `off`.
    pub fn as_str(self) -> &'static str {
        self.attach().map_or("off", AttachMode::as_str)
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
        XdpMode::Native => XdpMode::Tc,
        XdpMode::Tc => XdpMode::Generic,
        XdpMode::Generic | XdpMode::Off => XdpMode::Off,
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
        XdpMode::Native => {
            vec![(Offload::Gro, true), (Offload::TxChecksum, false)]
        }
        XdpMode::Generic | XdpMode::Tc | XdpMode::Off => {
            vec![(Offload::Gro, true)]
        }
    }
}

/// The relaxations `target` allows once it is in place.
pub fn after(target: XdpMode) -> Vec<(Offload, bool)> {
    match target {
        XdpMode::Native => vec![],
        XdpMode::Generic | XdpMode::Tc | XdpMode::Off => {
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
        let m = fallback(XdpMode::Native);
        assert_eq!(m, XdpMode::Tc);
        let m = fallback(m);
        assert_eq!(m, XdpMode::Generic);
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
        let native = offloads(XdpMode::Native);
        assert_eq!(native, vec![(Gro, true), (TxChecksum, false)]);
        let generic = offloads(XdpMode::Generic);
        assert_eq!(generic, vec![(Gro, true), (TxChecksum, true), (Tso, true)]);
        assert_eq!(offloads(XdpMode::Off), generic, "off keeps every offload");
        assert_eq!(offloads(XdpMode::Tc), generic, "tc keeps every offload");
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
