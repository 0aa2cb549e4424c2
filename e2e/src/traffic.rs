//! Traffic between namespaces: ping (iputils), and UDP echo and TCP transfers
//! from threads that entered the pods' namespaces. Bounded in time: nothing
//! here can hang a test.

use std::{
    io::{Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use crate::netns::{in_netns, Netns};

const DEADLINE: Duration = Duration::from_secs(20);

/// `ping -c count` from `from` to `to`; fails unless every reply came back.
pub fn ping(from: &Netns, to: IpAddr, count: u32) -> Result<()> {
    let c = count.to_string();
    let fam = if to.is_ipv6() { "-6" } else { "-4" };
    let out = from
        .exec(&[
            "ping",
            fam,
            "-n",
            "-q",
            "-c",
            &c,
            "-i",
            "0.2",
            "-W",
            "2",
            &to.to_string(),
        ])
        .with_context(|| format!("ping {to} from {}", from.name()))?;
    ensure!(
        out.contains(&format!("{count} packets transmitted, {count} received")),
        "ping {to} lost replies: {out}"
    );
    Ok(())
}

/// Sends `n` datagrams of `size` bytes from `from` to a UDP echo server on
/// `to` inside `to_ns`, one at a time, and checks every echo.
pub fn udp_echo(from: &Netns, to_ns: &Netns, to: IpAddr, n: usize, size: usize) -> Result<()> {
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let server = s.spawn(move || {
            in_netns(to_ns, || {
                let sock = UdpSocket::bind(SocketAddr::new(to, 0))?;
                sock.set_read_timeout(Some(Duration::from_secs(3)))?;
                tx.send(sock.local_addr()?.port())?;
                let mut buf = vec![0u8; 65536];
                for _ in 0..n {
                    let (len, peer) = sock.recv_from(&mut buf).context("echo server recv")?;
                    sock.send_to(&buf[..len], peer)?;
                }
                Ok(())
            })
        });
        let port = rx.recv_timeout(Duration::from_secs(5))?;
        let client = in_netns(from, || {
            let bind = if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
            let sock = UdpSocket::bind(bind)?;
            sock.set_read_timeout(Some(Duration::from_secs(2)))?;
            let mut buf = vec![0u8; 65536];
            for i in 0..n {
                let msg: Vec<u8> = (0..size).map(|j| (i + j) as u8).collect();
                sock.send_to(&msg, SocketAddr::new(to, port))?;
                let (len, _) = sock
                    .recv_from(&mut buf)
                    .with_context(|| format!("no echo for datagram {i} to {to}"))?;
                ensure!(buf[..len] == msg[..], "echo {i} differs");
            }
            Ok(())
        });
        let server = server
            .join()
            .map_err(|_| anyhow::anyhow!("udp server panicked"))?;
        client.and(server)
    })
}

fn fnv(h: &mut u64, data: &[u8]) {
    for b in data {
        *h ^= u64::from(*b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

/// What a TCP run sends: `bytes`, hashed on both ends and compared (a
/// check of delivery: the hashing caps the rate, ~5 Gbit/s here), or as much
/// as it can for a time, only counted (a measure of the path's rate).
#[derive(Debug, Clone, Copy)]
enum Load {
    Checked(usize),
    Timed(Duration),
}

/// Streams `bytes` over TCP from `from` to a server on `to` inside `to_ns`;
/// the server answers with the length and hash it received, which must match.
/// Returns the goodput in Mbit/s (informative only: the hashing bounds it).
pub fn tcp_transfer(from: &Netns, to_ns: &Netns, to: IpAddr, bytes: usize) -> Result<f64> {
    tcp_run(from, to_ns, to, Load::Checked(bytes))
}

/// One TCP stream from `from` to a server on `to` inside `to_ns` for `time`,
/// nothing computed per byte on either end (the server's count must equal
/// what was sent): the goodput in Mbit/s, what the path carries.
pub fn tcp_stream(from: &Netns, to_ns: &Netns, to: IpAddr, time: Duration) -> Result<f64> {
    tcp_run(from, to_ns, to, Load::Timed(time))
}

/// The server end: one connection accepted on `listener`, read to its end;
/// answers with the bytes it got and their hash (0 when `hash` is off).
fn tcp_sink(listener: &TcpListener, to: IpAddr, hash: bool) -> Result<()> {
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    let mut conn = loop {
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() > DEADLINE {
                    bail!("no TCP connection to {to}");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    };
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let (mut n, mut h) = (0u64, 0xcbf2_9ce4_8422_2325u64);
    let mut buf = vec![0u8; 1 << 17];
    loop {
        let len = conn.read(&mut buf).context("server read")?;
        if len == 0 {
            break;
        }
        n += len as u64;
        if hash {
            fnv(&mut h, &buf[..len]);
        }
    }
    conn.write_all(&n.to_be_bytes())?;
    conn.write_all(&(if hash { h } else { 0 }).to_be_bytes())?;
    Ok(())
}

/// The client end: `load` sent to `to:port`, the server's answer checked; Mbit/s.
fn tcp_source(to: IpAddr, port: u16, load: Load) -> Result<f64> {
    let start = Instant::now();
    let mut conn = TcpStream::connect_timeout(&SocketAddr::new(to, port), Duration::from_secs(5))
        .with_context(|| format!("TCP connect to {to}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    let chunk: Vec<u8> = (0..1 << 17).map(|i: usize| (i * 7 + 3) as u8).collect();
    let (mut h, mut sent) = (0xcbf2_9ce4_8422_2325u64, 0usize);
    loop {
        let len = match load {
            Load::Checked(bytes) if sent >= bytes => break,
            Load::Checked(bytes) => chunk.len().min(bytes - sent),
            Load::Timed(time) if start.elapsed() >= time => break,
            Load::Timed(_) => chunk.len(),
        };
        conn.write_all(&chunk[..len]).context("client write")?;
        if matches!(load, Load::Checked(_)) {
            fnv(&mut h, &chunk[..len]);
        }
        sent += len;
    }
    conn.shutdown(Shutdown::Write)?;
    let mut reply = [0u8; 16];
    conn.read_exact(&mut reply).context("server summary")?;
    let (mut n, mut rh) = ([0u8; 8], [0u8; 8]);
    n.copy_from_slice(&reply[..8]);
    rh.copy_from_slice(&reply[8..]);
    let got = u64::from_be_bytes(n);
    ensure!(got == sent as u64, "server got {got} of {sent} bytes");
    if matches!(load, Load::Checked(_)) {
        ensure!(u64::from_be_bytes(rh) == h, "stream corrupted in transit");
    }
    Ok(sent as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e6)
}

fn tcp_run(from: &Netns, to_ns: &Netns, to: IpAddr, load: Load) -> Result<f64> {
    let hash = matches!(load, Load::Checked(_));
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let server = s.spawn(move || {
            in_netns(to_ns, || {
                let listener = TcpListener::bind(SocketAddr::new(to, 0))?;
                tx.send(listener.local_addr()?.port())?;
                tcp_sink(&listener, to, hash)
            })
        });
        let port = rx.recv_timeout(Duration::from_secs(5))?;
        let client = in_netns(from, || tcp_source(to, port, load));
        let server = server
            .join()
            .map_err(|_| anyhow::anyhow!("tcp server panicked"))?;
        let mbps = client?;
        server?;
        Ok(mbps)
    })
}

/// `ping -i 0.01` from a namespace, running in the background while a test
/// restarts or reconfigures things; killed by its PID on Drop. Its output
/// is read as it comes (a thread of its own): each request's fate by
/// sequence number, with ping's own timestamps (`-D`) and its report of
/// each request still unanswered when it sends the next (`-O`).
#[derive(Debug)]
pub struct BackgroundPing {
    child: Option<std::process::Child>,
    reader: Option<std::thread::JoinHandle<PingOutput>>,
    count: u32,
}

/// What a ping printed: the requests answered, those answered by an ICMP
/// error, those reported unanswered (with when, in seconds since the
/// epoch), and its summary.
#[derive(Debug, Default)]
struct PingOutput {
    replied: std::collections::BTreeSet<u32>,
    errors: std::collections::BTreeSet<u32>,
    unanswered: std::collections::BTreeMap<u32, f64>,
    summary: String,
}

impl PingOutput {
    /// Reads one line of ping's output.
    fn line(&mut self, line: &str) {
        // "[1733590000.123456] " before every line but the summary (-D).
        let (at, text) = match line
            .strip_prefix('[')
            .and_then(|l| l.split_once("] "))
            .and_then(|(t, rest)| Some((t.parse::<f64>().ok()?, rest)))
        {
            Some((at, rest)) => (Some(at), rest),
            None => (None, line),
        };
        let seq = |after: &str| -> Option<u32> {
            text.split_once(after)?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        if let Some(n) = seq("no answer yet for icmp_seq=") {
            self.unanswered.insert(n, at.unwrap_or(0.0));
        } else if text.starts_with("From ") {
            self.errors.extend(seq("icmp_seq="));
        } else if text.contains(" time=") && !text.contains("DUP!") {
            self.replied.extend(seq("icmp_seq="));
        }
    }
}

/// How long before [`BackgroundPing::interrupt`] a request must have been
/// reported unanswered to be judged lost: a reply may still be on its way.
pub const PING_UNJUDGED: Duration = Duration::from_millis(200);

impl BackgroundPing {
    /// Starts `count` pings, one every 10 ms, from `from` to `to`.
    pub fn start(from: &Netns, to: IpAddr, count: u32) -> Result<Self> {
        let mut child = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                from.name(),
                "ping",
                "-n",
                "-D",
                "-O",
                "-i",
                "0.01",
                "-W",
                "1",
            ])
            .arg("-c")
            .arg(count.to_string())
            .arg(to.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting ping")?;
        let stdout = child.stdout.take().context("ping's stdout")?;
        let reader = std::thread::spawn(move || {
            use std::io::BufRead;
            let mut out = PingOutput::default();
            let mut in_summary = false;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                in_summary |= line.starts_with("--- ");
                if in_summary {
                    out.summary.push_str(&line);
                    out.summary.push('\n');
                } else {
                    out.line(&line);
                }
            }
            out
        });
        Ok(Self {
            child: Some(child),
            reader: Some(reader),
            count,
        })
    }

    /// Waits for ping to end (`signal` first, if any) and for its output.
    fn output(&mut self, signal: Option<libc::c_int>) -> Result<PingOutput> {
        let mut child = self.child.take().context("already waited")?;
        if let Some(sig) = signal {
            let pid = libc::pid_t::try_from(child.id())?;
            // SAFETY: kill(2) of our own child, by its PID.
            unsafe {
                libc::kill(pid, sig);
            }
        }
        child.wait()?;
        self.reader
            .take()
            .context("already read")?
            .join()
            .map_err(|_| anyhow::anyhow!("the ping reader panicked"))
    }

    /// Waits for the end; how many replies were lost.
    pub fn lost(self) -> Result<u32> {
        Ok(self.stats()?.lost)
    }

    /// Ends the pings now (SIGINT); of the requests sent, how many are
    /// lost: answered by an ICMP error, or reported unanswered at least
    /// [`PING_UNJUDGED`] before now and never answered since. A request
    /// still in flight when ping is stopped is not a loss (counting it, as
    /// ping's summary does, once made the migration test report a lost ping
    /// to its cpumap pod: 150 interrupts of steady pings with nothing else
    /// happening lost one there). So a caller leaves at least 200 ms after
    /// what it checks.
    pub fn interrupt(mut self) -> Result<PingStats> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64();
        let out = self.output(Some(libc::SIGINT))?;
        let sent = summary_field(&out.summary, " packets transmitted")?;
        Ok(PingStats {
            sent,
            lost: judged_lost(&out, now - PING_UNJUDGED.as_secs_f64()),
            avg_ms: None,
            max_ms: None,
        })
    }

    /// Waits for the end; losses and round-trip times.
    pub fn stats(mut self) -> Result<PingStats> {
        let out = self.output(None)?;
        let received = summary_field(&out.summary, " received")?;
        // "rtt min/avg/max/mdev = 0.041/0.062/0.311/0.030 ms" (absent when
        // nothing came back).
        let rtt: Vec<f64> = out
            .summary
            .split_once("rtt min/avg/max/mdev = ")
            .map(|(_, r)| {
                r.split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .split('/')
                    .filter_map(|v| v.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        Ok(PingStats {
            sent: self.count,
            lost: self.count.saturating_sub(received),
            avg_ms: rtt.get(1).copied(),
            max_ms: rtt.get(2).copied(),
        })
    }
}

/// The requests of `out` lost by `judged_until` (seconds since the epoch):
/// answered by an ICMP error, or reported unanswered by then and never
/// answered.
fn judged_lost(out: &PingOutput, judged_until: f64) -> u32 {
    let silent = out
        .unanswered
        .iter()
        .filter(|(n, at)| {
            **at <= judged_until && !out.replied.contains(n) && !out.errors.contains(n)
        })
        .count();
    let errors = out.errors.difference(&out.replied).count();
    u32::try_from(silent + errors).unwrap_or(u32::MAX)
}

/// A count of ping's summary ("N packets transmitted, M received, ...").
fn summary_field(summary: &str, suffix: &str) -> Result<u32> {
    summary
        .split(',')
        .find_map(|part| part.trim().strip_suffix(suffix))
        .and_then(|n| n.split_whitespace().last()?.parse().ok())
        .with_context(|| format!("no ping summary in {summary}"))
}

/// What a [`BackgroundPing`] saw.
#[derive(Clone, Copy, Debug)]
pub struct PingStats {
    /// Echo requests sent.
    pub sent: u32,
    /// Requests without a reply.
    pub lost: u32,
    /// Mean round trip (None when no reply came).
    pub avg_ms: Option<f64>,
    /// Longest round trip.
    pub max_ms: Option<f64>,
}

impl Drop for BackgroundPing {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// `PACKET_QDISC_BYPASS` from linux/if_packet.h (not in the libc crate).
const PACKET_QDISC_BYPASS: libc::c_int = 20;

/// Pins the calling thread to `cpu`.
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    ensure!(cpu < libc::CPU_SETSIZE as usize, "CPU {cpu} out of range");
    // SAFETY: `set` is a valid cpu_set_t and cpu < CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is sized as passed.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    ensure!(
        rc == 0,
        "sched_setaffinity CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// What an AF_PACKET socket from [`packet_socket`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketUse {
    /// Sending straight to the driver (`PACKET_QDISC_BYPASS`), receiving
    /// nothing (protocol 0 binds no receive hook): floods.
    Flood,
    /// Sending, and capturing every frame that arrives (`ETH_P_ALL`) but
    /// not its own (`PACKET_IGNORE_OUTGOING`): probes.
    Capture,
}

/// An AF_PACKET socket bound to `ifname` of the calling thread's namespace.
pub fn packet_socket(ifname: &str, usage: PacketUse) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let (proto, option, option_name) = match usage {
        PacketUse::Flood => (0u16, PACKET_QDISC_BYPASS, "PACKET_QDISC_BYPASS"),
        PacketUse::Capture => (
            (libc::ETH_P_ALL as u16).to_be(),
            libc::PACKET_IGNORE_OUTGOING,
            "PACKET_IGNORE_OUTGOING",
        ),
    };
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from(proto),
        )
    };
    ensure!(
        fd >= 0,
        "socket(AF_PACKET): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: fd is a fresh socket we own from here on.
    let sock = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: `one` outlives the call and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            option,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    ensure!(
        rc == 0,
        "{option_name}: {}",
        std::io::Error::last_os_error()
    );
    let name = std::ffi::CString::new(ifname)?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    ensure!(ifindex != 0, "no interface {ifname}");
    // SAFETY: a zeroed sockaddr_ll is valid; the fields set below are its own.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: `sll` is a sockaddr_ll of the size passed.
    let rc = unsafe {
        libc::bind(
            fd,
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    ensure!(
        rc == 0,
        "bind AF_PACKET {ifname}: {}",
        std::io::Error::last_os_error()
    );
    Ok(sock)
}

/// Sends each of `frames` once out of `ifname` in `from` (AF_PACKET,
/// past the qdisc, paced), retrying a frame the driver refused for want of
/// room.
/// Returns frames sent: all of them, or an error.
pub fn send_frames(from: &Netns, ifname: &str, frames: &[Vec<u8>]) -> Result<usize> {
    in_netns(from, || {
        let sock = packet_socket(ifname, PacketUse::Flood)?;
        for (i, f) in frames.iter().enumerate() {
            // Paced: a burst would overflow the veth's 256-frame ring, and
            // the point is that every frame arrives.
            if i % 32 == 31 {
                std::thread::sleep(Duration::from_micros(500));
            }
            let mut tries = 0;
            loop {
                // SAFETY: `f` outlives the call; the socket is bound.
                let n = unsafe {
                    libc::send(
                        std::os::fd::AsRawFd::as_raw_fd(&sock),
                        f.as_ptr().cast(),
                        f.len(),
                        0,
                    )
                };
                if n == f.len() as isize {
                    break;
                }
                let e = std::io::Error::last_os_error();
                tries += 1;
                ensure!(
                    tries < 1000 && e.raw_os_error() == Some(libc::ENOBUFS),
                    "sending frame {i}: {e}"
                );
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(frames.len())
    })
}

/// Sends `payload` from `from` as fast as `sendmmsg` batches of 64 go, from
/// one thread per entry of `cpus` (`Some(n)`: pinned to CPU n), each on its
/// own socket from `open` (called inside the namespace), for `dur`. Returns
/// messages handed to the kernel.
pub fn flood(
    from: &Netns,
    open: impl Fn() -> Result<std::os::fd::OwnedFd> + Sync,
    payload: &[u8],
    cpus: &[Option<usize>],
    dur: Duration,
) -> Result<u64> {
    const BATCH: usize = 64;
    let open = &open;
    std::thread::scope(|s| {
        let handles: Vec<_> = cpus
            .iter()
            .map(|cpu| {
                s.spawn(move || {
                    in_netns(from, || {
                        if let Some(cpu) = cpu {
                            pin_to_cpu(*cpu)?;
                        }
                        let sock = open()?;
                        let mut buf = payload.to_vec();
                        let mut iov = libc::iovec {
                            iov_base: buf.as_mut_ptr().cast(),
                            iov_len: buf.len(),
                        };
                        // SAFETY: zeroed mmsghdr is valid; each points at the one iovec.
                        let mut msgs: Vec<libc::mmsghdr> =
                            (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
                        for m in &mut msgs {
                            m.msg_hdr.msg_iov = &mut iov;
                            m.msg_hdr.msg_iovlen = 1;
                        }
                        let deadline = Instant::now() + dur;
                        let mut sent = 0u64;
                        while Instant::now() < deadline {
                            // SAFETY: msgs/iov/buf outlive the call; the socket is
                            // connected or bound, so no address is needed.
                            let n = unsafe {
                                libc::sendmmsg(
                                    std::os::fd::AsRawFd::as_raw_fd(&sock),
                                    msgs.as_mut_ptr(),
                                    BATCH as u32,
                                    0,
                                )
                            };
                            if n > 0 {
                                sent += n as u64;
                            }
                        }
                        Ok(sent)
                    })
                })
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        }
        Ok(total)
    })
}

/// Sends the prebuilt Ethernet `frame` out of `ifname` in `from`, skipping
/// the pod's socket and qdisc layers (see [`flood`]). Returns frames handed
/// to the driver.
pub fn raw_flood(
    from: &Netns,
    ifname: &str,
    frame: &[u8],
    cpus: &[Option<usize>],
    dur: Duration,
) -> Result<u64> {
    flood(
        from,
        || packet_socket(ifname, PacketUse::Flood),
        frame,
        cpus,
        dur,
    )
}

/// One unpinned sender per online CPU, for [`flood`] and [`udp_flood`].
pub fn every_cpu() -> Vec<Option<usize>> {
    vec![None; std::thread::available_parallelism().map_or(1, |n| n.get())]
}

/// Sends UDP datagrams of `payload` bytes from `from` to `to` through
/// ordinary connected sockets (see [`flood`]). Returns datagrams sent.
pub fn udp_flood(
    from: &Netns,
    to: SocketAddr,
    payload: usize,
    cpus: &[Option<usize>],
    dur: Duration,
) -> Result<u64> {
    let open = || -> Result<std::os::fd::OwnedFd> {
        let sock = UdpSocket::bind("0.0.0.0:0")?;
        sock.connect(to)?;
        Ok(sock.into())
    };
    flood(from, open, &vec![0x5a; payload], cpus, dur)
}

/// TCP request/response round trips from `from` to an echo server in `to_ns`
/// at `to`: one connection, TCP_NODELAY, one 32-byte request in flight,
/// both ends busy-polling (see the UDP version in the bench). Microseconds,
/// after `warmup` unrecorded rounds.
pub fn tcp_rr(
    from: &Netns,
    to_ns: &Netns,
    to: SocketAddr,
    rounds: usize,
    warmup: usize,
) -> Result<Vec<f64>> {
    tcp_rr_via(from, to_ns, to, to, rounds, warmup)
}

/// [`tcp_rr`] with the server bound at `bind` and the client dialing `dial`
/// (a Service address translated or DNAT'd to `bind`).
pub fn tcp_rr_via(
    from: &Netns,
    to_ns: &Netns,
    bind: SocketAddr,
    dial: SocketAddr,
    rounds: usize,
    warmup: usize,
) -> Result<Vec<f64>> {
    // Both ends busy-poll: each on a CPU of its own where there are two, or
    // the scheduler's placement (one CPU taking turns, or two) makes the
    // round trip bimodal (5.5 or 11 us here) whatever the path.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (client_cpu, server_cpu) = (0, cpus.saturating_sub(1));
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let stop = &stop;
        let server = s.spawn(move || {
            in_netns(to_ns, || {
                if cpus > 1 {
                    pin_to_cpu(server_cpu)?;
                }
                let l = TcpListener::bind(bind)?;
                l.set_nonblocking(true)?;
                tx.send(())?;
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut c = loop {
                    match l.accept() {
                        Ok((c, _)) => break c,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if stop.load(std::sync::atomic::Ordering::Relaxed)
                                || Instant::now() > deadline
                            {
                                return Ok(());
                            }
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        Err(e) => return Err(e.into()),
                    }
                };
                c.set_nodelay(true)?;
                c.set_nonblocking(true)?;
                let mut buf = [0u8; 32];
                let mut have = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match c.read(&mut buf[have..]) {
                        Ok(0) => break,
                        Ok(n) => {
                            have += n;
                            if have == buf.len() {
                                c.write_all(&buf)?;
                                have = 0;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::hint::spin_loop()
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(())
            })
        });
        let result = (|| {
            rx.recv_timeout(Duration::from_secs(5))?;
            // in_netns runs each end on a thread of its own: pinned alone.
            in_netns(from, || {
                if cpus > 1 {
                    pin_to_cpu(client_cpu)?;
                }
                let mut c = TcpStream::connect_timeout(&dial, Duration::from_secs(5))?;
                c.set_nodelay(true)?;
                c.set_nonblocking(true)?;
                let req = [7u8; 32];
                let mut buf = [0u8; 32];
                let mut rtts = Vec::with_capacity(rounds);
                for i in 0..rounds + warmup {
                    let t = Instant::now();
                    c.write_all(&req)?;
                    let mut have = 0;
                    while have < buf.len() {
                        match c.read(&mut buf[have..]) {
                            Ok(0) => bail!("echo server closed"),
                            Ok(n) => have += n,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                ensure!(t.elapsed() < Duration::from_secs(1), "round {i} lost");
                                std::hint::spin_loop();
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    if i >= warmup {
                        rtts.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                c.shutdown(Shutdown::Both)?;
                Ok(rtts)
            })
        })();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        server
            .join()
            .map_err(|_| anyhow::anyhow!("echo server panicked"))??;
        result
    })
}

/// What an [`echo_probe`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EchoCount {
    /// Echo requests handed to the kernel (sends that failed, for want of a
    /// route or an interface, are not counted).
    pub sent: u64,
    /// Echo replies from the destination.
    pub replies: u64,
    /// When the first reply came, from the start.
    pub first_reply: Option<Duration>,
}

fn icmp_checksum(b: &[u8]) -> u16 {
    let mut sum: u32 = b
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Sends an ICMP (or ICMPv6) echo request to `to` every `every` for `for_`
/// from a thread that entered the network namespace at `netns` (a path, so
/// the probe can run while the namespace is handed to a CNI ADD), counting
/// the replies from `to`. Sends go on when they fail (no interface or
/// route yet): the probe can start before the namespace has a network.
pub fn echo_probe(
    netns: std::path::PathBuf,
    to: IpAddr,
    every: Duration,
    for_: Duration,
) -> std::thread::JoinHandle<Result<EchoCount>> {
    std::thread::spawn(move || {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let ns = std::fs::File::open(&netns)?;
        // SAFETY: a valid namespace fd; only this thread changes namespace.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!(
                "setns {}: {}",
                netns.display(),
                std::io::Error::last_os_error()
            );
        }
        let (family, proto, echo, reply) = match to {
            IpAddr::V4(_) => (libc::AF_INET, libc::IPPROTO_ICMP, 8u8, 0u8),
            IpAddr::V6(_) => (libc::AF_INET6, libc::IPPROTO_ICMPV6, 128u8, 129u8),
        };
        // SAFETY: socket(2); the fd is owned below.
        let raw = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_NONBLOCK, proto) };
        ensure!(
            raw >= 0,
            "raw ICMP socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let id = (std::process::id() as u16) ^ 0x5a5a;
        let dest = socket2_addr(to);
        let mut count = EchoCount::default();
        let start = Instant::now();
        let mut seq: u16 = 0;
        let mut buf = [0u8; 2048];
        while start.elapsed() < for_ {
            let mut msg = vec![echo, 0, 0, 0];
            msg.extend_from_slice(&id.to_be_bytes());
            msg.extend_from_slice(&seq.to_be_bytes());
            msg.extend_from_slice(b"xdpcni-window-probe");
            if to.is_ipv4() {
                let c = icmp_checksum(&msg);
                msg[2..4].copy_from_slice(&c.to_be_bytes());
            }
            seq = seq.wrapping_add(1);
            // SAFETY: msg and dest are valid for the lengths given.
            let sent = unsafe {
                libc::sendto(
                    fd.as_raw_fd(),
                    msg.as_ptr().cast(),
                    msg.len(),
                    0,
                    dest.0.as_ptr().cast(),
                    dest.1,
                )
            };
            if sent > 0 {
                count.sent += 1;
            }
            let next = Instant::now() + every;
            while Instant::now() < next {
                let mut from = [0u8; 128];
                let mut from_len = from.len() as libc::socklen_t;
                // SAFETY: buf and from are valid for the lengths given.
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        from.as_mut_ptr().cast(),
                        &mut from_len,
                    )
                };
                if n <= 0 {
                    std::thread::sleep(Duration::from_micros(100));
                    continue;
                }
                let n = n as usize;
                // IPv4 raw sockets see the IP header; IPv6 ones do not.
                let icmp = if to.is_ipv4() {
                    let ihl = usize::from(buf[0] & 0x0f) * 4;
                    if n < ihl + 8 || buf[12..16] != socket2_octets(to)[..] {
                        continue;
                    }
                    &buf[ihl..n]
                } else {
                    if n < 8 || from[8..24] != socket2_octets(to)[..] {
                        continue;
                    }
                    &buf[..n]
                };
                if icmp[0] == reply && icmp[4..6] == id.to_be_bytes() {
                    count.replies += 1;
                    count.first_reply.get_or_insert(start.elapsed());
                }
            }
        }
        Ok(count)
    })
}

/// The bytes of a socket address of `ip` (port 0), and its length.
fn socket2_addr(ip: IpAddr) -> (Vec<u8>, libc::socklen_t) {
    match ip {
        IpAddr::V4(a) => {
            let mut sa: libc::sockaddr_in = zeroed_sockaddr();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from_ne_bytes(a.octets());
            (
                as_bytes(&sa),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        IpAddr::V6(a) => {
            let mut sa: libc::sockaddr_in6 = zeroed_sockaddr();
            sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sa.sin6_addr.s6_addr = a.octets();
            (
                as_bytes(&sa),
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

fn socket2_octets(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn zeroed_sockaddr<T: Copy>() -> T {
    // SAFETY: only used for plain C socket address structs, for which all
    // zeroes is a valid value.
    unsafe { std::mem::zeroed() }
}

fn as_bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: reads the bytes of a plain C struct, size_of::<T>() of them.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_ping_in_flight_at_the_interrupt_is_not_lost_an_older_one_is() {
        let mut out = PingOutput::default();
        for line in [
            "PING 10.0.0.2 (10.0.0.2) 56(84) bytes of data.",
            "[100.000] 64 bytes from 10.0.0.2: icmp_seq=1 ttl=64 time=0.050 ms",
            // 2 unanswered, then answered late: not lost.
            "[100.020] no answer yet for icmp_seq=2",
            "[100.021] 64 bytes from 10.0.0.2: icmp_seq=2 ttl=64 time=11.0 ms",
            "[100.021] 64 bytes from 10.0.0.2: icmp_seq=2 ttl=64 time=11.0 ms (DUP!)",
            // 3 never answered, reported long before the interrupt: lost.
            "[100.030] no answer yet for icmp_seq=3",
            // 4 refused by an ICMP error: lost whenever.
            "[100.990] From 10.0.0.1 icmp_seq=4 Destination Net Unreachable",
            // 5 reported unanswered 50 ms before the interrupt: not judged.
            "[100.950] no answer yet for icmp_seq=5",
            "[100.960] 64 bytes from 10.0.0.2: icmp_seq=6 ttl=64 time=0.040 ms",
        ] {
            out.line(line);
        }
        // Interrupted at 101.0: judged until 100.8. (7, in flight, was
        // never reported.)
        assert_eq!(judged_lost(&out, 100.8), 2);
        assert_eq!(judged_lost(&out, 101.0), 3);
        assert_eq!(judged_lost(&out, 100.0), 1);
    }
}
