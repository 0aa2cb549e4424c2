//! `xdpcni-agent`: the node agent.
//!
//! ```text
//! xdpcni-agent run --config FILE          watch this node's pods (NODE_NAME, KUBECONFIG or in-cluster)
//! xdpcni-agent standalone --config FILE   run without Kubernetes (pods file)
//! xdpcni-agent install-cni --config FILE [--cni-conf-dir D] [--cni-bin-dir D] [--plugin P] [--pod-cidr C]...
//! xdpcni-agent prepare-node [--host-proc /host/proc] [--bpf-root /sys/fs/bpf] [--netns-dir /run/netns]
//!                                         the chart's first init container: bpffs and the netns mount
//! xdpcni-agent uninstall [--pin-dir DIR] [--state-dir DIR]
//!                                         detach the datapath everywhere and unpin it, remove
//!                                         the NetworkPolicy table; with --state-dir, also
//!                                         remove what install-cni installed
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use xdpcni_agent::config::Config;

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

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_init();
    match cli.command {
        Command::Run { config } => {
            let cfg = Config::read(&config)?;
            runtime()?.block_on(xdpcni_agent::kube::run(cfg))
        }
        Command::InstallCni {
            config,
            cni_conf_dir,
            cni_bin_dir,
            plugin,
            pod_cidrs,
        } => {
            let cfg = Config::read(&config)?;
            let plugin = match plugin {
                Some(p) => p,
                None => std::env::current_exe()?.with_file_name("xdpcni"),
            };
            let mut cidrs = pod_cidrs;
            if cidrs.is_empty() {
                let node = cfg
                    .node_name()
                    .context("NODE_NAME (or --pod-cidr) is needed")?;
                cidrs = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(xdpcni_agent::install::node_pod_cidrs(&node))?;
            }
            let dest =
                xdpcni_agent::install::install(&cfg, &cidrs, &cni_conf_dir, &cni_bin_dir, &plugin)?;
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
        Command::Standalone { config } => {
            let cfg = Config::read(&config)?;
            runtime()?.block_on(xdpcni_agent::standalone::run(cfg))
        }
        Command::PrepareNode {
            host_proc,
            bpf_root,
            netns_dir,
        } => xdpcni_agent::prepare::prepare_node(host_proc.as_deref(), &bpf_root, &netns_dir),
        Command::Uninstall { pin_dir, state_dir } => {
            if let Some(state) = state_dir {
                let removed = xdpcni_node::install::uninstall(&state).with_context(|| {
                    format!(
                        "uninstalling the installation recorded in {}",
                        state.display()
                    )
                })?;
                for p in removed.paths {
                    eprintln!("xdpcni-agent: removed {}", p.display());
                }
            }
            xdpcni_ebpf::Datapath::uninstall(&pin_dir)
                .with_context(|| format!("uninstalling {}", pin_dir.display()))?;
            eprintln!(
                "xdpcni-agent: datapath at {} detached and unpinned",
                pin_dir.display()
            );
            if xdpcni_node::nftable::remove_table().context("removing the NetworkPolicy table")? {
                eprintln!(
                    "xdpcni-agent: NetworkPolicy table inet {} removed",
                    xdpcni_node::nftable::TABLE
                );
            }
            Ok(())
        }
    }
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
