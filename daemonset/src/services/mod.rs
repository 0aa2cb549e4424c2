//! Services translated at the socket for this node's pods (issue 34; see
//! ebpf/src/services.bpf.c): what the cluster's Services mean for this
//! node ([`model`]).

pub mod model;
