//! Test knobs. Crash points: with `XDPCNI_TEST_STOP_AT=<step>` in its
//! environment, a process stops itself (SIGSTOP) when it reaches `<step>`, so
//! a test can SIGKILL it exactly there and prove that what comes next (DEL,
//! GC, an agent restart) leaves nothing behind. Without the variable a stop
//! point is one environment lookup. Only builds with the `test-hooks` feature
//! (what the e2e tests exec) have them.
//!
//! The steps are named where they are: `add:<step>` and `del:<step>` in the
//! plugin, `converge:<step>` in the agent's `apply.rs` (its mode switches).

/// The environment variable naming the step to stop at.
pub const STOP_AT: &str = "XDPCNI_TEST_STOP_AT";

/// Stops this process with SIGSTOP if [`STOP_AT`] names `step`. It goes on
/// if it is continued (SIGCONT) instead of killed. Without the `test-hooks`
/// feature (every binary built for a node) it does nothing.
#[cfg(feature = "test-hooks")]
pub fn stop_point(step: &str) {
    if std::env::var_os(STOP_AT).is_some_and(|s| s == step) {
        eprintln!("xdpcni: stopping at {step} ({STOP_AT})");
        // SAFETY: raise has no memory-safety preconditions.
        unsafe {
            libc::raise(libc::SIGSTOP);
        }
    }
}

/// A crash point of a build without test hooks: nothing.
#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub fn stop_point(_step: &str) {}

/// How many generated inputs each property test (`fuzz_*`) tries:
/// `XDPCNI_FUZZ_CASES`, or 2000 (a bounded run, seconds in CI).
pub fn fuzz_cases() -> u32 {
    std::env::var("XDPCNI_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}
