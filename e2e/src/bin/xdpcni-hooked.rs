//! The `xdpcni` CNI plugin with its hook points armed ([`xdpcni_e2e::hooks`]):
//! what the tests exec, so that a crash point or an injected failure is
//! there whatever else was built. Not for nodes.

fn main() {
    xdpcni_e2e::hooks::arm();
    std::process::exit(xdpcni_plugin::cli::main());
}
