//! Property tests ("fuzz"): CPU lists and attachment records fed generated
//! input. Bounded by `XDPCNI_FUZZ_CASES` (default 2000 per property);
//! proptest shrinks and prints any failing input.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::net::IpAddr;

use proptest::prelude::*;
use xdpcni_host::{
    hook::fuzz_cases,
    pod::{format_cpu_list, parse_cpu_list, Mac},
    state::Record,
};

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(fuzz_cases())
}

/// Strings near the CPU-list grammar: digits, separators, spaces, signs.
fn cpu_listish() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[0-9,\\- a+x]{0,24}").unwrap()
}

fn record() -> impl Strategy<Value = Record> {
    (
        (".{0,70}", "[a-z0-9]{1,15}", ".{0,40}", "xdp[0-9a-f]{12}"),
        (any::<u32>(), any::<[u8; 6]>(), any::<[u8; 6]>()),
        proptest::collection::vec(any::<IpAddr>(), 0..4),
        (any::<u32>(), any::<u16>(), any::<Option<u16>>()),
        (".{0,20}", ".{0,20}"),
    )
        .prop_map(
            |((id, ifname, netns, host), (index, hm, pm), ips, (mtu, hr, he), (ns, name))| Record {
                container_id: id,
                ifname,
                netns,
                host_veth: host,
                host_ifindex: index,
                host_mac: Mac(hm),
                pod_mac: Mac(pm),
                ips,
                mtu,
                headroom_requested: hr,
                headroom_effective: he,
                pod_namespace: ns,
                pod_name: name,
                netns_cookie: (index % 3 == 0).then_some(u64::from(index)),
                deleting: index % 2 == 0,
            },
        )
}

proptest! {
    #![proptest_config(config())]

    /// Any string: a mask or a reason, never a panic; a mask is what the
    /// list says (formatting it and parsing again gives it back).
    #[test]
    fn fuzz_cpu_lists_parse_to_the_mask_they_name_or_a_reason(s in cpu_listish()) {
        match parse_cpu_list(&s) {
            Ok(mask) => {
                prop_assert!(mask != 0, "{s:?} parsed to no CPU");
                prop_assert_eq!(parse_cpu_list(&format_cpu_list(mask)), Ok(mask));
            }
            Err(why) => prop_assert!(!why.is_empty()),
        }
    }

    /// Every mask formats to a list that parses back to it.
    #[test]
    fn fuzz_cpu_masks_round_trip(mask in 1u64..) {
        prop_assert_eq!(parse_cpu_list(&format_cpu_list(mask)), Ok(mask));
    }

    /// Arbitrary bytes: an error, or a record that writes back to one that
    /// reads the same (never a panic).
    #[test]
    fn fuzz_record_parse_takes_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(rec) = Record::parse(&bytes) {
            let again = Record::parse(&serde_json::to_vec(&rec).unwrap()).unwrap();
            prop_assert_eq!(again, rec);
        }
    }

    /// Every record reads back as written; damaged files are refused.
    #[test]
    fn fuzz_records_round_trip_and_damage_is_refused(
        rec in record(),
        cut in any::<proptest::sample::Index>(),
    ) {
        let bytes = serde_json::to_vec(&rec).unwrap();
        prop_assert_eq!(Record::parse(&bytes).unwrap(), rec);
        let cut = cut.index(bytes.len());
        prop_assert!(Record::parse(&bytes[..cut]).is_err(), "a record cut at {cut} parsed");
    }

    /// Records with fields of the wrong type or value are refused.
    #[test]
    fn fuzz_records_with_a_bad_field_are_refused(
        rec in record(),
        field in prop_oneof![
            Just("hostMac"), Just("podMac"), Just("ips"), Just("hostIfindex"),
            Just("mtu"), Just("headroomRequested"), Just("headroomEffective"),
        ],
        junk in prop_oneof![
            Just(serde_json::json!("native-ish")),
            Just(serde_json::json!(-1)),
            Just(serde_json::json!(["x"])),
            Just(serde_json::json!({"a": 1})),
            Just(serde_json::json!("zz:zz:zz:zz:zz:zz")),
        ],
    ) {
        let mut v = serde_json::to_value(&rec).unwrap();
        v[field] = junk;
        prop_assert!(Record::parse(v.to_string().as_bytes()).is_err(), "{field}: {v}");
    }
}
