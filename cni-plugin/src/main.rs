//! The `xdpcni` CNI plugin (issue 3 builds it; until then it refuses every
//! command with a CNI error so no runtime mistakes it for a working plugin).

fn main() {
    println!(
        "{{\"cniVersion\":\"1.1.0\",\"code\":50,\"msg\":\"xdpcni CNI plugin not built yet\"}}"
    );
    std::process::exit(1);
}
