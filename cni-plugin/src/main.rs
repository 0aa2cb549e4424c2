//! `xdpcni`: the CNI plugin binary the container runtime execs
//! ([`xdpcni_plugin::cli`]).

fn main() {
    std::process::exit(xdpcni_plugin::cli::main());
}
