//! The tests' knobs, read only by the e2e crate's hooked binaries
//! (`xdpcni-hooked`, `xdpcni-agent-hooked`), which arm the product's hook
//! points ([`xdpcni_host::hook`]) with [`arm`] before they run its `main`.
//! A product binary has the points but never arms them.

/// The crash point a hooked binary stops itself at (SIGSTOP): `add:ipam`,
/// `del:detached`, `converge:records`, `migrate:started`, ...
pub const STOP_AT: &str = "XDPCNI_TEST_STOP_AT";
/// The ADD step after which a hooked plugin fails with an injected error.
pub const FAIL_AFTER: &str = "XDPCNI_TEST_FAIL_AFTER";

fn stop(step: &str) {
    if std::env::var_os(STOP_AT).is_some_and(|s| s == step) {
        eprintln!("xdpcni: stopping at {step} ({STOP_AT})");
        // SAFETY: raise has no memory-safety preconditions.
        unsafe {
            libc::raise(libc::SIGSTOP);
        }
    }
}

fn fail(step: &str) -> bool {
    std::env::var_os(FAIL_AFTER).is_some_and(|s| s == step)
}

/// Arms this process's hook points with the knobs above.
pub fn arm() {
    xdpcni_host::hook::arm(xdpcni_host::hook::Hooks { stop, fail });
}
