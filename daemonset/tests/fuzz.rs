//! Property tests ("fuzz"): a pod's annotations, with any keys and values,
//! resolved against any node defaults and online-CPU mask. Bounded by
//! `XDPCNI_FUZZ_CASES` (default 2000); proptest shrinks any failing input.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::collections::BTreeMap;

use proptest::prelude::*;
use xdpcni_agent::wish::{resolve, Wish, ANNOTATION_CPUS, ANNOTATION_MODE, ANNOTATION_REDIRECT};
use xdpcni_ebpf::abi::RedirectPolicy;
use xdpcni_host::{
    hook::fuzz_cases,
    pod::{format_cpu_list, parse_cpu_list, XdpMode},
};

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("native".to_string()),
        Just("generic".to_string()),
        Just("off".to_string()),
        Just(" Native ".to_string()),
        Just("devmap".to_string()),
        Just("cpumap".to_string()),
        Just("0-1".to_string()),
        "[0-9,\\- ]{0,12}",
        ".{0,24}",
    ]
}

fn annotations() -> impl Strategy<Value = BTreeMap<String, String>> {
    proptest::collection::btree_map(
        prop_oneof![
            Just(ANNOTATION_MODE.to_string()),
            Just(ANNOTATION_REDIRECT.to_string()),
            Just(ANNOTATION_CPUS.to_string()),
            Just("xdpcni.io/other".to_string()),
            ".{0,20}",
        ],
        value(),
        0..5,
    )
}

fn defaults() -> impl Strategy<Value = Wish> {
    (0u8..3, any::<bool>(), any::<u64>()).prop_map(|(m, c, mask)| Wish {
        mode: match m {
            0 => XdpMode::Off,
            1 => XdpMode::Native,
            _ => XdpMode::Generic,
        },
        redirect: if c {
            RedirectPolicy::Cpumap
        } else {
            RedirectPolicy::Devmap
        },
        cpu_mask: mask,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases()))]

    /// Any annotations: a policy the node can run (CPUs online and some),
    /// each value either honoured exactly or reported as a problem naming
    /// its annotation, and the node default kept for anything refused.
    #[test]
    fn fuzz_annotations_resolve_to_a_runnable_policy_or_a_named_problem(
        ann in annotations(),
        def in defaults(),
        online in 1u64..,
    ) {
        let (p, problems) = resolve(&ann, &def, online);
        prop_assert!(p.cpu_mask != 0 && p.cpu_mask & !online == 0, "{p:?} online {online:#x}");
        for pr in &problems {
            prop_assert!(ann.get(&pr.key) == Some(&pr.value), "{pr:?} names no given annotation");
            prop_assert!(!pr.why.is_empty() && !pr.fallback.is_empty());
        }
        let refused = |k: &str| problems.iter().any(|pr| pr.key == k);
        match ann.get(ANNOTATION_MODE) {
            Some(v) if !refused(ANNOTATION_MODE) => {
                prop_assert_eq!(Some(p.mode), XdpMode::parse(v.trim()));
            }
            _ => prop_assert_eq!(p.mode, def.mode),
        }
        match ann.get(ANNOTATION_REDIRECT) {
            Some(v) if !refused(ANNOTATION_REDIRECT) => {
                prop_assert_eq!(Some(p.redirect), RedirectPolicy::parse(v.trim()));
            }
            _ => prop_assert_eq!(p.redirect, def.redirect),
        }
        if let Some(v) = ann.get(ANNOTATION_CPUS) {
            if !refused(ANNOTATION_CPUS) {
                prop_assert_eq!(Ok(p.cpu_mask), parse_cpu_list(v.trim()));
            }
        }
    }

    /// A CPU list made from any mask of online CPUs is honoured as that mask.
    #[test]
    fn fuzz_cpu_annotations_from_any_online_mask_are_honoured(
        mask in 1u64..,
        extra in any::<u64>(),
    ) {
        let online = mask | extra;
        let ann = BTreeMap::from([(ANNOTATION_CPUS.to_string(), format_cpu_list(mask))]);
        let def = Wish { mode: XdpMode::Off, redirect: RedirectPolicy::Cpumap, cpu_mask: 0 };
        let (p, problems) = resolve(&ann, &def, online);
        prop_assert!(problems.is_empty(), "{problems:?}");
        prop_assert_eq!(p.cpu_mask, mask);
    }
}
