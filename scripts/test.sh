#!/usr/bin/env bash
# Every check and test of xdpcni (as root: the tests load XDP programs and
# build network namespaces). Run scripts/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt"
cargo fmt --all --check
echo "== clang-format"
clang-format --dry-run --Werror ebpf/src/*.c ebpf/include/*.h ebpf/build/*.c
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo build (the e2e tests exec the real xdpcni binary)"
cargo build --workspace --bins --locked
echo "== cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"
echo "== benchmark smoke test (checks every measurement runs, not the numbers)"
target/debug/bench --quick --out target/bench-quick >/dev/null
test -s target/bench-quick/bench.png
echo "bench --quick: ok ($(grep -c '^| ' target/bench-quick/bench.md) table rows)"
# One closing line over every test binary (cargo prints one per binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
