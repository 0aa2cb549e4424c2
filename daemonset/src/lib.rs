//! The xdpcni node agent: turns each pod's wish (annotations in Kubernetes,
//! a file in standalone mode) into the datapath's state, and reports it.
//!
//! - `config`: the config file and the node defaults.
//! - `wish`: what a pod asks of the datapath (mode, redirect, cpus) from its annotations (pure).
//! - `apply`: one pod brought to its mode, through the datapath's verbs.
//! - `reconciler`: the reconciler over the datapath: one pod, or the node-wide work.
//! - `owner`: the datapath owner, one thread that alone holds the reconciler
//!   and runs the commands the tasks send it.
//! - `daemon`: shared by both modes: the owner's handle, the records, the
//!   FORWARD scan, the view (readiness), the policy facts, HTTP, shutdown.
//! - `records`, `forward`: the CNI records (cache, inotify) and the FORWARD
//!   chain's rules that name pods.
//! - `metrics`: the Prometheus families.
//! - `status`: what is in force (each pod's mode and why), read by
//!   /metrics and /v1/status, and the `status` command's output.
//! - `kube` (Kubernetes mode, a kube-runtime controller) and `standalone`.
//! - `netpol`: NetworkPolicy enforcement (what policies mean for this
//!   node's pods, as one nftables ruleset).
//! - `routes`, `install`, `prepare`: routes to other nodes, install-cni,
//!   prepare-node.

pub mod apply;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod forward;
pub mod install;
pub mod kube;
pub mod metrics;
pub mod netpol;
pub mod owner;
pub mod prepare;
pub mod reconciler;
pub mod records;
pub mod routes;
pub mod services;
pub mod standalone;
pub mod status;
pub mod wish;
