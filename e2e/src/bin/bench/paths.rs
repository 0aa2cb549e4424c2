//! The paths compared and the node each gets: two pods made by real CNI
//! calls (ptp, xdpcni in each mode, Cilium's technique on xdpcni pods, a
//! direct veth), torn down on Drop.

#[allow(clippy::wildcard_imports)]
use super::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Ptp,
    /// No CNI and no forwarding: the two pods share one veth pair. The floor
    /// any path through a node can approach, not a path a CNI could offer.
    Direct,
    Xdpcni {
        mode: &'static str,
        redirect: &'static str,
        headroom: u16,
        /// `cpus` of the CNI config (cpumap CPUs), None: the default.
        cpus: Option<&'static str>,
        /// Leave mode and redirect out of the config: the CNI's defaults,
        /// checked against `mode`/`redirect` from the attachment record.
        defaults: bool,
        /// Cilium's same-node technique on the pods (mode `off`): a tc
        /// ingress program on each host veth redirecting to the peer.
        peer: bool,
    },
}

#[derive(Clone, Copy, Debug)]
pub struct PathSpec {
    pub label: &'static str,
    pub kind: Kind,
}

pub const fn xdp(label: &'static str, mode: &'static str, redirect: &'static str) -> PathSpec {
    PathSpec {
        label,
        kind: Kind::Xdpcni {
            mode,
            redirect,
            headroom: 256,
            cpus: None,
            defaults: false,
            peer: false,
        },
    }
}

/// The node default (what a pod without annotations gets): the agent's own
/// default mode, which `Bench::new` checks from what the agent attached.
pub const DEFAULT_PATH: &str = TC_PATH;

/// The pinned-sender workload's cpumap paths: the destination's cpumap CPU
/// is CPU 1, the sender is pinned to CPU 0.
pub const PINNED_CPUMAP: &[PathSpec] = &[
    PathSpec {
        label: "native cpumap, cpus 1",
        kind: Kind::Xdpcni {
            mode: "native",
            redirect: "cpumap",
            headroom: 256,
            cpus: Some("1"),
            defaults: false,
            peer: false,
        },
    },
    PathSpec {
        label: "generic cpumap, cpus 1",
        kind: Kind::Xdpcni {
            mode: "generic",
            redirect: "cpumap",
            headroom: 256,
            cpus: Some("1"),
            defaults: false,
            peer: false,
        },
    },
];

pub const PATHS: &[PathSpec] = &[
    PathSpec {
        label: "ptp (baseline)",
        kind: Kind::Ptp,
    },
    xdp("xdpcni off", "off", "devmap"),
    xdp("native devmap", "native", "devmap"),
    xdp("native cpumap", "native", "cpumap"),
    xdp("generic devmap", "generic", "devmap"),
    xdp("generic cpumap", "generic", "cpumap"),
    PathSpec {
        label: DEFAULT_PATH,
        kind: Kind::Xdpcni {
            mode: "tc",
            redirect: "devmap",
            headroom: 256,
            cpus: None,
            defaults: true,
            peer: false,
        },
    },
    PathSpec {
        label: PEER_PATH,
        kind: Kind::Xdpcni {
            mode: "off",
            redirect: "devmap",
            headroom: 256,
            cpus: None,
            defaults: false,
            peer: true,
        },
    },
];

/// xdpcni's tc mode: the datapath's decisions on tcx ingress, delivered
/// with bpf_redirect_peer.
pub const TC_PATH: &str = "xdpcni tc";

/// Cilium's same-node technique as a reference path: tc ingress and
/// `bpf_redirect_peer` on the host veths of CNI-made pods in mode `off`
/// (bench.bpf.c's `tc_redirect_peer`).
pub const PEER_PATH: &str = "tc redirect_peer (Cilium's same-node technique)";

/// A node of two pods made through real CNI calls (and, for xdpcni, the
/// real agent that attaches their fast path), torn down on Drop.
pub struct Bench {
    pub spec: PathSpec,
    pub net: Network,
    pub _pins: PinDir,
    pub pods: Vec<Netns>,
    pub ips: Vec<IpAddr>,
    pub hosts: Vec<String>,
    pub conf_patch: Value,
    pub agent: Option<StandaloneAgent>,
    /// The tc program of the peer path, attached while it lives.
    pub peer: Option<PeerRedirect>,
}

pub const DIRECT: PathSpec = PathSpec {
    label: "direct veth (no forwarding)",
    kind: Kind::Direct,
};

pub fn cni_conf(spec: PathSpec, net: &mut Network) -> Value {
    match spec.kind {
        Kind::Direct => json!({}),
        Kind::Ptp => {
            net.plugin = Path::new(REFERENCE_PLUGINS).join("ptp");
            net.conf.plugin_type = "ptp".into();
            json!({})
        }
        Kind::Xdpcni { headroom, .. } => json!({ "headroom": headroom }),
    }
}

/// The agent's node defaults for an xdpcni path (none: its own defaults).
pub fn agent_conf(spec: PathSpec) -> impl FnOnce(&mut AgentConfig) {
    move |c| {
        if let Kind::Xdpcni {
            mode,
            redirect,
            cpus,
            defaults,
            ..
        } = spec.kind
        {
            if !defaults {
                c.xdp_mode = mode.into();
                c.redirect = redirect.into();
            }
            if let Some(cpus) = cpus {
                c.cpus = cpus.into();
            }
        }
    }
}

impl Bench {
    pub fn new(spec: PathSpec) -> Result<Self> {
        let pins = PinDir::new("xb")?;
        let mut net = Network::new(pins.path(), "1.0.0", json!([[{"subnet": "10.78.0.0/24"}]]))?;
        let conf_patch = cni_conf(spec, &mut net);
        // The agent loads the datapath and attaches the pods' fast path.
        let agent = match spec.kind {
            Kind::Xdpcni { .. } => {
                Some(StandaloneAgent::start(&net, pins.path(), agent_conf(spec))?)
            }
            Kind::Direct | Kind::Ptp => None,
        };
        let mut b = Self {
            spec,
            net,
            _pins: pins,
            pods: Vec::new(),
            ips: Vec::new(),
            hosts: Vec::new(),
            conf_patch,
            agent,
            peer: None,
        };
        if spec.kind == Kind::Direct {
            b.direct()?;
            return Ok(b);
        }
        for i in 0..2 {
            let pod = Netns::new("xp")?;
            let id = format!("bench{i}");
            let out = b
                .net
                .call(&Call::new("ADD", &id, Some(&pod.path())), &b.conf_patch)?;
            ensure!(out.status == 0, "{} ADD: {}", spec.label, out.json);
            let ip: IpAddr = out.json["ips"][0]["address"]
                .as_str()
                .and_then(|a| a.split('/').next())
                .context("no ip")?
                .parse()?;
            b.hosts.push(
                out.json["interfaces"][0]["name"]
                    .as_str()
                    .unwrap_or("")
                    .into(),
            );
            b.ips.push(ip);
            b.pods.push(pod);
        }
        if let Kind::Xdpcni {
            mode,
            redirect,
            peer,
            ..
        } = spec.kind
        {
            // Both pods in the path's mode, as the agent attached them (for
            // the default path: what the agent does by default).
            let want = match mode {
                "native" => "xdp",
                "generic" => "xdpgeneric",
                "tc" => "tc",
                _ => "none",
            };
            for h in &b.hosts {
                wait_mode(&b.net.node, h, want, Duration::from_secs(5)).with_context(|| {
                    format!(
                        "{}: the agent's mode is not {mode} (update DEFAULT_PATH if its default changed): {}",
                        spec.label,
                        b.agent.as_ref().map(StandaloneAgent::log).unwrap_or_default()
                    )
                })?;
            }
            let maps = Maps::open_pinned(b._pins.path())?;
            let start = Instant::now();
            loop {
                let ep = maps.endpoint(b.ips[1])?;
                if ep.is_some_and(|e| {
                    e.redirect == RedirectPolicy::parse(redirect).map_or(0, |r| r.as_raw())
                }) {
                    break;
                }
                ensure!(
                    start.elapsed() < Duration::from_secs(5),
                    "{}: the agent did not register {} for {redirect}",
                    spec.label,
                    b.ips[1]
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            // Attached and pinned: the agent has nothing left to do here
            // and its passes would share the CPUs measured (and put back
            // what the ceiling swaps out).
            if let Some(agent) = b.agent.take() {
                agent.stop(libc::SIGTERM)?;
            }
            if peer {
                b.peer = Some(PeerRedirect::attach(&b)?);
            }
        }
        Ok(b)
    }
}

impl Bench {
    /// Two pods joined by one veth pair (eth0 on both sides), 10.79.0.1/.2.
    pub fn direct(&mut self) -> Result<()> {
        let (a, b) = (Netns::new("xp")?, Netns::new("xp")?);
        a.add_veth("eth0", "eth0", Some(&b))?;
        for (ns, ip) in [(&a, "10.79.0.1"), (&b, "10.79.0.2")] {
            ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
            ns.ip(&["link", "set", "lo", "up"])?;
            self.ips.push(ip.parse()?);
        }
        self.pods = vec![a, b];
        Ok(())
    }

    /// An attachment record of this node's CNI (both pods share a policy).
    pub fn record(&self) -> Result<Value> {
        let rec = std::fs::read_dir(self.net.dir.path().join("state"))?
            .flatten()
            .find(|e| e.path().extension().is_some_and(|x| x == "json"))
            .context("no attachment record")?;
        Ok(serde_json::from_slice(&std::fs::read(rec.path())?)?)
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        if self.spec.kind == Kind::Direct {
            return; // the pods' Drop deletes the namespaces and the veth
        }
        for (i, pod) in self.pods.iter().enumerate() {
            let id = format!("bench{i}");
            let _ = self
                .net
                .call(&Call::new("DEL", &id, Some(&pod.path())), &self.conf_patch);
        }
    }
}
