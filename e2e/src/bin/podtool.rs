//! `podtool`: the traffic tool inside the local Kubernetes test pods
//! (e2e/k8s), next to busybox. Every client is bounded in time and exits
//! non-zero with a message when the network does not do what it checks.
//!
//! ADDR is an IP address, or a name the pod's resolver resolves (the cluster DNS).
//!
//! ```text
//! podtool serve PORT...              on each PORT (IPv4 and IPv6), TCP: greets every
//!                                    connection with the pod's name ($PODTOOL_NAME, else
//!                                    /etc/hostname), then discards what it is sent (but
//!                                    answers a first "who?\n" with the address it sees the
//!                                    client at); UDP: echoes, but answers "who?" with its name
//!                                    and that address
//! podtool greet ADDR PORT N          N TCP connections in a row, each must get a greeting
//!                                    and show ADDR PORT as its peer (getpeername: what a
//!                                    translated Service must still show); prints each
//!                                    distinct greeting with its count
//! podtool echo ADDR PORT N           N UDP datagrams from one unconnected socket, each must be
//!                                    echoed within 1 s from ADDR PORT itself
//! podtool who PROTO ADDR PORT N      N probes of a Service's observable result, each from a
//!                                    new socket (PROTO tcp, udp: unconnected, two datagrams
//!                                    that must reach one backend, udp-connected); prints
//!                                    "BACKEND SOURCE COUNT" (the source the backend saw) or
//!                                    "error KIND COUNT" (refused, timeout, ...); checks that
//!                                    the peer shown (getpeername, recvmsg) is ADDR PORT
//! podtool follow ADDR PORT SECS      one connected UDP socket asking "who?" every 100 ms for
//!                                    SECS seconds; prints each run of equal answers in order
//!                                    ("BACKEND SOURCE COUNT", "error KIND COUNT"); a socket the
//!                                    kernel closed ("error aborted": ECONNABORTED, or
//!                                    EDESTADDRREQ on a send) is connected anew, as a resilient
//!                                    client (a DNS resolver) does
//! podtool stream ADDR PORT SECS      one TCP stream for SECS seconds, or until SIGINT or
//!                                    SIGTERM; prints Gbit/s and the longest time no byte
//!                                    could be sent
//! ```

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, what: &str| -> Result<&str> {
        args.get(i)
            .map(String::as_str)
            .with_context(|| format!("missing {what}; see the usage at the top of podtool.rs"))
    };
    match arg(0, "command")? {
        "serve" => {
            arg(1, "PORT")?;
            let ports = args[1..]
                .iter()
                .map(|p| p.parse().with_context(|| format!("port {p:?}")))
                .collect::<Result<Vec<u16>>>()?;
            serve(&ports)
        }
        "greet" => greet(
            target(arg(1, "ADDR")?, arg(2, "PORT")?)?,
            arg(3, "N")?.parse()?,
        ),
        "echo" => echo(
            target(arg(1, "ADDR")?, arg(2, "PORT")?)?,
            arg(3, "N")?.parse()?,
        ),
        "who" => who(
            arg(1, "PROTO")?,
            target(arg(2, "ADDR")?, arg(3, "PORT")?)?,
            arg(4, "N")?.parse()?,
        ),
        "follow" => follow(
            target(arg(1, "ADDR")?, arg(2, "PORT")?)?,
            arg(3, "SECS")?.parse()?,
        ),
        "stream" => stream(
            target(arg(1, "ADDR")?, arg(2, "PORT")?)?,
            arg(3, "SECS")?.parse()?,
        ),
        other => bail!("unknown command {other:?}"),
    }
}

/// ADDR PORT as a socket address: ADDR an IP address, or a name resolved
/// as the pod's libc resolves it (its resolv.conf: the cluster DNS and its
/// search domains), its first IPv4 address preferred.
fn target(addr: &str, port: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let port: u16 = port.parse().with_context(|| format!("port {port:?}"))?;
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let all: Vec<SocketAddr> = (addr, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {addr:?}"))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .with_context(|| format!("{addr:?} has no address"))
}

fn serve(ports: &[u16]) -> Result<()> {
    let name = match std::env::var("PODTOOL_NAME") {
        Ok(n) => n,
        Err(_) => std::fs::read_to_string("/etc/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "pod".into()),
    };
    // Both families on one socket ([::] with IPv4-mapped addresses), or
    // IPv4 alone in a pod without IPv6.
    let any = |port: u16| -> [SocketAddr; 2] {
        [
            SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)),
            SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, port)),
        ]
    };
    let mut listeners = Vec::new();
    for &port in ports {
        let udp = UdpSocket::bind(&any(port)[..]).with_context(|| format!("binding UDP {port}"))?;
        let name = name.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, peer)) = udp.recv_from(&mut buf) {
                if &buf[..n] == b"who?" {
                    let seen = format!("{name} {}", peer.ip().to_canonical());
                    let _ = udp.send_to(seen.as_bytes(), peer);
                } else {
                    let _ = udp.send_to(&buf[..n], peer);
                }
            }
        });
        listeners.push(
            TcpListener::bind(&any(port)[..]).with_context(|| format!("binding TCP {port}"))?,
        );
    }
    eprintln!("podtool: serving on ports {ports:?} as {name}");
    let mut threads = Vec::new();
    for tcp in listeners {
        let name = name.clone();
        threads.push(std::thread::spawn(move || {
            for conn in tcp.incoming() {
                let Ok(mut conn) = conn else { continue };
                let greeting = format!("{name}\n");
                std::thread::spawn(move || {
                    if conn.write_all(greeting.as_bytes()).is_err() {
                        return;
                    }
                    let mut buf = vec![0u8; 1 << 16];
                    if matches!(conn.read(&mut buf), Ok(n) if buf[..n].starts_with(b"who?\n")) {
                        let seen = conn.peer_addr().map(|p| p.ip().to_canonical());
                        if let Ok(ip) = seen {
                            let _ = conn.write_all(format!("{ip}\n").as_bytes());
                        }
                    }
                    while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
                });
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn greet(to: SocketAddr, n: u32) -> Result<()> {
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for i in 0..n {
        let mut c = TcpStream::connect_timeout(&to, Duration::from_secs(2))
            .with_context(|| format!("connection {i} of {n} to {to}"))?;
        let peer = c.peer_addr()?;
        ensure!(
            peer == to,
            "connection {i} of {n} to {to}: its peer shows as {peer}"
        );
        c.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while line.len() < 256 {
            match c.read(&mut byte) {
                Ok(1) if byte[0] != b'\n' => line.push(byte[0]),
                Ok(_) => break,
                Err(e) => bail!("connection {i} of {n} to {to}: no greeting: {e}"),
            }
        }
        ensure!(
            !line.is_empty(),
            "connection {i} of {n} to {to}: empty greeting"
        );
        *seen
            .entry(String::from_utf8_lossy(&line).into_owned())
            .or_default() += 1;
    }
    for (who, count) in &seen {
        println!("{who} {count}");
    }
    Ok(())
}

/// One line of a stream: up to `\n`, bounded.
fn read_line(c: &mut TcpStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 256 {
        match c.read(&mut byte)? {
            1 if byte[0] != b'\n' => line.push(byte[0]),
            _ => break,
        }
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

/// What a failed probe shows: the error's kind, as the kernel reported it.
fn error_kind(e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => "refused".into(),
        TimedOut | WouldBlock => "timeout".into(),
        HostUnreachable | NetworkUnreachable => "unreachable".into(),
        k => format!("{k:?}"),
    }
}

/// One probe of [`who`]: the backend and the source it saw.
fn who_one(proto: &str, to: SocketAddr) -> Result<std::result::Result<String, String>> {
    let wait = Duration::from_secs(1);
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let fail = |e: std::io::Error| Ok(Err(error_kind(&e)));
    match proto {
        "tcp" => {
            // Past the first SYN's retransmission (1 s): a refusal that
            // arrives while connect() still holds the socket is seen on
            // the second SYN (IPv6).
            let mut c = match TcpStream::connect_timeout(&to, 3 * wait) {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            ensure!(c.peer_addr()? == to, "the peer shows as {}", c.peer_addr()?);
            c.set_read_timeout(Some(wait))?;
            let name = match read_line(&mut c) {
                Ok(n) => n,
                Err(e) => return fail(e),
            };
            c.write_all(b"who?\n")?;
            let seen = match read_line(&mut c) {
                Ok(n) => n,
                Err(e) => return fail(e),
            };
            Ok(Ok(format!("{name} {seen}")))
        }
        "udp" | "udp-connected" => {
            let sock = UdpSocket::bind(any)?;
            sock.set_read_timeout(Some(wait))?;
            let mut buf = [0u8; 512];
            if proto == "udp-connected" {
                sock.connect(to)?;
                ensure!(
                    sock.peer_addr()? == to,
                    "the peer shows as {}",
                    sock.peer_addr()?
                );
            }
            let mut answers = Vec::new();
            for _ in 0..2 {
                let got = if proto == "udp" {
                    // A send the node's own rules refuse fails at once
                    // (EPERM): an answer like any other.
                    match sock.send_to(b"who?", to) {
                        Ok(_) => sock.recv_from(&mut buf).map(|(n, from)| (n, Some(from))),
                        Err(e) => Err(e),
                    }
                } else {
                    match sock.send(b"who?") {
                        Ok(_) => sock.recv(&mut buf).map(|n| (n, None)),
                        Err(e) => Err(e),
                    }
                };
                let (n, from) = match got {
                    Ok(g) => g,
                    Err(e) => return fail(e),
                };
                if let Some(from) = from {
                    ensure!(from == to, "the answer came from {from}");
                }
                answers.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
            ensure!(
                answers[0] == answers[1],
                "one socket's datagrams reached two backends: {answers:?}"
            );
            Ok(Ok(answers.remove(0)))
        }
        other => bail!("unknown protocol {other:?}: tcp, udp or udp-connected"),
    }
}

fn who(proto: &str, to: SocketAddr, n: u32) -> Result<()> {
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for i in 0..n {
        let line = match who_one(proto, to).with_context(|| format!("probe {i} of {n} to {to}"))? {
            Ok(answer) => answer,
            Err(kind) => format!("error {kind}"),
        };
        *seen.entry(line).or_default() += 1;
    }
    for (line, count) in &seen {
        println!("{line} {count}");
    }
    Ok(())
}

fn follow(to: SocketAddr, secs: f64) -> Result<()> {
    let connect = || -> Result<UdpSocket> {
        let any: SocketAddr = match to {
            SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let sock = UdpSocket::bind(any)?;
        sock.connect(to)?;
        ensure!(
            sock.peer_addr()? == to,
            "the peer shows as {}",
            sock.peer_addr()?
        );
        sock.set_read_timeout(Some(Duration::from_millis(300)))?;
        Ok(sock)
    };
    let mut sock = connect()?;
    let mut runs: Vec<(String, u32)> = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut buf = [0u8; 512];
    while Instant::now() < end {
        let got = sock.send(b"who?").and_then(|_| sock.recv(&mut buf));
        let answer = match got {
            Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
            // Closed by the kernel (SOCK_DESTROY): a receive sees
            // ECONNABORTED; a send, on the socket it left unconnected,
            // EDESTADDRREQ. Either way, connect anew.
            Err(e) => match e.raw_os_error() {
                Some(libc::ECONNABORTED | libc::EDESTADDRREQ) => {
                    sock = connect()?;
                    "error aborted".to_string()
                }
                _ => format!("error {}", error_kind(&e)),
            },
        };
        match runs.last_mut() {
            Some((last, n)) if *last == answer => *n += 1,
            _ => runs.push((answer, 1)),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for (answer, n) in runs {
        println!("{answer} {n}");
    }
    Ok(())
}

fn echo(to: SocketAddr, n: u32) -> Result<()> {
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let sock = UdpSocket::bind(any)?;
    sock.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut buf = vec![0u8; 2048];
    for i in 0..n {
        let msg = format!("xdpcni echo {i}");
        sock.send_to(msg.as_bytes(), to)?;
        let (len, from) = sock
            .recv_from(&mut buf)
            .with_context(|| format!("no echo for datagram {i} of {n} from {to}"))?;
        ensure!(&buf[..len] == msg.as_bytes(), "echo {i} differs");
        ensure!(from == to, "echo {i} of {n} to {to} came from {from}");
    }
    println!("{n} echoed");
    Ok(())
}

fn stream(to: SocketAddr, secs: f64) -> Result<()> {
    // A caller that watches something of unknown length (a roll) ends the
    // stream with a signal when it is over; the report is the same.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .with_context(|| format!("installing the handler of signal {sig}"))?;
    }
    let mut c = TcpStream::connect_timeout(&to, Duration::from_secs(2))
        .with_context(|| format!("connecting to {to}"))?;
    c.set_write_timeout(Some(Duration::from_secs(5)))?;
    let chunk = vec![0x5au8; 1 << 16];
    let start = Instant::now();
    let mut last = start;
    let mut stall = Duration::ZERO;
    let mut sent: u64 = 0;
    while start.elapsed().as_secs_f64() < secs && !stop.load(Ordering::Relaxed) {
        let n = c
            .write(&chunk)
            .with_context(|| format!("stream to {to} broke after {sent} bytes"))?;
        let now = Instant::now();
        stall = stall.max(now - last);
        last = now;
        sent += n as u64;
    }
    let el = start.elapsed().as_secs_f64();
    println!(
        "bytes={sent} secs={el:.2} gbps={:.2} max_stall_ms={}",
        sent as f64 * 8.0 / el / 1e9,
        stall.as_millis()
    );
    Ok(())
}
