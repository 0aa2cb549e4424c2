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
echo "== cargo test"
cargo test --workspace --locked
