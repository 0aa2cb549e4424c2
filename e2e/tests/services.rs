//! Services at the socket (ebpf/src/services.bpf.c) on the real kernel: a
//! client pod's connect and sendmsg to a Service frontend reach a backend,
//! and getpeername and recvmsg show the frontend; only the network
//! namespaces the maps name are translated. Root; cgroup v2 mounted
//! somewhere (here /sys/fs/cgroup/unified, beside the v1 controllers).
//!
//! The client runs inside a cgroup this test makes (the programs are
//! attached there, never at a cgroup the host's own processes use), in a
//! client netns wired to a server netns whose `podtool serve` processes are
//! the backends.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use xdpcni_e2e::{
    cgroup::TestCgroup,
    netns::{Netns, PinDir},
};
use xdpcni_ebpf::{
    abi::SvcAddr, abi::SVC_AFFINITY, abi::SVC_NS_POD, ServiceEntry, ServiceStats, Services,
    SVC_LEASE_SECS,
};

const TCP: u8 = 6;
const UDP: u8 = 17;

/// A `podtool serve` in a namespace, killed by its PID on Drop.
struct Server(Child);

impl Server {
    fn start(ns: &Netns, name: &str, port: u16) -> Result<Self> {
        let child = Command::new("ip")
            .args(["netns", "exec", ns.name(), env!("CARGO_BIN_EXE_podtool")])
            .args(["serve", &port.to_string()])
            .env("PODTOOL_NAME", name)
            .stdout(Stdio::null())
            .spawn()
            .context("starting podtool serve")?;
        Ok(Self(child))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Two namespaces on one veth: the client pod and the server (the backends).
/// Fields drop in order: the servers, then the programs, the cgroup, the
/// namespaces and the pins.
struct Scene {
    _servers: Vec<Server>,
    svc: Services,
    cgroup: TestCgroup,
    client: Netns,
    server: Netns,
    pins: PinDir,
}

const CLIENT4: &str = "10.97.0.1";
const SERVER4: &str = "10.97.0.2";
const CLIENT6: &str = "fd97::1";
const SERVER6: &str = "fd97::2";
/// The backends' ports: each `podtool serve` answers with its own name.
const PORTS: [(&str, u16); 2] = [("backend-a", 8081), ("backend-b", 8082)];

impl Scene {
    fn new() -> Result<Self> {
        let pins = PinDir::new("xsvc")?;
        let client = Netns::new("xsc")?;
        let server = Netns::new("xss")?;
        client.add_veth("eth0", "eth0", Some(&server))?;
        for (ns, a4, a6) in [(&client, CLIENT4, CLIENT6), (&server, SERVER4, SERVER6)] {
            ns.ip(&["addr", "add", &format!("{a4}/24"), "dev", "eth0"])?;
            ns.ip(&["addr", "add", &format!("{a6}/64"), "dev", "eth0", "nodad"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
        }
        let servers = PORTS
            .iter()
            .map(|(name, port)| Server::start(&server, name, *port))
            .collect::<Result<Vec<_>>>()?;
        let cgroup = TestCgroup::new()?;
        let mut svc = Services::open(pins.path())?;
        svc.attach(&cgroup.path)?;
        // The writer vouches for its maps (the agent renews this).
        svc.renew_lease(SVC_LEASE_SECS)?;
        let scene = Self {
            _servers: servers,
            svc,
            cgroup,
            client,
            server,
            pins,
        };
        scene.wait_for_servers()?;
        Ok(scene)
    }

    fn wait_for_servers(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        // Each backend over both families, straight: the topology is ready
        // (IPv6 neighbours too) before any translation is tried.
        for (_, port) in PORTS {
            for server in [SERVER4, SERVER6] {
                let port = port.to_string();
                while self
                    .run_client(false, &["greet", server, &port, "1"])
                    .is_err()
                    || self
                        .run_client(false, &["echo", server, &port, "1"])
                        .is_err()
                {
                    ensure!(
                        Instant::now() < deadline,
                        "podtool serve {server} {port} never answered"
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        Ok(())
    }

    fn client_cookie(&self) -> Result<u64> {
        Ok(xdpcni_host::netns::netns_cookie(&self.client.path())?)
    }

    /// `podtool ARGS` in the client netns, inside the test cgroup when
    /// `in_cgroup` (the programs run for it), else outside.
    fn run_client(&self, in_cgroup: bool, args: &[&str]) -> Result<String> {
        self.cgroup.podtool(in_cgroup, self.client.name(), args)
    }

    /// `podtool greet` through the cgroup: how many connections each backend greeted.
    fn greet(&self, to: SocketAddr, n: u32) -> Result<BTreeMap<String, u32>> {
        let out = self.run_client(
            true,
            &[
                "greet",
                &to.ip().to_string(),
                &to.port().to_string(),
                &n.to_string(),
            ],
        )?;
        out.lines()
            .map(|l| {
                let (who, count) = l.rsplit_once(' ').context("greet output")?;
                Ok((who.to_string(), count.parse()?))
            })
            .collect()
    }
}

fn svc_addr(ip: &str, port: u16, proto: u8) -> Result<SvcAddr> {
    let ip: IpAddr = ip.parse()?;
    Ok(SvcAddr::new(SocketAddr::new(ip, port), proto))
}

/// A service `frontend` whose backends are PORTS on the server address `server`.
fn entry(
    id: u32,
    frontend: SvcAddr,
    server: &str,
    proto: u8,
    which: &[usize],
) -> Result<ServiceEntry> {
    Ok(ServiceEntry {
        frontend,
        id,
        flags: 0,
        affinity_timeout: 0,
        backends: which
            .iter()
            .map(|&i| Ok((id * 16 + i as u32, svc_addr(server, PORTS[i].1, proto)?)))
            .collect::<Result<_>>()?,
    })
}

#[test]
fn service_connect_reaches_every_backend_and_shows_the_frontend_ipv4_and_ipv6() -> Result<()> {
    let mut s = Scene::new()?;
    s.svc.add_netns(s.client_cookie()?, SVC_NS_POD)?;
    for (id, vip, server) in [(1, "10.96.0.10", SERVER4), (2, "fd96::10", SERVER6)] {
        let fe = svc_addr(vip, 80, TCP)?;
        s.svc
            .set_service(&entry(id, fe, server, TCP, &[0, 1])?, None)?;
        let to = SocketAddr::new(vip.parse()?, 80);
        // podtool checks that each connection's peer shows as `to`.
        let seen = s.greet(to, 60)?;
        assert_eq!(seen.values().sum::<u32>(), 60, "{vip}: {seen:?}");
        for (name, _) in PORTS {
            assert!(
                seen.get(name).copied().unwrap_or(0) > 0,
                "{vip}: {name} never chosen: {seen:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn service_udp_unconnected_sends_stay_on_one_backend_and_replies_show_the_frontend() -> Result<()> {
    let mut s = Scene::new()?;
    s.svc.add_netns(s.client_cookie()?, SVC_NS_POD)?;
    // Each backend's datagrams counted where they arrive, per family.
    s.server.exec(&["nft", "add", "table", "inet", "xsvc"])?;
    s.server.exec(&[
        "nft",
        "add",
        "chain",
        "inet",
        "xsvc",
        "in",
        "{ type filter hook input priority 0 ; }",
    ])?;
    for family in ["ipv4", "ipv6"] {
        for (_, port) in PORTS {
            let rule = format!("meta nfproto {family} udp dport {port} counter");
            s.server
                .exec(&["nft", "add", "rule", "inet", "xsvc", "in", &rule])?;
        }
    }
    let counts = |family: &str| -> Result<Vec<u64>> {
        let listed = s
            .server
            .exec(&["nft", "list", "chain", "inet", "xsvc", "in"])?;
        PORTS
            .iter()
            .map(|(_, port)| {
                let line = listed
                    .lines()
                    .find(|l| l.contains(&format!("nfproto {family} udp dport {port} ")))
                    .with_context(|| format!("no counter for {family} {port} in {listed}"))?;
                let n = line
                    .split_whitespace()
                    .skip_while(|w| *w != "packets")
                    .nth(1)
                    .context("packets")?;
                Ok(n.parse()?)
            })
            .collect()
    };
    for (id, vip, server, family) in [
        (3, "10.96.0.53", SERVER4, "ipv4"),
        (4, "fd96::53", SERVER6, "ipv6"),
    ] {
        let fe = svc_addr(vip, 53, UDP)?;
        s.svc
            .set_service(&entry(id, fe, server, UDP, &[0, 1])?, None)?;
        // 50 datagrams from one socket: each echoed from the frontend
        // (podtool checks the source), all by one of the two backends.
        let out = s.run_client(true, &["echo", vip, "53", "50"])?;
        assert_eq!(out.trim(), "50 echoed", "{vip}");
        let mut got = counts(family)?;
        got.sort();
        assert_eq!(got, vec![0, 50], "{vip}: datagrams per backend");
    }
    Ok(())
}

#[test]
fn service_removed_backend_is_never_chosen_and_affinity_keeps_one_backend() -> Result<()> {
    let mut s = Scene::new()?;
    s.svc.add_netns(s.client_cookie()?, SVC_NS_POD)?;
    let fe = svc_addr("10.96.0.11", 80, TCP)?;
    let to: SocketAddr = "10.96.0.11:80".parse()?;
    let both = entry(5, fe, SERVER4, TCP, &[0, 1])?;
    s.svc.set_service(&both, None)?;
    let only_b = entry(5, fe, SERVER4, TCP, &[1])?;
    s.svc.set_service(&only_b, Some(&both))?;
    let seen = s.greet(to, 40)?;
    assert_eq!(
        seen.get("backend-b"),
        Some(&40),
        "backend-a removed: {seen:?}"
    );

    let affine = ServiceEntry {
        flags: SVC_AFFINITY,
        affinity_timeout: 10800,
        ..entry(5, fe, SERVER4, TCP, &[0, 1])?
    };
    s.svc.set_service(&affine, Some(&only_b))?;
    let seen = s.greet(to, 40)?;
    assert_eq!(
        seen.len(),
        1,
        "ClientIP affinity: one backend for 40 connections: {seen:?}"
    );
    Ok(())
}

#[test]
fn service_translates_only_the_namespaces_it_names() -> Result<()> {
    let mut s = Scene::new()?;
    let fe = svc_addr("10.96.0.12", 80, TCP)?;
    s.svc
        .set_service(&entry(6, fe, SERVER4, TCP, &[0, 1])?, None)?;
    // Not named in svc_netns: the connect goes on to the frontend itself,
    // which nothing here routes.
    let err = s
        .greet("10.96.0.12:80".parse()?, 1)
        .expect_err("untranslated connect");
    assert!(err.to_string().contains("connection 0 of 1"), "{err:#}");
    let cookie = s.client_cookie()?;
    s.svc.add_netns(cookie, SVC_NS_POD)?;
    assert_eq!(
        s.greet("10.96.0.12:80".parse()?, 4)?.values().sum::<u32>(),
        4
    );
    // Outside the cgroup the programs do not run at all.
    assert!(s
        .run_client(false, &["greet", "10.96.0.12", "80", "1"])
        .is_err());
    assert!(s.svc.remove_netns(cookie)?);
    assert!(s.greet("10.96.0.12:80".parse()?, 1).is_err());
    // The writer's sync: exactly the node's pods, added then removed.
    let only = BTreeMap::from([(cookie, BTreeSet::from([CLIENT4.parse()?]))]);
    assert_eq!(s.svc.sync_netns(&only, None)?, (1, 0));
    assert_eq!(s.svc.sync_netns(&only, None)?, (0, 0));
    assert_eq!(
        s.greet("10.96.0.12:80".parse()?, 2)?.values().sum::<u32>(),
        2
    );
    assert_eq!(s.svc.sync_netns(&BTreeMap::new(), None)?, (0, 1));
    assert!(s.greet("10.96.0.12:80".parse()?, 1).is_err());
    Ok(())
}

#[test]
fn service_backend_that_is_the_caller_itself_is_left_to_kube_proxy() -> Result<()> {
    let mut s = Scene::new()?;
    let cookie = s.client_cookie()?;
    let fe = svc_addr("10.96.0.14", 80, TCP)?;
    s.svc
        .set_service(&entry(8, fe, SERVER4, TCP, &[0])?, None)?;
    let to: SocketAddr = "10.96.0.14:80".parse()?;
    let stats = || ServiceStats::read_pinned(s.pins.path()).map(|st| st.unwrap_or_default());
    let own = |ips: &[&str]| -> Result<BTreeMap<u64, BTreeSet<IpAddr>>> {
        let ips = ips.iter().map(|i| i.parse()).collect::<Result<_, _>>()?;
        Ok(BTreeMap::from([(cookie, ips)]))
    };
    // The client's own addresses are not the backend's: translated.
    s.svc.sync_netns(&own(&[CLIENT4, CLIENT6])?, None)?;
    assert_eq!(s.greet(to, 3)?.values().sum::<u32>(), 3);
    // The backend's address the client's own (a pod reaching itself through
    // its Service): left to kube-proxy, whose masquerade shows the pod the
    // node as its client (here nothing routes the frontend), counted as left.
    let before = stats()?;
    s.svc.sync_netns(&own(&[CLIENT4, SERVER4])?, None)?;
    assert!(s.greet(to, 2).is_err());
    let after = stats()?;
    assert_eq!(after.left, before.left + 1, "{after:?}");
    assert_eq!(after.translated, before.translated, "{after:?}");
    // No longer its own: translated again.
    assert_eq!(s.svc.sync_netns(&own(&[CLIENT4])?, None)?, (0, 0));
    assert_eq!(s.greet(to, 2)?.values().sum::<u32>(), 2);
    Ok(())
}

#[test]
fn service_without_ready_backends_is_left_to_the_kernel_path() -> Result<()> {
    let mut s = Scene::new()?;
    s.svc.add_netns(s.client_cookie()?, SVC_NS_POD)?;
    let fe = svc_addr("10.96.0.13", 80, TCP)?;
    let none = entry(7, fe, SERVER4, TCP, &[])?;
    s.svc.set_service(&none, None)?;
    // Count 0: not translated, so kube-proxy's rules would decide (here
    // nothing routes the frontend: the connect fails).
    assert!(s.greet("10.96.0.13:80".parse()?, 1).is_err());
    let one = entry(7, fe, SERVER4, TCP, &[0])?;
    s.svc.set_service(&one, Some(&none))?;
    assert_eq!(
        s.greet("10.96.0.13:80".parse()?, 3)?.get("backend-a"),
        Some(&3)
    );
    Ok(())
}

#[test]
fn service_lease_run_out_leaves_every_call_to_the_kernel_path_until_renewed() -> Result<()> {
    let mut s = Scene::new()?;
    s.svc.add_netns(s.client_cookie()?, SVC_NS_POD)?;
    let fe = svc_addr("10.96.0.14", 80, TCP)?;
    s.svc
        .set_service(&entry(8, fe, SERVER4, TCP, &[0])?, None)?;
    let to: SocketAddr = "10.96.0.14:80".parse()?;
    assert_eq!(s.greet(to, 2)?.get("backend-a"), Some(&2));
    let stats = || ServiceStats::read_pinned(s.pins.path()).map(|st| st.unwrap_or_default());
    let before = stats()?;
    // A writer that stopped vouching (lease 0: run out): nothing is
    // translated, kube-proxy would decide (here nothing routes the
    // frontend: the connect fails), and the calls are counted as such.
    s.svc.renew_lease(0)?;
    assert!(s.greet(to, 1).is_err());
    let after = stats()?;
    assert_eq!(after.translated, before.translated);
    assert_eq!(after.expired, before.expired + 1);
    // A lease of a second runs out by itself.
    s.svc.renew_lease(1)?;
    assert_eq!(s.greet(to, 1)?.get("backend-a"), Some(&1));
    std::thread::sleep(Duration::from_millis(1100));
    assert!(s.greet(to, 1).is_err());
    s.svc.renew_lease(SVC_LEASE_SECS)?;
    assert_eq!(s.greet(to, 1)?.get("backend-a"), Some(&1));
    Ok(())
}

#[test]
fn service_sync_writes_only_changes_and_a_reopened_writer_keeps_every_id() -> Result<()> {
    use xdpcni_ebpf::ServiceWant;
    let mut s = Scene::new()?;
    s.svc.add_netns(s.client_cookie()?, SVC_NS_POD)?;
    let fe = svc_addr("10.96.0.14", 80, TCP)?;
    let want = |which: &[usize]| -> Result<std::collections::BTreeMap<_, _>> {
        Ok(std::collections::BTreeMap::from([(
            fe,
            ServiceWant {
                backends: which
                    .iter()
                    .map(|&i| svc_addr(SERVER4, PORTS[i].1, TCP))
                    .collect::<Result<_>>()?,
                ..ServiceWant::default()
            },
        )]))
    };
    assert_eq!(s.svc.sync(&want(&[0, 1])?)?, 1);
    assert_eq!(
        s.svc.sync(&want(&[0, 1])?)?,
        0,
        "nothing changed, nothing written"
    );
    let before = s.svc.written()?;
    // A new writer over the same pins (an agent restart) reads the same
    // state back, ids included, and continues from it.
    drop(std::mem::replace(
        &mut s.svc,
        Services::open(s.pins.path())?,
    ));
    s.svc.attach(&s.cgroup.path)?;
    assert_eq!(s.svc.written()?, before);
    assert_eq!(s.svc.sync(&want(&[1])?)?, 1);
    let after = s.svc.written()?;
    assert_eq!(after[&fe].id, before[&fe].id);
    assert_eq!(after[&fe].backends, vec![before[&fe].backends[1]]);
    assert_eq!(
        s.greet("10.96.0.14:80".parse()?, 10)?.get("backend-b"),
        Some(&10)
    );
    assert_eq!(s.svc.sync(&std::collections::BTreeMap::new())?, 1);
    assert!(s.svc.written()?.is_empty());
    Ok(())
}

#[test]
fn service_links_pinned_outlive_their_writer_and_move_to_a_new_one() -> Result<()> {
    let mut s = Scene::new()?;
    // Another cgroup for the pinned links, so Scene's own attach does not
    // also translate: the client runs in this one.
    let pinned = TestCgroup::new()?;
    let fe = svc_addr("10.96.0.15", 80, TCP)?;
    s.svc
        .set_service(&entry(8, fe, SERVER4, TCP, &[0])?, None)?;
    s.svc.add_netns(s.client_cookie()?, SVC_NS_POD)?;
    let greet = |cg: &TestCgroup| -> Result<String> {
        let script = format!(
            "echo $$ > {} && exec ip netns exec {} {} greet 10.96.0.15 80 2",
            cg.path.join("cgroup.procs").display(),
            s.client.name(),
            env!("CARGO_BIN_EXE_podtool")
        );
        let out = Command::new("sh").args(["-c", &script]).output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    {
        let mut writer = Services::open(s.pins.path())?;
        writer.attach_pinned(s.pins.path(), &pinned.path)?;
    }
    // The writer is gone; its links and the maps stay.
    assert_eq!(greet(&pinned)?.trim(), "backend-a 2");
    // A new writer moves the pinned links to its programs.
    let mut again = Services::open(s.pins.path())?;
    again.attach_pinned(s.pins.path(), &pinned.path)?;
    drop(again);
    assert_eq!(greet(&pinned)?.trim(), "backend-a 2");
    assert!(Services::detach_pinned(s.pins.path())?);
    assert!(
        greet(&pinned).is_err(),
        "detached: the frontend itself, unrouted"
    );
    assert!(!Services::detach_pinned(s.pins.path())?);
    Ok(())
}
