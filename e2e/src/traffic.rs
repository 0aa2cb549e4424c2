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

/// Streams `bytes` over TCP from `from` to a server on `to` inside `to_ns`;
/// the server answers with the length and hash it received, which must match.
/// Returns the goodput in Mbit/s (informative only).
pub fn tcp_transfer(from: &Netns, to_ns: &Netns, to: IpAddr, bytes: usize) -> Result<f64> {
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let server = s.spawn(move || {
            in_netns(to_ns, || {
                let listener = TcpListener::bind(SocketAddr::new(to, 0))?;
                tx.send(listener.local_addr()?.port())?;
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
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let len = conn.read(&mut buf).context("server read")?;
                    if len == 0 {
                        break;
                    }
                    n += len as u64;
                    fnv(&mut h, &buf[..len]);
                }
                conn.write_all(&n.to_be_bytes())?;
                conn.write_all(&h.to_be_bytes())?;
                Ok(())
            })
        });
        let port = rx.recv_timeout(Duration::from_secs(5))?;
        let client = in_netns(from, || {
            let start = Instant::now();
            let mut conn =
                TcpStream::connect_timeout(&SocketAddr::new(to, port), Duration::from_secs(5))
                    .with_context(|| format!("TCP connect to {to}"))?;
            conn.set_read_timeout(Some(Duration::from_secs(10)))?;
            conn.set_write_timeout(Some(Duration::from_secs(10)))?;
            let chunk: Vec<u8> = (0..1 << 16).map(|i: usize| (i * 7 + 3) as u8).collect();
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            let mut sent = 0;
            while sent < bytes {
                let len = chunk.len().min(bytes - sent);
                conn.write_all(&chunk[..len]).context("client write")?;
                fnv(&mut h, &chunk[..len]);
                sent += len;
            }
            conn.shutdown(Shutdown::Write)?;
            let mut reply = [0u8; 16];
            conn.read_exact(&mut reply).context("server summary")?;
            let (mut n, mut rh) = ([0u8; 8], [0u8; 8]);
            n.copy_from_slice(&reply[..8]);
            rh.copy_from_slice(&reply[8..]);
            ensure!(
                u64::from_be_bytes(n) == bytes as u64,
                "server got {} of {bytes} bytes",
                u64::from_be_bytes(n)
            );
            ensure!(u64::from_be_bytes(rh) == h, "stream corrupted in transit");
            Ok(bytes as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e6)
        });
        let server = server
            .join()
            .map_err(|_| anyhow::anyhow!("tcp server panicked"))?;
        let mbps = client?;
        server?;
        Ok(mbps)
    })
}

/// `ping -i 0.01` from a namespace, running in the background while a test
/// restarts or reconfigures things; killed by its PID on Drop.
#[derive(Debug)]
pub struct BackgroundPing {
    child: Option<std::process::Child>,
    count: u32,
}

impl BackgroundPing {
    /// Starts `count` pings, one every 10 ms, from `from` to `to`.
    pub fn start(from: &Netns, to: IpAddr, count: u32) -> Result<Self> {
        let child = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                from.name(),
                "ping",
                "-n",
                "-q",
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
        Ok(Self {
            child: Some(child),
            count,
        })
    }

    /// Waits for the end; how many replies were lost.
    pub fn lost(mut self) -> Result<u32> {
        let out = self
            .child
            .take()
            .context("already waited")?
            .wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let received: u32 = text
            .split(',')
            .find_map(|part| part.trim().strip_suffix(" received"))
            .and_then(|n| n.trim().parse().ok())
            .with_context(|| format!("no ping summary in {text}"))?;
        Ok(self.count.saturating_sub(received))
    }
}

impl Drop for BackgroundPing {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
