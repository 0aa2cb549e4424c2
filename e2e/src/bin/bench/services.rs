//! Services: a client pod's TCP stream, UDP 64-byte flood and TCP_RR to a
//! server pod of the same node, three ways, side by side in each
//! repetition: through the Service's cluster IP (translated at the client's
//! socket by the agent, then the fast path), to the server's pod IP (the
//! fast path, no Service), and through kube-proxy's path (the connect left
//! untranslated, DNAT'd by iptables as kube-proxy's iptables mode does, the
//! replies un-DNAT'd: the kernel path both ways, the server's replies sent
//! there by the exact NAT check). And the node's own socket's TCP_RR to
//! the same server, translated at its socket (`services.nodeSockets`), to
//! the pod IP (no Service: no translation can do better) and through
//! kube-proxy's path (an iptables DNAT in nat OUTPUT).

#[allow(clippy::wildcard_imports)]
use super::*;
use xdpcni_e2e::cluster::KubeNode;
use xdpcni_ebpf::abi::Verdict;

/// The paths of the Service rows.
pub const SVC_CLUSTERIP: &str = "ClusterIP, translated at the socket";
pub const SVC_PODIP: &str = "pod IP, no Service";
pub const SVC_KUBEPROXY: &str = "kube-proxy's path (iptables DNAT)";

/// The address kube-proxy's path dials: no Service of the API names it, so
/// no socket program translates it, and an iptables DNAT in the node's
/// `nat` PREROUTING (kube-proxy's hook) sends it to the server.
const KUBEPROXY_VIP: &str = "10.96.250.250";

/// The Service's ports (port = targetPort): iperf3, the UDP sink, the
/// request/response echo.
const PORTS: [(&str, &str, u16); 3] = [
    ("iperf", "TCP", 5201),
    ("sink", "UDP", 9000),
    ("rr", "TCP", 7000),
];

/// The Service rows on a node of their own (API server, agent in
/// Kubernetes mode, the default tc mode), and the share of the client's
/// packets each path kept on the fast path.
pub fn services_bench(
    reps: usize,
    secs: u32,
    rounds: usize,
    push: &mut dyn FnMut(&str, &str, usize, f64),
    extra: &mut Vec<String>,
) -> Result<()> {
    use xdpcni_e2e::{cluster::KubeNode, traffic::tcp_rr_via};
    // The node's own sockets translated too (the host ClusterIP row).
    let node = KubeNode::start(|c| c.services.node_sockets = true)?;
    // An uplink with a default route, as a node has: cluster IPs are
    // routed (kube-proxy's DNAT of the node's own packets happens after
    // the route lookup, and the translation binds the route's source).
    // (A veth pair: this kernel has no dummy device.)
    let (uplink, far) = (
        xdpcni_e2e::unique_name("xbu"),
        xdpcni_e2e::unique_name("xbv"),
    );
    let n = &node.net.node;
    n.ip(&["link", "add", &uplink, "type", "veth", "peer", "name", &far])?;
    n.ip(&["addr", "add", "192.168.240.1/24", "dev", &uplink])?;
    n.ip(&["link", "set", &far, "up"])?;
    n.ip(&["link", "set", &uplink, "up"])?;
    n.ip(&["route", "add", "default", "via", "192.168.240.254"])?;
    let client = node.add_pod("default", "client", json!({}), json!([]))?;
    let server = node.add_pod("default", "server", json!({}), json!([]))?;
    let sip = server.ip(false);
    let ports: Vec<Value> = PORTS
        .iter()
        .map(|(n, p, port)| json!({ "name": n, "protocol": p, "port": port }))
        .collect();
    let svc_ports: Vec<Value> = PORTS
        .iter()
        .map(|(n, p, port)| json!({ "name": n, "protocol": p, "port": port, "targetPort": port }))
        .collect();
    let vip: IpAddr = node.client(move |c| async move {
        use k8s_openapi::api::core::v1::{Endpoints, Service};
        use kube::{api::PostParams, Api};
        let eps: Api<Endpoints> = Api::namespaced(c.clone(), "default");
        eps.create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "bench" },
                "subsets": [{ "addresses": [{ "ip": sip.to_string() }], "ports": ports }],
            }))?,
        )
        .await?;
        let svc = Api::<Service>::namespaced(c, "default")
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": "bench" },
                    "spec": { "ports": svc_ports },
                }))?,
            )
            .await?;
        Ok(svc
            .spec
            .and_then(|s| s.cluster_ip)
            .context("no cluster IP")?
            .parse()?)
    })?;
    // Every frontend in the maps, and the server's ports NAT'd (the exact
    // check asks conntrack about their flows).
    let start = Instant::now();
    loop {
        let m = node.metrics()?;
        if m.get(r#"xdpcni_service_frontends{backends="ready"}"#)
            .copied()
            == Some(3.0)
            && Maps::open_pinned(node.pin_dir())?
                .nat_ports()?
                .iter()
                .filter(|(ip, ..)| *ip == sip)
                .count()
                == 3
        {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "the Service's frontends and NAT'd ports not in place"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The node's own packets meet kube-proxy's rules in nat OUTPUT.
    node.net.node.exec(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "OUTPUT",
        "-d",
        KUBEPROXY_VIP,
        "-p",
        "tcp",
        "--dport",
        &PORTS[2].2.to_string(),
        "-j",
        "DNAT",
        "--to-destination",
        &format!("{sip}:{}", PORTS[2].2),
    ])?;
    for (_, p, port) in PORTS {
        node.net.node.exec(&[
            "iptables",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-d",
            KUBEPROXY_VIP,
            "-p",
            &p.to_lowercase(),
            "--dport",
            &port.to_string(),
            "-j",
            "DNAT",
            "--to-destination",
            &format!("{sip}:{port}"),
        ])?;
    }
    let kp: IpAddr = KUBEPROXY_VIP.parse()?;
    let paths = [(SVC_CLUSTERIP, vip), (SVC_PODIP, sip), (SVC_KUBEPROXY, kp)];
    let maps = Maps::open_pinned(node.pin_dir())?;
    let idx = node.net.node.ifindex(&client.host)?;
    let mut share: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let dur = Duration::from_secs(u64::from(secs));
    for rep in 0..reps {
        for (label, dial) in rep_order(&paths, rep).into_iter().copied() {
            let before = maps.counters(idx)?;
            let bind = SocketAddr::new(sip, PORTS[0].2);
            push(
                W_SVC_TCP,
                label,
                rep,
                iperf_via(&client.netns, &server.netns, bind, dial, secs)?,
            );
            let after = maps.counters(idx)?;
            let s = share.entry(label).or_default();
            s.0 += after.forwarded() - before.forwarded();
            s.1 += after.passed() - before.passed();
            let (bind, to) = (
                SocketAddr::new(sip, PORTS[1].2),
                SocketAddr::new(dial, PORTS[1].2),
            );
            push(
                W_SVC_UDP64,
                label,
                rep,
                pps_via(&client.netns, &server.netns, bind, to, 22, dur)? / 1e6,
            );
            check_interrupt()?;
            let (bind, to) = (
                SocketAddr::new(sip, PORTS[2].2),
                SocketAddr::new(dial, PORTS[2].2),
            );
            let mut rtts = tcp_rr_via(&client.netns, &server.netns, bind, to, rounds, 100)?;
            push(W_SVC_RR, label, rep, percentile(&mut rtts, 0.5));
        }
        // The node's own socket (a host process, a hostNetwork pod).
        for (label, dial) in rep_order(&paths, rep).into_iter().copied() {
            let (bind, to) = (
                SocketAddr::new(sip, PORTS[2].2),
                SocketAddr::new(dial, PORTS[2].2),
            );
            let mut rtts = tcp_rr_via(&node.net.node, &server.netns, bind, to, rounds, 100)?;
            push(W_SVC_HOST_RR, label, rep, percentile(&mut rtts, 0.5));
        }
    }
    for (label, (fast, kernel)) in &share {
        extra.push(format!(
            "Service rows, {label}: {:.1}% of the client's packets of the TCP streams on the fast path ({fast} redirected, {kernel} to the kernel)",
            100.0 * *fast as f64 / (*fast + *kernel).max(1) as f64
        ));
    }
    let m = node.metrics()?;
    extra.push(format!(
        "Service rows: the node's own socket: {} (192.168.240.1, the route's source toward the cluster IPs, bound on the translated path and kept by kube-proxy's DNAT in nat OUTPUT)",
        if xdpcni_e2e::oracle::status(&node)?["services"]["nodeSockets"] == true {
            "translated"
        } else {
            "NOT translated (services.nodeSockets did not take)"
        }
    ));
    extra.push(format!(
        "Service rows: {} connects translated at the socket (xdpcni_service_calls_total), kube-proxy's path an iptables DNAT in nat PREROUTING per port (one rule each: kube-proxy's chains add a jump or two before it)",
        m.get(r#"xdpcni_service_calls_total{result="translated"}"#)
            .copied()
            .unwrap_or(0.0)
    ));
    Ok(())
}

/// The paths of the north-south rows.
pub const NS_TC: &str = "NodePort, xdpcni at tc on the uplink";
pub const NS_KUBEPROXY: &str = "NodePort, kube-proxy 1.20.2 (iptables)";
/// The same, the backend on another node.
pub const NS_TC_REMOTE: &str = "NodePort to another node's backend, xdpcni at tc on the uplink";
pub const NS_KUBEPROXY_REMOTE: &str = "NodePort to another node's backend, kube-proxy 1.20.2";

/// The node ports of the north-south rows, each also the server's port (so
/// one address and port serves both the bind and the dial); the remote
/// backend's Service has each plus one.
const NS_PORTS: [(&str, &str, u16); 3] = [
    ("iperf", "TCP", 30201),
    ("sink", "UDP", 30900),
    ("rr", "TCP", 30700),
];

/// Creates Service `name` (NodePort, each of [`NS_PORTS`] plus `offset`
/// as port, target and node port) with one ready backend `ip` on `node_name`.
fn ns_service(node: &KubeNode, name: &str, ip: IpAddr, node_name: &str, offset: u16) -> Result<()> {
    let ports: Vec<Value> = NS_PORTS
        .iter()
        .map(|(n, p, port)| json!({ "name": n, "protocol": p, "port": port + offset }))
        .collect();
    let svc_ports: Vec<Value> = NS_PORTS
        .iter()
        .map(|(n, p, port)| {
            let port = port + offset;
            json!({ "name": n, "protocol": p, "port": port, "targetPort": port, "nodePort": port })
        })
        .collect();
    let (name, node_name) = (name.to_string(), node_name.to_string());
    node.client(move |c| async move {
        use k8s_openapi::api::core::v1::{Endpoints, Service};
        use kube::{api::PostParams, Api};
        Api::<Endpoints>::namespaced(c.clone(), "default")
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": name },
                    "subsets": [{
                        "addresses": [{ "ip": ip.to_string(), "nodeName": node_name }],
                        "ports": ports,
                    }],
                }))?,
            )
            .await?;
        Api::<Service>::namespaced(c, "default")
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": name },
                    "spec": { "type": "NodePort", "ports": svc_ports },
                }))?,
            )
            .await?;
        Ok(())
    })
}

/// North-south: a client outside the node calls a NodePort whose backend is
/// a pod of this node, or "another node's" (a namespace behind a third
/// device of the node, the program on it too), through two uplinks of one
/// node, side by side in each repetition: uplink A with the agent's program
/// (`services.northSouthDevices`), uplink B left to a real kube-proxy
/// 1.20.2 in iptables mode (its DNAT and masquerade, conntrack both ways).
/// `externalTrafficPolicy: Cluster`: both masquerade the client. Also the
/// share of A's packets the program carried (`ns_to_pod`, `ns_to_node`).
pub fn north_south_bench(
    reps: usize,
    secs: u32,
    rounds: usize,
    push: &mut dyn FnMut(&str, &str, usize, f64),
    extra: &mut Vec<String>,
) -> Result<()> {
    use xdpcni_e2e::{oracle, traffic::tcp_rr_via};
    let (dev_a, dev_b, dev_r) = (
        xdpcni_e2e::unique_name("xba"),
        xdpcni_e2e::unique_name("xbb"),
        xdpcni_e2e::unique_name("xbr"),
    );
    let config_devs = vec![dev_a.clone(), dev_r.clone()];
    let node = KubeNode::start(move |c| c.services.north_south_devices = config_devs)?;
    let a = oracle::outside(&node, &dev_a, 0)?;
    let b = oracle::outside(&node, &dev_b, 1)?;
    let far = oracle::remote_on(&node, &dev_r)?;
    let server = node.add_pod("default", "server", json!({}), json!([]))?;
    let sip = server.ip(false);
    let rip: IpAddr = oracle::REMOTE4.parse()?;
    ns_service(&node, "nsbench", sip, xdpcni_e2e::cluster::NODE, 0)?;
    ns_service(&node, "nsbench-r", rip, "node-b", 1)?;
    let _proxy = oracle::kube_proxy(&node)?;
    // kube-proxy's node port rules, and the agent's outside frontends.
    let start = Instant::now();
    loop {
        let (v4, _) = oracle::rules(&node);
        let fronts = oracle::status(&node)?["services"]["frontends"].clone();
        let outside = fronts.as_array().map_or(0, |f| {
            f.iter()
                .filter(|f| {
                    f["outside"] == true
                        && f["backends"] == 1
                        && f["frontend"]
                            .as_str()
                            .is_some_and(|s| s.starts_with(&format!("{}:", a.node[0])))
                })
                .count()
        });
        if outside == 2 * NS_PORTS.len()
            && NS_PORTS.iter().all(|(n, ..)| {
                v4.contains(&format!("default/nsbench:{n}"))
                    && v4.contains(&format!("default/nsbench-r:{n}"))
            })
        {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(60),
            "kube-proxy's rules or the agent's outside frontends not in place"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // (label, client side, server's namespace and address, port offset, the
    // program's verdict for it)
    type Path<'a> = (
        &'a str,
        &'a oracle::Outside,
        &'a Netns,
        IpAddr,
        u16,
        Option<Verdict>,
    );
    let paths: [Path; 4] = [
        (NS_TC, &a, &server.netns, sip, 0, Some(Verdict::NsToPod)),
        (NS_KUBEPROXY, &b, &server.netns, sip, 0, None),
        (
            NS_TC_REMOTE,
            &a,
            far.netns(),
            rip,
            1,
            Some(Verdict::NsToNode),
        ),
        (NS_KUBEPROXY_REMOTE, &b, far.netns(), rip, 1, None),
    ];
    let maps = Maps::open_pinned(node.pin_dir())?;
    let up = node.net.node.ifindex(&dev_a)?;
    let carried = |m: &Maps| -> Result<u64> {
        let c = m.counters(up)?;
        Ok(c.get(Verdict::NsToPod).packets + c.get(Verdict::NsToNode).packets)
    };
    let mut flood: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let dur = Duration::from_secs(u64::from(secs));
    for rep in 0..reps {
        for (label, side, srv, ip, off, verdict) in rep_order(&paths, rep).into_iter().copied() {
            let dial = side.node[0];
            let port = |i: usize| NS_PORTS[i].2 + off;
            let c0 = carried(&maps)?;
            let bind = SocketAddr::new(ip, port(0));
            push(
                W_NS_TCP,
                label,
                rep,
                iperf_via(&side.netns, srv, bind, dial, secs)?,
            );
            let (bind, to) = (SocketAddr::new(ip, port(1)), SocketAddr::new(dial, port(1)));
            let c1 = maps.counters(up)?;
            let mpps = pps_via(&side.netns, srv, bind, to, 22, dur)? / 1e6;
            push(W_NS_UDP64, label, rep, mpps);
            if let Some(v) = verdict {
                let got = maps.counters(up)?.get(v).packets - c1.get(v).packets;
                let e = flood.entry(label).or_default();
                e.0 += got;
                e.1 += (mpps * 1e6 * dur.as_secs_f64()) as u64;
            }
            check_interrupt()?;
            let (bind, to) = (SocketAddr::new(ip, port(2)), SocketAddr::new(dial, port(2)));
            let mut rtts = tcp_rr_via(&side.netns, srv, bind, to, rounds, 100)?;
            push(W_NS_RR, label, rep, percentile(&mut rtts, 0.5));
            if verdict.is_none() {
                ensure!(
                    carried(&maps)? == c0,
                    "the program carried packets of kube-proxy's uplink"
                );
            }
        }
    }
    let shares: Vec<String> = flood
        .iter()
        .map(|(l, (got, sent))| format!("{l}: {got} of the UDP flood's packets carried by the program against {sent} received by the server"))
        .collect();
    extra.push(format!(
        "North-south rows: {}; kube-proxy's: the same Services' node ports on another uplink of the same node, kube-proxy's own rules (DNAT, masquerade, conntrack); both masquerade the client (externalTrafficPolicy Cluster); another node's backend is a namespace behind a third device of the node (one forwarding hop more than a local pod, no second node's stack)",
        shares.join("; ")
    ));
    Ok(())
}
