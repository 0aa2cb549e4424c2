//! Standalone mode: no Kubernetes. The agent loads (or takes over) the
//! datapath, reads the CNI plugin's attachment records for the pods of the
//! node, takes each pod's annotations from a local JSON file, applies them,
//! and serves /metrics, /healthz and /readyz. Used by the demo and by
//! runtimes without Kubernetes.

use std::{
    collections::{BTreeMap, HashMap},
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
use xdpcni_plugin::{
    config::{parse_cpu_list, XdpMode},
    state::{self, Record},
};

use crate::{
    apply::apply,
    metrics::{render, AgentMetrics, PodMetrics},
    policy::{resolve, Policy},
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
    pub pods_file: PathBuf,
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
        let redirect = match self.redirect.as_str() {
            "devmap" => RedirectPolicy::Devmap,
            "cpumap" => RedirectPolicy::Cpumap,
            other => anyhow::bail!("redirect {other:?} is not devmap or cpumap"),
        };
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

/// Mask of online CPUs.
pub fn online_cpus() -> u64 {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpu_list(s.trim()).ok())
        .unwrap_or(1)
}

/// Set by SIGTERM/SIGINT.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

struct Shared {
    metrics: Mutex<String>,
    ready: AtomicBool,
}

fn serve(listener: TcpListener, shared: Arc<Shared>) {
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

type Annotations = BTreeMap<String, String>;

fn read_pods_file(path: &PathBuf) -> Result<HashMap<String, Annotations>> {
    match std::fs::read(path) {
        Ok(bytes) if bytes.iter().all(u8::is_ascii_whitespace) => Ok(HashMap::new()),
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not {{\"ns/pod\": {{annotations}}}}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashMap::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn pod_key(rec: &Record) -> (String, String) {
    if rec.pod_name.is_empty() {
        (String::new(), rec.container_id.clone())
    } else {
        (rec.pod_namespace.clone(), rec.pod_name.clone())
    }
}

/// Runs the standalone agent until SIGTERM/SIGINT. The datapath stays attached.
pub fn run(cfg: &Config) -> Result<()> {
    install_signal_handlers();
    let online = online_cpus();
    let defaults = cfg.defaults(online)?;
    let mut dp = Datapath::open(&cfg.pin_dir)
        .with_context(|| format!("opening the datapath at {}", cfg.pin_dir.display()))?;
    info!(
        pin_dir = %cfg.pin_dir.display(),
        upgraded = dp.upgraded(),
        program = dp.from_pod_program_id().unwrap_or(0),
        "datapath ready"
    );
    let shared = Arc::new(Shared {
        metrics: Mutex::new(String::new()),
        ready: AtomicBool::new(false),
    });
    let listener =
        TcpListener::bind(&cfg.listen).with_context(|| format!("listening on {}", cfg.listen))?;
    {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || serve(listener, shared));
    }
    let mut agent = AgentMetrics::default();
    let mut last_pods = HashMap::new();
    let mut reported: HashMap<String, String> = HashMap::new();
    while !STOP.load(Ordering::Relaxed) {
        let started = Instant::now();
        match read_pods_file(&cfg.pods_file) {
            Ok(p) => last_pods = p,
            Err(e) => warn!(error = %e, "pods file unreadable; keeping the last good one"),
        }
        let mut failed = false;
        let mut pods = Vec::new();
        let records = state::list(&cfg.state_dir).unwrap_or_default();
        for rec in &records {
            let (ns, name) = pod_key(rec);
            let key = if ns.is_empty() {
                name.clone()
            } else {
                format!("{ns}/{name}")
            };
            let ann = last_pods.get(&key).cloned().unwrap_or_default();
            let (policy, mut problems) = resolve(&ann, &defaults, online);
            // Pods whose veth is gone (deleted, DEL pending) are skipped.
            if !std::path::Path::new(&rec.netns).exists() {
                continue;
            }
            let mode = match apply(&mut dp, rec, &policy, false) {
                Ok(applied) => {
                    if applied.changed {
                        info!(pod = %key, mode = applied.mode.as_str(), "applied");
                    }
                    problems.extend(applied.problems);
                    applied.mode.as_str().to_string()
                }
                Err(e) => {
                    warn!(pod = %key, error = %e, "apply failed");
                    failed = true;
                    continue;
                }
            };
            let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
            let text = text.join("; ");
            if !text.is_empty() && reported.get(&key) != Some(&text) {
                // Standalone has no Events: the log and the counter carry it.
                warn!(pod = %key, problem = %text, "policy refused, fallback in use");
                agent.policy_problems += problems.len() as u64;
            }
            reported.insert(key.clone(), text);
            pods.push(PodMetrics {
                namespace: ns,
                pod: name,
                interface: rec.host_veth.clone(),
                mode,
                counters: dp.maps().counters(rec.host_ifindex).unwrap_or_default(),
            });
        }
        if let Ok(gone) = dp.gc_links() {
            for ifindex in gone {
                info!(ifindex, "collected the link pin of a deleted veth");
            }
        }
        agent.reconciles += 1;
        agent.reconcile_seconds += started.elapsed().as_secs_f64();
        if failed {
            agent.reconcile_errors += 1;
        } else if !agent.ready {
            agent.ready = true;
            shared.ready.store(true, Ordering::Relaxed);
            if let Some(f) = &cfg.ready_file {
                if let Some(dir) = f.parent() {
                    let _ = std::fs::create_dir_all(dir);
                }
                std::fs::write(f, b"ready\n")
                    .with_context(|| format!("writing {}", f.display()))?;
            }
            info!("node reconciled: ready");
        }
        if let Ok(mut m) = shared.metrics.lock() {
            *m = render(&pods, &agent);
        }
        let deadline = Instant::now() + Duration::from_millis(cfg.interval_ms);
        while Instant::now() < deadline && !STOP.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    info!("stopping; the datapath stays attached");
    Ok(())
}
