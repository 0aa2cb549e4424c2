//! What a killed test run left is swept by the next one: namespaces (and
//! the processes in them), veths, pin directories, cgroups and temporary
//! directories named with a dead PID go; those of a live run stay.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::process::{Command, Stdio};

use xdpcni_e2e::{cgroup::cgroup2_root, netns::run, sweep, Netns, PinDir};

/// A PID no process has now: a child's, once it has been waited for.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn sweep_removes_what_a_dead_run_left_and_keeps_a_live_runs() {
    // This binary's own first sweep (the first unique name takes it) is
    // done before the leftovers are made: the sweep below is the one seen.
    sweep::sweep_once();
    let pid = dead_pid();
    let name = |n: u32| format!("xsw{pid}_{n}");
    // What a run killed mid-test would have left.
    run(&["ip", "netns", "add", &name(0)]).unwrap();
    let mut sleeper = Command::new("ip")
        .args(["netns", "exec", &name(0), "sleep", "600"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    run(&[
        "ip",
        "link",
        "add",
        &name(1),
        "type",
        "veth",
        "peer",
        "name",
        &name(2),
    ])
    .unwrap();
    let pins = std::path::Path::new("/sys/fs/bpf").join(name(3));
    std::fs::create_dir(&pins).unwrap();
    let cgroup = cgroup2_root().unwrap().join(name(4));
    std::fs::create_dir(&cgroup).unwrap();
    let tmp = std::env::temp_dir().join(name(5));
    std::fs::create_dir(&tmp).unwrap();
    std::fs::write(tmp.join("left"), "behind").unwrap();
    // And what this live run has.
    let live_ns = Netns::new("xsw").unwrap();
    let live_pins = PinDir::new("xsw").unwrap();
    std::fs::create_dir(live_pins.path()).unwrap();
    // Let the sleeper enter its namespace.
    std::thread::sleep(std::time::Duration::from_millis(200));

    let s = sweep::sweep();

    assert!(s.netns.contains(&name(0)), "{s:?}");
    assert!(!std::path::Path::new("/run/netns").join(name(0)).exists());
    assert!(
        s.links.contains(&name(1)) || s.links.contains(&name(2)),
        "{s:?}"
    );
    for l in [name(1), name(2)] {
        assert!(
            !std::path::Path::new("/sys/class/net").join(&l).exists(),
            "{l} left"
        );
    }
    assert!(s.pins.contains(&name(3)) && !pins.exists(), "{s:?}");
    assert!(s.cgroups.contains(&name(4)) && !cgroup.exists(), "{s:?}");
    assert!(s.dirs.contains(&name(5)) && !tmp.exists(), "{s:?}");
    // The process left in the dead run's namespace was ended.
    let status = sleeper.wait().unwrap();
    assert!(!status.success(), "the sleeper was killed: {status}");
    // The live run's own are untouched.
    assert!(std::path::Path::new("/run/netns")
        .join(live_ns.name())
        .exists());
    assert!(live_pins.path().exists());
}
