#!/usr/bin/env bash
# The local demo on a fresh Debian 12 machine, as root: installs what is
# needed, builds, and runs three pods (namespaces made by the real CNI
# plugin) with the agent in standalone mode, through every mode.
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/.."
bash scripts/setup.sh
step "cargo build --release"
cargo build --release --locked --workspace --bins
step "demo"
target/release/demo
