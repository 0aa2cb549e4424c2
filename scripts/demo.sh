#!/usr/bin/env bash
# The local demo on a fresh Debian 12 machine, as root: installs only what it
# uses (scripts/setup.sh --demo: no Kubernetes), builds the three binaries it
# runs, and runs three pods (namespaces made by the real CNI plugin) with the
# agent in standalone mode, through every mode.
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/.."
step "setup (scripts/setup.sh --demo)"
bash scripts/setup.sh --demo
step "disk: 3 GiB free for the demo's build"
need_disk 3 "${CARGO_TARGET_DIR:-target}" "scripts/demo.sh's build"
step "cargo build --profile demo (Cargo.toml): xdpcni, xdpcni-agent, demo"
cargo build --profile demo --locked --bin xdpcni --bin xdpcni-agent --bin demo
step "demo"
target/demo/demo
