//! Standalone mode: no Kubernetes. The agent loads (or takes over) the
//! datapath, reads the CNI plugin's attachment records for the pods of the
//! node, takes each pod's annotations from a local JSON file, applies them,
//! and serves /metrics, /healthz and /readyz. Used by the demo and by
//! runtimes without Kubernetes.

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::TcpListener,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use serde::Deserialize;
use tracing::{info, warn};
use xdpcni_ebpf::{abi::RedirectPolicy, Datapath};
use xdpcni_node::{
    pod::{online_cpus, parse_cpu_list, XdpMode},
    state,
};

use crate::{
    metrics::render,
    node::{Annotations, Pass, PodInput, Reconciler},
    policy::Policy,
};

fn default_interval() -> u64 {
    500
}

/// The agent's configuration file (JSON).
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Datapath pin directory.
    pub pin_dir: PathBuf,
    /// The CNI plugin's record directory (its `stateDir`).
    pub state_dir: PathBuf,
    /// Created once the node is reconciled (the CNI's `agentReadyFile`).
    pub ready_file: Option<PathBuf>,
    /// Address of /metrics, /healthz, /readyz.
    pub listen: String,
    /// Node defaults: `native`, `generic` or `off`.
    pub xdp_mode: String,
    /// Node default redirect: `devmap` or `cpumap`.
    pub redirect: String,
    /// Node default cpumap CPUs (empty: all online).
    #[serde(default)]
    pub cpus: String,
    /// Standalone: JSON object `{"namespace/name" | "containerID": {annotations}}`.
    #[serde(default)]
    pub pods_file: Option<PathBuf>,
    /// Kubernetes: this node's name (default: the NODE_NAME variable).
    #[serde(default)]
    pub node_name: Option<String>,
    /// install-cni: MTU of pod interfaces (default 1500).
    #[serde(default)]
    pub mtu: Option<u32>,
    /// install-cni: headroom asked of pod veths (default 256).
    #[serde(default)]
    pub headroom: Option<u16>,
    /// Reconcile period in milliseconds.
    #[serde(default = "default_interval")]
    pub interval_ms: u64,
}

impl Config {
    /// The node defaults, validated.
    pub fn defaults(&self, online: u64) -> Result<Policy> {
        let mode = XdpMode::parse(&self.xdp_mode).with_context(|| {
            format!("xdpMode {:?} is not native, generic or off", self.xdp_mode)
        })?;
        let redirect = RedirectPolicy::parse(&self.redirect)
            .with_context(|| format!("redirect {:?} is not devmap or cpumap", self.redirect))?;
        let cpu_mask = if self.cpus.is_empty() {
            online
        } else {
            parse_cpu_list(&self.cpus).map_err(|e| anyhow::anyhow!("cpus: {e}"))?
        };
        Ok(Policy {
            mode,
            redirect,
            cpu_mask,
        })
    }
}

/// Set by SIGTERM/SIGINT.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Whether SIGTERM/SIGINT arrived.
pub fn stopping() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Installs the SIGTERM/SIGINT handlers that end the agent's loop.
pub fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// What the HTTP endpoints serve, updated after each pass.
pub struct Shared {
    metrics: Mutex<String>,
    ready: AtomicBool,
}

impl Shared {
    /// Serves /metrics, /healthz and /readyz on `listen` from a thread.
    pub fn serve(listen: &str) -> Result<Arc<Self>> {
        let shared = Arc::new(Self {
            metrics: Mutex::new(String::new()),
            ready: AtomicBool::new(false),
        });
        let listener =
            TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
        let s = Arc::clone(&shared);
        std::thread::spawn(move || serve(listener, s));
        Ok(shared)
    }

    /// Publishes a pass: metrics text, and readiness (with the CNI's ready
    /// file) after the first pass that applied every pod.
    pub fn publish(&self, cfg: &Config, rec: &mut Reconciler, pass: &Pass) -> Result<()> {
        if !pass.failed && !rec.metrics.ready {
            rec.metrics.ready = true;
            self.ready.store(true, Ordering::Relaxed);
            if let Some(f) = &cfg.ready_file {
                if let Some(dir) = f.parent() {
                    let _ = std::fs::create_dir_all(dir);
                }
                std::fs::write(f, b"ready\n")
                    .with_context(|| format!("writing {}", f.display()))?;
            }
            info!("node reconciled: ready");
        }
        if let Ok(mut m) = self.metrics.lock() {
            *m = render(&pass.pods, &rec.metrics);
        }
        Ok(())
    }
}

fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let shared = &*shared;
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
        // Read the whole request head: closing with unread bytes would reset
        // the connection under the client.
        let mut buf = Vec::with_capacity(1024);
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let req = String::from_utf8_lossy(&buf);
        let path = req.split_whitespace().nth(1).unwrap_or("/");
        let (status, body) = match path {
            "/metrics" => (
                "200 OK",
                shared.metrics.lock().map(|m| m.clone()).unwrap_or_default(),
            ),
            "/healthz" => ("200 OK", "ok\n".to_string()),
            "/readyz" if shared.ready.load(Ordering::Relaxed) => ("200 OK", "ready\n".into()),
            "/readyz" => ("503 Service Unavailable", "not ready\n".into()),
            _ => ("404 Not Found", "not found\n".into()),
        };
        let _ = write!(
            conn,
            "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }
}

fn read_pods_file(path: &std::path::Path) -> Result<HashMap<String, Annotations>> {
    match std::fs::read(path) {
        Ok(bytes) if bytes.iter().all(u8::is_ascii_whitespace) => Ok(HashMap::new()),
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not {{\"ns/pod\": {{annotations}}}}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashMap::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Runs the standalone agent until SIGTERM/SIGINT. The datapath stays attached.
pub fn run(cfg: &Config) -> Result<()> {
    install_signal_handlers();
    let pods_file = cfg
        .pods_file
        .clone()
        .context("standalone mode needs podsFile")?;
    let online = online_cpus();
    let mut rec = open_reconciler(cfg, online)?;
    let shared = Shared::serve(&cfg.listen)?;
    let mut last_pods = HashMap::new();
    while !STOP.load(Ordering::Relaxed) {
        match read_pods_file(&pods_file) {
            Ok(p) => last_pods = p,
            Err(e) => warn!(error = %e, "pods file unreadable; keeping the last good one"),
        }
        let records = state::list(&cfg.state_dir).unwrap_or_default();
        let pass = rec.pass(&records, |ns, name| {
            let key = if ns.is_empty() {
                name.to_string()
            } else {
                format!("{ns}/{name}")
            };
            last_pods.get(&key).map(|a| PodInput {
                annotations: a.clone(),
                kernel_only: false,
            })
        });
        // Standalone has no Events: the log and the counter carry problems.
        shared.publish(cfg, &mut rec, &pass)?;
        let deadline = Instant::now() + Duration::from_millis(cfg.interval_ms);
        while Instant::now() < deadline && !STOP.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    info!("stopping; the datapath stays attached");
    Ok(())
}

/// Loads or takes over the datapath and builds the reconciler.
pub fn open_reconciler(cfg: &Config, online: u64) -> Result<Reconciler> {
    let defaults = cfg.defaults(online)?;
    let dp = Datapath::open(&cfg.pin_dir)
        .with_context(|| format!("opening the datapath at {}", cfg.pin_dir.display()))?;
    info!(
        pin_dir = %cfg.pin_dir.display(),
        upgraded = dp.upgraded(),
        program = dp.from_pod_program_id().unwrap_or(0),
        "datapath ready"
    );
    Ok(Reconciler::new(dp, defaults, online))
}
