//! Driving the real `xdpcni` binary the way a container runtime does: the
//! network config on stdin, CNI_* in the environment, inside the node's
//! network namespace (only the network namespace, so bpffs stays visible),
//! with Debian's reference plugins (host-local, portmap, bandwidth) in
//! CNI_PATH. Also a conflist runner that chains plugins as libcni does.

use std::{
    io::Write,
    net::IpAddr,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use xdpcni_host::netconf::PluginConf;

use crate::netns::{unique_name, Netns};

/// Where Debian's containernetworking-plugins live.
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

/// The name of every test network (host-local keeps its leases under it).
pub const NETWORK_NAME: &str = "xdpcni-test";

static PRODUCT_BINARIES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`plugin_binary`] and [`agent_binary`] find the product builds
/// (`xdpcni`, `xdpcni-agent`: what a node runs) instead of this crate's
/// hooked ones: for the demo and the benchmarks, which set no test knob.
pub fn use_product_binaries() {
    PRODUCT_BINARIES.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The binary `product` (or, for the tests, its hooked build `hooked`) of
/// this build, in `target/<profile>/`.
fn binary(product: &str, hooked: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let (name, build) = if PRODUCT_BINARIES.load(std::sync::atomic::Ordering::Relaxed) {
        (
            product,
            "cargo build -p xdpcni-plugin -p xdpcni-agent --bins".to_string(),
        )
    } else {
        (
            hooked,
            "cargo build -p xdpcni-e2e --bins (cargo test -p xdpcni-e2e builds it)".to_string(),
        )
    };
    // target/<profile>/deps/<test> or target/<profile>/<bin>
    for dir in exe.ancestors().skip(1).take(2) {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "{name} is not built next to {} (run `{build}`)",
        exe.display()
    )
}

/// The CNI plugin the harness runs: `xdpcni-hooked` (the plugin with its
/// test hooks armed) for the tests, `xdpcni` after [`use_product_binaries`].
pub fn plugin_binary() -> Result<PathBuf> {
    binary("xdpcni", "xdpcni-hooked")
}

/// The prefix of every test knob ([`crate::hooks`]).
pub const TEST_KNOB_PREFIX: &str = "XDPCNI_TEST_";

/// Refuses to run `bin` with a test knob when it is no hooked build: it
/// would ignore the knob, and the test would fail later with nothing saying
/// why ("never reached migrate:started"). Only this crate's binaries
/// (`xdpcni-hooked`, `xdpcni-agent-hooked`) read the knobs; a product
/// binary carries no knob's name, which is what this looks for.
pub fn require_hooks<'a>(bin: &Path, env: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let Some(knob) = env.into_iter().find(|k| k.starts_with(TEST_KNOB_PREFIX)) else {
        return Ok(());
    };
    static CHECKED: std::sync::Mutex<Vec<(PathBuf, std::time::SystemTime, bool)>> =
        std::sync::Mutex::new(Vec::new());
    let modified = std::fs::metadata(bin)
        .and_then(|m| m.modified())
        .with_context(|| format!("reading {}", bin.display()))?;
    let mut checked = CHECKED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let hooked = match checked.iter().find(|(p, t, _)| p == bin && *t == modified) {
        Some((_, _, h)) => *h,
        None => {
            let data = std::fs::read(bin).with_context(|| format!("reading {}", bin.display()))?;
            let marker = crate::hooks::STOP_AT.as_bytes();
            let h = data.windows(marker.len()).any(|w| w == marker);
            checked.push((bin.to_path_buf(), modified, h));
            h
        }
    };
    if !hooked {
        bail!(
            "{} has no test hooks, so it would ignore {knob}: the tests run this crate's \
             hooked builds (xdpcni-hooked, xdpcni-agent-hooked; `cargo build -p xdpcni-e2e \
             --bins`), not the product binaries",
            bin.display()
        );
    }
    Ok(())
}

/// What one plugin call printed and returned.
#[derive(Debug)]
pub struct CniOutput {
    /// Exit status.
    pub status: i32,
    /// stdout as JSON (Null when empty).
    pub json: Value,
    /// stderr.
    pub stderr: String,
}

impl CniOutput {
    /// The CNI error code, when the call failed.
    pub fn code(&self) -> Option<u64> {
        (self.status != 0).then(|| self.json["code"].as_u64().unwrap_or(0))
    }
}

/// A directory removed on Drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// `/tmp/<unique>`.
    pub fn new(prefix: &str) -> Result<Self> {
        let p = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One invocation of a plugin.
#[derive(Clone, Debug)]
pub struct Call<'a> {
    /// CNI_COMMAND.
    pub command: &'a str,
    /// CNI_CONTAINERID.
    pub container_id: &'a str,
    /// CNI_NETNS (None: unset).
    pub netns: Option<&'a Path>,
    /// CNI_IFNAME.
    pub ifname: &'a str,
    /// CNI_ARGS.
    pub args: &'a str,
    /// Extra environment (e.g. XDPCNI_TEST_FAIL_AFTER), or variables to drop
    /// (value `None`).
    pub env: Vec<(&'a str, Option<&'a str>)>,
}

impl<'a> Call<'a> {
    /// A call for a pod.
    pub fn new(command: &'a str, container_id: &'a str, netns: Option<&'a Path>) -> Self {
        Self {
            command,
            container_id,
            netns,
            ifname: "eth0",
            args: "IgnoreUnknown=1",
            env: Vec::new(),
        }
    }
}

/// Runs `plugin` with `conf` on stdin inside `node`'s network namespace.
pub fn exec(
    plugin: &Path,
    cni_path: &str,
    node: &Netns,
    conf: &Value,
    call: &Call<'_>,
) -> Result<CniOutput> {
    exec_raw(plugin, cni_path, node, conf.to_string().as_bytes(), call)
}

/// [`exec`] with raw stdin bytes.
pub fn exec_raw(
    plugin: &Path,
    cni_path: &str,
    node: &Netns,
    stdin: &[u8],
    call: &Call<'_>,
) -> Result<CniOutput> {
    let child = spawn(plugin, cni_path, node, stdin, call)?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let json = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).with_context(|| format!("stdout is not JSON: {text}"))?
    };
    Ok(CniOutput {
        status: out.status.code().unwrap_or(-1),
        json,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Starts `plugin` inside `node` with `stdin` written and closed.
fn spawn(
    plugin: &Path,
    cni_path: &str,
    node: &Netns,
    stdin: &[u8],
    call: &Call<'_>,
) -> Result<Child> {
    require_hooks(plugin, call.env.iter().map(|(k, _)| *k))?;
    let ns = std::fs::File::open(node.path())?;
    let mut cmd = Command::new(plugin);
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", call.command)
        .env("CNI_CONTAINERID", call.container_id)
        .env("CNI_IFNAME", call.ifname)
        .env("CNI_ARGS", call.args)
        .env("CNI_PATH", cni_path);
    if let Some(n) = call.netns {
        cmd.env("CNI_NETNS", n);
    }
    for (k, v) in &call.env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let fd = ns.as_raw_fd();
    // SAFETY: setns(2) is async-signal-safe; the fd stays open until spawn
    // returns because `ns` lives until the end of this function.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {}", plugin.display()))?;
    child.stdin.take().context("stdin")?.write_all(stdin)?;
    Ok(child)
}

/// Runs `plugin` until it reaches the crash point `step` (it stops itself
/// there: `XDPCNI_TEST_STOP_AT`), then SIGKILLs it, as an OOM kill or a node
/// power cut would. Fails if the plugin ends without reaching `step`.
pub fn exec_killed_at(
    plugin: &Path,
    cni_path: &str,
    node: &Netns,
    conf: &Value,
    call: &Call<'_>,
    step: &str,
) -> Result<()> {
    let mut call = call.clone();
    call.env.push((crate::hooks::STOP_AT, Some(step)));
    let mut child = spawn(plugin, cni_path, node, conf.to_string().as_bytes(), &call)?;
    let pid = libc::pid_t::try_from(child.id())?;
    let mut status = 0;
    // SAFETY: waits for our own child; WUNTRACED also returns when it stops.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
    if r != pid {
        bail!("waitpid: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFSTOPPED(status) {
        // It ended (and is reaped): read what it said.
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        bail!(
            "{} ended (wait status {status:#x}) without reaching {step}: {err}",
            call.command
        );
    }
    child.kill()?;
    child.wait()?;
    Ok(())
}

/// A test network: a node namespace, xdpcni + reference plugins in CNI_PATH,
/// host-local with a private data directory, a private state directory and
/// log file, and the datapath pin directory to use (present or not).
#[derive(Debug)]
pub struct Network {
    /// The node ("host") namespace where the plugin runs.
    pub node: Netns,
    /// Temporary files: IPAM data, plugin state, log.
    pub dir: TempDir,
    /// The xdpcni binary.
    pub plugin: PathBuf,
    /// CNI_PATH.
    pub cni_path: String,
    /// The config given to xdpcni (the plugin's own type).
    pub conf: PluginConf,
}

impl Network {
    /// A network with IPv4 `v4` and IPv6 `v6` ranges (host-local syntax),
    /// datapath pins at `pin_dir`.
    pub fn new(pin_dir: &Path, version: &str, ranges: Value) -> Result<Self> {
        let node = Netns::new("xn")?;
        // An address for "the host" that pods can reach.
        node.ip(&["addr", "add", "10.99.0.1/32", "dev", "lo"])?;
        node.ip(&["-6", "addr", "add", "fd99::1/128", "dev", "lo"])?;
        let dir = TempDir::new("xdpcni-test-")?;
        let plugin = plugin_binary()?;
        let cni_path = format!(
            "{}:{REFERENCE_PLUGINS}",
            plugin.parent().context("plugin dir")?.display()
        );
        let mut conf = PluginConf::new(
            None,
            None,
            pin_dir.to_path_buf(),
            dir.path().join("state"),
            None,
            json!({
                "type": "host-local",
                "dataDir": dir.path().join("ipam"),
                "ranges": ranges,
            }),
        );
        conf.cni_version = Some(version.into());
        conf.name = Some(NETWORK_NAME.into());
        conf.log_file = Some(dir.path().join("xdpcni.log"));
        Ok(Self {
            node,
            dir,
            plugin,
            cni_path,
            conf,
        })
    }

    /// Dual-stack ranges: 10.78.0.0/24 and fd78::/64.
    pub fn dual_stack() -> Value {
        json!([[{"subnet": "10.78.0.0/24"}], [{"subnet": "fd78::/64"}]])
    }

    /// The config as the runtime hands it to the plugin (JSON).
    pub fn conf_json(&self) -> Result<Value> {
        serde_json::to_value(&self.conf).context("serializing the network's config")
    }

    /// Runs xdpcni with this network's config (plus `patch` merged at top
    /// level: a patch may carry what the type refuses, for the tests of
    /// malformed configs).
    pub fn call(&self, call: &Call<'_>, patch: &Value) -> Result<CniOutput> {
        let mut conf = self.conf_json()?;
        if let (Some(c), Some(p)) = (conf.as_object_mut(), patch.as_object()) {
            for (k, v) in p {
                c.insert(k.clone(), v.clone());
            }
        }
        exec(&self.plugin, &self.cni_path, &self.node, &conf, call)
    }

    /// [`exec_killed_at`] with this network's config.
    pub fn call_killed_at(&self, call: &Call<'_>, step: &str) -> Result<()> {
        exec_killed_at(
            &self.plugin,
            &self.cni_path,
            &self.node,
            &self.conf_json()?,
            call,
            step,
        )
    }

    /// The IPs host-local has allocated (files named by address).
    pub fn allocated_ips(&self) -> Vec<IpAddr> {
        let dir = self.dir.path().join("ipam").join(NETWORK_NAME);
        std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Attachment records left in the state directory.
    pub fn records(&self) -> usize {
        std::fs::read_dir(self.dir.path().join("state"))
            .map(|rd| rd.flatten().count())
            .unwrap_or(0)
    }

    /// Host veths the plugin made (`xdp` + 12 hex digits) still in the node.
    pub fn host_veths(&self) -> Result<Vec<String>> {
        let out = self.node.ip(&["-j", "link", "show"])?;
        let v: Value = serde_json::from_str(&out)?;
        Ok(v.as_array()
            .map(|links| {
                links
                    .iter()
                    .filter_map(|l| l["ifname"].as_str())
                    .filter(|n| n.starts_with("xdp") && n.len() == 15)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default())
    }

    /// The plugin's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("xdpcni.log")).unwrap_or_default()
    }
}

/// The agent the harness runs: `xdpcni-agent-hooked` for the tests,
/// `xdpcni-agent` after [`use_product_binaries`].
pub fn agent_binary() -> Result<PathBuf> {
    binary("xdpcni-agent", "xdpcni-agent-hooked")
}

/// A process started inside `node`'s network namespace, killed (by its PID)
/// on Drop.
#[derive(Debug)]
pub struct NodeProcess {
    child: Option<std::process::Child>,
}

impl NodeProcess {
    /// Spawns `cmd args` in the namespace, stderr to `log`.
    pub fn spawn(node: &Netns, cmd: &Path, args: &[&str], log: &Path) -> Result<Self> {
        Self::spawn_env(node, cmd, args, &[], log)
    }

    /// [`NodeProcess::spawn`] with extra environment variables.
    pub fn spawn_env(
        node: &Netns,
        cmd: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        log: &Path,
    ) -> Result<Self> {
        require_hooks(cmd, env.iter().map(|(k, _)| *k))?;
        let ns = std::fs::File::open(node.path())?;
        let fd = ns.as_raw_fd();
        let mut c = Command::new(cmd);
        c.args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?);
        // SAFETY: setns(2) is async-signal-safe; `ns` outlives spawn().
        unsafe {
            c.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = c
            .spawn()
            .with_context(|| format!("spawning {}", cmd.display()))?;
        drop(ns);
        Ok(Self { child: Some(child) })
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, std::process::Child::id)
    }

    /// Waits until the process has stopped itself (SIGSTOP at a crash point,
    /// `XDPCNI_TEST_STOP_AT`): its state in /proc is `T`.
    pub fn wait_stopped(&self, within: std::time::Duration) -> Result<()> {
        let start = std::time::Instant::now();
        let stat = format!("/proc/{}/stat", self.pid());
        loop {
            let text = std::fs::read_to_string(&stat)?;
            // pid (comm) state ...: the state follows the last ')'.
            let state = text
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            if state == Some("T") {
                return Ok(());
            }
            if start.elapsed() > within {
                bail!(
                    "pid {} not stopped after {within:?} (state {state:?})",
                    self.pid()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Waits for the process to exit by itself; its exit code.
    pub fn wait(mut self) -> Result<Option<i32>> {
        let mut child = self.child.take().context("already stopped")?;
        Ok(child.wait()?.code())
    }

    /// Sends `signal` and waits for the exit; returns the exit status code
    /// (None when killed by a signal).
    pub fn stop(mut self, signal: i32) -> Result<Option<i32>> {
        let mut child = self.child.take().context("already stopped")?;
        let pid = i32::try_from(child.id())?;
        // SAFETY: kill(2) on the PID of a child we own and have not reaped.
        unsafe { libc::kill(pid, signal) };
        Ok(child.wait()?.code())
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits until the agent on `node` answers 200 on `/readyz` at `addr`, at
/// most `within`; the error carries `log()` (the agent's log).
pub fn wait_ready(
    node: &Netns,
    addr: &str,
    within: Duration,
    log: impl Fn() -> String,
) -> Result<Duration> {
    let start = Instant::now();
    while !matches!(http_get(node, addr, "/readyz"), Ok((200, _))) {
        if start.elapsed() > within {
            bail!("agent not ready after {within:?}: {}", log());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(start.elapsed())
}

/// `GET path` on `addr` from inside `node`: (status code, body).
pub fn http_get(node: &Netns, addr: &str, path: &str) -> Result<(u16, String)> {
    http_raw(
        node,
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").into_bytes(),
    )
}

/// Sends `request` (raw bytes, in one write) to `addr` from inside `node`;
/// the status code and body of the answer.
pub fn http_raw(node: &Netns, addr: &str, request: Vec<u8>) -> Result<(u16, String)> {
    http_exchange(node, addr, request).map(|a| (a.status, a.body))
}

/// An HTTP answer: status, headers (name lower-cased, value trimmed), body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpAnswer {
    /// The status code.
    pub status: u16,
    /// The headers, in order.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl HttpAnswer {
    /// The value of header `name` (lower case), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// [`http_raw`], with the headers.
pub fn http_exchange(node: &Netns, addr: &str, request: Vec<u8>) -> Result<HttpAnswer> {
    use std::io::Read;
    let addr = addr.to_string();
    crate::in_netns(node, move || {
        let mut s = std::net::TcpStream::connect(&addr)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        // One write: a request split over several segments could be read
        // in part by a server that answers on the first read.
        s.write_all(&request)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        let out = String::from_utf8_lossy(&out);
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no status")?;
        let headers = head
            .lines()
            .skip(1)
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().to_ascii_lowercase(), v.trim().to_string()))
            })
            .collect();
        Ok(HttpAnswer {
            status,
            headers,
            body: body.to_string(),
        })
    })
}

/// The addresses of a CNI result (`ips[].address` without the prefix).
pub fn result_ips(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .map(|ips| {
            ips.iter()
                .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binary_without_test_hooks_is_refused_naming_the_build() {
        let dir = TempDir::new("xdpcni-hooks").unwrap();
        let bare = dir.path().join("bare");
        std::fs::write(&bare, b"\x7fELF no knobs here").unwrap();
        let hooked = dir.path().join("hooked");
        std::fs::write(&hooked, format!("..{}..", crate::hooks::STOP_AT)).unwrap();
        let err = require_hooks(&bare, ["PATH", crate::hooks::STOP_AT]).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("cargo build -p xdpcni-e2e --bins"), "{msg}");
        assert!(msg.contains(crate::hooks::STOP_AT), "{msg}");
        require_hooks(&hooked, [crate::hooks::STOP_AT]).unwrap();
        // Without a knob nothing is read: a product binary runs as it is.
        require_hooks(&dir.path().join("absent"), ["PATH"]).unwrap();
    }
}
