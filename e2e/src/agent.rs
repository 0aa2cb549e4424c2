//! The real `xdpcni-agent` in standalone mode for tests that need the fast
//! path: since the agent alone attaches it, a pod made by the CNI stays on
//! kernel routing until an agent runs. Started inside a test network's node
//! namespace over its pins and records; killed by PID on Drop.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use serde_json::Value;

use crate::{
    cni::{agent_binary, wait_ready, Network, NodeProcess},
    netns::Netns,
};

/// The agent's configuration file, typed ([`xdpcni_agent::config::Config`]):
/// the tests set its fields, never a JSON of their own.
pub type AgentConfig = xdpcni_agent::config::Config;

/// Where the agent listens in its node namespace (each test network has
/// its own loopback): the agent's default.
pub const LISTEN: &str = xdpcni_agent::config::DEFAULT_LISTEN;

/// A standalone agent over a test network.
#[derive(Debug)]
pub struct StandaloneAgent {
    process: Option<NodeProcess>,
    /// Its config file.
    pub config: PathBuf,
    /// Its pods file (annotations by `namespace/name`, or container ID).
    pub pods_file: PathBuf,
    /// Its log.
    pub log: PathBuf,
}

impl StandaloneAgent {
    /// Starts an agent over `net` (its records) and `pins`, its config
    /// changed by `config` (unchanged: the agent's own defaults), and waits
    /// until it is ready.
    pub fn start(
        net: &Network,
        pins: &Path,
        config: impl FnOnce(&mut AgentConfig),
    ) -> Result<Self> {
        Self::start_binary(&agent_binary()?, net, pins, config)
    }

    /// [`StandaloneAgent::start`] with the agent binary `bin` (another
    /// release's).
    pub fn start_binary(
        bin: &Path,
        net: &Network,
        pins: &Path,
        config: impl FnOnce(&mut AgentConfig),
    ) -> Result<Self> {
        let pods_file = net.dir.path().join("pods.json");
        if !pods_file.exists() {
            std::fs::write(&pods_file, "{}")?;
        }
        let mut cfg = AgentConfig::new(pins.to_path_buf(), net.dir.path().join("state"));
        cfg.pods_file = Some(pods_file.clone());
        cfg.listen = LISTEN.into();
        cfg.interval_ms = 200;
        config(&mut cfg);
        let path = net.dir.path().join("agent.json");
        std::fs::write(&path, serde_json::to_string(&cfg)?)?;
        let log = net.dir.path().join(crate::unique_name("xagent-") + ".log");
        let process = NodeProcess::spawn(
            &net.node,
            bin,
            &["standalone", "--config", &path.to_string_lossy()],
            &log,
        )?;
        let agent = Self {
            process: Some(process),
            config: path,
            pods_file,
            log,
        };
        wait_ready(&net.node, &cfg.listen, Duration::from_secs(15), || {
            agent.log()
        })?;
        Ok(agent)
    }

    /// Writes the pods file (`{"ns/name" or "container-id": {annotations}}`).
    pub fn set_pods(&self, pods: &Value) -> Result<()> {
        Ok(std::fs::write(&self.pods_file, pods.to_string())?)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its PID (0 once it is stopped).
    pub fn pid(&self) -> u32 {
        self.process.as_ref().map_or(0, NodeProcess::pid)
    }

    /// Stops it with `signal`; its exit code.
    pub fn stop(mut self, signal: i32) -> Result<Option<i32>> {
        match self.process.take() {
            Some(p) => p.stop(signal),
            None => Ok(None),
        }
    }
}

/// How [`mode_of`] shows `mode` attached: `xdp`, `xdpgeneric`, `tc` or `none`.
pub fn shown(mode: xdpcni_host::pod::XdpMode) -> &'static str {
    match mode {
        xdpcni_host::pod::XdpMode::Native => "xdp",
        xdpcni_host::pod::XdpMode::Generic => "xdpgeneric",
        xdpcni_host::pod::XdpMode::Tc => "tc",
        xdpcni_host::pod::XdpMode::Off => "none",
    }
}

/// How [`mode_of`] shows a pod in the agent's default mode.
pub fn default_shown() -> &'static str {
    shown(xdpcni_host::pod::DEFAULT_MODE)
}

/// Waits (3 s at most) until `host` in `node` runs the agent's default mode.
pub fn wait_default_mode(node: &Netns, host: &str) -> Result<Duration> {
    wait_mode(node, host, default_shown(), Duration::from_secs(3))
}

/// The datapath mode on `host` in `node` as the kernel reports it: `xdp`
/// or `xdpgeneric` (netlink), else `tc` when the datapath's tc program is on
/// its tcx ingress (BPF_PROG_QUERY), else `none`.
pub fn mode_of(node: &Netns, host: &str) -> Result<String> {
    if let Some((m, _)) = node.xdp_attached(host)? {
        return Ok(m);
    }
    // The kernel keeps 15 bytes of a program's name.
    let tc = &xdpcni_ebpf::TC_FROM_POD_PROGRAM[..15];
    Ok(if node.tcx_ingress(host)?.iter().any(|(n, _)| n == tc) {
        "tc".into()
    } else {
        "none".into()
    })
}

/// Waits until `host` in `node` shows `want` (see [`mode_of`]); how long it
/// took.
pub fn wait_mode(node: &Netns, host: &str, want: &str, within: Duration) -> Result<Duration> {
    let start = Instant::now();
    loop {
        let now = mode_of(node, host)?;
        if now == want {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            bail!("{host}: {now} after {within:?}, wanted {want}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
