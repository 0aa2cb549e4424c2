//! Migration of the pinned datapath from the previous release's layout to
//! this build's, with the previous release's own binaries: its agent and CNI
//! plugin are built from this repository's history
//! (`scripts/previous-release.sh`, the commit in `e2e/k8s/PREVIOUS_RELEASE`).
//! Pods made by the CNI, pings every 10 ms throughout; this build's agent
//! killed at every step of the migration (`XDPCNI_TEST_STOP_AT`), the next
//! one finishing it; the previous release's agent taking the datapath back
//! (a rollback) between the rounds; the plugin of either version adding pods
//! while the datapath is the other version's.
//! Needs root, bpffs at /sys/fs/bpf, containernetworking-plugins and git.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};
use xdpcni_ebpf::testing::RawMaps;

use serde_json::{json, Value};
use xdpcni_e2e::{
    cni::{agent_binary, http_get, result_ips, Call, NodeProcess},
    netns::Netns,
    node::Node,
    traffic::{ping, tcp_transfer, BackgroundPing},
};
use xdpcni_ebpf::{
    abi, layout_dir, objects, previous_layout_dir, Maps, Pinned, FROM_POD_PROGRAM, PREVIOUS_LAYOUT,
};

const LISTEN: &str = xdpcni_agent::config::DEFAULT_LISTEN;

/// The tests of this file share one node's loopback listener: one at a time.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Which build a process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    Previous,
    This,
}

/// A [`Node`] whose agent and plugin are either build.
struct UpgradeNode {
    node: Node,
    previous: PathBuf,
    this_plugin: PathBuf,
}

impl std::ops::Deref for UpgradeNode {
    type Target = Node;
    fn deref(&self) -> &Node {
        &self.node
    }
}

impl std::ops::DerefMut for UpgradeNode {
    fn deref_mut(&mut self) -> &mut Node {
        &mut self.node
    }
}

impl UpgradeNode {
    fn new(pods: Value) -> Self {
        let previous = xdpcni_e2e::previous_release().unwrap();
        let mut node = Node::builder()
            .pins("xm")
            .ready_file()
            .pods_file(pods)
            .build()
            .unwrap();
        node.config.interval_ms = 200;
        let this_plugin = node.net.plugin.clone();
        Self {
            node,
            previous,
            this_plugin,
        }
    }

    fn agent(&self, build: Build, log: &str, env: &[(&str, &str)]) -> NodeProcess {
        let bin = match build {
            Build::Previous => self.previous.join("xdpcni-agent"),
            Build::This => agent_binary().unwrap(),
        };
        self.node.spawn_agent(&bin, log, env).unwrap()
    }

    /// Starts an agent and waits until it serves /readyz.
    fn start(&self, build: Build, log: &str) -> NodeProcess {
        let agent = self.agent(build, log, &[]);
        self.node
            .wait_agent_ready(log)
            .unwrap_or_else(|e| panic!("{build:?} agent: {e:#}"));
        agent
    }

    /// Starts this build's agent stopped at crash point `step`, and kills it
    /// there.
    fn kill_at(&self, step: &str, log: &str) {
        let agent = self.agent(Build::This, log, &[(xdpcni_e2e::hooks::STOP_AT, step)]);
        agent
            .wait_stopped(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("never reached {step}: {e:#}: {}", self.log(log)));
        assert_eq!(agent.stop(libc::SIGKILL).unwrap(), None, "killed at {step}");
    }

    /// ADD of pod `name` in `namespace` by the plugin of `build`.
    fn add(&mut self, build: Build, namespace: &str, name: &str) -> (Netns, Value) {
        let pod = Netns::new("xp").unwrap();
        let out = self.try_add(build, namespace, name, &pod);
        assert_eq!(out.0, 0, "{build:?} ADD {name}: {}", out.1);
        (pod, out.1)
    }

    fn try_add(&mut self, build: Build, namespace: &str, name: &str, pod: &Netns) -> (u64, Value) {
        self.net.plugin = match build {
            Build::Previous => self.previous.join("xdpcni"),
            Build::This => self.this_plugin.clone(),
        };
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        let path = pod.path();
        let mut call = Call::new("ADD", name, Some(&path));
        call.args = &args;
        let out = self.net.call(&call, &json!({})).unwrap();
        self.net.plugin = self.this_plugin.clone();
        let code = if out.status == 0 {
            0
        } else {
            out.code().unwrap_or(999)
        };
        (code, out.json)
    }

    fn del(&self, name: &str, pod: &Netns) {
        let out = self
            .net
            .call(&Call::new("DEL", name, Some(&pod.path())), &json!({}))
            .unwrap();
        assert_eq!(out.status, 0, "{:?}", out.json);
    }

    /// The XDP program id on each host veth (`None`: no XDP).
    fn programs(&self, hosts: &[String]) -> Vec<Option<u64>> {
        hosts
            .iter()
            .map(|h| self.net.node.xdp_attached(h).unwrap().map(|(_, id)| id))
            .collect()
    }

    /// The id of the program for host veths that the layout in `dir` pins.
    fn from_pod_id(dir: &Path) -> u64 {
        u64::from(objects::pinned_id(&dir.join("progs").join(FROM_POD_PROGRAM)).unwrap())
    }

    /// Waits until every host veth runs the program of the layout in `dir`.
    fn wait_on(&self, dir: &Path, hosts: &[String], what: &str, log: &str) {
        let start = Instant::now();
        loop {
            let want = dir
                .join("progs")
                .join(FROM_POD_PROGRAM)
                .exists()
                .then(|| Self::from_pod_id(dir));
            let have = self.programs(hosts);
            if want.is_some() && have.iter().all(|p| *p == want) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{what}: host veths run {have:?}, not {want:?} ({}): {}",
                dir.display(),
                self.log(log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every map and program the previous layout pins, by kernel id.
    fn previous_ids(&self) -> (BTreeSet<u32>, BTreeSet<u32>) {
        let dir = previous_layout_dir(self.pins.path());
        let maps = PREVIOUS_MAPS
            .iter()
            .map(|m| objects::pinned_id(&dir.join(m)).unwrap())
            .collect();
        let progs = std::fs::read_dir(dir.join("progs"))
            .unwrap()
            .map(|e| objects::pinned_id(&e.unwrap().path()).unwrap())
            .collect();
        (maps, progs)
    }
}

fn host(res: &Value) -> String {
    res["interfaces"][0]["name"].as_str().unwrap().to_string()
}

fn ipv4(res: &Value) -> IpAddr {
    *result_ips(res).iter().find(|ip| ip.is_ipv4()).unwrap()
}

/// Three pods of the previous release (a: the node default, b: native,
/// c: cpumap on CPU 0) on a fresh node, and pings every 10 ms from a to b
/// and to c.
struct Scene {
    node: UpgradeNode,
    pods: Vec<(Netns, Value)>,
    hosts: Vec<String>,
    to_b: BackgroundPing,
    to_c: BackgroundPing,
}

impl Scene {
    fn new() -> (Self, NodeProcess) {
        // Modes by annotation: the previous release's default (generic)
        // is not this one's, and a migration must change no pod's mode.
        let mut node = UpgradeNode::new(json!({
            "default/a": { "xdpcni.io/xdp-mode": "generic" },
            "default/b": { "xdpcni.io/xdp-mode": "native" },
            "default/c": { "xdpcni.io/xdp-mode": "generic", "xdpcni.io/redirect": "cpumap", "xdpcni.io/cpus": "0" },
            "default/d": { "xdpcni.io/xdp-mode": "generic" },
        }));
        let old = node.start(Build::Previous, "previous0.log");
        let pods: Vec<(Netns, Value)> = ["a", "b", "c"]
            .iter()
            .map(|n| node.add(Build::Previous, "default", n))
            .collect();
        let hosts: Vec<String> = pods.iter().map(|(_, r)| host(r)).collect();
        node.wait_on(
            &previous_layout_dir(node.pins.path()),
            &hosts,
            "the previous release attached",
            "previous0.log",
        );
        let p = Pinned::read(node.pins.path()).unwrap();
        assert!(p.previous && p.own.is_none(), "{p:?}");
        // Longer than any test takes; ended when it is done.
        let to_b = BackgroundPing::start(&pods[0].0, ipv4(&pods[1].1), 100_000).unwrap();
        let to_c = BackgroundPing::start(&pods[0].0, ipv4(&pods[2].1), 100_000).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        (
            Self {
                node,
                pods,
                hosts,
                to_b,
                to_c,
            },
            old,
        )
    }

    /// Forwarded packets counted on b's host veth in `maps`.
    fn b_forwarded(&self, maps: &Maps) -> u64 {
        let idx = self.node.net.node.ifindex(&self.hosts[1]).unwrap();
        maps.counters(idx).unwrap().forwarded()
    }

    /// Traffic, records and modes as the pods ask, on this layout.
    fn assert_converged(&self, what: &str, log: &str) {
        let node = &self.node;
        let p = Pinned::read(node.pins.path()).unwrap();
        assert!(
            p.ready() && !p.previous && p.unknown.is_empty(),
            "{what}: {p:?}"
        );
        assert_eq!(p.own.unwrap().layout, abi::LAYOUT, "{what}");
        node.wait_on(&layout_dir(node.pins.path()), &self.hosts, what, log);
        let maps = Maps::open_pinned(node.pins.path()).unwrap();
        for (_, res) in &self.pods {
            assert!(
                maps.endpoint(ipv4(res)).unwrap().is_some(),
                "{what}: no endpoint record of {}",
                host(res)
            );
        }
        let modes: Vec<String> = self
            .hosts
            .iter()
            .map(|h| node.net.node.xdp_attached(h).unwrap().unwrap().0)
            .collect();
        assert_eq!(modes, ["xdpgeneric", "xdp", "xdpgeneric"], "{what}");
        tcp_transfer(
            &self.pods[0].0,
            &self.pods[1].0,
            ipv4(&self.pods[1].1),
            1 << 20,
        )
        .unwrap();
        tcp_transfer(
            &self.pods[0].0,
            &self.pods[2].0,
            ipv4(&self.pods[2].1),
            1 << 20,
        )
        .unwrap();
    }

    /// Ends the pings; what was lost, if any, as the failure to report
    /// once the caller has stopped its agent (a panic here would remove the
    /// pin directory under a running agent, which makes it again).
    fn finish(self, what: &str) -> (UpgradeNode, Vec<(Netns, Value)>, Result<(), String>) {
        std::thread::sleep(Duration::from_millis(300));
        let (b, c) = (
            self.to_b.interrupt().unwrap(),
            self.to_c.interrupt().unwrap(),
        );
        let lost = if (b.lost, c.lost) == (0, 0) {
            Ok(())
        } else {
            Err(format!(
                "{what}: pings lost (to b, to c) {:?} of {} and {}",
                (b.lost, c.lost),
                b.sent,
                c.sent
            ))
        };
        (self.node, self.pods, lost)
    }
}

/// The previous layout's names are aliases of this layout's maps and
/// programs, layout 1's names (which the previous release keeps as aliases
/// of its own) are gone, and nothing else is pinned (but the Service maps
/// the datapath shares, in the Service layout).
fn assert_aliases(node: &UpgradeNode, what: &str) {
    let dir = node.pins.path();
    let layout = layout_dir(dir);
    let previous = previous_layout_dir(dir);
    let names = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let svc = xdpcni_ebpf::svc_layout_dir(dir);
    let mut want = vec![
        format!("layout-{}", abi::LAYOUT),
        format!("layout-{PREVIOUS_LAYOUT}"),
        "links".into(),
        svc.file_name().unwrap().to_string_lossy().into_owned(),
    ];
    want.sort();
    assert_eq!(names(dir), want, "{what}");
    // The Service maps the datapath shares (made by it where the Service
    // programs have not made them): those alone.
    let mut shared: Vec<String> = xdpcni_ebpf::SHARED_SVC_MAPS
        .iter()
        .map(|s| s.to_string())
        .collect();
    shared.sort();
    assert_eq!(names(&svc), shared, "{what}: the Service layout");
    let mut want: Vec<String> = PREVIOUS_MAPS.iter().map(|s| s.to_string()).collect();
    want.push("progs".into());
    want.sort();
    assert_eq!(names(&previous), want, "{what}");
    for m in PREVIOUS_MAPS {
        assert_eq!(
            objects::pinned_id(&previous.join(m)).unwrap(),
            objects::pinned_id(&layout.join(m)).unwrap(),
            "{what}: {m} is not an alias"
        );
    }
    for p in [
        FROM_POD_PROGRAM,
        xdpcni_ebpf::TC_FROM_POD_PROGRAM,
        xdpcni_ebpf::CPUMAP_PROGRAM,
        xdpcni_ebpf::HOLD_PROGRAM,
    ] {
        assert_eq!(
            objects::pinned_id(&previous.join("progs").join(p)).unwrap(),
            objects::pinned_id(&layout.join("progs").join(p)).unwrap(),
            "{what}: progs/{p} is not an alias"
        );
    }
}

/// The previous layout's maps: this layout's less the endpoint cache.
const PREVIOUS_MAPS: [&str; 11] = [
    "meta",
    "endpoints4",
    "endpoints6",
    "tx_ports",
    "cpu_map",
    "nat_ports",
    "counters",
    "port_slots",
    "slot_owners",
    "policy_namespaces",
    "policy_gate",
];

/// Waits until the kernel has freed every map and program of `ids`.
fn assert_freed(ids: &(BTreeSet<u32>, BTreeSet<u32>), what: &str) {
    let start = Instant::now();
    loop {
        let maps: Vec<u32> = ids
            .0
            .iter()
            .copied()
            .filter(|id| objects::object_exists(*id, true).unwrap())
            .collect();
        let progs: Vec<u32> = ids
            .1
            .iter()
            .copied()
            .filter(|id| objects::object_exists(*id, false).unwrap())
            .collect();
        if maps.is_empty() && progs.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{what}: the previous layout still loaded: maps {maps:?}, programs {progs:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn migrate_killed_at_each_step_the_next_agent_finishes_without_a_lost_ping_or_a_leak() {
    let _one = ONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for step in [
        "migrate:started",
        "migrate:filled",
        "migrate:swapping",
        "migrate:swapped",
        "migrate:complete",
        "migrate:removed",
    ] {
        let what = format!("killed at {step}");
        let (scene, old) = Scene::new();
        let node = &scene.node;
        let old_ids = node.previous_ids();
        let before = scene.b_forwarded(&Maps::open_previous(node.pins.path()).unwrap());
        assert!(before > 0, "{what}: the previous layout forwarded nothing");
        assert_eq!(old.stop(libc::SIGTERM).unwrap(), Some(0));

        node.kill_at(step, "killed.log");
        let p = Pinned::read(node.pins.path()).unwrap();
        let state = p.own.map(|m| m.state);
        let ours = layout_dir(node.pins.path());
        let previous = previous_layout_dir(node.pins.path());
        match step {
            "migrate:complete" => assert!(
                p.previous && state == Some(abi::META_COMPLETE),
                "{what}: {p:?}"
            ),
            "migrate:removed" => assert!(
                !p.previous && state == Some(abi::META_COMPLETE),
                "{what}: {p:?}"
            ),
            _ => assert!(
                p.previous && state == Some(abi::META_FILLING),
                "{what}: {p:?}"
            ),
        }
        assert!(
            !p.ready() || step == "migrate:removed",
            "{what}: ready too early"
        );
        if step == "migrate:filled" {
            // The policy gate came over as it was (its generation too).
            let gate1 = Maps::open_previous(node.pins.path())
                .unwrap()
                .policy_gate()
                .unwrap();
            let gate2 = Maps::open_pinned(node.pins.path())
                .unwrap()
                .policy_gate()
                .unwrap();
            assert_eq!(gate1, gate2, "{what}");
            assert_eq!(gate1.complete, 1, "{what}");
        }
        if matches!(
            step,
            "migrate:swapped" | "migrate:complete" | "migrate:removed"
        ) {
            node.wait_on(&ours, &scene.hosts, &what, "killed.log");
        } else if step == "migrate:swapping" {
            // One pod moved, the others not yet: each on a whole datapath.
            let (one, two) = (
                Some(UpgradeNode::from_pod_id(&previous)),
                Some(UpgradeNode::from_pod_id(&ours)),
            );
            let progs = node.programs(&scene.hosts);
            let moved = progs.iter().filter(|p| **p == two).count();
            let left = progs.iter().filter(|p| **p == one).count();
            assert_eq!((moved, left), (1, 2), "{what}: {progs:?}");
        } else {
            node.wait_on(&previous, &scene.hosts, &what, "killed.log");
        }
        // Killed mid-way: traffic flows, on one layout or the other.
        ping(&scene.pods[0].0, ipv4(&scene.pods[1].1), 3)
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));

        // The next agent finishes it.
        let new = node.start(Build::This, "this.log");
        scene.assert_converged(&what, "this.log");
        let after = scene.b_forwarded(&Maps::open_pinned(node.pins.path()).unwrap());
        assert!(
            after >= before,
            "{what}: b's counters went back from {before} to {after}"
        );
        let (_, body) = http_get(&node.net.node, LISTEN, "/metrics").unwrap();
        assert!(
            body.lines().any(|l| l.starts_with("xdpcni_datapath_info{")
                && l.contains(&format!("layout=\"{}\"", abi::LAYOUT))
                && l.ends_with(" 1")),
            "{what}: no xdpcni_datapath_info: {body}"
        );
        assert_aliases(node, &what);
        assert_freed(&old_ids, &what);
        let (node, pods, lost) = scene.finish(&what);
        assert_eq!(new.stop(libc::SIGTERM).unwrap(), Some(0));
        lost.unwrap();
        for (i, (pod, _)) in pods.iter().enumerate() {
            node.del(["a", "b", "c"][i], pod);
        }
        eprintln!(
            "{what}: converged, 0 pings lost, {} maps and {} programs of the previous layout freed",
            old_ids.0.len(),
            old_ids.1.len()
        );
    }
}

#[test]
fn migrate_then_roll_back_to_the_previous_release_and_forward_again_without_a_lost_ping() {
    let _one = ONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (mut scene, old) = Scene::new();
    let old_ids = scene.node.previous_ids();
    assert_eq!(old.stop(libc::SIGTERM).unwrap(), Some(0));
    let new = scene.node.start(Build::This, "this0.log");
    scene.assert_converged("upgraded", "this0.log");
    let migrated = Maps::open_pinned(scene.node.pins.path()).unwrap();
    let before = scene.b_forwarded(&migrated);
    assert_eq!(new.stop(libc::SIGTERM).unwrap(), Some(0));

    // The rollback: the previous release's agent runs on the aliases.
    let old = scene.node.start(Build::Previous, "previous1.log");
    let root = scene.node.pins.path().to_path_buf();
    let previous = previous_layout_dir(&root);
    scene
        .node
        .wait_on(&previous, &scene.hosts, "rolled back", "previous1.log");
    tcp_transfer(
        &scene.pods[0].0,
        &scene.pods[1].0,
        ipv4(&scene.pods[1].1),
        1 << 20,
    )
    .unwrap();
    // Its counters are this layout's: continuous.
    let during = scene.b_forwarded(&migrated);
    assert!(
        during >= before,
        "counters went back from {before} to {during}"
    );
    // Its plugin adds a pod, which its agent attaches.
    let (pd, rd) = scene.node.add(Build::Previous, "default", "d");
    let hd = host(&rd);
    let mut hosts = scene.hosts.clone();
    hosts.push(hd.clone());
    scene.node.wait_on(
        &previous,
        &hosts,
        "the previous release attached d",
        "previous1.log",
    );
    ping(&scene.pods[0].0, ipv4(&rd), 3).unwrap();
    assert_eq!(old.stop(libc::SIGTERM).unwrap(), Some(0));

    // Forward again: nothing to migrate; every link back on this build.
    let new = scene.node.start(Build::This, "this1.log");
    scene.hosts = hosts;
    scene.pods.push((pd, rd));
    let p = Pinned::read(scene.node.pins.path()).unwrap();
    assert!(p.ready(), "{p:?}");
    scene.node.wait_on(
        &layout_dir(&root),
        &scene.hosts,
        "forward again",
        "this1.log",
    );
    assert_aliases(&scene.node, "forward again");
    assert_freed(&old_ids, "forward again");
    assert!(scene.b_forwarded(&migrated) >= during);
    drop(migrated);
    let (node, pods, lost) = scene.finish("upgrade, rollback, upgrade");
    assert_eq!(new.stop(libc::SIGTERM).unwrap(), Some(0));
    lost.unwrap();
    for (i, (pod, _)) in pods.iter().enumerate() {
        node.del(["a", "b", "c", "d"][i], pod);
    }
}

#[test]
fn migrate_plugins_of_either_version_during_the_roll_give_pods_their_network() {
    let _one = ONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Generic by annotation: the two releases' defaults differ, and the
    // checks below read which layout's XDP program each veth runs.
    let mut node = UpgradeNode::new(json!({
        "default/a": { "xdpcni.io/xdp-mode": "generic" },
        "default/d": { "xdpcni.io/xdp-mode": "generic" },
        "default/e": { "xdpcni.io/xdp-mode": "generic" },
    }));
    let ours = layout_dir(node.pins.path());
    let old = node.start(Build::Previous, "previous.log");
    let (pa, ra) = node.add(Build::Previous, "default", "a");
    assert_eq!(old.stop(libc::SIGTERM).unwrap(), Some(0));

    // The roll, first half: this build's plugin is installed before its
    // agent has migrated. A pod no policy may select gets its network on
    // kernel routing; one that must be held is refused for a retry.
    let (pd, rd) = node.add(Build::This, "default", "d");
    assert_eq!(
        xdpcni_e2e::agent::mode_of(&node.net.node, &host(&rd)).unwrap(),
        "none"
    );
    ping(&pa, ipv4(&rd), 3).unwrap();
    {
        let mut maps = Maps::open_previous(node.pins.path()).unwrap();
        let gate: std::collections::BTreeMap<String, u32> =
            [("guarded".to_string(), 1)].into_iter().collect();
        maps.raw_write_policy_gate(&gate).unwrap();
    }
    let pg = Netns::new("xp").unwrap();
    let (code, err) = node.try_add(Build::This, "guarded", "g", &pg);
    assert_eq!(code, 11, "{err}");
    assert!(
        err["msg"].as_str().unwrap().contains("must be held"),
        "{err}"
    );
    // Nothing of it is left for the retry to trip over.
    assert_eq!(node.net.records(), 2, "records of a and d only");

    // This build's agent migrates, then attaches d.
    let new = node.start(Build::This, "this.log");
    let hosts = vec![host(&ra), host(&rd)];
    node.wait_on(
        &ours,
        &hosts,
        "this build's agent attached a and d",
        "this.log",
    );
    ping(&pa, ipv4(&rd), 3).unwrap();
    // The retry works (the standalone agent writes a gate without
    // namespaces: it knows no policies).
    let (code, rg) = node.try_add(Build::This, "guarded", "g", &pg);
    assert_eq!(code, 0, "{rg}");
    ping(&pa, ipv4(&rg), 3).unwrap();
    node.del("g", &pg);
    assert_eq!(new.stop(libc::SIGTERM).unwrap(), Some(0));

    // A rollback, first half: the previous release's plugin is back before
    // its agent; it works on this layout through the previous layout's names.
    let pe = Netns::new("xp").unwrap();
    let (code, re) = node.try_add(Build::Previous, "default", "e", &pe);
    assert_eq!(code, 0, "{re}");
    ping(&pa, ipv4(&re), 3).unwrap();
    let old = node.start(Build::Previous, "previous-again.log");
    node.wait_on(
        &previous_layout_dir(node.pins.path()),
        &[host(&ra), host(&rd), host(&re)],
        "the previous agent attached",
        "previous-again.log",
    );
    ping(&pa, ipv4(&re), 3).unwrap();
    assert_eq!(old.stop(libc::SIGTERM).unwrap(), Some(0));
    for (name, pod) in [("a", &pa), ("d", &pd), ("e", &pe)] {
        node.del(name, pod);
    }
}

/// A node of a release older than the previous one (layout 1's maps in the
/// pin directory itself, no layout 2): this build refuses to take it over,
/// saying so, and its plugin does not use it. (A map pinned under one of
/// layout 1's names stands for that release's datapath.)
#[test]
fn migrate_refuses_a_layout_older_than_the_previous_release_s() {
    let pins = xdpcni_e2e::PinDir::new("xo").unwrap();
    std::fs::create_dir_all(pins.path()).unwrap();
    let older = aya::maps::HashMap::<aya::maps::MapData, u32, u32>::create(4, 0).unwrap();
    older.pin(pins.path().join("endpoints4")).unwrap();
    let err = match xdpcni_ebpf::Datapath::open(pins.path()) {
        Ok(_) => panic!("a layout 1 datapath was taken over"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("layout 1") && err.contains("upgrade through the previous release"),
        "{err}"
    );
    assert!(
        pins.path().join("endpoints4").exists(),
        "its pins are left alone"
    );
    let p = Pinned::read(pins.path()).unwrap();
    assert!(!p.ready() && !p.previous, "{p:?}");
}
