//! The `xdpcni-agent` binary's command line.
//!
//! ```text
//! xdpcni-agent run --config FILE          watch this node's pods (NODE_NAME, KUBECONFIG or in-cluster)
//! xdpcni-agent standalone --config FILE   run without Kubernetes (pods file)
//! xdpcni-agent install-cni --config FILE [--cni-conf-dir D] [--cni-bin-dir D] [--plugin P] [--pod-cidr C]...
//! xdpcni-agent prepare-node [--host-proc /host/proc] [--bpf-root /sys/fs/bpf] [--netns-dir /run/netns]
//!                                         the chart's first init container: bpffs and the netns mount
//! xdpcni-agent status [--config FILE | --url URL] [-o table|json] [--pod NS/NAME]
//!                                         what the local agent has in force, per pod and why
//! xdpcni-agent uninstall [--pin-dir DIR] [--state-dir DIR]
//!                                         detach the datapath everywhere and unpin it, remove
//!                                         the NetworkPolicy table, the VXLAN device and the
//!                                         routes to other nodes' pods; with --state-dir, also
//!                                         remove what install-cni installed
//! ```

use std::path::PathBuf;

use crate::config::Config;
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

/// The xdpcni node agent.
#[derive(Parser, Debug)]
#[command(name = "xdpcni-agent", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Watch this node's pods and apply their policy (NODE_NAME, KUBECONFIG
    /// or in-cluster credentials).
    Run {
        /// The agent's JSON config.
        #[arg(long)]
        config: PathBuf,
    },
    /// Run without Kubernetes (pods from a file).
    Standalone {
        /// The agent's JSON config.
        #[arg(long)]
        config: PathBuf,
    },
    /// Write the CNI conflist and install the plugins (the chart's init container).
    InstallCni {
        /// The agent's JSON config.
        #[arg(long)]
        config: PathBuf,
        /// Where the conflist goes.
        #[arg(long, default_value = "/etc/cni/net.d")]
        cni_conf_dir: PathBuf,
        /// Where the plugin binaries go.
        #[arg(long, default_value = "/opt/cni/bin")]
        cni_bin_dir: PathBuf,
        /// The xdpcni binary to install (default: next to this one).
        #[arg(long)]
        plugin: Option<PathBuf>,
        /// The node's pod CIDRs (repeatable; default: the Node object's).
        #[arg(long = "pod-cidr")]
        pod_cidrs: Vec<String>,
    },
    /// Mount bpffs and make the netns directory shared (the chart's first
    /// init container).
    PrepareNode {
        /// The host's /proc, to enter the node's mount namespace.
        #[arg(long)]
        host_proc: Option<PathBuf>,
        /// Where bpffs must be mounted.
        #[arg(long, default_value = "/sys/fs/bpf")]
        bpf_root: PathBuf,
        /// The runtime's network namespace directory.
        #[arg(long, default_value = "/run/netns")]
        netns_dir: PathBuf,
    },
    /// What the local agent has in force: the node, and per pod its mode
    /// and why (reads the agent's /v1/status).
    Status {
        /// The agent's JSON config, whose `listen` address is asked.
        #[arg(long, default_value = "/etc/xdpcni/agent.json")]
        config: PathBuf,
        /// The agent's address (`http://HOST:PORT`), instead of the
        /// config's.
        #[arg(long)]
        url: Option<String>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Only this pod (`namespace/name`, or a container ID).
        #[arg(long)]
        pod: Option<String>,
    },
    /// Detach the datapath everywhere and unpin it; with --state-dir, also
    /// remove what install-cni installed.
    Uninstall {
        /// The datapath's pin directory.
        #[arg(long, default_value = xdpcni_ebpf::DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// The CNI state directory holding install-cni's manifest.
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
}

/// `status` output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    /// Columns a person reads.
    Table,
    /// The agent's JSON, as it answered.
    Json,
}

/// The whole binary: parses the command line and runs the command.
/// `main.rs` (and the e2e crate's hooked build) call it.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_init();
    match cli.command {
        Command::Run { config } => {
            let cfg = Config::read(&config)?;
            runtime()?.block_on(crate::kube::run(cfg))
        }
        Command::InstallCni {
            config,
            cni_conf_dir,
            cni_bin_dir,
            plugin,
            pod_cidrs,
        } => install_cni(&config, &cni_conf_dir, &cni_bin_dir, plugin, pod_cidrs),
        Command::Standalone { config } => {
            let cfg = Config::read(&config)?;
            runtime()?.block_on(crate::standalone::run(cfg))
        }
        Command::PrepareNode {
            host_proc,
            bpf_root,
            netns_dir,
        } => crate::prepare::prepare_node(host_proc.as_deref(), &bpf_root, &netns_dir),
        Command::Status {
            config,
            url,
            output,
            pod,
        } => status(&config, url, output, pod.as_deref()),
        Command::Uninstall { pin_dir, state_dir } => uninstall(&pin_dir, state_dir.as_deref()),
    }
}

/// `install-cni`: the conflist for this node's pod CIDRs (from `--pod-cidr`,
/// or the Node object) with the pod MTU the routing allows, and the plugins.
fn install_cni(
    config: &std::path::Path,
    cni_conf_dir: &std::path::Path,
    cni_bin_dir: &std::path::Path,
    plugin: Option<PathBuf>,
    pod_cidrs: Vec<String>,
) -> Result<()> {
    let cfg = Config::read(config)?;
    let plugin = match plugin {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("xdpcni"),
    };
    let mut facts = crate::install::NodeFacts {
        cidrs: pod_cidrs,
        internal_ip: None,
    };
    if facts.cidrs.is_empty() {
        let node = cfg
            .node_name()
            .context("NODE_NAME (or --pod-cidr) is needed")?;
        facts = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(crate::install::node_facts(&node))?;
    }
    let underlay = crate::install::underlay(facts.internal_ip)?;
    let mtu = crate::install::pod_mtu(&cfg, underlay.as_ref())?;
    let mode = cfg.routing()?.mode;
    match &underlay {
        Some(u) => eprintln!(
            "xdpcni-agent: pod MTU {mtu} (routing {mode}, underlay {} MTU {})",
            u.link.name, u.link.mtu
        ),
        None => eprintln!(
            "xdpcni-agent: pod MTU {mtu} (routing {mode}; no interface holds the \
             node's InternalIP {:?}, so the underlay MTU is taken as {})",
            facts.internal_ip,
            xdpcni_host::netconf::DEFAULT_MTU
        ),
    }
    let cidrs = facts.cidrs;
    let dest = crate::install::install(&cfg, &cidrs, mtu, cni_conf_dir, cni_bin_dir, &plugin)?;
    eprintln!(
        "xdpcni-agent: wrote {} for {cidrs:?}, installed {} in {}",
        dest.conflist.display(),
        dest.binaries
            .iter()
            .filter_map(|b| b.file_name()?.to_str())
            .collect::<Vec<_>>()
            .join(", "),
        cni_bin_dir.display()
    );
    Ok(())
}

/// `uninstall`: the host crate's, as `xdpcni uninstall` runs it (every
/// step runs even when one fails; the failures together), with the
/// manifest's part when `state_dir` is given.
fn uninstall(pin_dir: &std::path::Path, state_dir: Option<&std::path::Path>) -> Result<()> {
    let mut failed = Vec::new();
    let manifest = state_dir.map(xdpcni_host::install::uninstall);
    let node = xdpcni_host::install::uninstall_node(pin_dir);
    for done in manifest.into_iter().chain([node]) {
        match done {
            Ok(removed) => {
                for line in removed.lines() {
                    eprintln!("xdpcni-agent: {line}");
                }
            }
            Err(e) => failed.push(e.to_string()),
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "uninstalling xdpcni (datapath at {}): {}",
        pin_dir.display(),
        failed.join("; ")
    );
    Ok(())
}

/// The agent's status URL: `url`, or the `listen` address of the config
/// (an unspecified address asked on loopback), or the default address.
fn status_url(config: &std::path::Path, url: Option<String>) -> Result<String> {
    if let Some(u) = url {
        return Ok(format!(
            "{}{}",
            u.trim_end_matches('/'),
            crate::status::PATH
        ));
    }
    let listen = match Config::read(config) {
        Ok(c) => c.listen,
        Err(_) if !config.exists() => crate::config::DEFAULT_LISTEN.to_string(),
        Err(e) => return Err(e),
    };
    let addr: std::net::SocketAddr = listen
        .parse()
        .with_context(|| format!("listen address {listen:?} in {}", config.display()))?;
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v) if v.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(v) if v.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    Ok(format!(
        "http://{}{}",
        std::net::SocketAddr::new(ip, addr.port()),
        crate::status::PATH
    ))
}

/// Asks the local agent for its status and prints it.
fn status(
    config: &std::path::Path,
    url: Option<String>,
    output: Output,
    pod: Option<&str>,
) -> Result<()> {
    use http_body_util::BodyExt;
    let url = status_url(config, url)?;
    let uri: hyper::Uri = url.parse().with_context(|| format!("URL {url:?}"))?;
    let body = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http::<http_body_util::Empty<hyper::body::Bytes>>();
            let res = tokio::time::timeout(std::time::Duration::from_secs(10), client.get(uri))
                .await
                .context("no answer within 10 s")??;
            let code = res.status();
            let body = res.into_body().collect().await?.to_bytes();
            anyhow::ensure!(
                code.is_success(),
                "the agent answered {code}: {}",
                String::from_utf8_lossy(&body).trim()
            );
            Ok(body)
        })
        .with_context(|| format!("asking the agent at {url} (is it running on this node?)"))?;
    let status: crate::status::Status = serde_json::from_slice(&body)
        .with_context(|| format!("the agent at {url} answered something else than a status"))?;
    let chosen = match pod {
        Some(which) => Some(
            status
                .find(which)
                .with_context(|| format!("no pod {which} on this node"))?,
        ),
        None => None,
    };
    let text = match (output, chosen) {
        (Output::Json, Some(p)) => serde_json::to_string_pretty(p)?,
        (Output::Json, None) => serde_json::to_string_pretty(&status)?,
        (Output::Table, Some(p)) => status.pod_detail(p),
        (Output::Table, None) => status.table(),
    };
    println!("{}", text.trim_end());
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn tracing_init() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
}
