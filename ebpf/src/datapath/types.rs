//! The datapath's value types: how a program is attached, what a hold is on,
//! an attachment, a veth's counters, a NAT'd port's protocol.

use std::{fmt, str::FromStr, time::Duration};

use aya::programs::{TcAttachType, XdpMode as AyaXdpMode};

use crate::{
    abi::{StatsValue, Verdict, VerdictKind},
    Error, Result,
};

/// How the datapath runs on a host veth: one of the two XDP modes, or the
/// tc hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttachMode {
    /// Driver mode: veth runs it on `xdp_frame`s (needs GRO or XDP on the peer,
    /// and tx checksum offload off in the pod for TCP; see KERNEL-NOTES).
    Native,
    /// skb mode: runs in the stack on the skb, keeps checksum state, but drops
    /// redirected skbs larger than the target MTU (GSO super-packets go to
    /// the kernel path).
    Generic,
    /// The tc program on the host veth's tcx ingress: the same decisions on
    /// the skb, delivered with `bpf_redirect_peer` into the destination
    /// pod's eth0 (GSO super-packets kept).
    Tc,
}

impl AttachMode {
    /// Every mode.
    pub const ALL: [AttachMode; 3] = [Self::Native, Self::Generic, Self::Tc];

    /// The XDP attach flag of an XDP mode; `None` for tc.
    pub(super) const fn xdp_mode(self) -> Option<AyaXdpMode> {
        match self {
            Self::Native => Some(AyaXdpMode::Driver),
            Self::Generic => Some(AyaXdpMode::Skb),
            Self::Tc => None,
        }
    }

    /// `native`, `generic` or `tc`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
            Self::Tc => "tc",
        }
    }

    /// Whether this mode runs on the XDP hook (one XDP mode per device).
    pub const fn is_xdp(self) -> bool {
        !matches!(self, Self::Tc)
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AttachMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "native" => Ok(Self::Native),
            "generic" => Ok(Self::Generic),
            "tc" => Ok(Self::Tc),
            other => Err(Error::Invalid {
                what: "attach mode",
                why: format!("{other:?} is not \"native\", \"generic\" or \"tc\""),
            }),
        }
    }
}

/// The tc hook of a host veth a hold is attached to: both, so that nothing
/// reaches the pod and nothing leaves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HoldHook {
    /// Frames from the pod (tcx ingress of the host veth).
    Ingress,
    /// Frames to the pod on the kernel path (tcx egress of the host veth).
    Egress,
}

impl HoldHook {
    /// Both hooks.
    pub const ALL: [HoldHook; 2] = [Self::Ingress, Self::Egress];

    pub(super) const fn tc_type(self) -> TcAttachType {
        match self {
            Self::Ingress => TcAttachType::Ingress,
            Self::Egress => TcAttachType::Egress,
        }
    }
}

/// The datapath attached to a host veth through a pinned link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The host veth.
    pub ifindex: u32,
    /// Native, generic or tc.
    pub mode: AttachMode,
    /// The kernel id of the attached program.
    pub prog_id: u32,
    /// The kernel id of the bpf_link.
    pub link_id: u32,
    /// Whether this call changed anything (new attach or program swap).
    pub changed: bool,
}

/// Per-verdict totals of one host veth, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub(super) rows: Vec<(Verdict, StatsValue)>,
}

impl Counters {
    /// Packets counted with `verdict`.
    pub fn packets(&self, verdict: Verdict) -> u64 {
        self.get(verdict).packets
    }

    /// Packets and bytes counted with `verdict`.
    pub fn get(&self, verdict: Verdict) -> StatsValue {
        self.rows
            .iter()
            .find(|(v, _)| *v == verdict)
            .map(|(_, s)| *s)
            .unwrap_or_default()
    }

    /// Every non-zero verdict.
    pub fn iter(&self) -> impl Iterator<Item = (Verdict, StatsValue)> + '_ {
        self.rows.iter().copied()
    }

    /// Packets passed to the kernel, for any reason.
    pub fn passed(&self) -> u64 {
        self.of_kind(VerdictKind::Kernel)
    }

    /// Packets this veth's program redirected to another pod (each
    /// delivery once, on the sender's side).
    pub fn forwarded(&self) -> u64 {
        self.of_kind(VerdictKind::Forward)
    }

    /// Packets the fast path delivered to this veth's pod (the receive
    /// side of another veth's `forwarded`).
    pub fn received(&self) -> u64 {
        self.of_kind(VerdictKind::Received)
    }

    /// Packets counted with any verdict of `kind`.
    pub fn of_kind(&self, kind: VerdictKind) -> u64 {
        self.rows
            .iter()
            .filter(|(v, _)| v.kind() == kind)
            .map(|(_, s)| s.packets)
            .sum()
    }
}

/// L4 protocol of a NAT'd port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum L4Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl L4Proto {
    /// Its IP protocol number (`IPPROTO_TCP`, `IPPROTO_UDP`).
    pub const fn number(self) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
        }
    }

    /// Its name as Kubernetes writes it (`TCP`, `UDP`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
        }
    }
}

/// What `Maps::fill_from` copied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Filled {
    /// Endpoint records (addresses), both families.
    pub endpoints: usize,
    /// Redirect targets (devmap entries).
    pub tx_ports: usize,
    /// NAT'd ports.
    pub nat_ports: usize,
    /// Counter slots claimed, with every row of their values.
    pub slots: usize,
    /// Namespaces of the policy gate.
    pub policy_namespaces: usize,
}

/// A migration [`crate::Datapath::open`] carried out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Migration {
    /// The layout it came from.
    pub from: u32,
    /// What was copied.
    pub filled: Filled,
    /// Links moved to this layout's programs.
    pub links: usize,
    /// From loading this layout to removing the older one.
    pub duration: Duration,
}
