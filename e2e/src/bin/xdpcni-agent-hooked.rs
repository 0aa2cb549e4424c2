//! The `xdpcni-agent` node agent with its hook points armed
//! ([`xdpcni_e2e::hooks`]): what the tests exec. Not for nodes.

fn main() -> anyhow::Result<()> {
    xdpcni_e2e::hooks::arm();
    xdpcni_agent::cli::main()
}
