//! `xdpcni`: the CNI plugin binary the container runtime execs.

use std::io::{Read, Write};

fn main() {
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
