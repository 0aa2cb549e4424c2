//! `xdpcni`: the CNI plugin binary the container runtime execs.
//!
//! Run by hand on a node as `xdpcni uninstall [STATE_DIR]` (after
//! `helm uninstall`), it takes xdpcni off the node: see `install::uninstall`.

use std::io::{Read, Write};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("CNI_COMMAND").is_none()
        && args.first().map(String::as_str) == Some("uninstall")
    {
        std::process::exit(uninstall(args.get(1).map(String::as_str)));
    }
    let mut stdin = Vec::new();
    // An unreadable stdin is the same as an empty one: the config parse fails
    // with a decode error JSON.
    let _ = std::io::stdin().read_to_end(&mut stdin);
    let out = xdpcni_plugin::run(|k| std::env::var(k).ok(), &stdin);
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(out.stdout.as_bytes());
    let _ = stdout.flush();
    std::process::exit(out.status);
}

fn uninstall(state_dir: Option<&str>) -> i32 {
    let dir = std::path::Path::new(state_dir.unwrap_or(xdpcni_plugin::config::DEFAULT_STATE_DIR));
    match xdpcni_plugin::install::uninstall(dir) {
        Ok(r) => {
            for p in &r.paths {
                eprintln!("xdpcni uninstall: removed {}", p.display());
            }
            if r.paths.is_empty() {
                eprintln!(
                    "xdpcni uninstall: nothing installed (no manifest in {})",
                    dir.display()
                );
            }
            for pod in &r.pods_left {
                eprintln!("xdpcni uninstall: pod {pod} is still on the node (kernel routing until it is deleted)");
            }
            0
        }
        Err(e) => {
            eprintln!("xdpcni uninstall: {e}");
            1
        }
    }
}
