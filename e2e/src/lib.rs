//! Harness of xdpcni's end-to-end tests and benchmark: uniquely named network
//! namespaces, veth pairs and bpffs pin directories that remove themselves on
//! Drop (even when a test panics), a way to run code inside a namespace, and
//! hand-built packets.

pub mod agent;
pub mod capture;
pub mod cgroup;
pub mod cluster;
pub mod cni;
pub mod cost;
pub mod hooks;
pub mod kube;
pub mod measure;
pub mod netns;
pub mod node;
pub mod nodes;
pub mod oracle;
pub mod packet;
pub mod sweep;
pub mod testrun;
pub mod topo;
pub mod traffic;

pub use netns::{in_netns, run, run_out, unique_name, Netns, PinDir};

/// The environment variable `name` parsed, or `default` when it is unset or
/// does not parse (the knobs that lengthen or replay a test run).
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The directory of the previous release's binaries (`xdpcni`,
/// `xdpcni-agent`), built from this repository's history on first use by
/// `scripts/previous-release.sh` (the commit in `e2e/k8s/PREVIOUS_RELEASE`).
pub fn previous_release() -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context as _;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("bash")
        .arg(root.join("scripts/previous-release.sh"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running scripts/previous-release.sh")?;
    anyhow::ensure!(
        out.status.success(),
        "scripts/previous-release.sh failed: {}",
        out.status
    );
    Ok(std::path::PathBuf::from(
        String::from_utf8(out.stdout)?.trim(),
    ))
}
