//! The datapath's instruction budget: every program of the product, and
//! every stage of the fast path on both hooks, against the counts written
//! in ebpf/budget.json. A change to the datapath that makes a program or a
//! stage longer fails here until its diff raises the budget (saying what
//! the instructions buy); one that makes it shorter fails until the budget
//! is lowered to match, so the file always states what the datapath costs.
//! Runs the per-stage measurement (e2e/src/cost.rs) on its fixed frames and
//! prints the table; the nanoseconds are the benchmark's to judge, the
//! instructions are this test's.
//! Needs root and bpffs.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::collections::BTreeMap;

use serde::Deserialize;
use xdpcni_e2e::cost::{self, Hook};

#[derive(Deserialize)]
struct Budget {
    programs: BTreeMap<String, Program>,
    stages: BTreeMap<String, Vec<i64>>,
}

#[derive(Deserialize)]
struct Program {
    translated: u32,
    verified: u32,
}

/// Over the budget, or so far under it that the budget no longer says what
/// the datapath costs (more than 5% and 2 instructions).
fn problem(what: &str, got: i64, budget: i64) -> Option<String> {
    if got > budget {
        return Some(format!(
            "{what}: {got} instructions, over its budget of {budget}: raise it in ebpf/budget.json, saying why"
        ));
    }
    let slack = (budget.abs() / 20).max(2);
    (budget - got > slack).then(|| {
        format!("{what}: {got} instructions, far under its budget of {budget}: lower it in ebpf/budget.json")
    })
}

#[test]
fn budget_every_program_and_stage_within_its_instruction_count() {
    let budget: Budget =
        serde_json::from_str(include_str!("../../ebpf/budget.json")).expect("ebpf/budget.json");
    let costs = cost::measure(20, 100).expect("the stage measurement");
    eprintln!("{}", costs.table());
    let mut problems = Vec::new();
    assert_eq!(
        costs.programs.len(),
        budget.programs.len(),
        "a budget per program"
    );
    for (name, translated, verified) in &costs.programs {
        let b = budget
            .programs
            .get(*name)
            .unwrap_or_else(|| panic!("no budget for {name}"));
        eprintln!("{name}: {translated} translated, {verified} verified instructions");
        problems.extend(problem(
            &format!("{name} translated"),
            (*translated).into(),
            b.translated.into(),
        ));
        problems.extend(problem(
            &format!("{name} verified"),
            (*verified).into(),
            b.verified.into(),
        ));
    }
    for (hook, insns) in &costs.insns {
        let key = match hook {
            Hook::Xdp => "xdp",
            Hook::Tc => "tc",
        };
        let b = &budget.stages[key];
        assert_eq!(b.len(), insns.len(), "a budget per {key} stage");
        let names = cost::stages(*hook);
        for i in 0..insns.len() {
            let got = i64::from(insns[i]) - if i == 0 { 0 } else { i64::from(insns[i - 1]) };
            problems.extend(problem(
                &format!("{key} stage {i} ({})", names[i]),
                got,
                b[i],
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The uplink program's per-packet cost of north-south Services: the
/// node's own traffic (what every node pays for the frontend lookup) and
/// an established north-south flow's packet (NAT and redirect), printed
/// beside a test run's own cost; the program must take each path (its
/// action: on to the stack, redirected). Its instructions are in the
/// budget above (`xdpcni_tc_from_node`).
#[test]
fn budget_north_south_per_packet_cost_of_the_uplink_program() {
    let c = cost::north_south(20, 100).expect("the north-south measurement");
    eprintln!(
        "| xdpcni_tc_from_node (BPF_PROG_TEST_RUN, IPv4 UDP 64-byte, less a test run's own) | ns |\n| --- | ---: |\n| the node's own traffic (no frontend; median of 20 x 100 runs, less {:.1}) | {:.1} |\n| a north-south flow's packet (NAT, redirect_peer; median of 200 x 1 run) | {:.1} |\n({} instructions)",
        c.base_ns, c.node_ns, c.flow_ns, c.insns
    );
    assert!(c.flow_ns > c.node_ns, "{c:?}: the flow's packet does more");
}

/// The rule itself, without the kernel: over fails, at or just under
/// passes, far under fails (the budget must follow a cut down).
#[test]
fn budget_rule_refuses_growth_and_a_stale_budget() {
    assert!(problem("p", 101, 100).is_some());
    assert!(problem("p", 100, 100).is_none());
    assert!(problem("p", 95, 100).is_none());
    assert!(problem("p", 94, 100).is_some());
    assert!(problem("s", 0, 2).is_none());
    assert!(problem("s", -3, 0).is_some());
}
