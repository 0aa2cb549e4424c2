//! Harness of xdpcni's end-to-end tests and benchmark: uniquely named network
//! namespaces, veth pairs and bpffs pin directories that remove themselves on
//! Drop (even when a test panics), a way to run code inside a namespace, and
//! hand-built packets.

pub mod cni;
pub mod kube;
pub mod netns;
pub mod packet;
pub mod testrun;
pub mod topo;
pub mod traffic;

pub use netns::{in_netns, run, run_out, unique_name, Netns, PinDir};
