#!/usr/bin/env bash
# The local demo on a fresh Debian 12 machine, as root: installs what is
# needed, builds, and runs pods-as-namespaces traffic through every mode.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo run --release --locked -p xdpcni-e2e --bin demo
