//! The `xdpcni-agent` node agent (issue 4 builds it).

fn main() {
    eprintln!("xdpcni-agent: not built yet (see issue 4)");
    std::process::exit(1);
}
