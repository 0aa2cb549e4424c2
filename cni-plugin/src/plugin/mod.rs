//! The CNI commands.
//!
//! Gateway scheme: every pod routes through link-local gateways, 169.254.1.1
//! and fe80::1, that no interface owns. The pod has a permanent neighbour
//! entry mapping both to its host veth's MAC, so it never ARPs or solicits
//! for them; the node has a /32 and /128 route per pod address on the host
//! veth. The pod's addresses are /32 and /128: everything leaves through the
//! gateway, which is where the XDP datapath (or kernel routing) picks it up.
//!
//! One file per command: [`add`], [`del`] (DEL and GC), [`check`]; STATUS and
//! VERSION, and what they share, here.

mod add;
mod check;
mod del;

pub use add::add;
pub use check::check;
pub use del::{del, gc};

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::{json, Value};
use xdpcni_ebpf::Datapath;
use xdpcni_host::hook;

use crate::{
    config::{CniEnv, NetConf},
    error::{Error, Result},
    types::{self},
};

/// IPv4 gateway of every pod.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// IPv6 gateway of every pod.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

fn gateway(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(GATEWAY_V4),
        IpAddr::V6(_) => IpAddr::V6(GATEWAY_V6),
    }
}

fn host_prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

/// A step of ADD done: a crash point (`add:<step>`) and a fail point, where
/// a test build injects an error to prove that ADD undoes every earlier step
/// (see [`hook`]; nothing in a product binary).
fn fail_point(step: &str) -> Result<()> {
    if !hook::armed() {
        return Ok(());
    }
    hook::stop_point(&format!("add:{step}"));
    if hook::fail_point(step) {
        return Err(Error::Injected(step.into()));
    }
    Ok(())
}

fn write_sysctl(path: &str, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(|e| Error::io(format!("writing {path}"), e))
}

/// Removes what the datapath knows of an endpoint on `ifindex`: when
/// `owns_ifindex`, its XDP link, its hold, every endpoint record pointing at
/// it, its devmap entry and counters; otherwise (the ifindex is another
/// pod's now) only the records of `ips` still pointing at it.
fn forget_endpoint(
    dp: &mut Datapath,
    ifindex: u32,
    ips: &[IpAddr],
    owns_ifindex: bool,
) -> Result<()> {
    if !owns_ifindex {
        return Ok(dp.forget_addresses(ifindex, ips)?);
    }
    dp.forget_veth(ifindex, &mut |step| {
        hook::stop_point(&format!("del:{step}"))
    })?;
    Ok(())
}

/// Refuses `command` for a config older than `min` (CHECK came in 0.4.0,
/// GC and STATUS in 1.1.0).
fn require_version(conf: &NetConf, min: &str, command: &str) -> Result<()> {
    if types::version_tuple(&conf.cni_version) < types::version_tuple(min) {
        return Err(Error::IncompatibleVersion(format!(
            "{command} needs cniVersion {min} or later, got {}",
            conf.cni_version
        )));
    }
    Ok(())
}

/// CNI_NETNS, which must exist.
fn existing_netns(env: &CniEnv) -> Result<std::path::PathBuf> {
    let netns = env.netns.clone().ok_or(Error::InvalidEnv {
        var: "CNI_NETNS",
        why: "not set".into(),
    })?;
    if !netns.exists() {
        return Err(Error::ContainerUnknown(format!(
            "network namespace {} does not exist",
            netns.display()
        )));
    }
    Ok(netns)
}

/// STATUS: unavailable while the datapath is not pinned or the agent not ready.
pub fn status(conf: &NetConf) -> Result<()> {
    require_version(conf, "1.1.0", "STATUS")?;
    let pinned = conf.pinned()?;
    if !pinned.ready() {
        return Err(Error::Unavailable(format!(
            "the XDP datapath of layout {} is not ready at {}: {} is pinned there",
            xdpcni_ebpf::abi::LAYOUT,
            conf.pin_dir.display(),
            pinned.describe()
        )));
    }
    if let Some(ready) = &conf.agent_ready_file {
        if !ready.exists() {
            return Err(Error::Unavailable(format!(
                "the node agent is not ready ({} missing)",
                ready.display()
            )));
        }
    }
    Ok(())
}

/// VERSION.
pub fn version(stdin: &[u8]) -> Value {
    json!({ "cniVersion": types::asked_version(stdin), "supportedVersions": types::SUPPORTED_VERSIONS })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_answers_the_asked_version_when_supported() {
        assert_eq!(version(br#"{"cniVersion":"0.4.0"}"#)["cniVersion"], "0.4.0");
        assert_eq!(version(br#"{"cniVersion":"7.0.0"}"#)["cniVersion"], "1.1.0");
        assert_eq!(version(b"")["supportedVersions"][0], "0.3.0");
    }
}
