//! The pinned links under `links/`: their names, their kinds, attaching,
//! holding, releasing and collecting them.

use std::{
    fs,
    path::{Path, PathBuf},
};

use std::os::fd::AsFd;

use aya::programs::{
    links::{FdLink, PinnedLink},
    tc::TcAttachOptions,
    LinkOrder, TcAttachType,
};
use tracing::{debug, info, warn};

use super::{error_chain, AttachMode, Attachment, Datapath, HoldHook};
use crate::{sys, Error, Result};

/// What a link pinned under `links/` is: `<ifindex>_<suffix>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LinkKind {
    /// The datapath's program in this mode (XDP, or tc on tcx ingress).
    Datapath(AttachMode),
    /// The hold program on this tc hook.
    Hold(HoldHook),
    /// The program on a device other nodes' pods' packets come in by
    /// (tcx ingress; node.bpf.c).
    Uplink,
}

impl LinkKind {
    const ALL: [LinkKind; 6] = [
        Self::Datapath(AttachMode::Native),
        Self::Datapath(AttachMode::Generic),
        Self::Datapath(AttachMode::Tc),
        Self::Hold(HoldHook::Ingress),
        Self::Hold(HoldHook::Egress),
        Self::Uplink,
    ];

    /// The pin name's suffix. Pin names are an on-disk layout every release
    /// reads (a rollback's agent too), so they are spelled here and never
    /// follow a rename of the user-facing mode words (`AttachMode::as_str`).
    const fn suffix(self) -> &'static str {
        match self {
            Self::Datapath(AttachMode::Native) => "native",
            Self::Datapath(AttachMode::Generic) => "generic",
            Self::Datapath(AttachMode::Tc) => "tc",
            Self::Hold(HoldHook::Ingress) => "hold_ingress",
            Self::Hold(HoldHook::Egress) => "hold_egress",
            Self::Uplink => "uplink",
        }
    }

    fn parse(suffix: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.suffix() == suffix)
    }

    /// The kernel's view of the link pinned at `pin`.
    pub(crate) fn state(self, pin: &Path) -> std::io::Result<sys::LinkState> {
        match self {
            Self::Datapath(m) if m.is_xdp() => sys::pinned_xdp_link(pin),
            Self::Datapath(_) | Self::Hold(_) | Self::Uplink => sys::pinned_tcx_link(pin),
        }
    }

    /// Whether the link pinned at `pin` is attached to `ifindex` still.
    pub(crate) fn is_live(self, pin: &Path, ifindex: u32) -> bool {
        matches!(self.state(pin), Ok(s) if s.ifindex == ifindex)
    }
}

/// Pins an attached program's `link` at `pin` as a bpf_link, so that the
/// attachment outlives this process; `no_fd` is the error's wording when
/// the kernel cannot make it an fd link.
pub(crate) fn pin_link<L>(link: L, pin: &Path, no_fd: &'static str) -> Result<()>
where
    FdLink: TryFrom<L>,
    <FdLink as TryFrom<L>>::Error: std::error::Error,
{
    let fd_link = FdLink::try_from(link).map_err(|e| Error::Link {
        op: no_fd,
        path: pin.to_path_buf(),
        message: error_chain(&e),
    })?;
    fd_link.pin(pin).map_err(|e| Error::Link {
        op: "pinning link",
        path: pin.to_path_buf(),
        message: error_chain(&e),
    })?;
    Ok(())
}

/// The pin of the link of `kind` on `ifindex`: the one home of the name.
pub(crate) fn link_pin(pin_dir: &Path, ifindex: u32, kind: LinkKind) -> PathBuf {
    pin_dir
        .join("links")
        .join(format!("{ifindex}_{}", kind.suffix()))
}

/// Detaches the link pinned at `pin` *now* (BPF_LINK_DETACH), then removes
/// the pin. Unlinking a bpffs pin alone releases the link only when the
/// inode's reference goes, later, from an RCU callback: the program would
/// linger on the device for a moment, and the device's features with it (a
/// veth peer's TSO is forced off while native XDP is on). `Ok(false)` if
/// there was no pin.
pub(crate) fn unpin_link(pin: &Path) -> Result<bool> {
    if !pin.exists() {
        return Ok(false);
    }
    if let Err(e) = sys::detach_pinned_link(pin) {
        warn!(pin = %pin.display(), error = %e, "BPF_LINK_DETACH failed; unpinning only");
    }
    match fs::remove_file(pin) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("unpinning", pin, e)),
    }
}

pub(crate) fn link_pins(pin_dir: &Path) -> Result<Vec<(u32, LinkKind, PathBuf)>> {
    let dir = pin_dir.join("links");
    let mut out = Vec::new();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io("listing", &dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", &dir, e))?;
        let name = entry.file_name();
        let Some((idx, suffix)) = name.to_str().and_then(|n| n.split_once('_')) else {
            continue;
        };
        if let (Ok(idx), Some(kind)) = (idx.parse::<u32>(), LinkKind::parse(suffix)) {
            out.push((idx, kind, entry.path()));
        }
    }
    Ok(out)
}

/// Detaches the datapath links of `ifindex` (XDP and tc); whether there was one.
fn detach_pins(pin_dir: &Path, ifindex: u32) -> Result<bool> {
    unpin_kinds(pin_dir, ifindex, |k| matches!(k, LinkKind::Datapath(_)))
}

/// The name of `ifindex` in the calling thread's network namespace (aya
/// attaches tc programs by name).
pub(crate) fn ifname_of(ifindex: u32) -> Result<String> {
    crate::sys::ifname(ifindex)
        .map_err(|e| Error::io("resolving the name of", format!("ifindex {ifindex}"), e))
}

/// Removes the hold links of `ifindex`; whether there was one.
fn release_pins(pin_dir: &Path, ifindex: u32) -> Result<bool> {
    unpin_kinds(pin_dir, ifindex, |k| matches!(k, LinkKind::Hold(_)))
}

fn unpin_kinds(pin_dir: &Path, ifindex: u32, which: impl Fn(LinkKind) -> bool) -> Result<bool> {
    let mut any = false;
    for kind in LinkKind::ALL.into_iter().filter(|k| which(*k)) {
        any |= unpin_link(&link_pin(pin_dir, ifindex, kind))?;
    }
    Ok(any)
}

/// Whether a hold link of `ifindex` is pinned under `pin_dir` (what the CNI's
/// DEL and the agent read without opening the datapath).
pub fn is_held(pin_dir: &Path, ifindex: u32) -> bool {
    HoldHook::ALL
        .into_iter()
        .any(|h| link_pin(pin_dir, ifindex, LinkKind::Hold(h)).exists())
}

impl Datapath {
    fn link_pin(&self, ifindex: u32, mode: AttachMode) -> PathBuf {
        link_pin(&self.pin_dir, ifindex, LinkKind::Datapath(mode))
    }

    /// Holds the pod of host veth `ifindex` (named `ifname` in the calling
    /// thread's network namespace): the hold program on both tc hooks of
    /// the veth, first in their order, through pinned tcx links. Nothing
    /// but ARP and neighbour discovery reaches or leaves the pod until
    /// [`Datapath::release`]. Idempotent; whether anything was attached.
    pub(crate) fn hold(&mut self, ifindex: u32, ifname: &str) -> Result<bool> {
        let mut changed = false;
        for hook in HoldHook::ALL {
            let kind = LinkKind::Hold(hook);
            let pin = link_pin(&self.pin_dir, ifindex, kind);
            if pin.exists() {
                if kind.is_live(&pin, ifindex) {
                    continue;
                }
                fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
            }
            let id = self
                .hold
                .attach_with_options(
                    ifname,
                    hook.tc_type(),
                    TcAttachOptions::TcxOrder(LinkOrder::first()),
                )
                .map_err(|e| {
                    Error::program(format!("attaching the hold to {ifname} ({hook:?})"), e)
                })?;
            let link = self
                .hold
                .take_link(id)
                .map_err(|e| Error::program("taking link", e))?;
            pin_link(link, &pin, "converting to an fd link (kernel without tcx?)")?;
            changed = true;
        }
        Ok(changed)
    }

    /// Detaches whatever links of host veth `ifindex` are pinned under
    /// `pin_dir` (XDP and hold), without opening any layout's maps: what a
    /// DEL does where this build's layout is not ready.
    pub fn unlink(pin_dir: &Path, ifindex: u32) -> Result<bool> {
        Ok(detach_pins(pin_dir, ifindex)? | release_pins(pin_dir, ifindex)?)
    }

    /// The kernel id of the program that runs on a host veth in `mode`.
    fn program_id_for(&self, mode: AttachMode) -> Result<u32> {
        if mode.is_xdp() {
            self.from_pod_program_id()
        } else {
            self.tc_from_pod_program_id()
        }
    }

    /// Creates the link of `mode` on `ifindex` and pins it at `pin`.
    fn create_link(&mut self, ifindex: u32, mode: AttachMode, pin: &Path) -> Result<()> {
        match mode.xdp_mode() {
            Some(flags) => {
                let id = self
                    .from_pod
                    .attach_to_if_index(ifindex, flags)
                    .map_err(|e| {
                        Error::program(format!("attaching {mode} XDP to ifindex {ifindex}"), e)
                    })?;
                let link = self
                    .from_pod
                    .take_link(id)
                    .map_err(|e| Error::program("taking link", e))?;
                pin_link(
                    link,
                    pin,
                    "converting to an fd link (kernel without bpf_link for XDP?)",
                )
            }
            None => {
                let ifname = ifname_of(ifindex)?;
                // Last in the tcx chain: a hold (first) sees every frame before it.
                let id = self
                    .tc_from_pod
                    .attach_with_options(
                        &ifname,
                        TcAttachType::Ingress,
                        TcAttachOptions::TcxOrder(LinkOrder::last()),
                    )
                    .map_err(|e| {
                        Error::program(format!("attaching the tc datapath to {ifname}"), e)
                    })?;
                let link = self
                    .tc_from_pod
                    .take_link(id)
                    .map_err(|e| Error::program("taking link", e))?;
                pin_link(link, pin, "converting to an fd link (kernel without tcx?)")
            }
        }
    }

    /// Ends the hold of host veth `ifindex`; whether there was one.
    pub(crate) fn release(&mut self, ifindex: u32) -> Result<bool> {
        release_pins(&self.pin_dir, ifindex)
    }

    /// Whether host veth `ifindex` is held (either hook).
    pub fn is_held(&self, ifindex: u32) -> bool {
        is_held(&self.pin_dir, ifindex)
    }

    /// Attaches the datapath to host veth `ifindex` (resolved in the calling
    /// thread's network namespace) in `mode`, through a pinned link.
    ///
    /// Idempotent: a live link in the same mode running the current program is
    /// left alone; one running another program is swapped atomically. A link
    /// of the other XDP mode goes *before* the new one comes (the kernel
    /// allows one XDP mode at a time: between the two, packets take kernel
    /// routing); a link on the other hook (XDP <-> tc) goes only *after* it,
    /// so that one of the two hooks carries every frame throughout (with both
    /// on, XDP sees a frame first and tc what XDP passed).
    pub(crate) fn attach(&mut self, ifindex: u32, mode: AttachMode) -> Result<Attachment> {
        let want = self.program_id_for(mode)?;
        let kind = LinkKind::Datapath(mode);
        if mode.is_xdp() {
            for other in AttachMode::ALL
                .into_iter()
                .filter(|m| m.is_xdp() && *m != mode)
            {
                unpin_link(&self.link_pin(ifindex, other))?;
            }
        }
        let pin = self.link_pin(ifindex, mode);
        let mut changed = true;
        let mut existing = None;
        if pin.exists() {
            match kind.state(&pin) {
                Ok(state) if state.ifindex == ifindex => existing = Some(state),
                Ok(state) => {
                    debug!(?state, pin = %pin.display(), "removing defunct link pin");
                }
                Err(e) => warn!(error = %e, pin = %pin.display(), "unreadable link pin"),
            }
            if existing.is_none() {
                fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
            }
        }
        match existing {
            Some(state) if state.prog_id == want => changed = false,
            Some(_) => self.swap_link(&pin, mode)?,
            None => self.create_link(ifindex, mode, &pin)?,
        }
        // The other hook's link, now that this one carries the frames (also
        // one left by a switch killed between the two steps).
        for other in AttachMode::ALL
            .into_iter()
            .filter(|m| m.is_xdp() != mode.is_xdp())
        {
            changed |= unpin_link(&self.link_pin(ifindex, other))?;
        }
        let state = kind.state(&pin).map_err(|e| Error::Link {
            op: "reading link",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        Ok(Attachment {
            ifindex,
            mode,
            prog_id: state.prog_id,
            link_id: state.link_id,
            changed,
        })
    }

    /// Moves the link pinned at `pin` (of `mode`) to this build's program,
    /// atomically.
    pub(super) fn swap_link(&mut self, pin: &Path, mode: AttachMode) -> Result<()> {
        if !mode.is_xdp() {
            let fd = self
                .tc_from_pod
                .fd()
                .map_err(|e| Error::program("tc program fd", e))?;
            sys::update_pinned_link(pin, fd.as_fd()).map_err(|e| Error::Link {
                op: "swapping the tc program",
                path: pin.to_path_buf(),
                message: e.to_string(),
            })?;
            info!(pin = %pin.display(), "swapped program atomically");
            return Ok(());
        }
        let link = PinnedLink::from_pin(pin).map_err(|e| Error::Link {
            op: "opening link",
            path: pin.to_path_buf(),
            message: error_chain(&e),
        })?;
        let xdp_link =
            aya::programs::xdp::XdpLink::try_from(FdLink::from(link)).map_err(|e| Error::Link {
                op: "opening link",
                path: pin.to_path_buf(),
                message: error_chain(&e),
            })?;
        let id = self
            .from_pod
            .attach_to_link(xdp_link)
            .map_err(|e| Error::program(format!("swapping program of {}", pin.display()), e))?;
        // The pin keeps the link; dropping our fd detaches nothing.
        drop(self.from_pod.take_link(id));
        info!(pin = %pin.display(), "swapped program atomically");
        Ok(())
    }

    pub(super) fn swap_all_links(&mut self) -> Result<()> {
        for (ifindex, kind, pin) in self.link_pins()? {
            if !kind.is_live(&pin, ifindex) {
                continue;
            }
            match kind {
                LinkKind::Datapath(mode) => self.swap_link(&pin, mode)?,
                LinkKind::Uplink => {
                    self.attach_uplink(ifindex)?;
                }
                LinkKind::Hold(_) => {}
            }
        }
        Ok(())
    }

    pub(super) fn refresh_cpumap_programs(&mut self) -> Result<()> {
        for cpu in 0..self.maps.cpu_map.len() {
            if let Some(qsize) = self.maps.cpu_queue_size(cpu)? {
                self.enable_cpu(cpu, qsize)?;
            }
        }
        Ok(())
    }

    /// The attachment of `ifindex`, if a live pinned link exists (an XDP
    /// one first: with both hooks on, mid-switch, XDP sees frames first).
    pub fn attachment(&self, ifindex: u32) -> Result<Option<Attachment>> {
        for mode in AttachMode::ALL {
            let pin = self.link_pin(ifindex, mode);
            if !pin.exists() {
                continue;
            }
            if let Ok(s) = LinkKind::Datapath(mode).state(&pin) {
                if s.ifindex == ifindex {
                    return Ok(Some(Attachment {
                        ifindex,
                        mode,
                        prog_id: s.prog_id,
                        link_id: s.link_id,
                        changed: false,
                    }));
                }
            }
        }
        Ok(None)
    }

    /// Detaches the datapath from `ifindex`; `Ok(false)` if it was not attached.
    pub(crate) fn detach(&mut self, ifindex: u32) -> Result<bool> {
        detach_pins(&self.pin_dir, ifindex)
    }

    fn link_pins(&self) -> Result<Vec<(u32, LinkKind, PathBuf)>> {
        link_pins(&self.pin_dir)
    }

    /// Removes link pins (XDP and hold) whose device is gone (a pinned link
    /// outlives its veth); returns the ifindexes cleaned.
    pub(crate) fn gc_links(&mut self) -> Result<Vec<u32>> {
        let mut removed = Vec::new();
        for (ifindex, kind, pin) in self.link_pins()? {
            if !kind.is_live(&pin, ifindex) {
                match fs::remove_file(&pin) {
                    Ok(()) => removed.push(ifindex),
                    // The veth's DEL unpinned it first.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(Error::io("unpinning", &pin, e)),
                }
            }
        }
        Ok(removed)
    }
}
