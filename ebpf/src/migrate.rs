//! Moving a pinned datapath from an older layout into this build's, without
//! losing a packet, and finishing a move that an earlier agent began.
//!
//! Each layout pins its maps and programs in a directory of its own
//! ([`crate::layout_dir`]); this build migrates from the previous release's,
//! layout [`PREVIOUS_LAYOUT`] (layout 3 adds the endpoint cache to layout 2's
//! maps, which are otherwise the same). The links (`links/`) are shared: a
//! link moves from one layout's program to the next one's atomically
//! (`BPF_LINK_UPDATE`), so a pod is always on one complete datapath or the
//! other. The steps, each a crash point ([`crate::Datapath::open_with`]):
//!
//! 1. `migrate:started`: this layout's maps and programs are loaded beside
//!    the older ones and its meta says *filling* (the CNI plugin does not use
//!    it);
//! 2. `migrate:filled`: every map filled from the older layout (endpoints,
//!    redirect targets, cpumap CPUs with this layout's second stage, NAT'd
//!    ports, counter slots and every value, the policy gate), then the
//!    endpoint cache from the endpoints;
//! 3. `migrate:swapping` (after the first link), `migrate:swapped`: every
//!    live link on this layout's programs (XDP and holds);
//! 4. `migrate:complete`: the meta says *complete* (the CNI plugin uses it);
//! 5. `migrate:removed`: the previous layout's names pinned again as aliases
//!    of this layout's maps and programs ([`pin_aliases`]), and layout 1's
//!    names (which layout 2 kept as aliases of its own) removed; the older
//!    objects go with their last reference.
//!
//! An agent that starts with a previous layout of its own still pinned
//! repeats from 1 unless this layout is complete and no link runs another
//! program (killed between 4 and 5): then only 5 is left. Steps 1-3 can be repeated: the fill
//! writes the older layout's entries over what an abandoned one left, then
//! removes what the older layout lacks (never emptying a map that a link
//! already moved reads), and a link already moved is left alone. Packets counted by the older programs between the fill and their
//! link's move are not carried over (microseconds per link).
//!
//! A rollback (the previous release's agent) runs on the aliases, so when
//! this build comes back there is nothing to migrate: the endpoint cache is
//! rebuilt from the endpoints (the previous release's binaries wrote those
//! alone), then links running other programs are moved back, the aliases
//! pinned again.

use std::{fs, os::fd::AsFd as _, path::Path, time::Instant};

use tracing::info;

use crate::{
    abi::{DatapathMeta, MAX_CPUS, META_COMPLETE, META_FILLING},
    datapath::{
        links::{link_pins, LinkKind},
        maps::{MapName, Maps},
        previous_layout_dir,
        types::Migration,
        PREVIOUS_LAYOUT,
    },
    sys, Datapath, Error, Result,
};

/// What is pinned under a pin directory, read without loading or writing
/// anything: what the CNI plugin checks before it uses the datapath, and
/// what the agent reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pinned {
    /// The meta of this build's layout, if it is pinned.
    pub own: Option<DatapathMeta>,
    /// Whether a previous layout of its own is pinned (maps in its
    /// directory that are not aliases of this layout's).
    pub previous: bool,
    /// Other `layout-<N>` directories: layouts this build does not know.
    pub unknown: Vec<u32>,
}

impl Pinned {
    /// Reads what is pinned under `pin_dir` (nothing, if it does not exist).
    pub fn read(pin_dir: &Path) -> Result<Self> {
        let mut p = Self {
            previous: !separate_previous(pin_dir, &crate::layout_dir(pin_dir)).is_empty(),
            ..Self::default()
        };
        let entries = match fs::read_dir(pin_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(p),
            Err(e) => return Err(Error::io("listing", pin_dir, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("listing", pin_dir, e))?;
            let name = entry.file_name();
            let Some(n) = name
                .to_str()
                .and_then(|n| n.strip_prefix("layout-"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if n != crate::abi::LAYOUT && n != PREVIOUS_LAYOUT {
                p.unknown.push(n);
            }
        }
        p.unknown.sort_unstable();
        let meta = crate::layout_dir(pin_dir).join("meta");
        if meta.exists() {
            let data = aya::maps::MapData::from_pin(&meta)
                .map_err(|e| Error::map(format!("opening {}", meta.display()), e))?;
            let map: aya::maps::Array<_, DatapathMeta> =
                aya::maps::Array::try_from(aya::maps::Map::Array(data))
                    .map_err(|e| Error::map(format!("map {}", meta.display()), e))?;
            p.own = Some(
                map.get(&0, 0)
                    .map_err(|e| Error::map(format!("reading {}", meta.display()), e))?,
            );
        }
        Ok(p)
    }

    /// Whether this build's layout is pinned, complete and the only one an
    /// agent maintains: the CNI plugin may use it. While a previous layout
    /// of its own is pinned too, this layout is being filled, or finished but
    /// for aliasing the previous one, or stale (a previous release's agent
    /// came back and maintains its own layout again): the previous layout's
    /// policy gate is the one in force.
    pub fn ready(&self) -> bool {
        !self.previous && self.own.is_some_and(|m| m.state == META_COMPLETE)
    }

    /// What is there, for a message.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        match self.own {
            Some(m) if m.state == META_COMPLETE => parts.push(format!(
                "layout {} (complete, build {})",
                crate::abi::LAYOUT,
                m.build()
            )),
            Some(_) => parts.push(format!("layout {} (being filled)", crate::abi::LAYOUT)),
            None => {}
        }
        if self.previous {
            parts.push(format!("layout {PREVIOUS_LAYOUT}"));
        }
        for n in &self.unknown {
            parts.push(format!("layout {n} (unknown to this build)"));
        }
        if parts.is_empty() {
            "nothing".into()
        } else {
            parts.join(", ")
        }
    }
}

/// The maps of the previous layout pinned under `pin_dir` (in its own
/// directory) that are other objects than this layout's maps of the same
/// name (pinned in `layout`): a previous layout of its own. Its names that
/// are aliases of this layout's maps ([`pin_aliases`]) are not in it.
pub(crate) fn separate_previous(pin_dir: &Path, layout: &Path) -> Vec<&'static str> {
    let previous = previous_layout_dir(pin_dir);
    MapName::previous()
        .filter(|m| {
            let old = previous.join(m);
            old.exists() && sys::pinned_id(&old).ok() != sys::pinned_id(&layout.join(m)).ok()
        })
        .collect()
}

/// The programs the previous layout pinned in its `progs/`.
const PREVIOUS_PROGRAMS: [&str; 4] = [
    crate::FROM_POD_PROGRAM,
    crate::TC_FROM_POD_PROGRAM,
    crate::CPUMAP_PROGRAM,
    crate::HOLD_PROGRAM,
];

/// The programs layout 1 pinned in `<pin_dir>/progs`.
const LAYOUT1_PROGRAMS: [&str; 3] = [
    crate::FROM_POD_PROGRAM,
    crate::CPUMAP_PROGRAM,
    crate::HOLD_PROGRAM,
];

/// Pins this layout's maps and programs (in `layout`) under the previous
/// layout's names too, replacing whatever is there: its maps have the same
/// definitions as this layout's (less the endpoint cache, which only this
/// layout's programs read), so a previous release's agent or CNI plugin
/// that takes the node back (a rollback) opens *these* maps, filled and in
/// use, and its programs run on them, counters included. An agent of the
/// previous release that finds programs of another tag there pins its own
/// and moves every link to them at start; one that finds the same tag keeps
/// them. Then layout 1's names in the pin directory (layout 2's aliases of
/// its own objects) go: a previous release's binary that found them naming
/// other objects than its layout would take them for a layout 1 of its own,
/// and its agent pins them again. Kept for one version.
pub(crate) fn pin_aliases(pin_dir: &Path, layout: &Path) -> Result<()> {
    let previous = previous_layout_dir(pin_dir);
    let pairs = MapName::previous()
        .map(|m| (layout.join(m), previous.join(m)))
        .chain(
            PREVIOUS_PROGRAMS
                .iter()
                .map(|p| (layout.join("progs").join(p), previous.join("progs").join(p))),
        );
    let progs = previous.join("progs");
    fs::create_dir_all(&progs).map_err(|e| Error::io("creating", &progs, e))?;
    for (own, alias) in pairs {
        let id = sys::pinned_id(&own).map_err(|e| Error::io("reading", &own, e))?;
        if sys::pinned_id(&alias).ok() == Some(id) {
            continue;
        }
        unpin(&alias)?;
        sys::pin_again(&own, &alias).map_err(|e| Error::io("pinning an alias at", &alias, e))?;
    }
    let layout1 = MapName::layout1().map(|m| pin_dir.join(m)).chain(
        LAYOUT1_PROGRAMS
            .iter()
            .map(|p| pin_dir.join("progs").join(p)),
    );
    for old in layout1 {
        unpin(&old)?;
    }
    let progs1 = pin_dir.join("progs");
    match fs::remove_dir(&progs1) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::DirectoryNotEmpty
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(Error::io("removing", &progs1, e)),
    }
}

/// Removes a pin; nothing if there is none.
fn unpin(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("unpinning", path, e)),
    }
}

/// Live links under `pin_dir` whose program is not one of `ours`.
fn foreign_links(pin_dir: &Path, ours: &[u32]) -> Result<Vec<(u32, LinkKind, std::path::PathBuf)>> {
    Ok(link_pins(pin_dir)?
        .into_iter()
        .filter(|(ifindex, kind, pin)| {
            matches!(kind.state(pin), Ok(s) if s.ifindex == *ifindex && !ours.contains(&s.prog_id))
        })
        .collect())
}

/// Moves every live link that runs another program than `ours` to this
/// layout's programs; how many.
fn swap_foreign(dp: &mut Datapath, ours: &[u32], step: &mut dyn FnMut(&str)) -> Result<usize> {
    let mut links = 0;
    for (ifindex, kind, pin) in foreign_links(&dp.pin_dir.clone(), ours)? {
        match kind {
            LinkKind::Datapath(mode) => dp.swap_pinned_link(&pin, mode)?,
            LinkKind::Uplink => {
                dp.attach_uplink(ifindex)?;
            }
            LinkKind::Hold(_) => {
                let fd = dp
                    .hold
                    .fd()
                    .map_err(|e| Error::program("hold program fd", e))?;
                sys::update_pinned_link(&pin, fd.as_fd()).map_err(|e| Error::Link {
                    op: "moving a hold to this layout's program",
                    path: pin.clone(),
                    message: e.to_string(),
                })?;
            }
        }
        links += 1;
        if links == 1 {
            step("migrate:swapping");
        }
    }
    Ok(links)
}

/// With no previous layout of its own: refuses layout 1's maps pinned of
/// their own (a release older than the previous one). Its pods keep
/// forwarding on what is attached.
fn refuse_layout1(pin_dir: &Path, layout: &Path) -> Result<()> {
    let layout1: Vec<&str> = MapName::layout1()
        .filter(|m| {
            let old = pin_dir.join(m);
            old.exists() && sys::pinned_id(&old).ok() != sys::pinned_id(&layout.join(m)).ok()
        })
        .collect();
    if layout1.is_empty() {
        return Ok(());
    }
    Err(Error::Migration {
        from: 1,
        why: format!(
            "{} holds layout 1's maps ({}) and no layout {PREVIOUS_LAYOUT}: this build \
             migrates only from the previous release's layout {PREVIOUS_LAYOUT}; the pods \
             keep forwarding on what is attached: upgrade through the previous release, or \
             uninstall (docs/upgrades.md)",
            pin_dir.display(),
            layout1.join(", ")
        ),
    })
}

/// The previous layout's maps, opened to be copied from.
fn open_previous(pin_dir: &Path) -> Result<Maps> {
    let previous = previous_layout_dir(pin_dir);
    Maps::open_dir(&previous, false).map_err(|e| Error::Migration {
        from: PREVIOUS_LAYOUT,
        why: format!(
            "opening its maps: {e}: the pins in {} are not the previous release's layout \
             {PREVIOUS_LAYOUT}, the only one this build migrates from (an older release's?); the \
             pods keep forwarding on what is attached: upgrade through the previous release, or \
             uninstall (docs/upgrades.md)",
            previous.display()
        ),
    })
}

/// The cpumap CPUs as the previous layout had them.
fn copy_cpus(dp: &mut Datapath, src: &Maps) -> Result<()> {
    for cpu in 0..MAX_CPUS {
        match src.cpu_queue_size(cpu)? {
            Some(q) => dp.enable_cpu(cpu, q)?,
            None => {
                if dp.maps.cpu_queue_size(cpu)?.is_some() {
                    dp.disable_cpu(cpu)?;
                }
            }
        }
    }
    Ok(())
}

/// Brings `dp` (this layout, just loaded) to a complete datapath that every
/// link uses, migrating from a previous layout of its own if one is pinned,
/// and leaves the previous layout's names as aliases of this layout's
/// objects. The endpoint cache is rebuilt from the endpoints before any link
/// moves to this layout's programs, the only ones that read it.
pub(crate) fn converge(dp: &mut Datapath, step: &mut dyn FnMut(&str)) -> Result<Option<Migration>> {
    let pin_dir = dp.pin_dir.clone();
    let layout = crate::layout_dir(&pin_dir);
    let build = dp.build()?;
    let meta = dp.maps.meta()?;
    let complete = DatapathMeta::new(META_COMPLETE, &build);
    let mut ours = vec![
        dp.from_pod_program_id()?,
        dp.tc_from_pod_program_id()?,
        dp.hold_program_id()?,
    ];
    ours.extend(dp.tc_from_node_program_id()?);
    let separate = separate_previous(&pin_dir, &layout);
    if separate.is_empty() {
        refuse_layout1(&pin_dir, &layout)?;
    }
    if separate.is_empty()
        || (meta.state == META_COMPLETE && foreign_links(&pin_dir, &ours)?.is_empty())
    {
        // Nothing to migrate: a fresh node, this layout in use (a previous
        // release's agent may have run on the aliases and moved links to
        // its programs: they run on these maps, and come back), or a
        // migration killed after completing, before its aliases.
        dp.maps.refresh_cache()?;
        swap_foreign(dp, &ours, &mut |_| {})?;
        pin_aliases(&pin_dir, &layout)?;
        if meta != complete {
            dp.maps.set_meta(complete)?;
        }
        return Ok(None);
    }
    let t0 = Instant::now();
    info!(from = PREVIOUS_LAYOUT, to = crate::abi::LAYOUT, maps = ?separate, "migrating the pinned datapath");
    dp.maps.set_meta(DatapathMeta::new(META_FILLING, &build))?;
    step("migrate:started");

    let src = open_previous(&pin_dir)?;
    let filled = dp.maps.fill_from(&src, &separate)?;
    copy_cpus(dp, &src)?;
    dp.maps.refresh_cache()?;
    step("migrate:filled");
    let links = swap_foreign(dp, &ours, step)?;
    step("migrate:swapped");
    dp.maps.set_meta(complete)?;
    step("migrate:complete");
    drop(src);
    // The previous layout's pins become aliases: its own objects go with
    // their last reference.
    pin_aliases(&pin_dir, &layout)?;
    step("migrate:removed");
    let m = Migration {
        from: PREVIOUS_LAYOUT,
        filled,
        links,
        duration: t0.elapsed(),
    };
    info!(?m, "migrated the pinned datapath");
    Ok(Some(m))
}
