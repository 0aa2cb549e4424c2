//! The status for a person: the node's summary and a line per pod
//! (`xdpcni-agent status`), or one pod in full (`--pod`).

use std::fmt::Write as _;

use super::{PodStatus, Status};

fn ago(now: f64, then: f64) -> String {
    let s = (now - then).max(0.0);
    if s < 10.0 {
        format!("{s:.1}s ago")
    } else if s < 600.0 {
        format!("{s:.0}s ago")
    } else {
        format!("{:.0}m ago", s / 60.0)
    }
}

fn pod_name(p: &PodStatus) -> String {
    if p.namespace.is_empty() {
        p.name.clone()
    } else {
        format!("{}/{}", p.namespace, p.name)
    }
}

fn ips(p: &PodStatus) -> String {
    p.ips
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Lines padded into columns (the last one is left as is).
fn columns(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                let _ = write!(line, "{c:<w$}  ", w = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

impl Status {
    /// The node summary and one line per pod, for a person.
    pub fn table(&self) -> String {
        let mut out = self.summary();
        if !self.pods.is_empty() {
            out.push('\n');
            out.push_str(&self.pod_rows());
        }
        out
    }

    /// The node's lines of [`Status::table`].
    fn summary(&self) -> String {
        let mut out = String::new();
        let node = self.node.as_deref().unwrap_or("-");
        let dp = &self.datapath;
        let ready = if self.ready { "ready" } else { "NOT READY" };
        let migrated = if dp.migration_seconds > 0.0 {
            format!(", migrated in {:.3}s", dp.migration_seconds)
        } else {
            String::new()
        };
        let progs: Vec<String> = dp
            .programs
            .iter()
            .map(|p| format!("{} id {}", p.name, p.id))
            .collect();
        let maps: Vec<String> = dp
            .maps
            .iter()
            .map(|m| format!("{} {}/{}", m.name, m.entries, m.capacity))
            .collect();
        let d = &self.defaults;
        let last = self
            .last_node_pass
            .map_or("never".to_string(), |t| ago(self.now, t));
        let lines = [
            format!(
                "Agent:     xdpcni-agent {} ({}), node {node}, {ready}",
                self.version, self.agent_mode
            ),
            format!(
                "Datapath:  layout {}, build {}, pinned at {}{migrated}",
                dp.layout, dp.build, dp.pin_dir
            ),
            format!("Programs:  {}", progs.join(", ")),
            format!("Maps:      {}", maps.join(", ")),
            format!(
                "Defaults:  mode {}, redirect {}, cpus {}",
                d.mode, d.redirect, d.cpus
            ),
            format!("Policies:  {}", self.policies.summary()),
            format!(
                "Services:  {}{}",
                self.services.summary(),
                self.services
                    .served_by
                    .iter()
                    .map(|w| format!("\n           {}: {}", w.traffic, w.by))
                    .collect::<String>()
            ),
            format!("Fast path: {}", self.cross_node.summary()),
            format!("Last pass: {last}"),
            format!("Pods:      {}", self.pods_summary()),
        ];
        for l in lines {
            let _ = writeln!(out, "{l}");
        }
        out
    }

    /// How many pods, how many on the fast path, what was left out.
    fn pods_summary(&self) -> String {
        let fast = self
            .pods
            .iter()
            .filter(|p| !p.why.code.is_kernel_only() && p.mode != "off")
            .count();
        let left_out = if self.unreadable_records > 0 {
            format!(
                ", {} unreadable records left out (see the log)",
                self.unreadable_records
            )
        } else {
            String::new()
        };
        format!("{} ({fast} on the fast path){left_out}", self.pods.len())
    }

    /// The pod lines of [`Status::table`], under their header.
    fn pod_rows(&self) -> String {
        let mut rows = vec![[
            "POD", "IPS", "VETH", "MODE", "REDIRECT", "FORWARD", "KERNEL", "DROP", "WHY",
        ]
        .map(String::from)
        .to_vec()];
        for p in &self.pods {
            let c = p.counters.clone().unwrap_or_default();
            let redirect = if p.redirect == "cpumap" {
                format!("cpumap:{}", p.cpus)
            } else {
                p.redirect.clone()
            };
            rows.push(vec![
                pod_name(p),
                ips(p),
                p.host_veth.clone(),
                p.mode.clone(),
                redirect,
                c.forward.to_string(),
                c.kernel.to_string(),
                c.drop.to_string(),
                p.why.text.clone(),
            ]);
        }
        columns(&rows)
    }

    /// Everything about one pod, for a person.
    pub fn pod_detail(&self, p: &PodStatus) -> String {
        let c = p.counters.clone().unwrap_or_default();
        let mut rows: Vec<Vec<String>> = vec![
            vec!["Pod:".into(), pod_name(p)],
            vec!["Container:".into(), p.container_id.clone()],
            vec!["Addresses:".into(), ips(p)],
            vec![
                "Host veth:".into(),
                format!("{} (ifindex {})", p.host_veth, p.ifindex),
            ],
            vec!["Mode:".into(), format!("{} (asked: {})", p.mode, p.wanted)],
            vec![
                "Why:".into(),
                format!("{} [{}]", p.why.text, p.why.code.as_str()),
            ],
            vec![
                "Redirect:".into(),
                format!("{} (cpus {})", p.redirect, p.cpus),
            ],
            vec![
                "Packets:".into(),
                format!(
                    "forward {}, kernel {}, drop {}, received {}",
                    c.forward, c.kernel, c.drop, c.received
                ),
            ],
            vec![
                "Top:".into(),
                c.top
                    .iter()
                    .map(|t| format!("{} {}", t.verdict, t.packets))
                    .collect::<Vec<_>>()
                    .join(", "),
            ],
            vec!["Reconciled:".into(), ago(self.now, p.reconciled_at)],
        ];
        for pr in &p.problems {
            rows.push(vec!["Problem:".into(), pr.clone()]);
        }
        columns(&rows)
    }

    /// The pod `ns/name` (or a container ID).
    pub fn find(&self, which: &str) -> Option<&PodStatus> {
        let (ns, name) = which.split_once('/').unwrap_or(("", which));
        self.pods.iter().find(|p| {
            (p.namespace == ns && p.name == name) || (ns.is_empty() && p.container_id == which)
        })
    }
}
