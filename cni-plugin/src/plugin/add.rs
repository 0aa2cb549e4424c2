//! ADD: addresses, the veth pair, the policy hold, the pod side, the host
//! side, the record; each a step undone if a later one fails.

use std::{
    fs::File,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsFd,
    path::Path,
};

use serde_json::Value;
use tracing::{info, warn};
use xdpcni_ebpf::Datapath;
use xdpcni_host::{
    gate, hook,
    netns::in_netns,
    pod::{self, XdpMode},
    source_check,
    state::{self, Record},
};

use super::{existing_netns, fail_point, forget_endpoint, gateway, host_prefix, write_sysctl};
use crate::{
    config::{CniEnv, NetConf},
    error::{Error, Result},
    ipam,
    types::{Cidr, CniResult, Interface, IpConfig, Route},
};
use xdpcni_host::netlink::Netlink;

/// What ADD has done so far, for the undo.
#[derive(Default)]
struct Progress {
    ipam: bool,
    host_ifindex: Option<u32>,
    /// The datapath knows the veth (a hold, its counter slot).
    datapath: bool,
    record: bool,
}

/// ADD.
/// How long ADD waits for the host veth to be operationally up.
const OPER_UP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

pub fn add(conf: &NetConf, env: &CniEnv) -> Result<Value> {
    let netns = existing_netns(env)?;
    let host_name = state::host_veth_name(&env.container_id, &env.ifname);
    let mut nl = Netlink::new()?;
    if nl.link_by_name(&host_name)?.is_some() {
        return Err(Error::HostInterfaceExists(host_name));
    }
    let ifname = env.ifname.clone();
    in_netns(&netns, || {
        if Netlink::new()?.link_by_name(&ifname)?.is_some() {
            return Err(Error::InterfaceExists(ifname.clone()));
        }
        Ok(())
    })?;

    let mut add = Add {
        conf,
        env,
        netns: &netns,
        host_name: &host_name,
        nl,
        progress: Progress::default(),
    };
    match add.run() {
        Ok(v) => Ok(v),
        Err(e) => {
            warn!("ADD failed, undoing: {e}");
            if let Err(undo) = undo_add(conf, env, &host_name, &mut add.nl, &add.progress) {
                warn!("undo incomplete: {undo}");
            }
            Err(e)
        }
    }
}

/// One ADD in progress: its inputs and what it has done so far (for the
/// undo). Its steps, in order: addresses (IPAM), veth pair, policy gate (the
/// hold), pod side, host side, record; each step is a method, and a failure
/// after any of them is undone by `undo_add` from `progress`. ADD leaves the
/// pod on kernel routing: its fast path is the agent's to decide and attach.
struct Add<'a> {
    conf: &'a NetConf,
    env: &'a CniEnv,
    netns: &'a Path,
    host_name: &'a str,
    nl: Netlink,
    progress: Progress,
}

/// The host end of the veth pair, and the headroom the kernel reports.
struct HostSide {
    link: xdpcni_host::netlink::Link,
    headroom_effective: Option<u16>,
}

impl Add<'_> {
    fn run(&mut self) -> Result<Value> {
        let ipam = self.addresses()?;
        fail_point("ipam")?;
        let ips: Vec<IpAddr> = ipam.ips.iter().map(|c| c.address.ip).collect();
        let host = self.veth_pair()?;
        fail_point("veth")?;
        self.gate(&host.link)?;
        fail_point("hold")?;
        // The host end up first: the pod end, brought up second, then finds
        // its peer up and gets its queueing discipline at once.
        self.nl.set_up(host.link.index)?;
        let pod_mac = self.pod_side(&ips, &host.link)?;
        fail_point("pod")?;
        self.host_side(&ips, &host.link)?;
        fail_point("routes")?;
        self.record(&ips, &host, pod_mac)?;
        hook::stop_point("add:record");
        Ok(self.result(&ips, &host.link, pod_mac, ipam.dns))
    }

    /// Step 1: the pod's addresses from the IPAM plugin.
    fn addresses(&mut self) -> Result<CniResult> {
        let (conf, env) = (self.conf, self.env);
        let result = ipam::exec(conf, env, "ADD", &env.container_id, &env.ifname)?
            .ok_or_else(|| Error::Decode("IPAM ADD returned nothing".into()))?;
        self.progress.ipam = true;
        Ok(result)
    }

    /// Step 2: the veth pair (pod end created in the netns, both ends down)
    /// with the headroom asked for; reports what the kernel granted.
    fn veth_pair(&mut self) -> Result<HostSide> {
        let (conf, name) = (self.conf, self.host_name);
        let ns_file = File::open(self.netns).map_err(|e| {
            Error::ContainerUnknown(format!("opening {}: {e}", self.netns.display()))
        })?;
        self.nl
            .create_veth(name, &self.env.ifname, ns_file.as_fd(), conf.mtu)?;
        let link = self
            .nl
            .link_by_name(name)?
            .ok_or_else(|| Error::TryAgain(format!("{name} vanished after creation")))?;
        self.progress.host_ifindex = Some(link.index);
        // No DAD on the host veth's link-local: the node must solicit the
        // pod's IPv6 address right away.
        let _ = write_sysctl(&format!("/proc/sys/net/ipv6/conf/{name}/accept_dad"), "0");
        // Headroom: veth has no attribute for it; ask anyway, then report
        // what the kernel says it has (IFLA_HEADROOM).
        if let Err(e) = self.nl.set_headroom(link.index, conf.headroom) {
            info!(
                "kernel refused IFLA_HEADROOM={} on {name}: {e}",
                conf.headroom
            );
        }
        let headroom_effective = self.nl.link_by_name(name)?.and_then(|l| l.headroom);
        info!(
            "{name}: headroom requested {}, effective {headroom_effective:?}",
            conf.headroom
        );
        Ok(HostSide {
            link,
            headroom_effective,
        })
    }

    /// Step 3, the policy gate, before either end is up: a pod that a
    /// NetworkPolicy may select is held (every IP packet to and from it
    /// dropped, `drop_held`) until the agent has classified it; the
    /// decision is `gate::hold_reason`'s, from the maps the agent keeps, so
    /// it holds while the agent is down too. Without a pinned datapath no
    /// pod could be held, so none is admitted: the runtime retries once the
    /// agent has loaded it.
    fn gate(&mut self, host: &xdpcni_host::netlink::Link) -> Result<()> {
        let conf = self.conf;
        let namespace = self
            .env
            .args
            .get("K8S_POD_NAMESPACE")
            .map_or("", String::as_str);
        let pinned = conf.pinned()?;
        if !pinned.ready() {
            if pinned.previous {
                return self.gate_older(namespace, &pinned);
            }
            let what = if pinned == xdpcni_ebpf::Pinned::default() {
                "not pinned".to_string()
            } else {
                format!("not ready ({} is pinned)", pinned.describe())
            };
            return Err(Error::TryAgain(format!(
                "the datapath of layout {} at {} is {what}: the xdpcni agent has not loaded (or \
                 not finished migrating) it on this node, and no pod is admitted before it could \
                 be held for its NetworkPolicies",
                xdpcni_ebpf::abi::LAYOUT,
                conf.pin_dir.display(),
            )));
        }
        let mut dp = Datapath::open_existing(&conf.pin_dir)?;
        let Some(why) = gate::hold_reason(dp.maps(), namespace)? else {
            return Ok(());
        };
        // Recorded first: the undo releases a hold made only in part.
        self.progress.datapath = true;
        // The hold's drops count as the pod's own (its slot stays its own
        // when the agent attaches it).
        dp.hold_pod(host.index, &host.name, &[])?;
        info!(
            "{}: held until the agent classifies the pod: {why}",
            host.name
        );
        Ok(())
    }

    /// Step 3 on a node whose agent has not migrated the datapath from the
    /// previous layout yet (an upgrade rolling out: this binary is installed
    /// before the new agent starts). This plugin never writes into a layout
    /// that is not its own, so it cannot hold a pod: it reads the previous
    /// layout's policy gate, admits a pod no policy may select on kernel routing (the
    /// agent attaches it once it has migrated), and refuses the others for
    /// the runtime to retry.
    fn gate_older(&mut self, namespace: &str, pinned: &xdpcni_ebpf::Pinned) -> Result<()> {
        let older = xdpcni_ebpf::Maps::open_previous(&self.conf.pin_dir).map_err(|e| {
            Error::TryAgain(format!(
                "the datapath is {}, and its older maps are not the previous release's layout {} \
                 ({e}): this plugin cannot tell whether the pod must be held; the agent of this \
                 release cannot migrate them either (docs/upgrades.md)",
                pinned.describe(),
                xdpcni_ebpf::PREVIOUS_LAYOUT,
            ))
        })?;
        match gate::hold_reason(&older, namespace)? {
            None => {
                info!(
                    "the datapath is {}: admitted on kernel routing until the agent has migrated it",
                    pinned.describe()
                );
                Ok(())
            }
            Some(why) => Err(Error::TryAgain(format!(
                "the pod must be held ({why}), and the datapath is {}: this plugin holds pods \
                 only in its own layout {}, which the xdpcni agent has not migrated to yet",
                pinned.describe(),
                xdpcni_ebpf::abi::LAYOUT
            ))),
        }
    }

    /// Step 4, inside the pod: addresses, the gateway's permanent neighbour
    /// entry, routes, and the offloads of kernel routing (the agent sets
    /// those of the mode it attaches). Returns the pod MAC.
    fn pod_side(&mut self, ips: &[IpAddr], host: &xdpcni_host::netlink::Link) -> Result<[u8; 6]> {
        let ifname = self.env.ifname.as_str();
        let host_mac = host.mac;
        in_netns(self.netns, || -> Result<[u8; 6]> {
            let mut pnl = Netlink::new()?;
            let pod = pnl
                .link_by_name(ifname)?
                .ok_or_else(|| Error::TryAgain(format!("{ifname} missing in the pod")))?;
            for ip in ips {
                pnl.add_address(pod.index, *ip, host_prefix(*ip))?;
            }
            pnl.set_up(pod.index)?;
            for ip in ips {
                let gw = gateway(*ip);
                pnl.add_permanent_neighbour(pod.index, gw, host_mac)?;
                if ip.is_ipv4() {
                    pnl.add_route(gw, 32, None, pod.index)?;
                }
                pnl.add_route(unspecified(*ip), 0, Some(gw), pod.index)?;
            }
            pod::ensure_offloads(ifname, &pod::offloads(XdpMode::Off))
                .map_err(|e| Error::io(format!("offloads of {ifname}"), e))?;
            Ok(pod.mac)
        })
    }

    /// Step 5, on the node (the host veth is up since before step 4): a
    /// host route per pod address, forwarding on, the kernel path's source
    /// check (what the datapath's `drop_spoofed` is on the fast path):
    /// strict rp_filter on the veth, and for IPv6 the node's `rpfilter`
    /// rule; then the wait for the host veth to carry traffic.
    fn host_side(&mut self, ips: &[IpAddr], host: &xdpcni_host::netlink::Link) -> Result<()> {
        source_check::ipv4_strict(&host.name)
            .map_err(|e| Error::io(format!("strict rp_filter on {}", host.name), e))?;
        if ips.iter().any(IpAddr::is_ipv6) {
            match source_check::ensure_ipv6() {
                Ok(true) => info!("added the IPv6 source check rule (ip6tables raw)"),
                Ok(false) => {}
                Err(e) => warn!("IPv6 source check: {e}"),
            }
        }
        for ip in ips {
            self.nl.add_route(*ip, host_prefix(*ip), None, host.index)?;
        }
        if ips.iter().any(IpAddr::is_ipv4) {
            write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
        }
        if ips.iter().any(IpAddr::is_ipv6) {
            write_sysctl("/proc/sys/net/ipv6/conf/all/forwarding", "1")?;
        }
        self.wait_oper_up(host)
    }

    /// Waits until the kernel's link watch has seen the host veth's carrier
    /// (it came when the pod end went up). Until then the host veth has no
    /// queueing discipline and drops what the node sends the pod: a pod that
    /// answers its first request at once would lose the answer (measured:
    /// 1 first ping in ~300 lost under 8 parallel ADDs, the link watch
    /// waiting for RTNL). Past the limit the ADD goes on, and says so.
    fn wait_oper_up(&mut self, host: &xdpcni_host::netlink::Link) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            let link = self.nl.link_by_index(host.index)?.ok_or_else(|| {
                Error::TryAgain(format!("{} vanished while coming up", host.name))
            })?;
            if link.oper_up {
                return Ok(());
            }
            if start.elapsed() > OPER_UP_WAIT {
                warn!(
                    "{} not operationally up after {OPER_UP_WAIT:?}: the pod's first packets may \
                     go unanswered",
                    host.name
                );
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Step 6: the attachment record the agent, CHECK, DEL and GC read (its
    /// appearance wakes the agent, which attaches the fast path).
    fn record(&mut self, ips: &[IpAddr], host: &HostSide, pod_mac: [u8; 6]) -> Result<()> {
        let (conf, env) = (self.conf, self.env);
        let rec = Record {
            container_id: env.container_id.clone(),
            ifname: env.ifname.clone(),
            netns: self.netns.display().to_string(),
            host_veth: self.host_name.to_string(),
            host_ifindex: host.link.index,
            host_mac: pod::Mac(host.link.mac),
            pod_mac: pod::Mac(pod_mac),
            ips: ips.to_vec(),
            mtu: conf.mtu,
            headroom_requested: conf.headroom,
            headroom_effective: host.headroom_effective,
            pod_namespace: env
                .args
                .get("K8S_POD_NAMESPACE")
                .cloned()
                .unwrap_or_default(),
            pod_name: env.args.get("K8S_POD_NAME").cloned().unwrap_or_default(),
            // Only the Service translation needs it, and the agent reads it
            // from `netns` where a record lacks it: no reason to fail an ADD.
            netns_cookie: xdpcni_host::netns::netns_cookie(self.netns).ok(),
            deleting: false,
        };
        state::save(&conf.state_dir, &rec)?;
        self.progress.record = true;
        Ok(())
    }

    /// The CNI result: both interfaces, the addresses with their gateway,
    /// a default route per family, the IPAM's DNS.
    fn result(
        &self,
        ips: &[IpAddr],
        host: &xdpcni_host::netlink::Link,
        pod_mac: [u8; 6],
        dns: Value,
    ) -> Value {
        let (conf, env) = (self.conf, self.env);
        CniResult {
            interfaces: vec![
                Interface {
                    name: self.host_name.to_string(),
                    mac: pod::Mac(host.mac).to_string(),
                    mtu: Some(conf.mtu),
                    sandbox: String::new(),
                },
                Interface {
                    name: env.ifname.clone(),
                    mac: pod::Mac(pod_mac).to_string(),
                    mtu: Some(conf.mtu),
                    sandbox: self.netns.display().to_string(),
                },
            ],
            ips: ips
                .iter()
                .map(|ip| IpConfig {
                    address: Cidr {
                        ip: *ip,
                        prefix: host_prefix(*ip),
                    },
                    gateway: Some(gateway(*ip)),
                    interface: Some(1),
                })
                .collect(),
            routes: default_routes(ips),
            dns,
        }
        .to_json(&conf.cni_version)
    }
}

/// `0.0.0.0` or `::`, in the family of `ip`.
fn unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// One default route per family present, via that family's gateway.
fn default_routes(ips: &[IpAddr]) -> Vec<Route> {
    [false, true]
        .into_iter()
        .filter_map(|v6| ips.iter().find(|ip| ip.is_ipv6() == v6))
        .map(|ip| Route {
            dst: Cidr {
                ip: unspecified(*ip),
                prefix: 0,
            },
            gw: Some(gateway(*ip)),
        })
        .collect()
}

fn undo_add(
    conf: &NetConf,
    env: &CniEnv,
    host_name: &str,
    nl: &mut Netlink,
    p: &Progress,
) -> Result<()> {
    let mut errors = Vec::new();
    if p.record {
        if let Err(e) = state::remove(&conf.state_dir, &env.container_id, &env.ifname) {
            errors.push(e.into());
        }
    }
    if let Some(index) = p.host_ifindex {
        if p.datapath {
            match Datapath::open_existing(&conf.pin_dir) {
                Ok(mut dp) => {
                    if let Err(e) = forget_endpoint(&mut dp, index, &[], true) {
                        errors.push(e);
                    }
                }
                Err(e) => errors.push(e.into()),
            }
        }
    }
    match nl.link_by_name(host_name) {
        Ok(Some(l)) => {
            if let Err(e) = nl.del_link(l.index) {
                errors.push(e.into());
            }
        }
        Ok(None) => {}
        Err(e) => errors.push(e.into()),
    }
    if p.ipam {
        if let Err(e) = ipam::exec(conf, env, "DEL", &env.container_id, &env.ifname) {
            errors.push(e);
        }
    }
    Error::from_list(errors)
}
