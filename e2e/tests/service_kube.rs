//! Services translated at the socket, kept by the `xdpcni-agent` from a real
//! kube-apiserver (1.20.2: backends from Endpoints; no kube-proxy runs, so a
//! ClusterIP is reachable only through the agent's translation): a pod
//! reaches a Service's backends through the cluster IP and a named
//! targetPort, the peer it sees is the Service, a backend taken out of the
//! Endpoints stops being chosen, a removed Service stops being translated,
//! and neither the node's own sockets nor the pods of another agent are
//! ever translated. Needs root, bpffs, cgroup v2, containernetworking-plugins
//! and scripts/k8s-build.sh.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    collections::BTreeMap,
    net::IpAddr,
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{Endpoints, Service};
use kube::{
    api::{DeleteParams, Patch, PatchParams, PostParams},
    Api,
};
use serde_json::{json, Value};
use xdpcni_e2e::{
    cluster::{KubeNode, LISTEN, NODE},
    cni::http_get,
    netns::Netns,
};

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    start.elapsed()
}

/// `podtool greet IP PORT N` in namespace `ns` (it checks that each
/// connection's peer shows as the address dialed): connections per backend.
fn greet(ns: &str, ip: IpAddr, port: u16, n: u32) -> Result<BTreeMap<String, u32>, String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_podtool"), "greet"])
        .args([ip.to_string(), port.to_string(), n.to_string()])
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let (who, count) = l.rsplit_once(' ').unwrap();
            (who.to_string(), count.parse().unwrap())
        })
        .collect())
}

/// The agent's status, as JSON.
fn status(node: &Netns) -> Value {
    let (code, body) = http_get(node, LISTEN, "/v1/status").unwrap();
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The backends the status shows for frontend `fe`, if it shows it.
fn backends_of(node: &Netns, fe: &str) -> Option<u64> {
    status(node)["services"]["frontends"]
        .as_array()?
        .iter()
        .find(|f| f["frontend"] == fe)
        .and_then(|f| f["backends"].as_u64())
}

/// The Endpoints of Service `web`: `ips` on port 80, named `http`.
fn endpoints(ips: &[IpAddr]) -> Value {
    let addrs: Vec<Value> = ips
        .iter()
        .map(|ip| json!({ "ip": ip.to_string(), "nodeName": NODE }))
        .collect();
    json!({
        "metadata": { "name": "web" },
        "subsets": [{ "addresses": addrs, "ports": [{ "name": "http", "port": 80 }] }],
    })
}

/// p50 and p99 of `v` (sorted in place).
fn quantiles(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

#[test]
fn service_translation_follows_the_api_server() {
    let mut node = KubeNode::start(|_| {}).unwrap();
    let client = node
        .add_pod("default", "client", json!({}), json!([]))
        .unwrap();
    let b1 = node.add_pod("default", "b1", json!({}), json!([])).unwrap();
    let b2 = node.add_pod("default", "b2", json!({}), json!([])).unwrap();
    let (ip1, ip2) = (b1.ip(false), b2.ip(false));
    let client_ns = client.netns.name().to_string();

    // A Service whose targetPort is a name only the Endpoints resolve.
    let t_api = Instant::now();
    let cluster_ip: IpAddr = node
        .client(move |c| async move {
            let eps: Api<Endpoints> = Api::namespaced(c.clone(), "default");
            eps.create(
                &PostParams::default(),
                &serde_json::from_value(endpoints(&[ip1, ip2]))?,
            )
            .await?;
            let svcs: Api<Service> = Api::namespaced(c, "default");
            let svc = svcs
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": { "name": "web" },
                        "spec": { "ports": [{ "name": "http", "port": 8080, "targetPort": "http" }] },
                    }))?,
                )
                .await?;
            Ok(svc.spec.unwrap().cluster_ip.unwrap().parse()?)
        })
        .unwrap();
    let fe = format!("{cluster_ip}:8080");
    let took = wait_for("the frontend in the maps", Duration::from_secs(5), || {
        backends_of(&node.net.node, &fe) == Some(2)
    });
    eprintln!(
        "Service created -> in the maps: {took:?} after the API answered ({:?} from the first request)",
        t_api.elapsed()
    );

    // No kube-proxy here: the cluster IP answers only through translation.
    // Each connection's peer shows as the Service (getpeername), and both
    // backends are chosen.
    let seen = greet(&client_ns, cluster_ip, 8080, 40).unwrap();
    assert_eq!(seen.values().sum::<u32>(), 40, "{seen:?}");
    assert!(
        seen.contains_key("default/b1") && seen.contains_key("default/b2"),
        "{seen:?}"
    );

    // The node's own sockets are never translated, nor are a namespace's
    // that is no pod of this agent: their connects fail (no kube-proxy),
    // and the programs' count of translations does not move. (The foreign
    // namespace has no route anywhere, so its failure alone proves
    // nothing: the count does.)
    let translated = || {
        status(&node.net.node)["services"]["translated"]
            .as_u64()
            .unwrap()
    };
    let before = translated();
    let host = greet(node.net.node.name(), cluster_ip, 8080, 1);
    assert!(host.is_err(), "the node's socket was translated: {host:?}");
    let stranger = Netns::new("xq").unwrap();
    let other = greet(stranger.name(), cluster_ip, 8080, 1);
    assert!(
        other.is_err(),
        "a foreign namespace was translated: {other:?}"
    );
    assert_eq!(
        translated(),
        before,
        "a connect of the node or a stranger translated"
    );

    // A backend taken out of the Endpoints stops being chosen at once:
    // measured from the API's answer to the status showing the maps, 20
    // changes.
    let mut lat = Vec::new();
    for i in 0..20 {
        let keep: Vec<IpAddr> = if i % 2 == 0 {
            vec![ip1]
        } else {
            vec![ip1, ip2]
        };
        let want = keep.len() as u64;
        node.client(move |c| async move {
            let eps: Api<Endpoints> = Api::namespaced(c, "default");
            eps.patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(endpoints(&keep)),
            )
            .await?;
            Ok(())
        })
        .unwrap();
        lat.push(wait_for(
            "the backend change",
            Duration::from_secs(5),
            || backends_of(&node.net.node, &fe) == Some(want),
        ));
        if want == 1 {
            let seen = greet(&client_ns, cluster_ip, 8080, 10).unwrap();
            assert_eq!(
                seen,
                BTreeMap::from([("default/b1".to_string(), 10)]),
                "round {i}"
            );
        }
    }
    let (p50, p99) = quantiles(&mut lat);
    eprintln!(
        "Endpoints change -> maps (API answer to status, 20 changes): p50 {p50:?}, p99 {p99:?}"
    );
    assert!(p99 < Duration::from_secs(1), "p99 {p99:?}");

    // The status and the metrics say what was translated.
    let s = status(&node.net.node);
    assert!(s["services"]["translated"].as_u64().unwrap() >= 140, "{s}");
    assert!(s["services"]["namespaces"].as_u64().unwrap() >= 3, "{s}");
    // Who serves what: pods' ClusterIP connects by the programs, the rest
    // (the node's own sockets are not translated by default) by kube-proxy.
    let served = s["services"]["servedBy"].as_array().unwrap();
    assert_eq!(
        served[0]["traffic"], "ClusterIP from this node's pods, TCP and UDP",
        "{s}"
    );
    assert!(
        served[0]["by"].as_str().unwrap().starts_with("xdpcni"),
        "{s}"
    );
    assert!(
        served
            .iter()
            .filter(|w| w["traffic"]
                .as_str()
                .unwrap()
                .starts_with("NodePort, LoadBalancer, externalIPs"))
            .all(|w| w["by"] == "kube-proxy"),
        "{s}"
    );
    let m = node.metrics().unwrap();
    assert!(m[r#"xdpcni_service_calls_total{result="translated"}"#] >= 140.0);
    assert!(m["xdpcni_service_sync_seconds_count"] >= 20.0);
    assert_eq!(m[r#"xdpcni_reconcile_errors_total{stage="services"}"#], 0.0);
    let (code, table, err) = node.status(&[]).unwrap();
    assert_eq!(code, Some(0), "{err}");
    // Two Services: web, and the API server's own `kubernetes` (whose
    // API server writes no endpoint for its loopback address here).
    let line = table.lines().find(|l| l.starts_with("Services:")).unwrap();
    assert!(
        line.contains("2 frontends of 2 Services translated at the socket (1 with ready backends)")
            && line.contains("for 3 network namespaces"),
        "{table}"
    );
    assert!(
        table.contains(
            "\n           NodePort, LoadBalancer, externalIPs from the node and hostNetwork pods: kube-proxy\n"
        ),
        "{table}"
    );

    // The agent killed: the pinned programs and maps translate on (within
    // the agent's lease), and its next start takes them over.
    node.stop_agent(9).unwrap();
    let seen = greet(&client_ns, cluster_ip, 8080, 5).unwrap();
    assert_eq!(seen.values().sum::<u32>(), 5, "{seen:?}");
    node.start_agent().unwrap();
    wait_for(
        "the frontend after the restart",
        Duration::from_secs(10),
        || backends_of(&node.net.node, &fe) == Some(2),
    );

    // The Service removed: its frontend leaves the maps, and the cluster
    // IP no longer answers (kube-proxy's alone, and there is none).
    node.client(|c| async move {
        let svcs: Api<Service> = Api::namespaced(c, "default");
        svcs.delete("web", &DeleteParams::default()).await?;
        Ok(())
    })
    .unwrap();
    wait_for("the frontend gone", Duration::from_secs(5), || {
        backends_of(&node.net.node, &fe).is_none()
    });
    assert!(greet(&client_ns, cluster_ip, 8080, 1).is_err());
}
