//! Delegation to the IPAM plugin named in `ipam.type` (host-local, ...): the
//! same config on stdin, the same CNI_* environment, its result parsed back.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command as Proc, Output, Stdio},
};

use serde_json::Value;

use crate::{
    config::{CniEnv, NetConf},
    error::{Error, Result},
    types::{self, CniResult},
};

/// Runs the IPAM plugin with `command` for (`container_id`, `ifname`).
/// Returns its parsed result for ADD, `None` otherwise.
///
/// For cniVersion 1.1.0, which IPAM plugins may not speak yet (Debian's
/// host-local 1.1.1 stops at 1.0.0), asks the plugin's VERSION first and
/// delegates with the newest version both sides speak: the IPAM exchange is
/// internal to this plugin.
pub fn exec(
    conf: &NetConf,
    env: &CniEnv,
    command: &str,
    container_id: &str,
    ifname: &str,
) -> Result<Option<CniResult>> {
    // Versions up to 1.0.0 are spoken by every IPAM plugin we know; for newer
    // ones ask first rather than fail and retry (one exec less on ADD).
    if types::version_tuple(&conf.cni_version) <= (1, 0, 0) {
        return exec_version(conf, env, command, container_id, ifname, &conf.raw)
            .map(|r| r.map(|r| r.result));
    }
    let theirs = exec_version(conf, env, "VERSION", container_id, ifname, &conf.raw)?
        .map(|r| r.versions)
        .unwrap_or_default();
    let ours = types::version_tuple(&conf.cni_version);
    let common = types::SUPPORTED_VERSIONS
        .iter()
        .rev()
        .find(|v| types::version_tuple(v) <= ours && theirs.iter().any(|t| t == *v))
        .ok_or_else(|| {
            Error::config(
                "ipam.type",
                format!(
                    "{} speaks no CNI version we do (it speaks {theirs:?})",
                    conf.ipam_type
                ),
            )
        })?;
    let mut raw = conf.raw.clone();
    raw["cniVersion"] = Value::from(*common);
    exec_version(conf, env, command, container_id, ifname, &raw).map(|r| r.map(|r| r.result))
}

struct Answer {
    result: CniResult,
    versions: Vec<String>,
}

/// One call of the IPAM plugin with `command` and config `raw`, its
/// answer read: the result of ADD, the versions of VERSION.
fn exec_version(
    conf: &NetConf,
    env: &CniEnv,
    command: &str,
    container_id: &str,
    ifname: &str,
    raw: &Value,
) -> Result<Option<Answer>> {
    let plugin = find(conf, env)?;
    let out = run(&plugin, env, command, container_id, ifname, raw)?;
    let stdout = answer(conf, &out)?;
    match command {
        "VERSION" => Ok(Some(Answer {
            result: CniResult::default(),
            versions: versions(&stdout),
        })),
        "ADD" => added(conf, &stdout).map(|result| {
            Some(Answer {
                result,
                versions: Vec::new(),
            })
        }),
        _ => Ok(None),
    }
}

/// The IPAM plugin `ipam.type` names, on CNI_PATH.
fn find(conf: &NetConf, env: &CniEnv) -> Result<PathBuf> {
    if conf.ipam_type.is_empty() {
        return Err(Error::config(
            "ipam",
            "missing: xdpcni needs an IPAM plugin",
        ));
    }
    env.find_plugin(&conf.ipam_type).ok_or_else(|| {
        Error::config(
            "ipam.type",
            format!(
                "IPAM plugin {:?} not found in CNI_PATH {:?}",
                conf.ipam_type, env.path
            ),
        )
    })
}

/// Runs `plugin` with `command` and our CNI environment, `raw` on stdin.
fn run(
    plugin: &Path,
    env: &CniEnv,
    command: &str,
    container_id: &str,
    ifname: &str,
    raw: &Value,
) -> Result<Output> {
    let joined = |parts: Vec<String>, sep: &str| parts.join(sep);
    let cni_path = joined(
        env.path.iter().map(|p| p.display().to_string()).collect(),
        ":",
    );
    let args = joined(
        env.args.iter().map(|(k, v)| format!("{k}={v}")).collect(),
        ";",
    );
    let netns = env
        .netns
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut child = Proc::new(plugin)
        .env_clear()
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", ifname)
        .env("CNI_ARGS", args)
        .env("CNI_PATH", cni_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("running IPAM plugin {}", plugin.display()), e))?;
    if let Some(mut stdin) = child.stdin.take() {
        let bytes = serde_json::to_vec(raw).map_err(|e| Error::Decode(e.to_string()))?;
        match stdin.write_all(&bytes) {
            // A plugin may exit without reading stdin (VERSION): its exit
            // status and output decide, not our write.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            other => other.map_err(|e| Error::io("writing to the IPAM plugin", e))?,
        }
    }
    child
        .wait_with_output()
        .map_err(|e| Error::io("waiting for the IPAM plugin", e))
}

/// The plugin's stdout as JSON (`Null` when empty), or its error.
fn answer(conf: &NetConf, out: &Output) -> Result<Value> {
    let failed = |code: u32, msg: String, details: String| Error::Ipam {
        plugin: conf.ipam_type.clone(),
        code,
        msg,
        details,
    };
    let stdout: Value = if out.stdout.iter().all(u8::is_ascii_whitespace) {
        Value::Null
    } else {
        serde_json::from_slice(&out.stdout).map_err(|e| {
            failed(
                999,
                format!("unreadable answer: {e}"),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        })?
    };
    if out.status.success() {
        return Ok(stdout);
    }
    Err(failed(
        stdout
            .get("code")
            .and_then(Value::as_u64)
            .map_or(999, |c| c as u32),
        stdout
            .get("msg")
            .and_then(Value::as_str)
            .map_or_else(|| format!("exited with {}", out.status), str::to_string),
        stdout.get("details").and_then(Value::as_str).map_or_else(
            || String::from_utf8_lossy(&out.stderr).trim().to_string(),
            str::to_string,
        ),
    ))
}

/// The versions a VERSION answer lists.
fn versions(stdout: &Value) -> Vec<String> {
    stdout
        .get("supportedVersions")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The result of an ADD, which must hold an address.
fn added(conf: &NetConf, stdout: &Value) -> Result<CniResult> {
    let failed = |msg: String| Error::Ipam {
        plugin: conf.ipam_type.clone(),
        code: 999,
        msg,
        details: stdout.to_string(),
    };
    let result =
        CniResult::from_json(stdout).map_err(|e| failed(format!("unreadable result: {e}")))?;
    if result.ips.is_empty() {
        return Err(failed("returned no addresses".into()));
    }
    Ok(result)
}
