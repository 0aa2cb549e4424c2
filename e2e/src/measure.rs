//! What the benchmark and the scale benchmark both measure with: medians
//! and percentiles, target lines, the kernel's BPF statistics switch, CPU
//! and memory of a process and of the machine, and the forwarding workload
//! (a raw 64-byte frame from one pod to a raw-table DROP in another).

use std::{
    net::{IpAddr, SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::{
    netns::in_netns,
    netns::{parse_mac, Netns},
    packet::{eth, ipv4, udp, ETH_P_IP, IPPROTO_UDP},
    traffic::{raw_flood, udp_flood},
};

/// The median of `v` (sorted in place).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The `p` quantile (0..1) of `v`, nearest rank (sorted in place).
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[idx.min(v.len() - 1)]
}

/// How a target's value is held to its goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `>=`
    AtLeast,
    /// `<=`
    AtMost,
    /// `<`
    Below,
}

impl Op {
    /// Its sign in a target line.
    pub const fn sign(self) -> &'static str {
        match self {
            Self::AtLeast => ">=",
            Self::AtMost => "<=",
            Self::Below => "<",
        }
    }
}

/// One goal, printed as `target NAME: VALUE (goal OP N) met|missed`.
#[derive(Debug)]
pub struct Target {
    /// Its name in the line.
    pub name: &'static str,
    /// The measured value; `None` when it could not be measured (missed).
    pub value: Option<f64>,
    /// How the value is held to the goal.
    pub op: Op,
    /// The goal.
    pub goal: f64,
    /// What was compared, for the report.
    pub what: String,
}

impl Target {
    /// Whether the value meets the goal.
    pub fn met(&self) -> bool {
        self.value.is_some_and(|v| self.holds(v))
    }

    fn holds(&self, v: f64) -> bool {
        match self.op {
            Op::AtLeast => v >= self.goal,
            Op::AtMost => v <= self.goal,
            Op::Below => v < self.goal,
        }
    }

    /// The value with two decimals, or as many more as it takes for the
    /// printed figure to give the same verdict as the value (0.996 against
    /// `< 1` is met and prints as 0.996, not 1.00): every line can be checked
    /// from its own text.
    fn printed(&self, v: f64) -> String {
        (2..=9)
            .map(|digits| format!("{v:.digits$}"))
            .find(|s| s.parse().is_ok_and(|p| self.holds(p) == self.holds(v)))
            .unwrap_or_else(|| format!("{v}"))
    }

    /// `target NAME: VALUE (goal OP N) met|missed`, exactly: scripts read it.
    pub fn line(&self) -> String {
        let value = self
            .value
            .map_or_else(|| "none".to_string(), |v| self.printed(v));
        let verdict = if self.met() { "met" } else { "missed" };
        format!(
            "target {}: {value} (goal {} {}) {verdict}",
            self.name,
            self.op.sign(),
            self.goal
        )
    }

    /// The target as JSON for the report's data file.
    pub fn json(&self) -> Value {
        serde_json::json!({
            "name": self.name, "value": self.value, "goal": self.goal, "op": self.op.sign(),
            "met": self.met(), "what": self.what, "line": self.line(),
        })
    }
}

/// The end of a report: one line per note, the target lines, and what each
/// target compares.
pub fn report_tail(notes: &[String], targets: &[Target]) -> String {
    let mut md = String::new();
    md.push('\n');
    for n in notes {
        md.push_str(&format!("- {n}\n"));
    }
    md.push('\n');
    for t in targets {
        md.push_str(&t.line());
        md.push('\n');
    }
    md.push('\n');
    for t in targets {
        md.push_str(&format!("- {}: {}\n", t.name, t.what));
    }
    md
}

/// Prints `md` and writes `STEM.md`, `STEM.json` (`doc`) and `STEM.png`
/// (drawn by `e2e/bench/PLOT` with python3 and matplotlib) under `out`.
pub fn write_report(
    out: &std::path::Path,
    stem: &str,
    md: &str,
    doc: &Value,
    plot: &str,
) -> Result<()> {
    println!("{md}");
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join(format!("{stem}.md")), md)?;
    let json = out.join(format!("{stem}.json"));
    std::fs::write(&json, serde_json::to_vec_pretty(doc)?)?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("bench")
        .join(plot);
    let status = std::process::Command::new("python3")
        .arg(&script)
        .arg(&json)
        .arg(out.join(format!("{stem}.png")))
        .status()
        .context("running python3 for the chart")?;
    ensure!(status.success(), "chart rendering failed");
    eprintln!(
        "{stem}: wrote {0}/{stem}.md, {stem}.json, {stem}.png",
        out.display()
    );
    Ok(())
}

/// `kernel.bpf_stats_enabled`, restored to what it was on Drop.
pub struct BpfStats(String);

impl BpfStats {
    const PATH: &str = "/proc/sys/kernel/bpf_stats_enabled";

    /// Turns the kernel's per-program run time and count on.
    pub fn enable() -> Result<Self> {
        let old = std::fs::read_to_string(Self::PATH)?.trim().to_string();
        std::fs::write(Self::PATH, "1")?;
        Ok(Self(old))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, &self.0);
    }
}

/// (busy, total) jiffies of each CPU, from /proc/stat.
pub fn cpu_times() -> Result<Vec<(u64, u64)>> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let mut out = Vec::new();
    for line in stat.lines() {
        let mut f = line.split_whitespace();
        match f.next() {
            Some(c) if c.starts_with("cpu") && c.len() > 3 => {}
            _ => continue,
        }
        let v: Vec<u64> = f.filter_map(|x| x.parse().ok()).collect();
        ensure!(v.len() >= 5, "short /proc/stat line: {line}");
        let total: u64 = v.iter().sum();
        // idle + iowait are not busy
        out.push((total - v[3] - v[4], total));
    }
    Ok(out)
}

/// Busy share (0..1) of each CPU between two `cpu_times` samples.
pub fn busy_between(before: &[(u64, u64)], after: &[(u64, u64)]) -> Vec<f64> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| {
            let total = a.1.saturating_sub(b.1);
            if total == 0 {
                0.0
            } else {
                a.0.saturating_sub(b.0) as f64 / total as f64
            }
        })
        .collect()
}

/// CPU time (user + system, every thread) process `pid` has used.
pub fn process_cpu(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The fields after the command name, which is in parentheses and may
    // hold spaces: utime and stime are the 14th and 15th fields.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("no ')' in /proc/pid/stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    ensure!(f.len() > 13, "short /proc/{pid}/stat");
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(hz > 0, "sysconf(_SC_CLK_TCK) failed");
    Ok(Duration::from_secs_f64(ticks as f64 / hz as f64))
}

/// Share of one CPU (in %) process `pid` used over `window`.
pub fn process_cpu_percent(pid: u32, window: Duration) -> Result<f64> {
    let (c0, t0) = (process_cpu(pid)?, Instant::now());
    std::thread::sleep(window);
    let (c1, t1) = (process_cpu(pid)?, Instant::now());
    Ok(100.0 * (c1 - c0).as_secs_f64() / (t1 - t0).as_secs_f64())
}

/// Resident memory of process `pid`, MiB (`VmRSS`).
pub fn process_rss_mib(pid: u32) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .context("no VmRSS")?
        .parse()?;
    Ok(kb / 1024.0)
}

/// Packets `eth0` of `ns` has received.
pub fn rx_packets(ns: &Netns) -> Result<u64> {
    let out = ns.ip(&["-s", "-j", "link", "show", "eth0"])?;
    let v: Value = serde_json::from_str(&out)?;
    v[0]["stats64"]["rx"]["packets"]
        .as_u64()
        .context("no rx stats")
}

/// UDP datagrams of `payload` bytes per second delivered to `to_ns`'s eth0
/// from `from`'s flood to `dial` (one sender per entry of `cpus`, for
/// `dur`), received by a socket bound at `bind` (a Service address translated
/// or DNAT'd to it, or `dial` itself) that is never read: datagrams are
/// delivered, then dropped at the full socket, without ICMP replies.
pub fn udp_rate(
    from: &Netns,
    to_ns: &Netns,
    bind: SocketAddr,
    dial: SocketAddr,
    payload: usize,
    cpus: &[Option<usize>],
    dur: Duration,
) -> Result<f64> {
    let sink = in_netns(to_ns, || Ok(UdpSocket::bind(bind)?))?;
    let before = rx_packets(to_ns)?;
    let start = Instant::now();
    let sent = udp_flood(from, dial, payload, cpus, dur)?;
    let elapsed = start.elapsed();
    std::thread::sleep(Duration::from_millis(100));
    let delivered = rx_packets(to_ns)? - before;
    drop(sink);
    ensure!(sent > 0, "nothing sent");
    Ok(delivered as f64 / elapsed.as_secs_f64())
}

/// The destination port of the forwarding workload (discard).
pub const FWD_PORT: u16 = 9;

fn link_mac(out: &str) -> Result<[u8; 6]> {
    let v: Value = serde_json::from_str(out)?;
    parse_mac(v[0]["address"].as_str().context("no MAC")?)
}

/// A 64-byte UDP frame from the pod `from` (host veth `host` in `node`) at
/// `src` to `dst`, as its eth0 would put it on the wire: to the host veth's
/// MAC (the pod's gateway), a valid IPv4 header, to [`FWD_PORT`].
pub fn frame_between(
    node: &Netns,
    host: &str,
    from: &Netns,
    src: IpAddr,
    dst: IpAddr,
) -> Result<Vec<u8>> {
    let (IpAddr::V4(src), IpAddr::V4(dst)) = (src, dst) else {
        bail!("the forwarding workload is IPv4");
    };
    let host_mac = link_mac(&node.ip(&["-j", "link", "show", host])?)?;
    let pod_mac = link_mac(&from.ip(&["-j", "link", "show", "eth0"])?)?;
    let f = eth(
        host_mac,
        pod_mac,
        ETH_P_IP,
        &ipv4(src, dst, 64, IPPROTO_UDP, &udp(9000, FWD_PORT, &[0x5a; 22])),
    );
    ensure!(f.len() == 64, "frame is {} bytes", f.len());
    Ok(f)
}

/// What a forwarding run measured.
pub struct Fwd {
    /// Frames per second that reached the sink.
    pub rate: f64,
    /// Busy share of each CPU while the sender ran.
    pub busy: Vec<f64>,
}

/// Frames per second of `frame` that reached an iptables raw-table DROP in
/// `to` while `from`'s raw sender ran with one thread per entry of `cpus`.
pub fn raw_sink_rate(
    from: &Netns,
    to: &Netns,
    frame: &[u8],
    cpus: &[Option<usize>],
    dur: Duration,
) -> Result<Fwd> {
    let port = FWD_PORT.to_string();
    let rule = [
        "PREROUTING",
        "-i",
        "eth0",
        "-p",
        "udp",
        "--dport",
        &port,
        "-j",
        "DROP",
    ];
    let iptables = |op: &str| -> Result<String> {
        let mut args = vec!["iptables", "-w", "-t", "raw", op];
        args.extend(rule);
        to.exec(&args)
    };
    iptables("-A")?;
    let before = rx_packets(to);
    let t0 = cpu_times()?;
    let start = Instant::now();
    let sent = raw_flood(from, "eth0", frame, cpus, dur);
    let busy = busy_between(&t0, &cpu_times()?);
    std::thread::sleep(Duration::from_millis(100));
    let after = rx_packets(to);
    let elapsed = start.elapsed();
    iptables("-D")?;
    sent?;
    Ok(Fwd {
        rate: (after? - before?) as f64 / elapsed.as_secs_f64(),
        busy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_targets() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(median(&mut v), 50.5);
        assert!(median(&mut []).is_nan());
        let t = |value, op| Target {
            name: "x",
            value,
            op,
            goal: 1.0,
            what: String::new(),
        };
        assert_eq!(
            t(Some(1.0), Op::AtMost).line(),
            "target x: 1.00 (goal <= 1) met"
        );
        assert_eq!(
            t(Some(1.0), Op::Below).line(),
            "target x: 1.00 (goal < 1) missed"
        );
        // Printed with the digits its verdict needs.
        assert_eq!(
            t(Some(0.996), Op::Below).line(),
            "target x: 0.996 (goal < 1) met"
        );
        assert_eq!(
            t(Some(0.9999), Op::AtLeast).line(),
            "target x: 0.9999 (goal >= 1) missed"
        );
        assert_eq!(
            t(Some(1.004), Op::AtMost).line(),
            "target x: 1.004 (goal <= 1) missed"
        );
        assert_eq!(
            t(Some(1.5), Op::AtLeast).line(),
            "target x: 1.50 (goal >= 1) met"
        );
        assert_eq!(
            t(None, Op::AtLeast).line(),
            "target x: none (goal >= 1) missed"
        );
    }

    #[test]
    fn this_process_uses_cpu_and_memory() {
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(50) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(process_cpu(std::process::id()).unwrap() > Duration::ZERO);
        assert!(process_rss_mib(std::process::id()).unwrap() > 1.0);
    }
}
