//! A short-lived process that takes over the datapath pinned in a directory,
//! registers endpoints, attaches to host veths, prints what it did as JSON
//! and exits. The restart tests run it several times to show that a process
//! exiting detaches nothing and that the next one changes nothing that is
//! already right. Reads its spec as JSON on stdin.

use std::{fs::File, io::Read, net::IpAddr, os::fd::AsRawFd, path::PathBuf};
use xdpcni_ebpf::testing::{RawDatapath, RawMaps};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use xdpcni_e2e::netns::parse_mac;
use xdpcni_ebpf::{
    abi::{EndpointInfo, RedirectPolicy},
    AttachMode, Datapath,
};

#[derive(Deserialize)]
struct Spec {
    pin_dir: PathBuf,
    netns: PathBuf,
    mode: String,
    endpoints: Vec<Endpoint>,
}

#[derive(Deserialize)]
struct Endpoint {
    ips: Vec<IpAddr>,
    ifindex: u32,
    pod_mac: String,
    host_mac: String,
}

#[derive(Serialize)]
struct Report {
    upgraded: bool,
    attachments: Vec<Attached>,
}

#[derive(Serialize)]
struct Attached {
    ifindex: u32,
    prog_id: u32,
    link_id: u32,
    changed: bool,
}

fn main() -> Result<()> {
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input)?;
    let spec: Spec = serde_json::from_str(&input).context("spec on stdin")?;
    let mode: AttachMode = spec.mode.parse()?;

    // This process is single-threaded: enter the node's network namespace.
    let ns = File::open(&spec.netns).with_context(|| format!("{}", spec.netns.display()))?;
    // SAFETY: a valid namespace fd; this process has one thread.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns: {}", std::io::Error::last_os_error());
    }

    let mut dp = Datapath::open(&spec.pin_dir)?;
    let mut attachments = Vec::new();
    for ep in &spec.endpoints {
        let info = EndpointInfo {
            ifindex: ep.ifindex,
            pod_mac: parse_mac(&ep.pod_mac)?,
            host_mac: parse_mac(&ep.host_mac)?,
            flags: 0,
            redirect: RedirectPolicy::Devmap.as_raw(),
            mtu: 1500,
            stats_slot: 0,
            cpu_mask: 0,
        };
        for ip in &ep.ips {
            dp.raw_maps().raw_upsert_endpoint(*ip, &info)?;
        }
        dp.raw_maps().raw_add_tx_port(ep.ifindex)?;
        let a = dp.switch_mode(ep.ifindex, mode)?;
        attachments.push(Attached {
            ifindex: a.ifindex,
            prog_id: a.prog_id,
            link_id: a.link_id,
            changed: a.changed,
        });
    }
    let report = Report {
        upgraded: dp.upgraded(),
        attachments,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
