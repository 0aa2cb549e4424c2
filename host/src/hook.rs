//! Test hooks: named points in the product's code where a test build acts.
//! Crash points (`stop_point`): a test stops the process there (SIGSTOP) and
//! SIGKILLs it, to prove that what comes next (DEL, GC, an agent restart)
//! leaves nothing behind; fail points (`fail_point`): an injected failure, to
//! prove that ADD undoes every earlier step.
//!
//! The product binaries never [`arm`] them: a point is one load of an empty
//! slot, and no product binary reads a test knob or carries a knob's name.
//! The e2e crate's own binaries (`xdpcni-hooked`, `xdpcni-agent-hooked`: the
//! product's `main` with the slot armed first) arm them with functions that
//! read the tests' knobs (`xdpcni_e2e::hooks`), whatever features a build
//! unifies.
//!
//! The steps are named where they are: `add:<step>` and `del:<step>` in the
//! plugin, `converge:<step>` in the agent's `apply.rs` (its mode switches),
//! `migrate:<step>` in the datapath's migration.

use std::sync::OnceLock;

/// What an armed build does at the points.
#[derive(Clone, Copy, Debug)]
pub struct Hooks {
    /// At a crash point named `step`.
    pub stop: fn(step: &str),
    /// At a fail point named `step`: whether to fail there.
    pub fail: fn(step: &str) -> bool,
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Arms the points of this process (once; a second call changes nothing).
/// Only the e2e crate's binaries call it.
pub fn arm(hooks: Hooks) {
    let _ = HOOKS.set(hooks);
}

/// Whether this process's points are armed.
pub fn armed() -> bool {
    HOOKS.get().is_some()
}

/// A crash point: nothing unless armed.
pub fn stop_point(step: &str) {
    if let Some(h) = HOOKS.get() {
        (h.stop)(step);
    }
}

/// A fail point: whether an armed build's test asks to fail at `step`
/// (never, unless armed).
pub fn fail_point(step: &str) -> bool {
    HOOKS.get().is_some_and(|h| (h.fail)(step))
}

/// How many generated inputs each property test (`fuzz_*`) tries:
/// `XDPCNI_FUZZ_CASES`, or 2000 (a bounded run, seconds in CI).
pub fn fuzz_cases() -> u32 {
    std::env::var("XDPCNI_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}
