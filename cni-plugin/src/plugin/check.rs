//! CHECK: what ADD made is still there and as it was.

use std::net::IpAddr;

use xdpcni_host::{
    ethtool::{self, Offload},
    netns::in_netns,
    state::{self},
};

use super::{existing_netns, gateway, require_version};
use crate::{
    config::{CniEnv, NetConf},
    error::{Error, Result},
    ipam,
};
use xdpcni_host::netlink::Netlink;

/// CHECK: the pod's interface, addresses, routes and host veth still match
/// prevResult, and any endpoint record of its addresses points at its veth
/// (the agent writes them once it attaches the fast path; a pod on kernel
/// routing, or held, has none).
pub fn check(conf: &NetConf, env: &CniEnv) -> Result<()> {
    require_version(conf, "0.4.0", "CHECK")?;
    let prev = conf
        .prev_result
        .as_ref()
        .ok_or_else(|| Error::config("prevResult", "CHECK needs a prevResult"))?;
    let netns = existing_netns(env)?;
    let bad = |s: String| Err(Error::CheckFailed(s));
    let want: Vec<IpAddr> = prev.ips.iter().map(|c| c.address.ip).collect();
    let ifname = env.ifname.clone();
    let mtu = conf.mtu;
    in_netns(&netns, || -> Result<()> {
        let mut nl = Netlink::new()?;
        let Some(pod) = nl.link_by_name(&ifname)? else {
            return bad(format!("{ifname} is missing in the pod"));
        };
        if !pod.up {
            return bad(format!("{ifname} is down"));
        }
        if pod.mtu != mtu {
            return bad(format!("{ifname} MTU {} != {mtu}", pod.mtu));
        }
        let have = nl.addresses(pod.index)?;
        for ip in &want {
            if !have.iter().any(|(a, _)| a == ip) {
                return bad(format!("{ifname} lacks {ip}"));
            }
        }
        for ip in &want {
            let routes = nl.routes(pod.index, ip.is_ipv6())?;
            let gw = gateway(*ip);
            if !routes.iter().any(|(_, p, g)| *p == 0 && *g == Some(gw)) {
                return bad(format!("no default route via {gw} on {ifname}"));
            }
        }
        if !ethtool::get(&ifname, Offload::Gro).unwrap_or(false) {
            return bad(format!("GRO is off on {ifname}"));
        }
        Ok(())
    })?;
    let host_name = state::load(&conf.state_dir, &env.container_id, &env.ifname)?.map_or_else(
        || state::host_veth_name(&env.container_id, &env.ifname),
        |r| r.host_veth,
    );
    let mut nl = Netlink::new()?;
    let Some(host) = nl.link_by_name(&host_name)? else {
        return bad(format!("host veth {host_name} is missing"));
    };
    if !host.up {
        return bad(format!("host veth {host_name} is down"));
    }
    if conf.datapath_present() {
        let dp = xdpcni_ebpf::Maps::open_pinned(&conf.pin_dir)?;
        for ip in &want {
            match dp.endpoint(*ip)? {
                Some(e) if e.ifindex != host.index => {
                    return bad(format!(
                        "endpoint {ip} points at ifindex {}, not {}",
                        e.ifindex, host.index
                    ))
                }
                Some(_) | None => {}
            }
        }
    }
    ipam::exec(conf, env, "CHECK", &env.container_id, &env.ifname)?;
    Ok(())
}
