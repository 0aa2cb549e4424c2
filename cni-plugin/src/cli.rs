//! The `xdpcni` binary's command line: what the container runtime execs.
//!
//! Run by hand on a node as `xdpcni uninstall [STATE_DIR]` (after
//! `helm uninstall`), it takes xdpcni off the node: see `install::uninstall`.

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
};

use clap::{Parser, Subcommand};

/// The xdpcni CNI plugin. A container runtime runs it with CNI_COMMAND set
/// and the network config on stdin; by hand it has one command.
#[derive(Parser, Debug)]
#[command(name = "xdpcni", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Take xdpcni off the node (after `helm uninstall`): remove what
    /// install-cni installed, as recorded in the state directory.
    Uninstall {
        /// The CNI state directory.
        #[arg(default_value = xdpcni_host::netconf::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
    },
}

/// The whole binary: the runtime's call (CNI_COMMAND, stdin) or `uninstall`;
/// returns the exit status. `main.rs` (and the e2e crate's hooked build) call
/// it.
pub fn main() -> i32 {
    // A runtime's call: the spec's environment and stdin, never arguments.
    if std::env::var_os("CNI_COMMAND").is_none() {
        if let Some(Command::Uninstall { state_dir }) = Cli::parse().command {
            return uninstall(&state_dir);
        }
    }
    let mut stdin = Vec::new();
    // An unreadable stdin is the same as an empty one: the config parse fails
    // with a decode error JSON.
    let _ = std::io::stdin().read_to_end(&mut stdin);
    let out = crate::run(|k| std::env::var(k).ok(), &stdin);
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(out.stdout.as_bytes());
    let _ = stdout.flush();
    out.status
}

fn uninstall(dir: &Path) -> i32 {
    match xdpcni_host::install::uninstall(dir) {
        Ok(r) => {
            if r.paths.is_empty() {
                eprintln!(
                    "xdpcni uninstall: nothing installed (no manifest in {})",
                    dir.display()
                );
            }
            for line in r.lines() {
                eprintln!("xdpcni uninstall: {line}");
            }
            0
        }
        Err(e) => {
            eprintln!("xdpcni uninstall: {e}");
            1
        }
    }
}
