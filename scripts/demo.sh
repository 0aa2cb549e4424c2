#!/usr/bin/env bash
# The local demo on a fresh Debian 12 machine, as root: installs what is
# needed, builds, and runs three pods (namespaces made by the real CNI
# plugin) with the agent in standalone mode, through every mode.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked --workspace --bins
target/release/demo
