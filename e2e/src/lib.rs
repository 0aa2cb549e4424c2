//! Harness of xdpcni's end-to-end tests and benchmark: uniquely named network
//! namespaces, veth pairs and bpffs pin directories that remove themselves on
//! Drop (even when a test panics), a way to run code inside a namespace, and
//! hand-built packets.

pub mod agent;
pub mod cluster;
pub mod cni;
pub mod kube;
pub mod netns;
pub mod packet;
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
