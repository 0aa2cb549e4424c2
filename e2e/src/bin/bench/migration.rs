//! The datapath's migration from the previous release: its duration and
//! the agent's start to ready.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The migration of a datapath the previous release pinned (its layout,
/// [`xdpcni_ebpf::PREVIOUS_LAYOUT`]) with `n` pods attached (generic devmap,
/// its node default set so) to this build's layout: this
/// build's agent started over it; how long its migration took
/// (`xdpcni_datapath_migration_seconds`) and its start to ready. Fresh
/// node each repetition.
pub fn migration_bench(
    reps: usize,
    n: usize,
    push: &mut dyn FnMut(&str, &str, usize, f64),
) -> Result<String> {
    let previous = xdpcni_e2e::previous_release()?;
    let path = format!("{n} pods, this build's agent");
    for rep in 0..reps {
        check_interrupt()?;
        let pins = PinDir::new("xg")?;
        let mut net = Network::new(pins.path(), "1.1.0", json!([[{"subnet": "10.76.0.0/16"}]]))?;
        let this_plugin = std::mem::replace(&mut net.plugin, previous.join("xdpcni"));
        let old = StandaloneAgent::start_binary(
            &previous.join("xdpcni-agent"),
            &net,
            pins.path(),
            |c| c.xdp_mode = "generic".into(),
        )?;
        let pods: Vec<Netns> = (0..n).map(|_| Netns::new("xp")).collect::<Result<_>>()?;
        let mut hosts = Vec::new();
        for (i, pod) in pods.iter().enumerate() {
            let out = net.call(
                &Call::new("ADD", &format!("mig{i}"), Some(&pod.path())),
                &json!({}),
            )?;
            ensure!(out.status == 0, "previous release ADD: {}", out.json);
            hosts.push(
                out.json["interfaces"][0]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
        for h in &hosts {
            wait_mode(&net.node, h, "xdpgeneric", Duration::from_secs(10))?;
        }
        old.stop(libc::SIGTERM)?;
        net.plugin = this_plugin;
        let t = Instant::now();
        let agent = StandaloneAgent::start(&net, pins.path(), |_| {})?;
        let ready = t.elapsed().as_secs_f64() * 1e3;
        let (_, body) =
            xdpcni_e2e::cni::http_get(&net.node, xdpcni_e2e::agent::LISTEN, "/metrics")?;
        let secs: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix("xdpcni_datapath_migration_seconds "))
            .and_then(|v| v.trim().parse().ok())
            .context("no xdpcni_datapath_migration_seconds")?;
        ensure!(secs > 0.0, "the agent did not migrate: {}", agent.log());
        push(W_MIGRATE, &path, rep, secs * 1e3);
        push(W_MIGRATE_READY, &path, rep, ready);
        for (i, pod) in pods.iter().enumerate() {
            let _ = net.call(
                &Call::new("DEL", &format!("mig{i}"), Some(&pod.path())),
                &json!({}),
            );
        }
        drop(agent);
    }
    Ok(path)
}
