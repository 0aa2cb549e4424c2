//! `xdpcni-agent`: the node agent.
//!
//! ```text
//! xdpcni-agent standalone --config FILE   run without Kubernetes (pods file)
//! xdpcni-agent uninstall [--pin-dir DIR]  detach the datapath everywhere and unpin it
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    tracing_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("standalone") => {
            let cfg_path = flag(&args, "--config").context("standalone needs --config FILE")?;
            let bytes = std::fs::read(&cfg_path).with_context(|| format!("reading {cfg_path}"))?;
            let cfg: xdpcni_agent::standalone::Config =
                serde_json::from_slice(&bytes).with_context(|| format!("parsing {cfg_path}"))?;
            xdpcni_agent::standalone::run(&cfg)
        }
        Some("uninstall") => {
            let dir =
                flag(&args, "--pin-dir").unwrap_or_else(|| xdpcni_ebpf::DEFAULT_PIN_DIR.into());
            xdpcni_ebpf::Datapath::uninstall(&PathBuf::from(&dir))
                .with_context(|| format!("uninstalling {dir}"))?;
            eprintln!("xdpcni-agent: datapath at {dir} detached and unpinned");
            Ok(())
        }
        _ => bail!("usage: xdpcni-agent standalone --config FILE | uninstall [--pin-dir DIR]"),
    }
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
