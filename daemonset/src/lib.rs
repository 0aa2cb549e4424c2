//! The xdpcni node agent: turns each pod's policy (annotations in Kubernetes,
//! a file in standalone mode) into the datapath's state, and reports it.

pub mod apply;
pub mod install;
pub mod kube;
pub mod metrics;
pub mod node;
pub mod policy;
pub mod prepare;
pub mod routes;
pub mod standalone;
