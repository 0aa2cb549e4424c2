//! Prometheus text exposition of the agent's view: per-pod datapath counters,
//! attach modes, reconcile errors and latency.

use std::fmt::Write;

use xdpcni_ebpf::Counters;

/// One pod's line-up for /metrics.
#[derive(Clone, Debug)]
pub struct PodMetrics {
    /// Kubernetes namespace (or empty).
    pub namespace: String,
    /// Pod name (or the container ID when unknown).
    pub pod: String,
    /// Host veth.
    pub interface: String,
    /// `native`, `generic` or `off`.
    pub mode: String,
    /// Datapath counters of its host veth.
    pub counters: Counters,
}

/// Agent-wide figures.
#[derive(Clone, Debug, Default)]
pub struct AgentMetrics {
    /// Reconcile passes that failed for some pod.
    pub reconcile_errors: u64,
    /// Reconcile passes.
    pub reconciles: u64,
    /// Sum of reconcile pass durations, seconds.
    pub reconcile_seconds: f64,
    /// Annotation values refused (each reported once per change).
    pub policy_problems: u64,
    /// Whether the agent is ready.
    pub ready: bool,
}

/// Escapes a label value (backslash, quote, newline).
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Renders the exposition text.
pub fn render(pods: &[PodMetrics], agent: &AgentMetrics) -> String {
    let mut out = String::new();
    for (family, help, bytes) in [
        ("xdpcni_packets_total", "Packets", false),
        ("xdpcni_bytes_total", "Bytes", true),
    ] {
        let _ = writeln!(
            out,
            "# HELP {family} {help} seen by the XDP datapath, by pod and verdict."
        );
        let _ = writeln!(out, "# TYPE {family} counter");
        for p in pods {
            for (v, s) in p.counters.iter() {
                let _ = writeln!(
                    out,
                    "{family}{{namespace=\"{}\",pod=\"{}\",interface=\"{}\",verdict=\"{}\"}} {}",
                    escape(&p.namespace),
                    escape(&p.pod),
                    escape(&p.interface),
                    v.label(),
                    if bytes { s.bytes } else { s.packets }
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "# HELP xdpcni_attach_mode The XDP mode of each pod's host veth (1 for the mode in force)."
    );
    let _ = writeln!(out, "# TYPE xdpcni_attach_mode gauge");
    for p in pods {
        for mode in ["native", "generic", "off"] {
            let _ = writeln!(
                out,
                "xdpcni_attach_mode{{namespace=\"{}\",pod=\"{}\",mode=\"{mode}\"}} {}",
                escape(&p.namespace),
                escape(&p.pod),
                u8::from(p.mode == mode)
            );
        }
    }
    let scalars: [(&str, &str, &str, String); 4] = [
        (
            "xdpcni_reconcile_errors_total",
            "counter",
            "Reconcile passes that failed for some pod.",
            agent.reconcile_errors.to_string(),
        ),
        (
            "xdpcni_reconcile_duration_seconds",
            "summary",
            "Time spent reconciling the node.",
            String::new(),
        ),
        (
            "xdpcni_policy_problems_total",
            "counter",
            "Annotation values refused, with a fallback used.",
            agent.policy_problems.to_string(),
        ),
        (
            "xdpcni_ready",
            "gauge",
            "Whether the agent has reconciled the node.",
            u8::from(agent.ready).to_string(),
        ),
    ];
    for (name, kind, help, value) in &scalars {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        if *kind == "summary" {
            let _ = writeln!(out, "{name}_sum {}", agent.reconcile_seconds);
            let _ = writeln!(out, "{name}_count {}", agent.reconciles);
        } else {
            let _ = writeln!(out, "{name} {value}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_escaped_and_every_family_is_typed() {
        let text = render(
            &[PodMetrics {
                namespace: "ns".into(),
                pod: "we\"ird\\pod".into(),
                interface: "xdp0".into(),
                mode: "generic".into(),
                counters: Counters::default(),
            }],
            &AgentMetrics {
                ready: true,
                ..Default::default()
            },
        );
        assert!(
            text.contains(r#"pod="we\"ird\\pod",mode="generic"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"mode="native"} 0"#));
        assert!(text.contains("xdpcni_ready 1"));
        for family in [
            "xdpcni_packets_total",
            "xdpcni_attach_mode",
            "xdpcni_reconcile_errors_total",
            "xdpcni_reconcile_duration_seconds",
        ] {
            assert!(text.contains(&format!("# TYPE {family} ")), "{family}");
        }
    }
}
