//! The `xdpcni-agent` against a real kube-apiserver (1.20.2, etcd from
//! Debian), both running in the test's node namespace: Pod objects bound to
//! the node and backed by namespaces made through the real CNI plugin with
//! the matching K8S_POD_* args; annotations switch modes (seen over
//! netlink), a bad value becomes an Event and a fallback, and a
//! NetworkPolicy keeps the pods it selects on XDP, the datapath enforcing it.
//! Needs root, bpffs, containernetworking-plugins, and scripts/k8s-build.sh.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    core::v1::{Node, Pod},
    events::v1::Event,
    networking::v1::NetworkPolicy,
};
use kube::{
    api::{Patch, PatchParams, PostParams},
    Api,
};
use serde_json::{json, Value};
use xdpcni_e2e::{
    cni::{
        agent_binary, http_get, plugin_binary, result_ips, wait_ready, Call, Network, NodeProcess,
    },
    kube::ApiServer,
    netns::Netns,
    traffic::ping,
    PinDir,
};
use xdpcni_ebpf::{
    abi::{Verdict, EP_KERNEL_ONLY, EP_POLICY},
    Maps,
};

const LISTEN: &str = "127.0.0.1:9966";
const NODE: &str = "node-a";

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(25));
    }
    start.elapsed()
}

fn ipv4(res: &Value) -> IpAddr {
    *result_ips(res).iter().find(|i| i.is_ipv4()).unwrap()
}

#[test]
fn annotations_events_and_network_policies_from_the_api_server() {
    let pins = PinDir::new("xk").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    let api = ApiServer::start(&net.node).unwrap();

    // The node and two pods bound to it, as the scheduler would leave them.
    api.with_client(&net.node, |c| async move {
        let nodes: Api<Node> = Api::all(c.clone());
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": NODE },
                    "spec": { "podCIDR": "10.78.0.0/24" },
                }))?,
            )
            .await?;
        let pods: Api<Pod> = Api::namespaced(c, "default");
        for name in ["a", "b"] {
            pods.create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": name, "labels": { "app": name } },
                    "spec": { "nodeName": NODE, "containers": [{ "name": "c", "image": "pause" }] },
                }))?,
            )
            .await?;
        }
        Ok(())
    })
    .unwrap();

    // install-cni (the chart's init container): the conflist for this node's
    // pod CIDR, the plugin binary, both in place.
    let conf_dir = net.dir.path().join("net.d");
    let bin_dir = net.dir.path().join("bin");
    let agent_cfg = json!({
        "pinDir": pins.path(), "stateDir": net.dir.path().join("state"), "listen": LISTEN,
        // The node-wide resync is slow on purpose: pods must be reconciled
        // on their watch events, not by a periodic pass.
        "xdpMode": "native", "redirect": "devmap", "intervalMs": 3000,
        "forwardScanMs": 300,
    });
    let cfg = net.dir.path().join("agent.json");
    std::fs::write(&cfg, agent_cfg.to_string()).unwrap();
    let kubeconfig = api.kubeconfig.to_string_lossy().to_string();
    let install = NodeProcess::spawn_env(
        &net.node,
        &agent_binary().unwrap(),
        &[
            "install-cni",
            "--config",
            cfg.to_str().unwrap(),
            "--cni-conf-dir",
            conf_dir.to_str().unwrap(),
            "--cni-bin-dir",
            bin_dir.to_str().unwrap(),
            // The plugin the tests run (next to the agent is the product's).
            "--plugin",
            plugin_binary().unwrap().to_str().unwrap(),
        ],
        &[("NODE_NAME", NODE), ("KUBECONFIG", &kubeconfig)],
        &net.dir.path().join("install.log"),
    )
    .unwrap();
    let start = Instant::now();
    while !conf_dir.join("10-xdpcni.conflist").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "install-cni: {}",
            std::fs::read_to_string(net.dir.path().join("install.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(install);
    let list: Value =
        serde_json::from_slice(&std::fs::read(conf_dir.join("10-xdpcni.conflist")).unwrap())
            .unwrap();
    assert_eq!(list["plugins"][0]["type"], "xdpcni");
    assert_eq!(
        list["plugins"][0]["ipam"]["ranges"][0][0]["subnet"], "10.78.0.0/24",
        "the Node's podCIDR"
    );
    assert_eq!(list["plugins"][1]["type"], "portmap");
    let installed = bin_dir.join("xdpcni");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&installed).unwrap().permissions().mode() & 0o111,
        0o111
    );
    // The installed plugin accepts the installed config (VERSION, then a
    // STATUS against it: the datapath is not loaded yet, so 50).
    let mut plugin_conf = list["plugins"][0].clone();
    plugin_conf["cniVersion"] = json!("1.1.0");
    plugin_conf["name"] = json!("xdpcni");
    let status = xdpcni_e2e::cni::exec(
        &installed,
        &net.cni_path,
        &net.node,
        &plugin_conf,
        &Call::new("STATUS", "", None),
    )
    .unwrap();
    assert_eq!(status.code(), Some(50), "{:?}", status.json);

    // The agent: loads the datapath, watches this node's pods.
    let log = net.dir.path().join("agent.log");
    let agent = NodeProcess::spawn_env(
        &net.node,
        &agent_binary().unwrap(),
        &["run", "--config", cfg.to_str().unwrap()],
        &[("NODE_NAME", NODE), ("KUBECONFIG", &kubeconfig)],
        &log,
    )
    .unwrap();
    let agent_log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_ready(&net.node, LISTEN, Duration::from_secs(30), agent_log).unwrap();

    // The runtime creates the pods' networks through the CNI.
    let mut pods = Vec::new();
    for name in ["a", "b"] {
        let ns = Netns::new("xp").unwrap();
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}");
        let path = ns.path();
        let mut call = Call::new("ADD", name, Some(&path));
        call.args = &args;
        let out = net.call(&call, &json!({})).unwrap();
        assert_eq!(out.status, 0, "{:?}", out.json);
        pods.push((ns, out.json));
    }
    let (ha, b_ip) = (
        pods[0].1["interfaces"][0]["name"]
            .as_str()
            .unwrap()
            .to_string(),
        ipv4(&pods[1].1),
    );
    let mode = |h: &str| xdpcni_e2e::agent::mode_of(&net.node, h).unwrap();
    ping(&pods[0].0, b_ip, 2).unwrap();

    let annotate = |name: &'static str, value: Value| {
        api.with_client(&net.node, move |c| async move {
            let pods: Api<Pod> = Api::namespaced(c, "default");
            pods.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": { "annotations": value } })),
            )
            .await?;
            Ok(())
        })
        .unwrap();
    };

    // An annotation change is applied within 1 s of the API server
    // accepting it (the watch event follows at once), far below the 3 s
    // resync: the pod reconcile is driven by the event.
    annotate("a", json!({ "xdpcni.io/xdp-mode": "generic" }));
    let took = wait_for("generic on a", Duration::from_secs(1), || {
        mode(&ha) == "xdpgeneric"
    });
    eprintln!("annotation -> generic in {took:?}");
    ping(&pods[0].0, b_ip, 2).unwrap();

    // off: no program, kernel routing both ways.
    annotate("a", json!({ "xdpcni.io/xdp-mode": "off" }));
    let took = wait_for("off on a", Duration::from_secs(1), || mode(&ha) == "none");
    eprintln!("annotation -> off in {took:?}");
    ping(&pods[0].0, b_ip, 2).unwrap();
    // cpumap toward b on CPU 0: a's frames to b go through the cpumap.
    annotate("a", json!({ "xdpcni.io/xdp-mode": "native" }));
    annotate(
        "b",
        json!({ "xdpcni.io/redirect": "cpumap", "xdpcni.io/cpus": "0" }),
    );
    let took = wait_for("native on a", Duration::from_secs(1), || mode(&ha) == "xdp");
    eprintln!("annotation -> native in {took:?}");
    let maps = Maps::open_pinned(pins.path()).unwrap();
    wait_for("b via cpumap", Duration::from_secs(2), || {
        maps.endpoint(b_ip)
            .unwrap()
            .is_some_and(|e| e.redirect == 1 && e.cpu_mask == 1)
    });
    let a_idx = net.node.ifindex(&ha).unwrap();
    let via = || {
        maps.counters(a_idx)
            .unwrap()
            .packets(Verdict::RedirectCpumap)
    };
    let before = via();
    ping(&pods[0].0, b_ip, 3).unwrap();
    assert!(via() >= before + 3, "a->b through the cpumap");
    annotate(
        "b",
        json!({ "xdpcni.io/redirect": null, "xdpcni.io/cpus": null }),
    );

    // b backs a Service on 8080/tcp (an Endpoints object): conntrack is
    // asked about b:8080's flows. A pod that connects to b's address
    // directly keeps the fast path both ways (nothing NAT'd that flow); a
    // flow the kernel DNAT'd to b:8080 (here an nft rule standing in for
    // kube-proxy's) takes the kernel both ways, so its replies are un-DNAT'd.
    api.with_client(&net.node, move |c| async move {
        let eps: Api<k8s_openapi::api::core::v1::Endpoints> = Api::namespaced(c, "default");
        eps.create(&PostParams::default(), &serde_json::from_value(json!({
            "metadata": { "name": "svc" },
            "subsets": [{ "addresses": [{ "ip": b_ip.to_string() }], "ports": [{ "port": 8080, "protocol": "TCP" }] }],
        }))?)
        .await?;
        Ok(())
    })
    .unwrap();
    wait_for("b:8080 NAT'd", Duration::from_secs(2), || {
        maps.nat_ports()
            .unwrap()
            .contains(&(b_ip, xdpcni_ebpf::L4Proto::Tcp, 8080))
    });
    let b_idx = net
        .node
        .ifindex(pods[1].1["interfaces"][0]["name"].as_str().unwrap())
        .unwrap();
    // One echo exchange from a to `to`, served by b on 8080.
    let exchange = |to: std::net::SocketAddr| {
        std::thread::scope(|s| {
            let server = s.spawn(|| {
                xdpcni_e2e::in_netns(&pods[1].0, || {
                    let l = std::net::TcpListener::bind((b_ip, 8080))?;
                    let (mut c, _) = l.accept()?;
                    std::io::copy(&mut c.try_clone()?, &mut c)?;
                    Ok(())
                })
            });
            std::thread::sleep(Duration::from_millis(200));
            xdpcni_e2e::in_netns(&pods[0].0, || {
                use std::io::{Read, Write};
                let mut c = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3))?;
                c.write_all(b"an echo")?;
                c.shutdown(std::net::Shutdown::Write)?;
                let mut back = String::new();
                c.read_to_string(&mut back)?;
                assert_eq!(back, "an echo");
                Ok(())
            })
            .unwrap();
            server.join().unwrap().unwrap();
        })
    };
    let of_b = |v: Verdict| maps.counters(b_idx).unwrap().packets(v);
    let (nat0, fast0) = (of_b(Verdict::PassNat), of_b(Verdict::RedirectDevmap));
    exchange((b_ip, 8080).into());
    let (nat1, fast1) = (of_b(Verdict::PassNat), of_b(Verdict::RedirectDevmap));
    assert_eq!(nat1, nat0, "b:8080 dialed directly: nothing passed for NAT");
    assert!(
        fast1 >= fast0 + 3,
        "b's replies on the fast path: {fast0} -> {fast1}"
    );
    net.node.exec(&["nft", "add table ip xk_dnat"]).unwrap();
    net.node
        .exec(&[
            "nft",
            "add chain ip xk_dnat pre { type nat hook prerouting priority dstnat; }",
        ])
        .unwrap();
    net.node
        .exec(&[
            "nft",
            &format!(
                "add rule ip xk_dnat pre ip daddr 10.96.0.99 tcp dport 80 dnat to {b_ip}:8080"
            ),
        ])
        .unwrap();
    exchange("10.96.0.99:80".parse().unwrap());
    let nat2 = of_b(Verdict::PassNat);
    assert!(
        nat2 >= nat1 + 3,
        "replies of the DNAT'd flow passed for un-DNAT: {nat1} -> {nat2}"
    );

    // A bad value: an Event on the pod naming the problem and the fallback,
    // and the pod keeps working on the node default.
    annotate("a", json!({ "xdpcni.io/xdp-mode": "turbo" }));
    wait_for("fallback to native", Duration::from_secs(2), || {
        mode(&ha) == "xdp"
    });
    // The notes of the Events in namespace `ns` with `reason` about the
    // object of `kind` named `name`.
    let events =
        |ns: &'static str, kind: &'static str, name: &'static str, reason: &'static str| {
            api.with_client(&net.node, move |c| async move {
                let events: Api<Event> = Api::namespaced(c, ns);
                Ok(events
                    .list(&Default::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|e| {
                        let about = e.regarding.as_ref();
                        about.and_then(|r| r.name.as_deref()) == Some(name)
                            && about.and_then(|r| r.kind.as_deref()) == Some(kind)
                            && e.reason.as_deref() == Some(reason)
                    })
                    .filter_map(|e| e.note)
                    .collect::<Vec<_>>())
            })
            .unwrap()
        };
    let events_of = |reason: &'static str| events("default", "Pod", "a", reason);
    wait_for("an Event on pod a", Duration::from_secs(5), || {
        !events_of("XdpcniFallback").is_empty()
    });
    let note = events_of("XdpcniFallback").join(" ");
    assert!(note.contains("turbo") && note.contains("native"), "{note}");
    ping(&pods[0].0, b_ip, 2).unwrap();

    // A record the agent cannot read: an Event on the Node naming the file,
    // which is kept; the pods keep their network.
    let garbage = net.dir.path().join("state").join("unreadable-test.json");
    std::fs::write(&garbage, b"{not a record").unwrap();
    // In kube-system: the namespace every API server since 1.19 takes Events
    // about cluster-scoped objects in (this one is 1.20).
    let node_events = |reason: &'static str| events("kube-system", "Node", NODE, reason);
    let found = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        !node_events("XdpcniUnreadableRecord").is_empty()
    });
    assert!(found, "no Event on the Node within 10 s: {}", agent_log());
    let note = node_events("XdpcniUnreadableRecord").join(" ");
    assert!(note.contains("unreadable-test.json"), "{note}");
    assert!(garbage.exists(), "the agent must keep an unreadable record");
    ping(&pods[0].0, b_ip, 2).unwrap();
    std::fs::remove_file(&garbage).unwrap();

    // An administrator's FORWARD rule naming a (what XDP would bypass): a
    // becomes kernel-only with an Event saying why, and comes back when the
    // rule goes.
    let a_ip = ipv4(&pods[0].1);
    let rule = |op: &str| {
        net.node
            .exec(&[
                "iptables",
                op,
                "FORWARD",
                "-d",
                &a_ip.to_string(),
                "-p",
                "tcp",
                "--dport",
                "7",
                "-j",
                "DROP",
            ])
            .unwrap();
    };
    let a_kernel_only = || {
        maps.endpoint(a_ip)
            .unwrap()
            .is_some_and(|e| e.flags & EP_KERNEL_ONLY != 0)
    };
    rule("-I");
    let took = wait_for(
        "a kernel-only by a FORWARD rule",
        Duration::from_secs(5),
        || a_kernel_only() && mode(&ha) == "none",
    );
    eprintln!("FORWARD rule -> a kernel-only in {took:?}");
    wait_for(
        "an XdpcniKernelOnly Event on a",
        Duration::from_secs(5),
        || !events_of("XdpcniKernelOnly").is_empty(),
    );
    let note = events_of("XdpcniKernelOnly").join(" ");
    assert!(
        note.contains(&a_ip.to_string()) && note.contains("FORWARD"),
        "{note}"
    );
    ping(&pods[0].0, b_ip, 2).unwrap();
    rule("-D");
    wait_for("a back on XDP", Duration::from_secs(5), || {
        !a_kernel_only() && mode(&ha) == "xdp"
    });

    // A NetworkPolicy isolating b for ingress, allowing nothing: b keeps
    // XDP, flagged for the datapath's policy check, which refuses a's
    // frames to it (drop_policy); b's own connections still get their replies.
    api.with_client(&net.node, |c| async move {
        let nps: Api<NetworkPolicy> = Api::namespaced(c, "default");
        nps.create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "only-b" },
                "spec": { "podSelector": { "matchLabels": { "app": "b" } }, "policyTypes": ["Ingress"] },
            }))?,
        )
        .await?;
        Ok(())
    })
    .unwrap();
    wait_for(
        "b flagged for the policy check",
        Duration::from_secs(2),
        || {
            maps.endpoint(b_ip).unwrap().is_some_and(|e| {
                e.flags & (EP_KERNEL_ONLY | EP_POLICY) == EP_KERNEL_ONLY | EP_POLICY
            })
        },
    );
    let a_idx = net.node.ifindex(&ha).unwrap();
    let before = maps.counters(a_idx).unwrap().packets(Verdict::DropPolicy);
    assert!(
        ping(&pods[0].0, b_ip, 3).is_err(),
        "a -> b refused by the policy"
    );
    let after = maps.counters(a_idx).unwrap().packets(Verdict::DropPolicy);
    assert!(
        after >= before + 3,
        "a->b refused by the datapath (drop_policy): {before} -> {after}"
    );
    ping(&pods[1].0, ipv4(&pods[0].1), 2).unwrap();
    let hb = pods[1].1["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(mode(&hb), "xdp", "a policy-selected pod keeps XDP");
    let (_, body) = http_get(&net.node, LISTEN, "/metrics").unwrap();
    let drops = body
        .lines()
        .find(|l| l.starts_with("xdpcni_policy_datapath_packets_total{verdict=\"refused\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert!(
        drops.is_some_and(|d| d >= 3.0),
        "refused by the datapath's policy check: {drops:?}\n{body}"
    );

    // Another node: a route to its pod CIDR via its InternalIP appears, and
    // goes with the node. (192.0.2.0/24 is made on-link for the gateway.)
    let link = xdpcni_e2e::unique_name("xg");
    net.node.add_veth(&link, &format!("{link}p"), None).unwrap();
    net.node
        .ip(&["addr", "add", "192.0.2.1/24", "dev", &link])
        .unwrap();
    net.node.ip(&["link", "set", &link, "up"]).unwrap();
    net.node
        .ip(&["link", "set", &format!("{link}p"), "up"])
        .unwrap();
    api.with_client(&net.node, |c| async move {
        let nodes: Api<Node> = Api::all(c);
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": "node-b" },
                    "spec": { "podCIDR": "10.79.0.0/24" },
                }))?,
            )
            .await?;
        nodes
            .patch_status(
                "node-b",
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "status": { "addresses": [{ "type": "InternalIP", "address": "192.0.2.50" }] },
                })),
            )
            .await?;
        Ok(())
    })
    .unwrap();
    let route = || net.node.ip(&["route", "show", "10.79.0.0/24"]).unwrap();
    wait_for("route to node-b's pods", Duration::from_secs(3), || {
        route().contains("via 192.0.2.50") && route().contains("proto 90")
    });
    api.with_client(&net.node, |c| async move {
        Api::<Node>::all(c)
            .delete("node-b", &Default::default())
            .await?;
        Ok(())
    })
    .unwrap();
    wait_for("route gone with node-b", Duration::from_secs(3), || {
        route().trim().is_empty()
    });

    // Restart: the new agent applies nothing before its first complete
    // lists. a is generic by annotation (the node default is native): from
    // the new agent's start until it is ready and a second later, a's mode
    // never leaves generic.
    annotate("a", json!({ "xdpcni.io/xdp-mode": "generic" }));
    wait_for("generic on a", Duration::from_secs(1), || {
        mode(&ha) == "xdpgeneric"
    });
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.pid())).unwrap();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap_or_default()
        .to_string();
    eprintln!("agent after the kube test: {rss}");
    assert_eq!(
        agent.stop(libc::SIGTERM).unwrap(),
        Some(0),
        "clean exit on SIGTERM"
    );
    let log2 = net.dir.path().join("agent2.log");
    let agent = NodeProcess::spawn_env(
        &net.node,
        &agent_binary().unwrap(),
        &["run", "--config", cfg.to_str().unwrap()],
        &[("NODE_NAME", NODE), ("KUBECONFIG", &kubeconfig)],
        &log2,
    )
    .unwrap();
    let start = Instant::now();
    let mut samples = 0;
    let mut ready_at = None;
    while ready_at.is_none_or(|t: Instant| t.elapsed() < Duration::from_secs(1)) {
        assert_eq!(
            mode(&ha),
            "xdpgeneric",
            "a's mode changed during the restart (sample {samples}): {}",
            std::fs::read_to_string(&log2).unwrap_or_default()
        );
        samples += 1;
        if ready_at.is_none() && matches!(http_get(&net.node, LISTEN, "/readyz"), Ok((200, _))) {
            ready_at = Some(Instant::now());
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "restarted agent not ready"
        );
    }
    eprintln!(
        "restart: ready in {:?}, {samples} samples of a's mode, all generic",
        ready_at.map(|t| t - start)
    );

    for (i, (ns, _)) in pods.iter().enumerate() {
        let name = ["a", "b"][i];
        let d = net
            .call(&Call::new("DEL", name, Some(&ns.path())), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0);
    }
    assert_eq!(
        agent.stop(libc::SIGTERM).unwrap(),
        Some(0),
        "clean exit on SIGTERM"
    );
    drop(api);
}

/// `helm install` of the chart into the real API server, then the RBAC
/// authorizer asked (SubjectAccessReview) what the agent's ServiceAccount
/// may do: everything the agent uses, nothing more.
#[test]
fn the_chart_installs_and_grants_exactly_what_the_agent_uses() {
    let node = Netns::new("xn").unwrap();
    let api = ApiServer::start(&node).unwrap();
    let helm = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/helm.sh"))
        .output()
        .unwrap();
    let helm = String::from_utf8(helm.stdout).unwrap().trim().to_string();
    let home = xdpcni_e2e::cni::TempDir::new("xdpcni-helm-").unwrap();
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/xdpcni");
    let out = node
        .exec(&[
            "env",
            &format!("HOME={}", home.path().display()),
            &helm,
            "install",
            "xdpcni",
            chart,
            "--namespace",
            "kube-system",
            "--kubeconfig",
            api.kubeconfig.to_str().unwrap(),
        ])
        .unwrap();
    assert!(out.contains("STATUS: deployed"), "{out}");

    let checks: Vec<(&str, &str, &str, bool)> = vec![
        ("", "pods", "watch", true),
        ("", "pods", "list", true),
        ("", "nodes", "get", true),
        ("", "nodes", "watch", true),
        ("networking.k8s.io", "networkpolicies", "watch", true),
        // namespaceSelector: the labels of every namespace, nothing else.
        ("", "namespaces", "list", true),
        ("", "namespaces", "watch", true),
        ("", "namespaces", "update", false),
        ("", "namespaces", "delete", false),
        ("", "endpoints", "watch", true),
        ("", "endpoints", "update", false),
        // Services translated at the socket: Services and their backends.
        ("", "services", "watch", true),
        ("", "services", "list", true),
        ("", "services", "update", false),
        ("discovery.k8s.io", "endpointslices", "watch", true),
        ("discovery.k8s.io", "endpointslices", "list", true),
        ("events.k8s.io", "events", "create", true),
        ("events.k8s.io", "events", "patch", true),
        // No more than that:
        ("", "pods", "delete", false),
        ("", "pods", "patch", false),
        ("", "secrets", "get", false),
        ("", "nodes", "update", false),
        ("networking.k8s.io", "networkpolicies", "delete", false),
    ];
    let results = api
        .with_client(&node, move |c| async move {
            let sar: Api<k8s_openapi::api::authorization::v1::SubjectAccessReview> = Api::all(c.clone());
            let ds: Api<k8s_openapi::api::apps::v1::DaemonSet> = Api::namespaced(c, "kube-system");
            let d = ds.get("xdpcni-agent").await?;
            let spec = d.spec.unwrap().template.spec.unwrap();
            assert_eq!(spec.service_account_name.as_deref(), Some("xdpcni-agent"));
            // prepare-node (bpffs, the shared netns mount) before install-cni.
            let init: Vec<String> = spec.init_containers.unwrap().into_iter().map(|c| c.name).collect();
            assert_eq!(init, ["prepare-node", "install-cni"]);
            let mut out = Vec::new();
            for (group, resource, verb, want) in checks {
                let review = serde_json::from_value(json!({
                    "spec": {
                        "user": "system:serviceaccount:kube-system:xdpcni-agent",
                        "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system"],
                        "resourceAttributes": { "group": group, "resource": resource, "verb": verb, "namespace": "default" },
                    }
                }))?;
                let r = sar.create(&PostParams::default(), &review).await?;
                out.push((resource, verb, want, r.status.map(|s| s.allowed)));
            }
            Ok(out)
        })
        .unwrap();
    for (resource, verb, want, got) in results {
        assert_eq!(got, Some(want), "{verb} {resource}");
    }
}
