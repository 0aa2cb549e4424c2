//! `xdpcni-agent`: the node agent.
//!
//! ```text
//! xdpcni-agent run --config FILE          watch this node's pods (NODE_NAME, KUBECONFIG or in-cluster)
//! xdpcni-agent standalone --config FILE   run without Kubernetes (pods file)
//! xdpcni-agent install-cni --config FILE [--cni-conf-dir D] [--cni-bin-dir D] [--plugin P] [--pod-cidr C]...
//! xdpcni-agent prepare-node [--host-proc /host/proc] [--bpf-root /sys/fs/bpf] [--netns-dir /run/netns]
//!                                         the chart's first init container: bpffs and the netns mount
//! xdpcni-agent uninstall [--pin-dir DIR] [--state-dir DIR]
//!                                         detach the datapath everywhere and unpin it; with
//!                                         --state-dir, also remove what install-cni installed
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    tracing_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("run") => {
            let cfg = read_config(&args)?;
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(xdpcni_agent::kube::run(cfg))
        }
        Some("install-cni") => {
            let cfg = read_config(&args)?;
            let conf_dir = flag(&args, "--cni-conf-dir").unwrap_or_else(|| "/etc/cni/net.d".into());
            let bin_dir = flag(&args, "--cni-bin-dir").unwrap_or_else(|| "/opt/cni/bin".into());
            let plugin = match flag(&args, "--plugin") {
                Some(p) => PathBuf::from(p),
                None => std::env::current_exe()?.with_file_name("xdpcni"),
            };
            let mut cidrs: Vec<String> = args
                .windows(2)
                .filter(|w| w[0] == "--pod-cidr")
                .map(|w| w[1].clone())
                .collect();
            if cidrs.is_empty() {
                let node = cfg
                    .node_name
                    .clone()
                    .or_else(|| std::env::var("NODE_NAME").ok())
                    .context("NODE_NAME (or --pod-cidr) is needed")?;
                cidrs = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(xdpcni_agent::install::node_pod_cidrs(&node))?;
            }
            let dest = xdpcni_agent::install::install(
                &cfg,
                &cidrs,
                std::path::Path::new(&conf_dir),
                std::path::Path::new(&bin_dir),
                &plugin,
            )?;
            eprintln!(
                "xdpcni-agent: wrote {} for {cidrs:?}, installed {} in {bin_dir}",
                dest.conflist.display(),
                dest.binaries
                    .iter()
                    .filter_map(|b| b.file_name()?.to_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            Ok(())
        }
        Some("standalone") => {
            let cfg = read_config(&args)?;
            xdpcni_agent::standalone::run(&cfg)
        }
        Some("prepare-node") => {
            let host_proc = flag(&args, "--host-proc").map(PathBuf::from);
            let bpf_root = flag(&args, "--bpf-root").unwrap_or_else(|| "/sys/fs/bpf".into());
            let netns_dir = flag(&args, "--netns-dir").unwrap_or_else(|| "/run/netns".into());
            xdpcni_agent::prepare::prepare_node(
                host_proc.as_deref(),
                std::path::Path::new(&bpf_root),
                std::path::Path::new(&netns_dir),
            )
        }
        Some("uninstall") => {
            if let Some(state) = flag(&args, "--state-dir") {
                let removed = xdpcni_node::install::uninstall(std::path::Path::new(&state))
                    .with_context(|| format!("uninstalling the installation recorded in {state}"))?;
                for p in removed.paths {
                    eprintln!("xdpcni-agent: removed {}", p.display());
                }
            }
            let dir =
                flag(&args, "--pin-dir").unwrap_or_else(|| xdpcni_ebpf::DEFAULT_PIN_DIR.into());
            xdpcni_ebpf::Datapath::uninstall(&PathBuf::from(&dir))
                .with_context(|| format!("uninstalling {dir}"))?;
            eprintln!("xdpcni-agent: datapath at {dir} detached and unpinned");
            Ok(())
        }
        _ => bail!(
            "usage: xdpcni-agent run|standalone|install-cni --config FILE ... | prepare-node [...] | uninstall [--pin-dir DIR] [--state-dir DIR]"
        ),
    }
}

fn read_config(args: &[String]) -> Result<xdpcni_agent::standalone::Config> {
    let path = flag(args, "--config").context("--config FILE is required")?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {path}"))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {path}"))
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
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
