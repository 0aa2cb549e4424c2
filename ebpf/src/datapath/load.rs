//! Loading the datapath or taking over the pinned one, its atomic upgrade,
//! its cpumap CPUs and its removal.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use aya::{
    programs::{SchedClassifier, Xdp},
    Ebpf, EbpfLoader,
};
use tracing::{debug, info};

use super::{
    error_chain, layout_dir,
    links::{link_pins, unpin_link},
    maps::MapName,
    policy::PolicyMaps,
    Datapath, Maps, CPUMAP_PROGRAM, FROM_POD_PROGRAM, HOLD_PROGRAM, TC_FROM_POD_PROGRAM,
};
use crate::{Error, Result, DATAPATH_OBJECT};

/// The Service maps the datapath's programs share with the socket programs
/// (`lib/svc_maps.h`): pinned in the Service layout's directory, never in
/// the datapath's, so neither layout's change moves the other's maps.
pub const SHARED_SVC_MAPS: [&str; 9] = [
    "services",
    "svc_slots",
    "svc_backends",
    "svc_lease",
    "svc_nat",
    "svc_nat_stats",
    "svc_uplinks",
    "svc_client_affinity",
    "svc_source_ranges",
];

/// A loader for a datapath object under `pin_dir`: its maps pinned in (or
/// reused from) the layout's directory, the Service maps it shares in the
/// Service layout's (opened where the socket programs' loader pinned
/// them, or created there first).
pub fn datapath_loader(pin_dir: &Path) -> EbpfLoader<'static> {
    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(layout_dir(pin_dir));
    let svc = crate::svc::svc_layout_dir(pin_dir);
    for name in SHARED_SVC_MAPS {
        loader.map_pin_path(name, svc.join(name));
    }
    loader
}

impl Datapath {
    /// Loads the datapath into `pin_dir`, or takes over the one pinned there.
    ///
    /// Maps are reused from their pins. A pinned program whose tag equals the
    /// embedded one is reused as is, so nothing attached changes; a different
    /// one is replaced and every pinned link is swapped to the new program
    /// atomically (`bpf_link_update`), without a detach.
    pub fn open(pin_dir: &Path) -> Result<Self> {
        Self::open_object(pin_dir, DATAPATH_OBJECT)
    }

    /// [`Datapath::open`] with another build of the datapath object of this
    /// layout (an upgrade, or a rollback).
    pub fn open_object(pin_dir: &Path, object: &[u8]) -> Result<Self> {
        Self::open_with(pin_dir, object, &mut |_| {})
    }

    /// [`Datapath::open_object`], calling `step` with the name of each step
    /// of a migration from an older layout as it is reached
    /// (`migrate:started`, `migrate:filled`, `migrate:swapping`,
    /// `migrate:swapped`, `migrate:complete`, `migrate:removed`): the
    /// agent's crash points.
    pub fn open_with(pin_dir: &Path, object: &[u8], step: &mut dyn FnMut(&str)) -> Result<Self> {
        crate::bpffs::ensure_bpffs(pin_dir)?;
        let layout = layout_dir(pin_dir);
        for dir in [
            pin_dir.to_path_buf(),
            pin_dir.join("links"),
            // The previous layout's names (aliases: migrate.rs).
            super::previous_layout_dir(pin_dir),
            super::previous_layout_dir(pin_dir).join("progs"),
            layout.clone(),
            layout.join("progs"),
            crate::svc::svc_layout_dir(pin_dir),
        ] {
            fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
            // Root's alone, whatever the umask: whoever can add a pin here
            // or open a map can steer every pod's traffic. (The kernel makes
            // the pins themselves 0600.)
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                .map_err(|e| Error::io("restricting", &dir, e))?;
        }
        crate::bpffs::ensure_bpffs(pin_dir)?;
        // The conntrack kfuncs bound to this kernel's ids (kfunc.rs).
        let btf = aya::Btf::from_sys_fs().ok();
        let bound = super::kfunc::bind(object, btf.as_ref())?;
        let ct_kfuncs = u32::from(bound.ct_kfuncs());
        let mut ebpf = datapath_loader(pin_dir)
            .override_global(super::kfunc::CT_KFUNCS_GLOBAL, &ct_kfuncs, true)
            .load(bound.bytes())
            .map_err(|e| Error::Load(Box::new(e)))?;
        let maps = Maps::take(&mut ebpf, &layout)?;
        let policy = PolicyMaps::take(&mut ebpf)?;
        let remote = super::RemoteMaps::take(&mut ebpf)?;
        let (from_pod, a) = Self::adopt_program(&mut ebpf, &layout, FROM_POD_PROGRAM)?;
        let (cpumap, b) = Self::adopt_program(&mut ebpf, &layout, CPUMAP_PROGRAM)?;
        let (tc_from_pod, c) = Self::adopt_classifier(&mut ebpf, &layout, TC_FROM_POD_PROGRAM)?;
        let (tc_from_node, d) =
            Self::adopt_classifier(&mut ebpf, &layout, super::TC_FROM_NODE_PROGRAM)?;
        // A held pod's links keep the program they were made with within a
        // layout: it drops alike in every build, and the agent removes them
        // once it has classified the pod (a migration moves them).
        let (hold, _) = Self::adopt_classifier(&mut ebpf, &layout, HOLD_PROGRAM)?;
        let mut dp = Self {
            pin_dir: pin_dir.to_path_buf(),
            from_pod,
            tc_from_pod,
            tc_from_node: Some(tc_from_node),
            cpumap,
            hold,
            maps,
            policy: Some(policy),
            remote: Some(remote),
            upgraded: a || b || c || d,
            migration: None,
        };
        // An older layout first: its links move to this build's programs.
        // (converge rebuilds the endpoint cache before it moves any link.)
        dp.migration = crate::migrate::converge(&mut dp, step)?;
        if dp.upgraded {
            dp.swap_all_links()?;
            dp.refresh_cpumap_programs()?;
        }
        Ok(dp)
    }

    /// Opens the datapath pinned in `pin_dir` without loading anything: the
    /// pinned maps and programs of this build's layout as they are (what the
    /// CNI plugin uses; it never replaces programs). Fails if they are not
    /// pinned there or not complete ([`crate::Pinned::ready`]).
    pub fn open_existing(pin_dir: &Path) -> Result<Self> {
        let maps = Maps::open_pinned(pin_dir)?;
        let meta = maps.meta()?;
        if meta.state != crate::abi::META_COMPLETE {
            return Err(Error::NotReady(format!(
                "{} is being filled (from an older layout, or by an agent starting)",
                layout_dir(pin_dir).display()
            )));
        }
        let layout = layout_dir(pin_dir);
        let prog = |name: &'static str, attach_type| {
            let pin = layout.join("progs").join(name);
            Xdp::from_pin(&pin, attach_type)
                .map_err(|e| Error::program(format!("opening {}", pin.display()), e))
        };
        let classifier = |name: &'static str| {
            let pin = layout.join("progs").join(name);
            SchedClassifier::from_pin(&pin)
                .map_err(|e| Error::program(format!("opening {}", pin.display()), e))
        };
        Ok(Self {
            pin_dir: pin_dir.to_path_buf(),
            from_pod: prog(
                FROM_POD_PROGRAM,
                aya_obj::programs::XdpAttachType::Interface,
            )?,
            tc_from_pod: classifier(TC_FROM_POD_PROGRAM)?,
            tc_from_node: None,
            cpumap: prog(CPUMAP_PROGRAM, aya_obj::programs::XdpAttachType::CpuMap)?,
            hold: classifier(HOLD_PROGRAM)?,
            maps,
            policy: None,
            remote: None,
            upgraded: false,
            migration: None,
        })
    }

    /// Loads the tc program `name` and returns the one to use: the pinned
    /// one (in the layout directory `layout`) if it has the same tag, else
    /// the new one (now pinned), and whether it replaced a pinned one.
    fn adopt_classifier(
        ebpf: &mut Ebpf,
        layout: &Path,
        name: &'static str,
    ) -> Result<(SchedClassifier, bool)> {
        let pin = layout.join("progs").join(name);
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or(Error::Missing {
                kind: "program",
                name,
            })?
            .try_into()
            .map_err(|e| Error::program(format!("program {name}"), e))?;
        prog.load()
            .map_err(|e| Error::program(format!("loading {name}"), e))?;
        let tag = |p: &SchedClassifier| {
            p.info()
                .map(|i| i.tag())
                .map_err(|e| Error::program(format!("info of {name}"), e))
        };
        let new_tag = tag(prog)?;
        let from_pin = || {
            SchedClassifier::from_pin(&pin)
                .map_err(|e| Error::program(format!("opening {}", pin.display()), e))
        };
        let mut replaced = false;
        if pin.exists() {
            let pinned = from_pin()?;
            if tag(&pinned)? == new_tag {
                return Ok((pinned, false));
            }
            fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
            replaced = true;
        }
        prog.pin(&pin).map_err(|e| Error::Link {
            op: "pinning program",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        Ok((from_pin()?, replaced))
    }

    /// Loads `name` from the object and returns the program to use: the
    /// pinned one (in the layout directory `layout`) if it has the same tag,
    /// else the new one (now pinned).
    fn adopt_program(ebpf: &mut Ebpf, layout: &Path, name: &'static str) -> Result<(Xdp, bool)> {
        let pin = layout.join("progs").join(name);
        let prog: &mut Xdp = ebpf
            .program_mut(name)
            .ok_or(Error::Missing {
                kind: "program",
                name,
            })?
            .try_into()
            .map_err(|e| Error::program(format!("program {name}"), e))?;
        let attach_type = if name == CPUMAP_PROGRAM {
            aya_obj::programs::XdpAttachType::CpuMap
        } else {
            aya_obj::programs::XdpAttachType::Interface
        };
        prog.load()
            .map_err(|e| Error::program(format!("loading {name}"), e))?;
        let new_tag = prog
            .info()
            .map_err(|e| Error::program(format!("info of {name}"), e))?
            .tag();
        let mut replaced = false;
        if pin.exists() {
            let pinned = Xdp::from_pin(&pin, attach_type)
                .map_err(|e| Error::program(format!("opening {}", pin.display()), e))?;
            let old_tag = pinned
                .info()
                .map_err(|e| Error::program(format!("info of {}", pin.display()), e))?
                .tag();
            if old_tag == new_tag {
                debug!(program = name, "reusing pinned program");
                return Ok((pinned, false));
            }
            info!(program = name, old_tag, new_tag, "replacing pinned program");
            fs::remove_file(&pin).map_err(|e| Error::io("unpinning", &pin, e))?;
            replaced = true;
        }
        prog.pin(&pin).map_err(|e| Error::Link {
            op: "pinning program",
            path: pin.clone(),
            message: error_chain(&e),
        })?;
        let pinned = Xdp::from_pin(&pin, attach_type)
            .map_err(|e| Error::program(format!("opening {}", pin.display()), e))?;
        Ok((pinned, replaced))
    }

    /// The pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Whether [`Datapath::open`] replaced pinned programs with new code.
    pub fn upgraded(&self) -> bool {
        self.upgraded
    }

    /// The migration from an older layout [`Datapath::open`] carried out,
    /// if it found one.
    pub fn migration(&self) -> Option<&super::Migration> {
        self.migration.as_ref()
    }

    /// This build of the programs: `<crate version>+<tag of the program on
    /// host veths>`, as written in the datapath's meta.
    pub fn build(&self) -> Result<String> {
        let tag = self
            .from_pod
            .info()
            .map_err(|e| Error::program("program info", e))?
            .tag();
        Ok(format!("{}+{tag:016x}", env!("CARGO_PKG_VERSION")))
    }

    /// Each program's name and kernel id.
    pub fn program_ids(&self) -> Result<Vec<(&'static str, u32)>> {
        let id =
            |info: std::result::Result<aya::programs::ProgramInfo, aya::programs::ProgramError>| {
                info.map(|i| i.id())
                    .map_err(|e| Error::program("program info", e))
            };
        let mut ids = vec![
            (FROM_POD_PROGRAM, id(self.from_pod.info())?),
            (TC_FROM_POD_PROGRAM, id(self.tc_from_pod.info())?),
            (CPUMAP_PROGRAM, id(self.cpumap.info())?),
            (HOLD_PROGRAM, id(self.hold.info())?),
        ];
        if let Some(p) = &self.tc_from_node {
            ids.push((super::TC_FROM_NODE_PROGRAM, id(p.info())?));
        }
        Ok(ids)
    }

    /// Kernel id of the hold program.
    pub(crate) fn hold_program_id(&self) -> Result<u32> {
        Ok(self
            .hold
            .info()
            .map_err(|e| Error::program("program info", e))?
            .id())
    }

    pub(crate) fn swap_pinned_link(&mut self, pin: &Path, mode: super::AttachMode) -> Result<()> {
        self.swap_link(pin, mode)
    }

    /// The maps.
    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// The program that runs on pod host veths, e.g. for `test_run`.
    pub fn from_pod_program(&self) -> &Xdp {
        &self.from_pod
    }

    /// Kernel id of the program that runs on host veths.
    pub fn from_pod_program_id(&self) -> Result<u32> {
        Ok(self
            .from_pod
            .info()
            .map_err(|e| Error::program("program info", e))?
            .id())
    }

    /// Kernel id of the datapath's tc program (mode tc).
    pub fn tc_from_pod_program_id(&self) -> Result<u32> {
        Ok(self
            .tc_from_pod
            .info()
            .map_err(|e| Error::program("program info", e))?
            .id())
    }

    /// Kernel id of the uplink program, if loaded.
    pub fn tc_from_node_program_id(&self) -> Result<Option<u32>> {
        self.tc_from_node
            .as_ref()
            .map(|p| {
                p.info()
                    .map(|i| i.id())
                    .map_err(|e| Error::program("program info", e))
            })
            .transpose()
    }

    /// The uplink program, e.g. for `test_run` (`None` where only the
    /// pins were opened).
    pub fn tc_from_node_program(&self) -> Option<&SchedClassifier> {
        self.tc_from_node.as_ref()
    }

    /// The datapath's tc program, e.g. for `test_run`.
    pub fn tc_from_pod_program(&self) -> &SchedClassifier {
        &self.tc_from_pod
    }
}

impl Datapath {
    /// Enables cpumap delivery on `cpu` with a queue of `queue_size` frames,
    /// running the second-stage program there.
    pub(crate) fn enable_cpu(&mut self, cpu: u32, queue_size: u32) -> Result<()> {
        if cpu >= self.maps.cpu_map.len() {
            return Err(Error::Invalid {
                what: "cpu",
                why: format!("{cpu} is beyond the cpumap ({})", self.maps.cpu_map.len()),
            });
        }
        // An entry that already says this is left alone: replacing it tears
        // down the CPU's queue under the frames in flight (a migration
        // repeated after a crash runs this on entries links already use).
        let prog = self
            .cpumap
            .info()
            .map_err(|e| Error::program("cpumap program info", e))?
            .id();
        if let Ok(have) = self.maps.cpu_map.get(cpu, 0) {
            if have.queue_size == queue_size && have.prog_id.map(|p| p.get()) == Some(prog) {
                return Ok(());
            }
        }
        let fd = self
            .cpumap
            .fd()
            .map_err(|e| Error::program("cpumap program fd", e))?;
        self.maps
            .cpu_map
            .set(cpu, queue_size, Some(fd), 0)
            .map_err(|e| Error::XdpMap {
                op: format!("enabling cpumap CPU {cpu}"),
                source: Box::new(e),
            })
    }

    /// Disables cpumap delivery on `cpu`.
    pub(crate) fn disable_cpu(&mut self, cpu: u32) -> Result<()> {
        // The kernel frees a cpumap entry written with queue size 0
        // (cpu_map_update_elem); aya 0.14 has no CpuMap::remove.
        self.maps
            .cpu_map
            .set(cpu, 0, None, 0)
            .map_err(|e| Error::XdpMap {
                op: format!("disabling cpumap CPU {cpu}"),
                source: Box::new(e),
            })
    }

    /// The pins of a complete datapath missing under `pin_dir` (maps,
    /// programs, the links directory): empty when nothing is.
    pub fn missing_pins(pin_dir: &Path) -> Vec<PathBuf> {
        let layout = layout_dir(pin_dir);
        MapName::ALL
            .iter()
            .map(|m| layout.join(m.as_str()))
            .chain(
                [
                    FROM_POD_PROGRAM,
                    TC_FROM_POD_PROGRAM,
                    CPUMAP_PROGRAM,
                    HOLD_PROGRAM,
                ]
                .iter()
                .map(|p| layout.join("progs").join(p)),
            )
            .chain([pin_dir.join("links")])
            .filter(|p| !p.exists())
            .collect()
    }

    /// Removes every pin under `pin_dir`, detaching the datapath (and every
    /// hold) from every veth and the Service programs from their cgroup, and
    /// freeing the maps once no process holds them.
    pub fn uninstall(pin_dir: &Path) -> Result<()> {
        if !pin_dir.exists() {
            return Ok(());
        }
        for (_, _, pin) in link_pins(pin_dir)? {
            unpin_link(&pin)?;
        }
        crate::svc::Services::detach_pinned(pin_dir)?;
        fs::remove_dir_all(pin_dir).map_err(|e| Error::io("removing", pin_dir, e))
    }
}
