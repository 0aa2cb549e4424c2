//! The xdpcni CNI plugin (spec 1.1; answers 0.3.0 to 1.1.0): builds a pod's
//! veth pair with its end created directly inside the pod, addresses from a
//! delegated IPAM plugin, link-local gateways and routes, holds a pod a
//! NetworkPolicy may select until the agent has classified it, and records
//! the pod for the agent, which alone puts it on the fast path. [`run`] is
//! the whole plugin;
//! `main.rs` only wires stdin, the environment and stdout to it.

pub mod cli;
pub mod config;
pub mod error;
pub mod ipam;
pub mod log;

pub mod plugin;
pub mod types;

use config::{CniEnv, Command, NetConf};
use error::Error;

/// What the plugin prints and its exit status.
#[derive(Debug)]
pub struct Reply {
    /// stdout (a result, an error JSON, or nothing).
    pub stdout: String,
    /// Process exit status.
    pub status: i32,
}

/// Runs one CNI invocation: `lookup` reads the environment, `stdin` is the
/// network configuration. Errors become the spec's error JSON here, and only
/// here.
pub fn run(lookup: impl Fn(&str) -> Option<String>, stdin: &[u8]) -> Reply {
    let env = match CniEnv::from_lookup(&lookup) {
        Ok(env) => env,
        Err(e) => return failure(&e, &types::asked_version(stdin)),
    };
    if env.command == Command::Version {
        return Reply {
            stdout: plugin::version(stdin).to_string(),
            status: 0,
        };
    }
    let conf = match NetConf::parse(stdin) {
        Ok(c) => c,
        Err(e) => return failure(&e, &types::asked_version(stdin)),
    };
    // Each invocation logs through its own subscriber (the file of the
    // conflist's `logFile`, appended, or stderr; never stdout, the result's),
    // every line in a span naming the command, container and interface.
    tracing::subscriber::with_default(log::subscriber(conf.log_file.as_deref()), || {
        let _span = tracing::info_span!(
            "xdpcni",
            pid = std::process::id(),
            command = ?env.command,
            container = %env.container_id,
            ifname = %env.ifname,
        )
        .entered();
        let result = match env.command {
            Command::Add => plugin::add(&conf, &env).map(|v| v.to_string()),
            Command::Del => plugin::del(&conf, &env).map(|()| String::new()),
            Command::Check => plugin::check(&conf, &env).map(|()| String::new()),
            Command::Gc => plugin::gc(&conf, &env).map(|()| String::new()),
            Command::Status => plugin::status(&conf).map(|()| String::new()),
            Command::Version => Ok(String::new()),
        };
        match result {
            Ok(stdout) => {
                tracing::info!("ok");
                Reply { stdout, status: 0 }
            }
            Err(e) => {
                tracing::warn!("failed (code {}): {e}", e.code());
                failure(&e, &conf.cni_version)
            }
        }
    })
}

fn failure(e: &Error, version: &str) -> Reply {
    Reply {
        stdout: serde_json::to_string(&e.to_json(version))
            .unwrap_or_else(|_| format!("{{\"code\":{},\"msg\":\"error\"}}", e.code())),
        status: 1,
    }
}
