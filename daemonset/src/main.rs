//! `xdpcni-agent`: the node agent ([`xdpcni_agent::cli`] has its commands).

fn main() -> anyhow::Result<()> {
    xdpcni_agent::cli::main()
}
