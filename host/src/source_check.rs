//! The kernel path's source check: a pod may only send from its own
//! addresses, on every path, `off` included. The XDP datapath drops spoofed
//! sources itself (`drop_spoofed`); frames it passes, and every frame of a
//! pod in `off`, are routed by the kernel, which checks sources only where
//! told to:
//!
//! - IPv4: strict reverse-path filtering on each host veth
//!   (`net.ipv4.conf.<veth>.rp_filter = 1`, set at ADD; the effective value
//!   is the maximum of it and `all`, so a node's looser default does not
//!   weaken it, and it goes with the veth).
//! - IPv6 has no rp_filter: one `ip6tables -t raw` rule on the node drops a
//!   packet arriving on a host veth (`xdp+`) whose source does not route
//!   back through that veth (the `rpfilter` match), before conntrack sees
//!   it. Added at ADD when missing, removed by `xdpcni uninstall`.

use std::{path::PathBuf, process::Command};

use crate::state::HOST_VETH_PREFIX;

/// The comment that marks xdpcni's rule.
pub const RULE_COMMENT: &str = "xdpcni: pods send from their own addresses only";

/// Failures of the source check.
#[derive(Debug, thiserror::Error)]
pub enum SourceCheckError {
    /// No ip6tables binary on the node.
    #[error("ip6tables not found in {searched}: IPv6 kernel routing has no source check")]
    NoIp6tables {
        /// The directories searched.
        searched: String,
    },
    /// ip6tables failed.
    #[error("{command}: {detail}")]
    Ip6tables {
        /// The command line.
        command: String,
        /// Its exit status and stderr.
        detail: String,
    },
}

/// Strict reverse-path filtering on host veth `ifname`.
pub fn ipv4_strict(ifname: &str) -> std::io::Result<()> {
    std::fs::write(format!("/proc/sys/net/ipv4/conf/{ifname}/rp_filter"), "1")
}

/// Where node tools are looked for besides `$PATH` (the agent's image and
/// a runtime's environment may have a short `$PATH`).
pub const TOOL_DIRS: &[&str] = &["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// The node tool `name` (iptables-save, ip6tables, ...): the first file in
/// `$PATH`, then [`TOOL_DIRS`].
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .filter(|d| !d.is_empty())
        .chain(TOOL_DIRS.iter().copied())
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.is_file())
}

fn ip6tables() -> Result<PathBuf, SourceCheckError> {
    find_tool("ip6tables").ok_or_else(|| SourceCheckError::NoIp6tables {
        searched: format!("$PATH and {}", TOOL_DIRS.join(", ")),
    })
}

/// The rule's arguments after the operation (`-C`, `-A`, `-D`).
pub fn rule_args() -> Vec<String> {
    [
        "-i",
        &format!("{HOST_VETH_PREFIX}+"),
        "-m",
        "rpfilter",
        "--invert",
        "-m",
        "comment",
        "--comment",
        RULE_COMMENT,
        "-j",
        "DROP",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run(bin: &PathBuf, op: &str) -> Result<bool, SourceCheckError> {
    let mut cmd = Command::new(bin);
    cmd.args(["-w", "5", "-t", "raw", op, "PREROUTING"])
        .args(rule_args());
    let out = cmd.output().map_err(|e| SourceCheckError::Ip6tables {
        command: format!("{cmd:?}"),
        detail: e.to_string(),
    })?;
    match out.status.code() {
        Some(0) => Ok(true),
        // -C and -D: no such rule.
        Some(1) if op != "-A" => Ok(false),
        _ => Err(SourceCheckError::Ip6tables {
            command: format!("{cmd:?}"),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        }),
    }
}

/// Adds the IPv6 rule unless it is there. Returns whether it was added.
pub fn ensure_ipv6() -> Result<bool, SourceCheckError> {
    let bin = ip6tables()?;
    if run(&bin, "-C")? {
        return Ok(false);
    }
    run(&bin, "-A")
}

/// Removes every copy of the IPv6 rule. Returns how many were removed (0
/// without ip6tables: then there can be none).
pub fn remove_ipv6() -> Result<usize, SourceCheckError> {
    let Ok(bin) = ip6tables() else {
        return Ok(0);
    };
    let mut n = 0;
    while run(&bin, "-D")? {
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_matches_host_veths_and_names_itself() {
        let args = rule_args();
        assert_eq!(args[1], "xdp+");
        assert!(args.windows(2).any(|w| w == ["-m", "rpfilter"]));
        assert!(args.contains(&RULE_COMMENT.to_string()));
        assert_eq!(args.last().map(String::as_str), Some("DROP"));
        assert!(crate::state::host_veth_name("c", "eth0").starts_with(HOST_VETH_PREFIX));
    }
}
