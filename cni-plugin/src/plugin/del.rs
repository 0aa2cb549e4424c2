//! DEL (everything an ADD made, whatever is left of it) and GC (the
//! attachments the runtime no longer has).

use std::net::IpAddr;

use tracing::{info, warn};
use xdpcni_ebpf::Datapath;
use xdpcni_host::{
    hook,
    state::{self, Record},
};

use super::{forget_endpoint, require_version};
use crate::{
    config::{CniEnv, NetConf},
    error::{Error, Result},
    ipam,
};
use xdpcni_host::netlink::Netlink;

/// DEL: removes whatever is left of the attachment; succeeds when nothing is.
pub fn del(conf: &NetConf, env: &CniEnv) -> Result<()> {
    let rec = match state::load(&conf.state_dir, &env.container_id, &env.ifname) {
        Ok(r) => r,
        Err(e) => {
            warn!("unreadable record, going on without it: {e}");
            None
        }
    };
    // Marked first: the agent then knows the veth about to go is this
    // DEL's doing (no false "deleted outside the CNI" warning or Event).
    if let Some(r) = rec.as_ref().filter(|r| !r.deleting) {
        let marked = Record {
            deleting: true,
            ..r.clone()
        };
        if let Err(e) = state::save(&conf.state_dir, &marked) {
            warn!("could not mark the record as being deleted: {e}");
        }
    }
    cleanup(conf, env, &env.container_id, &env.ifname, rec.as_ref())
}

fn cleanup(
    conf: &NetConf,
    env: &CniEnv,
    container_id: &str,
    ifname: &str,
    rec: Option<&Record>,
) -> Result<()> {
    let mut errors = Vec::new();
    let host_name = rec.map_or_else(
        || state::host_veth_name(container_id, ifname),
        |r| r.host_veth.clone(),
    );
    let mut ips: Vec<IpAddr> = rec.map(|r| r.ips.clone()).unwrap_or_default();
    if let Some(prev) = &conf.prev_result {
        for c in &prev.ips {
            if !ips.contains(&c.address.ip) {
                ips.push(c.address.ip);
            }
        }
    }
    let mut nl = Netlink::new()?;
    let link = nl.link_by_name(&host_name)?;
    // Our veth's ifindex, and whether it is still ours. If the veth is gone
    // (its netns was deleted), the recorded ifindex may since have been given
    // to another pod's veth: its link, devmap entry and counters are then that
    // pod's, and only our addresses' records are removed.
    let ifindex = match (&link, rec) {
        (Some(l), _) => Some((l.index, true)),
        (None, Some(r)) => {
            let reused = nl.link_by_index(r.host_ifindex)?.is_some();
            if reused {
                info!(
                    "{host_name} is gone and ifindex {} belongs to another link now",
                    r.host_ifindex
                );
            }
            Some((r.host_ifindex, !reused))
        }
        (None, None) => None,
    };

    if let Some((index, owns)) = ifindex {
        if conf.datapath_present() {
            match Datapath::open_existing(&conf.pin_dir) {
                Ok(mut dp) => {
                    if let Err(e) = forget_endpoint(&mut dp, index, &ips, owns) {
                        errors.push(e);
                    }
                }
                Err(e) => errors.push(e.into()),
            }
        } else if owns {
            // Another layout (or one being filled): this plugin writes
            // none of its maps, but the links are every layout's; the
            // agent forgets the records of the vanished veth.
            if let Err(e) = Datapath::unlink(&conf.pin_dir, index) {
                errors.push(e.into());
            }
        }
    }
    hook::stop_point("del:datapath");
    if let Some(l) = link {
        match nl.del_link(l.index) {
            Ok(_) => info!("deleted {host_name}"),
            Err(e) => errors.push(e.into()),
        }
    }
    hook::stop_point("del:veth");
    if !conf.ipam_type.is_empty() {
        if let Err(e) = ipam::exec(conf, env, "DEL", container_id, ifname) {
            errors.push(e);
        }
    }
    hook::stop_point("del:ipam");
    if let Err(e) = state::remove(&conf.state_dir, container_id, ifname) {
        errors.push(e.into());
    }
    Error::from_list(errors)
}

/// GC: removes attachments not in `cni.dev/valid-attachments`.
pub fn gc(conf: &NetConf, env: &CniEnv) -> Result<()> {
    require_version(conf, "1.1.0", "GC")?;
    let valid = conf
        .valid_attachments
        .as_ref()
        .ok_or_else(|| Error::config("cni.dev/valid-attachments", "missing"))?;
    let mut errors = Vec::new();
    for rec in state::list(&conf.state_dir)? {
        if valid
            .iter()
            .any(|(id, ifn)| *id == rec.container_id && *ifn == rec.ifname)
        {
            continue;
        }
        info!(
            "GC: removing stale attachment {} {}",
            rec.container_id, rec.ifname
        );
        let mut env = env.clone();
        env.netns = None;
        env.container_id = rec.container_id.clone();
        env.ifname = rec.ifname.clone();
        if let Err(e) = cleanup(conf, &env, &rec.container_id, &rec.ifname, Some(&rec)) {
            errors.push(e);
        }
    }
    Error::from_list(errors)
}
