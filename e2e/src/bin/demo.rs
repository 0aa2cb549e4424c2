//! The local demo (no Kubernetes): a node made of network namespaces with
//! three pods, the XDP datapath loaded into a private pin directory, and
//! traffic between the pods in each mode, with the counters that show which
//! path it took. Cleans up after itself. Run as root: `scripts/demo.sh`.

use std::net::IpAddr;

use anyhow::Result;
use xdpcni_e2e::{
    in_netns,
    topo::{Node, Pod},
    traffic::{ping, tcp_transfer, udp_echo},
    PinDir,
};
use xdpcni_ebpf::{
    abi::{RedirectPolicy, Verdict},
    AttachMode, Datapath,
};

const TCP_BYTES: usize = 32 << 20;

fn traffic(pods: &[Pod]) -> Result<f64> {
    let mut best = 0f64;
    for (i, from) in pods.iter().enumerate() {
        let to = &pods[(i + 1) % pods.len()];
        for addr in to.addrs() {
            ping(&from.ns, addr, 2)?;
            udp_echo(&from.ns, &to.ns, addr, 20, 1000)?;
        }
        best = best.max(tcp_transfer(
            &from.ns,
            &to.ns,
            IpAddr::V4(to.ipv4),
            TCP_BYTES,
        )?);
    }
    Ok(best)
}

fn main() -> Result<()> {
    println!("building a node namespace with 3 pod namespaces...");
    let node = Node::new(3)?;
    let pins = PinDir::new("xdemo")?;
    let mut dp = in_netns(&node.ns, || Ok(Datapath::open(pins.path())?))?;
    let ncpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    println!(
        "datapath pinned at {} (program id {})\n",
        pins.path().display(),
        dp.from_pod_program_id()?
    );
    println!(
        "| mode | redirect | via XDP devmap | via XDP cpumap | passed to kernel | best TCP Mbit/s |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: |");

    // Kernel routing first: no program, forwarding on in the node.
    node.ns.sysctl("net.ipv4.ip_forward", "1")?;
    node.ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    let mbps = traffic(&node.pods)?;
    println!("| off (kernel routing) | - | 0 | 0 | all | {mbps:.0} |");
    node.ns.sysctl("net.ipv4.ip_forward", "0")?;
    node.ns.sysctl("net.ipv6.conf.all.forwarding", "0")?;

    for mode in [AttachMode::Native, AttachMode::Generic] {
        for redirect in [RedirectPolicy::Devmap, RedirectPolicy::Cpumap] {
            let mask = (1u64 << ncpus.min(63)) - 1;
            in_netns(&node.ns, || {
                node.register_all(dp.maps_mut(), redirect, mask)?;
                for cpu in 0..ncpus {
                    dp.enable_cpu(cpu, 2048)?;
                }
                for pod in &node.pods {
                    dp.maps_mut().remove_counters(pod.host_ifindex)?;
                    dp.attach(pod.host_ifindex, mode)?;
                }
                Ok(())
            })?;
            for pod in &node.pods {
                pod.apply_mode_offloads(mode)?;
            }
            let mbps = traffic(&node.pods)?;
            let (mut devmap, mut cpumap, mut passed) = (0, 0, 0);
            for pod in &node.pods {
                let c = dp.maps().counters(pod.host_ifindex)?;
                devmap += c.packets(Verdict::RedirectDevmap);
                cpumap += c.packets(Verdict::RedirectCpumap);
                passed += c.passed();
            }
            println!("| {mode} | {redirect:?} | {devmap} | {cpumap} | {passed} | {mbps:.0} |");
        }
    }
    println!(
        "\n(forwarding is off in the node namespace while XDP runs: what arrived, XDP carried;"
    );
    println!(" 'passed' is ND/multicast control traffic. Cleaning up namespaces and pins.)");
    Ok(())
}
