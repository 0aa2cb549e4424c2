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
echo "== helm chart: lint, render, schema, and the agent reads its config"
helm=$(bash scripts/helm.sh)
helm_home=$(mktemp -d)
HOME=$helm_home "$helm" lint --strict charts/xdpcni
HOME=$helm_home "$helm" template xdpcni charts/xdpcni --namespace kube-system >target/chart.yaml
rm -rf "$helm_home"
kubernetes-validate --strict -k 1.30.0 target/chart.yaml >/dev/null
python3 - <<'PY'
import json, re
text = open("target/chart.yaml").read()
body = re.search(r"agent\.json: \|\n((?:    .*\n)+)", text).group(1)
open("target/chart-agent.json", "w").write(json.dumps(json.loads(body)))
PY
rm -rf target/chart-cni
target/debug/xdpcni-agent install-cni --config target/chart-agent.json --pod-cidr 10.244.0.0/24 \
	--cni-conf-dir target/chart-cni/net.d --cni-bin-dir target/chart-cni/bin --plugin target/debug/xdpcni
test -x target/chart-cni/bin/xdpcni && test -s target/chart-cni/net.d/10-xdpcni.conflist
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
