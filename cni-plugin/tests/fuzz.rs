//! Property tests ("fuzz"): the plugin's parsers of what a runtime hands it
//! (the network config with its prevResult, and the CNI_* environment with
//! CNI_ARGS) fed generated input. Each input gives a value or an error with
//! a spec code, never a panic. Bounded by `XDPCNI_FUZZ_CASES` (default 2000
//! per property); proptest shrinks and prints any failing input.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::collections::HashMap;

use proptest::prelude::*;
use serde_json::{json, Value};
use xdpcni_host::hook::fuzz_cases;
use xdpcni_plugin::{
    config::{CniEnv, NetConf},
    error::Error,
    run,
};

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(fuzz_cases())
}

/// The error codes the spec and this plugin define (error.rs).
const CODES: &[u32] = &[1, 2, 3, 4, 5, 6, 7, 11, 50, 100, 101, 102, 103, 104];

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|n| json!(n)),
        ".{0,12}".prop_map(Value::String),
        Just(json!("10.1.0.5/24")),
        Just(json!("fd00::5/64")),
        Just(json!("native")),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("ips".to_string()),
                    Just("address".to_string()),
                    Just("gateway".to_string()),
                    Just("interfaces".to_string()),
                    Just("routes".to_string()),
                    Just("dst".to_string()),
                    Just("interface".to_string()),
                    ".{0,6}",
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The config keys the plugin reads.
const KEYS: &[&str] = &[
    "cniVersion",
    "name",
    "mtu",
    "headroom",
    "pinDir",
    "xdpMode",
    "redirect",
    "cpus",
    "stateDir",
    "logFile",
    "agentReadyFile",
    "ipam",
    "prevResult",
    "cni.dev/valid-attachments",
];

/// A config object: a valid base with some keys replaced by any value.
fn netconf() -> impl Strategy<Value = Value> {
    proptest::collection::vec((proptest::sample::select(KEYS), json_value()), 0..5).prop_map(
        |changes| {
            let mut v = json!({
                "cniVersion": "1.1.0", "name": "n", "type": "xdpcni",
                "ipam": { "type": "host-local" },
            });
            for (k, x) in changes {
                v[k] = x;
            }
            v
        },
    )
}

fn check_error(e: &Error) -> Result<(), TestCaseError> {
    let j = e.to_json("1.1.0");
    prop_assert!(CODES.contains(&j.code), "code {} for {e}", j.code);
    prop_assert!(!j.msg.is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fuzz_netconf_takes_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Err(e) = NetConf::parse(&bytes) {
            check_error(&e)?;
        }
    }

    /// Fields of any type and value: a valid config or an error naming the
    /// field; what parses is within the documented ranges.
    #[test]
    fn fuzz_netconf_fields_of_any_type_are_checked(v in netconf()) {
        match NetConf::parse(v.to_string().as_bytes()) {
            Ok(c) => {
                prop_assert!(xdpcni_host::netconf::MTU_RANGE.contains(&c.mtu));
                prop_assert!(xdpcni_host::netconf::HEADROOM_RANGE.contains(&c.headroom));
                prop_assert!(!c.ipam_type.contains('/'));
            }
            Err(e) => {
                check_error(&e)?;
                let msg = e.to_string();
                prop_assert!(
                    KEYS.iter().any(|k| msg.contains(k.trim_start_matches("cni.dev/")))
                        || msg.contains("ipam.type")
                        || matches!(e, Error::IncompatibleVersion(_)),
                    "error names no field: {msg}"
                );
            }
        }
    }

    /// A prevResult of any shape: parsed or refused as prevResult.
    #[test]
    fn fuzz_prev_result_of_any_shape(prev in json_value()) {
        let v = json!({"cniVersion": "1.0.0", "name": "n", "type": "xdpcni", "prevResult": prev});
        match NetConf::parse(v.to_string().as_bytes()) {
            Ok(_) => {}
            Err(e) => {
                check_error(&e)?;
                prop_assert!(e.to_string().contains("prevResult"), "{e}");
            }
        }
    }

    /// A well-formed prevResult of any version gives back its addresses.
    #[test]
    fn fuzz_prev_results_give_their_addresses(
        ips in proptest::collection::vec((any::<std::net::IpAddr>(), 0u8..=32), 1..4),
        old in any::<bool>(),
    ) {
        let version = if old { "0.4.0" } else { "1.1.0" };
        let list: Vec<Value> = ips
            .iter()
            .map(|(ip, p)| {
                let mut e = json!({ "address": format!("{ip}/{p}") });
                if old {
                    e["version"] = json!(if ip.is_ipv4() { "4" } else { "6" });
                }
                e
            })
            .collect();
        let v = json!({"cniVersion": version, "name": "n", "type": "xdpcni",
                       "prevResult": {"cniVersion": version, "ips": list}});
        let c = NetConf::parse(v.to_string().as_bytes()).unwrap();
        let got: Vec<_> = c.prev_result.unwrap().ips.iter().map(|i| i.address.ip).collect();
        let want: Vec<_> = ips.iter().map(|(ip, _)| *ip).collect();
        prop_assert_eq!(got, want);
    }

    /// CNI_ARGS and the other variables with any content: an environment
    /// or an InvalidEnv error (code 4) naming the variable.
    #[test]
    fn fuzz_cni_environment_of_any_content(
        vars in proptest::collection::btree_map(
            proptest::sample::select(&[
                "CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH",
            ][..]),
            prop_oneof![".{0,40}", Just("ADD".to_string()), Just("DEL".to_string()),
                        Just("a=b;c=d".to_string()), Just("=;==;a".to_string())],
            0..6,
        ),
    ) {
        let get = |k: &str| vars.get(k).cloned();
        if let Err(e) = CniEnv::from_lookup(get) {
            prop_assert_eq!(e.code(), 4, "{}", e);
            prop_assert!(e.to_string().contains("CNI_"), "{}", e);
        }
    }

    /// Well-formed CNI_ARGS give exactly their pairs (the last of a key wins).
    #[test]
    fn fuzz_cni_args_give_their_pairs(
        pairs in proptest::collection::vec(("[A-Za-z_][A-Za-z0-9_]{0,12}", "[^;=]{0,16}"), 0..6),
    ) {
        let args = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(";");
        let env = HashMap::from([
            ("CNI_COMMAND", "DEL".to_string()),
            ("CNI_CONTAINERID", "c1".to_string()),
            ("CNI_IFNAME", "eth0".to_string()),
            ("CNI_PATH", "/opt/cni/bin".to_string()),
            ("CNI_ARGS", args),
        ]);
        let parsed = CniEnv::from_lookup(|k| env.get(k).cloned()).unwrap();
        let want: HashMap<String, String> = pairs.into_iter().collect();
        prop_assert_eq!(parsed.args, want);
    }

    /// VERSION and STATUS (read-only) with any stdin: stdout is always one
    /// JSON object, a version answer or an error with a spec code.
    #[test]
    fn fuzz_read_only_commands_answer_json_for_any_stdin(
        command in prop_oneof![Just("VERSION"), Just("STATUS"), Just("NOPE"), Just("")],
        stdin in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..256),
            // No logFile: a generated path would be written to.
            netconf().prop_map(|mut v| {
                v.as_object_mut().unwrap().remove("logFile");
                v.to_string().into_bytes()
            }),
        ],
    ) {
        let env = HashMap::from([("CNI_COMMAND", command.to_string()), ("CNI_PATH", "/nonexistent".into())]);
        let out = run(|k| env.get(k).cloned(), &stdin);
        if out.status == 0 {
            if !out.stdout.is_empty() {
                let v: Value = serde_json::from_str(&out.stdout).unwrap();
                prop_assert!(v.is_object());
            }
        } else {
            let v: Value = serde_json::from_str(&out.stdout).unwrap();
            let code = v["code"].as_u64().unwrap();
            prop_assert!(CODES.contains(&u32::try_from(code).unwrap()), "{}", out.stdout);
        }
    }
}
