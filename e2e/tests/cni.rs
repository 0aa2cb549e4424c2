//! The real `xdpcni` binary driven exactly as a runtime drives it (stdin +
//! CNI_* env, inside the node namespace), with Debian's host-local as IPAM
//! and Debian's portmap and bandwidth chained after it. ADD leaves a pod on
//! kernel routing (or held, when a NetworkPolicy may select it): the fast
//! path is the agent's, so the tests that need it start the real agent.
//! Needs root, bpffs at /sys/fs/bpf and containernetworking-plugins.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{collections::HashSet, net::IpAddr, path::Path};
use xdpcni_ebpf::testing::RawMaps;

use std::time::Duration;

use serde_json::{json, Value};
use xdpcni_e2e::{
    agent::{mode_of, StandaloneAgent},
    cni::{exec, result_ips, Call, Network, REFERENCE_PLUGINS},
    in_netns,
    netns::Netns,
    traffic::{ping, tcp_transfer},
    PinDir,
};
use xdpcni_ebpf::{abi::Verdict, Datapath, Maps};

const VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// Loads the datapath into `pins` from inside the node namespace (no agent:
/// the policy gate is never written, so a pod with a namespace is held).
fn load_datapath(net: &Network, pins: &PinDir) {
    in_netns(&net.node, || Ok(Datapath::open(pins.path()).map(drop)?)).unwrap();
}

/// CNI_ARGS of a Kubernetes pod `ns/name`.
fn k8s_args(ns: &str, name: &str) -> String {
    format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name}")
}

fn v4(ips: &[IpAddr]) -> IpAddr {
    *ips.iter().find(|i| i.is_ipv4()).unwrap()
}

fn v6(ips: &[IpAddr]) -> IpAddr {
    *ips.iter().find(|i| i.is_ipv6()).unwrap()
}

/// Asserts what ADD must have built inside the pod.
fn assert_pod(pod: &Netns, ips: &[IpAddr], mtu: u64) {
    let link = pod.link_json("eth0").expect("eth0 in the pod");
    assert_eq!(link["mtu"].as_u64(), Some(mtu));
    assert!(link["flags"].as_array().unwrap().iter().any(|f| f == "UP"));
    let addrs = pod.ip(&["-j", "addr", "show", "dev", "eth0"]).unwrap();
    for ip in ips {
        assert!(
            addrs.contains(&format!("\"local\":\"{ip}\"")),
            "{ip} on eth0: {addrs}"
        );
    }
    let r4 = pod.ip(&["-j", "route", "show", "default"]).unwrap();
    assert!(r4.contains("\"gateway\":\"169.254.1.1\""), "{r4}");
    let r6 = pod.ip(&["-6", "-j", "route", "show", "default"]).unwrap();
    assert!(r6.contains("\"gateway\":\"fe80::1\""), "{r6}");
    let neigh = pod.ip(&["neigh", "show", "169.254.1.1"]).unwrap();
    assert!(neigh.contains("PERMANENT"), "{neigh}");
    assert_eq!(
        pod.offload("eth0", "generic-receive-offload").unwrap(),
        "on"
    );
}

/// Nothing of the attachment is left: veth, IPs, records, endpoints, links.
fn assert_nothing_left(net: &Network, pins: Option<&PinDir>, ips: &[IpAddr]) {
    assert_eq!(
        net.host_veths().unwrap(),
        Vec::<String>::new(),
        "host veths left"
    );
    assert_eq!(
        net.allocated_ips(),
        Vec::<IpAddr>::new(),
        "IPs left allocated"
    );
    assert_eq!(net.records(), 0, "records left");
    if let Some(pins) = pins {
        let maps = Maps::open_pinned(pins.path()).unwrap();
        for ip in ips {
            assert!(maps.endpoint(*ip).unwrap().is_none(), "endpoint {ip} left");
        }
        let links = std::fs::read_dir(pins.path().join("links"))
            .unwrap()
            .count();
        assert_eq!(links, 0, "link pins left");
    }
}

#[test]
fn lifecycle_in_every_spec_version() {
    for version in VERSIONS {
        let pins = PinDir::new("xc").unwrap();
        let net = Network::new(pins.path(), version, Network::dual_stack()).unwrap();
        // The agent loads the datapath and attaches what ADD makes.
        let agent = StandaloneAgent::start(&net, pins.path(), |_| {}).unwrap();
        let (pa, pb) = (Netns::new("xp").unwrap(), Netns::new("xp").unwrap());
        let (ida, idb) = (format!("a{version}"), format!("b{version}"));
        let ida = ida.replace('.', "");
        let idb = idb.replace('.', "");

        let add_a = net
            .call(&Call::new("ADD", &ida, Some(&pa.path())), &json!({}))
            .unwrap();
        assert_eq!(
            add_a.status,
            0,
            "{version} ADD: {:?} {}",
            add_a.json,
            net.log()
        );
        let add_b = net
            .call(&Call::new("ADD", &idb, Some(&pb.path())), &json!({}))
            .unwrap();
        assert_eq!(add_b.status, 0, "{version} ADD b: {:?}", add_b.json);
        let res = &add_a.json;
        assert_eq!(res["cniVersion"], *version);
        let old = version.starts_with("0.");
        assert_eq!(
            res["ips"][0].get("version").is_some(),
            old,
            "{version}: ips[].version"
        );
        assert_eq!(res["interfaces"][1]["name"], "eth0");
        assert_eq!(
            res["interfaces"][1]["sandbox"],
            pa.path().display().to_string()
        );
        let (ips_a, ips_b) = (result_ips(res), result_ips(&add_b.json));
        assert_eq!(ips_a.len(), 2, "dual stack");
        assert_pod(&pa, &ips_a, 1500);
        assert_pod(&pb, &ips_b, 1500);

        // The agent attaches both in its default mode, woken by
        // the records; the endpoint record points at the result's host veth.
        let host = res["interfaces"][0]["name"].as_str().unwrap();
        let host_b = add_b.json["interfaces"][0]["name"].as_str().unwrap();
        for h in [host, host_b] {
            xdpcni_e2e::agent::wait_default_mode(&net.node, h)
                .unwrap_or_else(|e| panic!("{version}: {e}: {}", agent.log()));
        }
        let host_idx = net.node.ifindex(host).unwrap();
        let maps = Maps::open_pinned(pins.path()).unwrap();
        for ip in &ips_a {
            let ep = maps.endpoint(*ip).unwrap().expect("endpoint record");
            assert_eq!(ep.ifindex, host_idx);
            assert_eq!(ep.mtu, 1500);
        }

        // Pod to pod over the fast path, pod to host through the kernel.
        for to in [v4(&ips_b), v6(&ips_b)] {
            ping(&pa, to, 3).unwrap();
        }
        ping(&pa, "10.99.0.1".parse().unwrap(), 2).unwrap();
        ping(&pa, "fd99::1".parse().unwrap(), 2).unwrap();
        tcp_transfer(&pa, &pb, v4(&ips_b), 1 << 20).unwrap();
        let c = maps.counters(host_idx).unwrap();
        assert!(c.forwarded() >= 6, "{version}: {c:?}");
        assert!(
            c.packets(Verdict::PassNoEndpoint) >= 4,
            "pod-to-host went to the kernel"
        );

        if *version != "0.3.0" && *version != "0.3.1" {
            let pa_path = pa.path();
            let check = Call::new("CHECK", &ida, Some(&pa_path));
            let out = net.call(&check, &json!({ "prevResult": res })).unwrap();
            assert_eq!(out.status, 0, "{version} CHECK: {:?}", out.json);
            // CHECK notices a missing address.
            pa.ip(&["addr", "del", &format!("{}/32", v4(&ips_a)), "dev", "eth0"])
                .unwrap();
            let out = net.call(&check, &json!({ "prevResult": res })).unwrap();
            assert_eq!(out.code(), Some(104), "{:?}", out.json);
        } else {
            let out = net
                .call(
                    &Call::new("CHECK", &ida, Some(&pa.path())),
                    &json!({ "prevResult": res }),
                )
                .unwrap();
            assert_eq!(out.code(), Some(1), "CHECK is not in {version}");
        }

        for (id, ns, res) in [(&ida, &pa, &add_a.json), (&idb, &pb, &add_b.json)] {
            let del = net
                .call(
                    &Call::new("DEL", id, Some(&ns.path())),
                    &json!({ "prevResult": res }),
                )
                .unwrap();
            assert_eq!(del.status, 0, "{version} DEL: {:?}", del.json);
            let again = net
                .call(&Call::new("DEL", id, Some(&ns.path())), &json!({}))
                .unwrap();
            assert_eq!(again.status, 0, "{version} second DEL: {:?}", again.json);
            // As runtimes do after removing the sandbox: no netns at all.
            let gone = net.call(&Call::new("DEL", id, None), &json!({})).unwrap();
            assert_eq!(
                gone.status, 0,
                "{version} DEL without netns: {:?}",
                gone.json
            );
        }
        let all: Vec<IpAddr> = ips_a.iter().chain(&ips_b).copied().collect();
        assert_nothing_left(&net, Some(&pins), &all);
        drop(agent);
    }
}

/// ADD writes nothing of the fast path: with no agent running, a pod has no
/// XDP program, no endpoint record and no redirect target, keeps every
/// offload of kernel routing, and its traffic is routed by the kernel.
#[test]
fn add_leaves_the_pod_on_kernel_routing() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    load_datapath(&net, &pins);
    let (pa, pb) = (Netns::new("xp").unwrap(), Netns::new("xp").unwrap());
    let a = net
        .call(&Call::new("ADD", "ka", Some(&pa.path())), &json!({}))
        .unwrap();
    let b = net
        .call(&Call::new("ADD", "kb", Some(&pb.path())), &json!({}))
        .unwrap();
    assert_eq!((a.status, b.status), (0, 0), "{:?} {:?}", a.json, b.json);
    let maps = Maps::open_pinned(pins.path()).unwrap();
    for (res, pod) in [(&a.json, &pa), (&b.json, &pb)] {
        let host = res["interfaces"][0]["name"].as_str().unwrap();
        assert_eq!(mode_of(&net.node, host).unwrap(), "none", "no XDP at ADD");
        let idx = net.node.ifindex(host).unwrap();
        assert!(!maps.has_tx_port(idx).unwrap(), "no redirect target");
        for ip in result_ips(res) {
            assert!(maps.endpoint(ip).unwrap().is_none(), "no endpoint {ip}");
        }
        assert!(
            !xdpcni_ebpf::is_held(pins.path(), idx),
            "no namespace: no hold"
        );
        for feature in ["tcp-segmentation-offload", "tx-checksumming"] {
            assert_eq!(pod.offload("eth0", feature).unwrap(), "on", "{feature}");
        }
    }
    // Each record carries its pod namespace's cookie, as the Service
    // programs see it (bpf_get_netns_cookie): distinct pods, distinct cookies.
    let cookies: Vec<u64> = [("ka", &pa), ("kb", &pb)]
        .iter()
        .map(|(id, pod)| {
            let path = net.dir.path().join("state").join(format!("{id}_eth0.json"));
            let rec: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            let want = xdpcni_host::netns::netns_cookie(&pod.path()).unwrap();
            assert_eq!(rec["netnsCookie"].as_u64(), Some(want), "{id}: {rec}");
            want
        })
        .collect();
    assert_ne!(cookies[0], cookies[1]);
    assert_eq!(net.node.sysctl_get("net.ipv4.ip_forward").unwrap(), "1");
    let ips_b = result_ips(&b.json);
    ping(&pa, v4(&ips_b), 2).unwrap();
    ping(&pa, v6(&ips_b), 2).unwrap();
    tcp_transfer(&pa, &pb, v6(&ips_b), 1 << 20).unwrap();
    let a_idx = net
        .node
        .ifindex(a.json["interfaces"][0]["name"].as_str().unwrap())
        .unwrap();
    assert_eq!(
        maps.counters(a_idx).unwrap().forwarded(),
        0,
        "nothing took the fast path"
    );
    for (id, ns) in [("ka", &pa), ("kb", &pb)] {
        let d = net
            .call(&Call::new("DEL", id, Some(&ns.path())), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0, "{:?}", d.json);
    }
    assert_nothing_left(&net, Some(&pins), &[]);
}

/// Without a pinned datapath no pod can be held for its NetworkPolicies, so
/// none is admitted: ADD answers "try again" (11), naming the datapath, and
/// leaves nothing; the runtime retries once the agent has loaded it.
#[test]
fn without_the_datapath_add_is_refused_until_the_agent_loads_it() {
    let pins = PinDir::new("xc").unwrap(); // never loaded
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    let pod = Netns::new("xp").unwrap();
    let out = net
        .call(&Call::new("ADD", "ka", Some(&pod.path())), &json!({}))
        .unwrap();
    assert_eq!(out.code(), Some(11), "{:?}", out.json);
    let msg = out.json["msg"].as_str().unwrap();
    assert!(msg.contains("not pinned") && msg.contains("agent"), "{msg}");
    assert_nothing_left(&net, None, &[]);
    assert!(pod.link_json("eth0").is_err(), "no eth0 left in the pod");
    let status = net
        .call(&Call::new("STATUS", "", None), &json!({}))
        .unwrap();
    assert_eq!(status.code(), Some(50), "STATUS: datapath not pinned");
    // DEL of what never came up succeeds without the datapath.
    let d = net
        .call(&Call::new("DEL", "ka", Some(&pod.path())), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0, "{:?}", d.json);
    load_datapath(&net, &pins);
    let again = net
        .call(&Call::new("ADD", "ka", Some(&pod.path())), &json!({}))
        .unwrap();
    assert_eq!(again.status, 0, "{:?}", again.json);
    let d = net
        .call(&Call::new("DEL", "ka", Some(&pod.path())), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0, "{:?}", d.json);
    assert_nothing_left(&net, Some(&pins), &[]);
}

/// The policy gate at ADD, as the agent writes it: a pod of a namespace
/// with NetworkPolicies, or of any namespace before the agent has listed
/// them, is held from its first packet: nothing reaches it, nothing leaves
/// it (counted `drop_held` on its own veth), ARP and ND excepted; a pod of a
/// namespace without policies is not. Releasing the hold (what the agent
/// does once it has classified the pod) gives it its network; DEL removes a
/// hold that was never released.
#[test]
fn the_policy_gate_holds_a_new_pod_a_policy_may_select() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    load_datapath(&net, &pins);
    let add = |name: &str, ns: &str| {
        let pod = Netns::new("xp").unwrap();
        let args = k8s_args(ns, name);
        let path = pod.path();
        let mut call = Call::new("ADD", name, Some(&path));
        call.args = &args;
        let out = net.call(&call, &json!({})).unwrap();
        assert_eq!(out.status, 0, "{name}: {:?} {}", out.json, net.log());
        let host = out.json["interfaces"][0]["name"]
            .as_str()
            .unwrap()
            .to_string();
        let idx = net.node.ifindex(&host).unwrap();
        (pod, out.json, idx)
    };
    let held = |idx: u32| xdpcni_ebpf::is_held(pins.path(), idx);
    // No agent has written the gate: every pod with a namespace is held.
    let (early, early_res, early_idx) = add("early", "free");
    assert!(held(early_idx), "gate incomplete: held");
    assert!(net.log().contains("has not listed"), "{}", net.log());

    // The agent's gate: namespace "guarded" has policies, "free" has none.
    let mut maps = Maps::open_pinned(pins.path()).unwrap();
    maps.raw_write_policy_gate(&[("guarded".to_string(), 2)].into())
        .unwrap();
    assert_eq!(maps.policy_gate().unwrap().complete, 1);
    let (guarded, guarded_res, guarded_idx) = add("g", "guarded");
    let (free, free_res, free_idx) = add("f", "free");
    assert!(held(guarded_idx), "a namespace with policies: held");
    assert!(!held(free_idx), "a namespace without policies: not held");

    let (g_ip, f_ip) = (v4(&result_ips(&guarded_res)), v4(&result_ips(&free_res)));
    let (g_ip6, e_ip) = (v6(&result_ips(&guarded_res)), v4(&result_ips(&early_res)));
    // Nothing in or out of a held pod, on any path; the free pod works.
    assert!(ping(&free, g_ip, 2).is_err(), "pod -> held pod");
    assert!(ping(&free, g_ip6, 2).is_err(), "pod -> held pod, IPv6");
    assert!(ping(&guarded, f_ip, 2).is_err(), "held pod -> pod");
    assert!(
        ping(&guarded, "10.99.0.1".parse().unwrap(), 1).is_err(),
        "held pod -> node"
    );
    assert!(ping(&free, e_ip, 1).is_err(), "pod -> early pod");
    ping(&free, "10.99.0.1".parse().unwrap(), 1).unwrap();
    let drops = maps
        .counters(guarded_idx)
        .unwrap()
        .packets(Verdict::DropHeld);
    assert!(drops >= 4, "drops counted on the held pod's veth: {drops}");

    // Released: the pod has its network (kernel routing).
    in_netns(&net.node, || {
        let mut dp = Datapath::open_existing(pins.path())?;
        anyhow::ensure!(dp.release_hold(guarded_idx)?, "was held");
        anyhow::ensure!(!dp.release_hold(guarded_idx)?, "released once");
        Ok(())
    })
    .unwrap();
    assert!(!held(guarded_idx));
    ping(&free, g_ip, 2).unwrap();
    ping(&guarded, f_ip, 2).unwrap();
    ping(&free, g_ip6, 2).unwrap();

    // DEL of a pod still held takes its hold with it.
    for (name, pod) in [("early", &early), ("g", &guarded), ("f", &free)] {
        let d = net
            .call(&Call::new("DEL", name, Some(&pod.path())), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0, "{:?}", d.json);
    }
    assert_nothing_left(&net, Some(&pins), &[]);
    let slots = maps.slot_owner_list().unwrap();
    assert!(slots.is_empty(), "counter slots left: {slots:?}");
}

#[test]
fn status_follows_the_datapath_and_the_agent() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    let status = |patch: &Value| net.call(&Call::new("STATUS", "", None), patch).unwrap();
    assert_eq!(status(&json!({})).code(), Some(50));
    load_datapath(&net, &pins);
    let ok = status(&json!({}));
    assert_eq!((ok.status, ok.json.clone()), (0, Value::Null));
    let ready = net.dir.path().join("agent-ready");
    let with_agent = json!({ "agentReadyFile": ready });
    let out = status(&with_agent);
    assert_eq!(out.code(), Some(50));
    assert!(
        out.json["msg"].as_str().unwrap().contains("agent"),
        "{:?}",
        out.json
    );
    std::fs::write(&ready, "").unwrap();
    assert_eq!(status(&with_agent).status, 0);
    let old = status(&json!({ "cniVersion": "1.0.0" }));
    assert_eq!(old.code(), Some(1), "STATUS is 1.1.0 only");
    let v = net
        .call(&Call::new("VERSION", "", None), &json!({}))
        .unwrap();
    assert_eq!(v.json["supportedVersions"], json!(VERSIONS));
}

#[test]
fn bad_input_gets_the_right_code_and_leaks_nothing() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    load_datapath(&net, &pins);
    let pod = Netns::new("xp").unwrap();
    let pod_path = pod.path();
    let add = || Call::new("ADD", "bad", Some(&pod_path));

    // Malformed JSON.
    let out =
        xdpcni_e2e::cni::exec_raw(&net.plugin, &net.cni_path, &net.node, b"{nope", &add()).unwrap();
    assert_eq!(out.code(), Some(6), "{:?}", out.json);
    // Missing CNI_* variables.
    for var in [
        "CNI_COMMAND",
        "CNI_CONTAINERID",
        "CNI_NETNS",
        "CNI_IFNAME",
        "CNI_PATH",
    ] {
        let mut c = add();
        c.env.push((var, None));
        if var == "CNI_NETNS" {
            c.netns = None;
        }
        if var == "CNI_CONTAINERID" {
            c.container_id = "";
        }
        let out = if var == "CNI_PATH" || var == "CNI_COMMAND" {
            // exec() always sets them: run with them emptied instead.
            let mut c = add();
            c.env.push((var, Some("")));
            net.call(&c, &json!({})).unwrap()
        } else {
            net.call(&c, &json!({})).unwrap()
        };
        assert_eq!(out.code(), Some(4), "{var}: {:?}", out.json);
        assert!(
            out.json["msg"].as_str().unwrap().contains(var),
            "{:?}",
            out.json
        );
    }
    // Unknown cniVersion.
    let out = net.call(&add(), &json!({ "cniVersion": "0.9.9" })).unwrap();
    assert_eq!(out.code(), Some(1));
    // Invalid values name their field.
    let out = net.call(&add(), &json!({ "mtu": 5 })).unwrap();
    assert_eq!(out.code(), Some(7));
    assert!(out.json["msg"].as_str().unwrap().contains("mtu"));
    // Missing IPAM plugin.
    let mut conf = net.conf.clone();
    conf.ipam.as_mut().unwrap()["type"] = json!("no-such-ipam");
    let conf = serde_json::to_value(&conf).unwrap();
    let out = exec(&net.plugin, &net.cni_path, &net.node, &conf, &add()).unwrap();
    assert_eq!(out.code(), Some(7), "{:?}", out.json);
    assert!(out.json["msg"].as_str().unwrap().contains("no-such-ipam"));
    // Nonexistent netns.
    let missing = Path::new("/var/run/netns/xdpcni-no-such-netns");
    let out = net
        .call(&Call::new("ADD", "bad", Some(missing)), &json!({}))
        .unwrap();
    assert_eq!(out.code(), Some(3), "{:?}", out.json);
    // Interface name already taken in the pod.
    pod.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "other0",
    ])
    .unwrap();
    let out = net.call(&add(), &json!({})).unwrap();
    assert_eq!(out.code(), Some(101), "{:?}", out.json);
    pod.ip(&["link", "del", "eth0"]).unwrap();
    assert_nothing_left(&net, Some(&pins), &[]);

    // A failure injected after each step undoes everything before it, the
    // hold too (a Kubernetes pod before any agent wrote the gate: held).
    let args = k8s_args("default", "bad");
    for step in ["ipam", "veth", "hold", "pod", "routes"] {
        let mut c = add();
        c.args = &args;
        c.env.push((xdpcni_e2e::hooks::FAIL_AFTER, Some(step)));
        let out = net.call(&c, &json!({})).unwrap();
        assert_eq!(out.code(), Some(100), "{step}: {:?}", out.json);
        assert!(out.json["msg"].as_str().unwrap().contains(step));
        assert_nothing_left(&net, Some(&pins), &[]);
        assert!(
            pod.link_json("eth0").is_err(),
            "{step}: eth0 left in the pod"
        );
    }
    // And then the same pod comes up fine.
    let out = net.call(&add(), &json!({})).unwrap();
    assert_eq!(out.status, 0, "{:?}", out.json);
    let d = net
        .call(&Call::new("DEL", "bad", Some(&pod_path)), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0);
    assert_nothing_left(&net, Some(&pins), &[]);
}

#[test]
fn an_exhausted_range_fails_cleanly() {
    let pins = PinDir::new("xc").unwrap();
    let ranges =
        json!([[{"subnet": "10.79.0.0/24", "rangeStart": "10.79.0.10", "rangeEnd": "10.79.0.10"}]]);
    let net = Network::new(pins.path(), "1.1.0", ranges).unwrap();
    load_datapath(&net, &pins);
    let (p1, p2) = (Netns::new("xp").unwrap(), Netns::new("xp").unwrap());
    let first = net
        .call(&Call::new("ADD", "e1", Some(&p1.path())), &json!({}))
        .unwrap();
    assert_eq!(first.status, 0, "{:?}", first.json);
    let second = net
        .call(&Call::new("ADD", "e2", Some(&p2.path())), &json!({}))
        .unwrap();
    // host-local's own code (999, "unknown") is passed through.
    assert_eq!(second.code(), Some(999), "{:?}", second.json);
    let msg = second.json["msg"].as_str().unwrap();
    assert!(
        msg.contains("IPAM") && msg.contains("no IP addresses available"),
        "{msg}"
    );
    // The first pod is untouched, the second left nothing.
    assert_eq!(net.host_veths().unwrap().len(), 1);
    assert_eq!(
        net.allocated_ips(),
        vec!["10.79.0.10".parse::<IpAddr>().unwrap()]
    );
    assert!(p2.link_json("eth0").is_err());
    let d = net
        .call(&Call::new("DEL", "e1", Some(&p1.path())), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0);
    let d = net
        .call(&Call::new("DEL", "e2", Some(&p2.path())), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0, "DEL of a pod that never came up succeeds");
    assert_nothing_left(&net, Some(&pins), &[]);
}

#[test]
fn fifty_concurrent_adds_then_dels() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    load_datapath(&net, &pins);
    let pods: Vec<Netns> = (0..50).map(|_| Netns::new("xp").unwrap()).collect();
    let ids: Vec<String> = (0..50).map(|i| format!("conc{i}")).collect();
    let results: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = pods
            .iter()
            .zip(&ids)
            .map(|(p, id)| {
                let net = &net;
                s.spawn(move || {
                    let out = net
                        .call(&Call::new("ADD", id, Some(&p.path())), &json!({}))
                        .unwrap();
                    assert_eq!(out.status, 0, "{id}: {:?}", out.json);
                    out.json
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let all: Vec<IpAddr> = results.iter().flat_map(result_ips).collect();
    let distinct: HashSet<_> = all.iter().collect();
    assert_eq!(all.len(), 100, "two addresses per pod");
    assert_eq!(distinct.len(), 100, "distinct addresses");
    assert_eq!(net.host_veths().unwrap().len(), 50);
    // Spot-check: the first pod reaches the last one.
    ping(&pods[0], v4(&result_ips(&results[49])), 1).unwrap();
    std::thread::scope(|s| {
        for (p, id) in pods.iter().zip(&ids) {
            let net = &net;
            s.spawn(move || {
                let out = net
                    .call(&Call::new("DEL", id, Some(&p.path())), &json!({}))
                    .unwrap();
                assert_eq!(out.status, 0, "{id}: {:?}", out.json);
            });
        }
    });
    assert_nothing_left(&net, Some(&pins), &all);
}

#[test]
fn gc_removes_attachments_that_are_not_valid() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    let agent = StandaloneAgent::start(&net, pins.path(), |_| {}).unwrap();
    let pods: Vec<Netns> = (0..3).map(|_| Netns::new("xp").unwrap()).collect();
    let mut ips = Vec::new();
    for (i, p) in pods.iter().enumerate() {
        let out = net
            .call(
                &Call::new("ADD", &format!("gc{i}"), Some(&p.path())),
                &json!({}),
            )
            .unwrap();
        assert_eq!(out.status, 0);
        let host = out.json["interfaces"][0]["name"].as_str().unwrap();
        xdpcni_e2e::agent::wait_default_mode(&net.node, host)
            .unwrap_or_else(|e| panic!("{e}: {}", agent.log()));
        ips.push(result_ips(&out.json));
    }
    // GC while no agent writes (it would collect the records' leftovers itself).
    agent.stop(libc::SIGTERM).unwrap();
    let gc = net
        .call(
            &Call::new("GC", "", None),
            &json!({ "cni.dev/valid-attachments": [{"containerID": "gc0", "ifname": "eth0"}] }),
        )
        .unwrap();
    assert_eq!(gc.status, 0, "{:?}", gc.json);
    assert_eq!(
        net.host_veths().unwrap().len(),
        1,
        "only gc0's veth is left"
    );
    assert_eq!(net.records(), 1);
    let mut left = net.allocated_ips();
    left.sort();
    let mut want = ips[0].clone();
    want.sort();
    assert_eq!(left, want, "only gc0's addresses stay allocated");
    let maps = Maps::open_pinned(pins.path()).unwrap();
    assert!(maps.endpoint(ips[1][0]).unwrap().is_none());
    assert!(maps.endpoint(ips[0][0]).unwrap().is_some());
    ping(&pods[0], "10.99.0.1".parse().unwrap(), 1).unwrap();
    let missing = net.call(&Call::new("GC", "", None), &json!({})).unwrap();
    assert_eq!(
        missing.code(),
        Some(7),
        "GC without valid-attachments is refused"
    );
    let d = net
        .call(&Call::new("DEL", "gc0", Some(&pods[0].path())), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0);
    assert_nothing_left(&net, Some(&pins), &[]);
}

/// Runs a conflist's plugins in order for ADD (each gets the previous
/// result) and in reverse for DEL, as libcni does.
fn conflist(net: &Network, plugins: &[Value], call: &Call<'_>, runtime: &Value) -> Value {
    let order: Vec<&Value> = if call.command == "DEL" {
        plugins.iter().rev().collect()
    } else {
        plugins.iter().collect()
    };
    let mut prev = Value::Null;
    for p in order {
        let mut conf = p.clone();
        // Debian's portmap and bandwidth (1.1.1) speak up to 1.0.0.
        conf["cniVersion"] = json!("1.0.0");
        conf["name"] = json!(xdpcni_e2e::cni::NETWORK_NAME);
        conf["runtimeConfig"] = runtime.clone();
        if !prev.is_null() {
            conf["prevResult"] = prev.clone();
        }
        let ty = conf["type"].as_str().unwrap().to_string();
        let bin = if ty == "xdpcni" {
            net.plugin.clone()
        } else {
            Path::new(REFERENCE_PLUGINS).join(&ty)
        };
        let out = exec(&bin, &net.cni_path, &net.node, &conf, call).unwrap();
        assert_eq!(
            out.status, 0,
            "{} {ty}: {:?} {}",
            call.command, out.json, out.stderr
        );
        if call.command == "ADD" {
            prev = out.json;
        }
    }
    prev
}

#[test]
fn chained_with_portmap_and_bandwidth() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    load_datapath(&net, &pins);
    // A client outside the node, on a link to it: 192.0.2.1 (node) - .2 (client).
    let client = Netns::new("xq").unwrap();
    let link = xdpcni_e2e::unique_name("xk");
    net.node.add_veth(&link, "up0", Some(&client)).unwrap();
    net.node
        .ip(&["addr", "add", "192.0.2.1/24", "dev", &link])
        .unwrap();
    net.node.ip(&["link", "set", &link, "up"]).unwrap();
    client
        .ip(&["addr", "add", "192.0.2.2/24", "dev", "up0"])
        .unwrap();
    client.ip(&["link", "set", "up0", "up"]).unwrap();

    let pod = Netns::new("xp").unwrap();
    let mut xdpcni = net.conf.clone();
    xdpcni.cni_version = None;
    let xdpcni = serde_json::to_value(&xdpcni).unwrap();
    let plugins = vec![
        xdpcni,
        json!({ "type": "portmap", "capabilities": { "portMappings": true } }),
        json!({ "type": "bandwidth", "ingressRate": 100_000_000, "ingressBurst": 1_000_000 }),
    ];
    let runtime = json!({ "portMappings": [{ "hostPort": 18080, "containerPort": 8080, "protocol": "tcp" }] });
    let pod_path = pod.path();
    let call = Call::new("ADD", "chain", Some(&pod_path));
    let result = conflist(&net, &plugins, &call, &runtime);
    let pod_ip = v4(&result_ips(&result));
    let host = result["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    // bandwidth shaped traffic to the pod on its host veth.
    let qdisc = net
        .node
        .exec(&["tc", "qdisc", "show", "dev", &host])
        .unwrap();
    assert!(
        qdisc.contains("tbf"),
        "bandwidth's qdisc on {host}: {qdisc}"
    );
    // portmap: client -> node:18080 is DNATed to pod:8080; the pod's replies
    // come from a NAT'd port and must go through the kernel to be un-NATed.
    let server = std::thread::spawn({
        let pod_name = pod.name().to_string();
        move || {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", &pod_name, "timeout", "10", "sh", "-c"])
                .arg(format!(
                    "echo hello-from-pod | {} -l {pod_ip} 8080",
                    "/bin/nc.openbsd -N"
                ))
                .output();
            out.map(|o| o.status.success())
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let got = client
        .exec(&[
            "timeout",
            "5",
            "/bin/nc.openbsd",
            "-N",
            "192.0.2.1",
            "18080",
        ])
        .unwrap_or_default();
    let _ = server.join();
    assert!(got.contains("hello-from-pod"), "hostPort forward: {got:?}");
    // Pod to pod is still fast-pathed with the chain in place.
    let pod2 = Netns::new("xp").unwrap();
    let r2 = net
        .call(&Call::new("ADD", "chain2", Some(&pod2.path())), &json!({}))
        .unwrap();
    assert_eq!(r2.status, 0);
    ping(&pod2, pod_ip, 2).unwrap();

    let del = Call::new("DEL", "chain", Some(&pod_path));
    conflist(&net, &plugins, &del, &runtime);
    let d2 = net
        .call(&Call::new("DEL", "chain2", Some(&pod2.path())), &json!({}))
        .unwrap();
    assert_eq!(d2.status, 0);
    let nat = net.node.exec(&["iptables-save", "-t", "nat"]).unwrap();
    assert!(!nat.contains("18080"), "portmap rules removed: {nat}");
    assert_nothing_left(&net, Some(&pins), &[]);
}

#[test]
fn pods_in_mode_off_are_kernel_only_both_ways() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    let agent = StandaloneAgent::start(&net, pins.path(), |_| {}).unwrap();
    // Pods without a namespace are named by their container ID.
    agent
        .set_pods(&json!({ "off": { "xdpcni.io/xdp-mode": "off" } }))
        .unwrap();
    let (fast, off) = (Netns::new("xp").unwrap(), Netns::new("xp").unwrap());
    let a = net
        .call(&Call::new("ADD", "fast", Some(&fast.path())), &json!({}))
        .unwrap();
    let b = net
        .call(&Call::new("ADD", "off", Some(&off.path())), &json!({}))
        .unwrap();
    assert_eq!((a.status, b.status), (0, 0), "{:?} {:?}", a.json, b.json);
    let fast_host = a.json["interfaces"][0]["name"].as_str().unwrap();
    xdpcni_e2e::agent::wait_default_mode(&net.node, fast_host)
        .unwrap_or_else(|e| panic!("{e}: {}", agent.log()));
    let off_host = b.json["interfaces"][0]["name"].as_str().unwrap();
    assert_eq!(
        xdpcni_e2e::agent::mode_of(&net.node, off_host).unwrap(),
        "none"
    );
    let maps = Maps::open_pinned(pins.path()).unwrap();
    let off_ip = v4(&result_ips(&b.json));
    let start = std::time::Instant::now();
    while maps.endpoint(off_ip).unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(3), "{}", agent.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let ep = maps.endpoint(off_ip).unwrap().unwrap();
    assert_eq!(
        ep.flags & xdpcni_ebpf::abi::EP_KERNEL_ONLY,
        xdpcni_ebpf::abi::EP_KERNEL_ONLY
    );
    // The fast pod's traffic to it goes through the kernel, and works.
    ping(&fast, off_ip, 2).unwrap();
    let fast_idx = net
        .node
        .ifindex(a.json["interfaces"][0]["name"].as_str().unwrap())
        .unwrap();
    let c = maps.counters(fast_idx).unwrap();
    assert!(c.packets(Verdict::PassKernelOnly) >= 2, "{c:?}");
    assert_eq!(c.packets(Verdict::RedirectDevmap), 0, "{c:?}");
    assert_eq!(
        off.offload("eth0", "tcp-segmentation-offload").unwrap(),
        "on"
    );
    for (id, ns) in [("fast", &fast), ("off", &off)] {
        let d = net
            .call(&Call::new("DEL", id, Some(&ns.path())), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0);
    }
    assert_nothing_left(&net, Some(&pins), &[]);
    drop(agent);
}

#[test]
fn a_late_del_leaves_an_ifindex_reused_by_another_pod_alone() {
    let pins = PinDir::new("xc").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    let agent = StandaloneAgent::start(&net, pins.path(), |_| {}).unwrap();
    let (old, new) = (Netns::new("xp").unwrap(), Netns::new("xp").unwrap());
    let a = net
        .call(&Call::new("ADD", "old", Some(&old.path())), &json!({}))
        .unwrap();
    let b = net
        .call(&Call::new("ADD", "new", Some(&new.path())), &json!({}))
        .unwrap();
    assert_eq!((a.status, b.status), (0, 0));
    let (ips_a, ips_b) = (result_ips(&a.json), result_ips(&b.json));
    let a_host = a.json["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let b_host = b.json["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let b_idx = net.node.ifindex(&b_host).unwrap();
    for h in [&a_host, &b_host] {
        xdpcni_e2e::agent::wait_default_mode(&net.node, h)
            .unwrap_or_else(|e| panic!("{e}: {}", agent.log()));
    }
    // No agent from here: the DEL alone must leave the new pod alone.
    agent.stop(libc::SIGTERM).unwrap();
    // The old pod's veth goes with its netns (the runtime deleted it before
    // DEL), and its ifindex is handed to the new pod's veth: simulated by
    // pointing the old record at the new veth's ifindex.
    net.node.ip(&["link", "del", &a_host]).unwrap();
    let rec_path = net.dir.path().join("state").join("old_eth0.json");
    let mut rec: Value = serde_json::from_slice(&std::fs::read(&rec_path).unwrap()).unwrap();
    rec["hostIfindex"] = json!(b_idx);
    std::fs::write(&rec_path, rec.to_string()).unwrap();
    let d = net
        .call(&Call::new("DEL", "old", None), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0, "{:?}", d.json);
    // The new pod keeps its link, devmap entry, endpoints and fast path.
    let maps = Maps::open_pinned(pins.path()).unwrap();
    assert_eq!(
        xdpcni_e2e::agent::mode_of(&net.node, &b_host).unwrap(),
        xdpcni_e2e::agent::default_shown(),
        "new pod still attached"
    );
    assert!(maps.has_tx_port(b_idx).unwrap());
    for ip in &ips_b {
        assert_eq!(maps.endpoint(*ip).unwrap().unwrap().ifindex, b_idx);
    }
    // The old pod's addresses are released.
    for ip in &ips_a {
        assert!(!net.allocated_ips().contains(ip));
    }
    let d = net
        .call(&Call::new("DEL", "new", Some(&new.path())), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0);
}
