#!/usr/bin/env bash
# Every check and test of xdpcni (as root: the tests load XDP programs, build
# network namespaces and run a real Kubernetes node). Run scripts/setup.sh
# once first. Ends with one line over everything: "tests: N passed, N failed".
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT

step "disk: 10 GiB free for the build, the images and the real node"
need_disk 10 "${CARGO_TARGET_DIR:-target}" "scripts/test.sh (builds ~6 GiB, images and the node's state the rest)"

step "cargo fmt"
cargo fmt --all --check
step "clang-format"
clang-format --dry-run --Werror ebpf/src/*.c ebpf/src/lib/*.h ebpf/include/*.h ebpf/build/*.c e2e/k8s/*.c
step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
step "cargo clippy of the node's crates alone (without the e2e crate's test-objects, as the image builds them)"
cargo clippy -p xdpcni-agent -p xdpcni-plugin -p xdpcni-host -p xdpcni-ebpf --all-targets --locked -- -D warnings
step "setup scripts' own tests"
bash scripts/test-setup.sh | tee -a "$log"
step "cargo build (the product binaries, and the hooked builds the e2e tests exec)"
cargo build --workspace --bins --locked

step "helm chart: lint, render, schema, and the agent reads its config"
helm=$(bash scripts/helm.sh)
helm_home=$(mktemp -d)
HOME=$helm_home "$helm" lint --strict charts/xdpcni
HOME=$helm_home "$helm" template xdpcni charts/xdpcni --namespace kube-system >target/chart.yaml
kubernetes-validate --strict -k 1.30.0 target/chart.yaml >/dev/null
python3 - <<'PY'
import json, re
text = open("target/chart.yaml").read()
body = json.loads(re.search(r"agent\.json: \|\n((?:    .*\n)+)", text).group(1))
# By default /metrics and the probes stay on the node's loopback, unannounced.
assert body["listen"] == "127.0.0.1:9965", body["listen"]
assert "prometheus.io/scrape" not in text
# The chart's config as the agent reads it, with the node paths moved into target/.
body["stateDir"] = "target/chart-cni/state"
body["pinDir"] = "target/chart-cni/pins"
open("target/chart-agent.json", "w").write(json.dumps(body))
PY
rm -rf target/chart-cni
target/debug/xdpcni-agent install-cni --config target/chart-agent.json --pod-cidr 10.244.0.0/24 \
	--cni-conf-dir target/chart-cni/net.d --cni-bin-dir target/chart-cni/bin --plugin target/debug/xdpcni
test -x target/chart-cni/bin/xdpcni && test -s target/chart-cni/net.d/10-xdpcni.conflist
# The chart's default routing (vxlan) and mtu (auto): pods get the tunnel's MTU.
python3 - <<'PY'
import json
body = json.load(open("target/chart-agent.json"))
assert body["routing"] == {"mode": "vxlan", "fastPath": True, "vni": 1, "port": 4789, "txChecksumOffload": True}, body["routing"]
# Services translated, at the node's cgroup mounted where the agent looks.
assert body["services"] == {"translate": True, "cgroup": "/host/cgroup", "nodeSockets": False, "clusterCIDRs": [], "healthCheckNodePorts": False, "northSouthDevices": [], "natCapacity": 262144}, body["services"]
assert "mtu" not in body, body
mtu = json.load(open("target/chart-cni/net.d/10-xdpcni.conflist"))["plugins"][0]["mtu"]
assert mtu == 1450, f"pod MTU under vxlan with no underlay known: {mtu}"
PY
# A proxy name reaches the agent's config, which reads it.
HOME=$helm_home "$helm" template xdpcni charts/xdpcni --namespace kube-system --set services.proxyName=xdpcni \
	--set services.nodeSockets=true --set 'services.clusterCIDRs={10.244.0.0/16,fd00:10:244::/56}' \
	--set services.healthCheckNodePorts=true --set 'services.northSouthDevices={eth0,bond0}' \
	--set services.natCapacity=65536 |
	python3 -c '
import json, re, sys
body = json.loads(re.search(r"agent\.json: \|\n((?:    .*\n)+)", sys.stdin.read()).group(1))
assert body["services"]["proxyName"] == "xdpcni", body["services"]
assert body["services"]["nodeSockets"] is True, body["services"]
assert body["services"]["clusterCIDRs"] == ["10.244.0.0/16", "fd00:10:244::/56"], body["services"]
assert body["services"]["healthCheckNodePorts"] is True, body["services"]
assert body["services"]["northSouthDevices"] == ["eth0", "bond0"], body["services"]
assert body["services"]["natCapacity"] == 65536, body["services"]
body["stateDir"], body["pinDir"] = "target/chart-cni/state", "target/chart-cni/pins"
json.dump(body, open("target/chart-agent-named.json", "w"))'
target/debug/xdpcni uninstall target/chart-cni/state
target/debug/xdpcni-agent install-cni --config target/chart-agent-named.json --pod-cidr 10.244.0.0/24 \
	--cni-conf-dir target/chart-cni/net.d --cni-bin-dir target/chart-cni/bin --plugin target/debug/xdpcni
target/debug/xdpcni uninstall target/chart-cni/state
test ! -e target/chart-cni/bin/xdpcni && test ! -e target/chart-cni/net.d/10-xdpcni.conflist

step "helm chart: values.schema.json refuses every bad value, naming it"
schema_pass=0
while read -r value path; do
	if out=$(HOME=$helm_home "$helm" template x charts/xdpcni --set-string "$value" 2>&1); then
		echo "chart accepted --set-string $value" >&2
		false
	fi
	grep -q "at '$path'" <<<"$out" || { echo "refusal of $value does not name $path: $out" >&2; false; }
	schema_pass=$((schema_pass + 1))
done <<'BAD'
datapath.xdpMode=turbo /datapath/xdpMode
datapath.redirect=xdp /datapath/redirect
datapath.cpus=0-3\,x /datapath/cpus
datapath.cpus=64 /datapath/cpus
datapath.mtu=notanumber /datapath/mtu
datapath.pinDir=/tmp/pins /datapath/pinDir
agent.metricsPort=notaport /agent/metricsPort
agent.logLevel=loud /agent/logLevel
agent.listenAddress=10.0.0.1 /agent/listenAddress
cni.binDir=relative/bin /cni/binDir
cni.netnsDir=/var/run/netns /cni/netnsDir
image.pullPolicy=Sometimes /image/pullPolicy
routing.fastPath=maybe /routing/fastPath
monitoring.podMonitor.enabled=maybe /monitoring/podMonitor/enabled
monitoring.podMonitor.interval=soon /monitoring/podMonitor/interval
monitoring.dashboard.namespace=Bad_NS /monitoring/dashboard/namespace
update.maxUnavailable=0 /update/maxUnavailable
update.maxUnavailable=half /update/maxUnavailable
routing.mode=host-gw /routing/mode
routing.vxlan.vni=one /routing/vxlan/vni
routing.vxlan.txChecksumOffload=maybe /routing/vxlan/txChecksumOffload
services.translate=sometimes /services/translate
services.cgroup=sys/fs/cgroup /services/cgroup
services.proxyName=Not_A_Name /services/proxyName
services.nodeSockets=maybe /services/nodeSockets
services.clusterCIDRs[0]=10.244.0.0 /services/clusterCIDRs/0
services.healthCheckNodePorts=maybe /services/healthCheckNodePorts
services.northSouthDevices[0]=eth0/1 /services/northSouthDevices/0
services.natCapacity=100 /services/natCapacity
BAD
for value in datapath.mtu=70000 routing.vxlan.vni=0 routing.vxlan.vni=16777216 routing.vxlan.port=0 datapath.headroom=2048 agent.metricsPort=0 agent.intervalMs=1 update.maxUnavailable=0; do
	if HOME=$helm_home "$helm" template x charts/xdpcni --set "$value" >/dev/null 2>&1; then
		echo "chart accepted --set $value" >&2
		false
	fi
	schema_pass=$((schema_pass + 1))
done
HOME=$helm_home "$helm" template x charts/xdpcni --set datapath.xdpMode=generic \
	--set-string 'datapath.cpus=0-1\,3' --set datapath.mtu=9000 >/dev/null
schema_pass=$((schema_pass + 1))
# Opened to scrapers: every address, announced; an IPv6 wildcard in brackets.
HOME=$helm_home "$helm" template x charts/xdpcni --set-string 'agent.listenAddress=::' |
	grep -q '"listen": "\[::\]:9965"'
HOME=$helm_home "$helm" template x charts/xdpcni --set agent.listenAddress=0.0.0.0 |
	grep -q 'prometheus.io/scrape: "true"'
schema_pass=$((schema_pass + 2))
# Health check ports are answered from the Service watch: not without translation.
if out=$(HOME=$helm_home "$helm" template x charts/xdpcni --set services.healthCheckNodePorts=true \
	--set services.translate=false 2>&1); then
	echo "chart accepted healthCheckNodePorts without translate" >&2
	false
fi
grep -q "at '/services/translate'" <<<"$out" || { echo "healthCheckNodePorts refusal unclear: $out" >&2; false; }
schema_pass=$((schema_pass + 1))
# North-south Services read the Service maps: not without translation.
if out=$(HOME=$helm_home "$helm" template x charts/xdpcni --set 'services.northSouthDevices={eth0}' \
	--set services.translate=false 2>&1); then
	echo "chart accepted northSouthDevices without translate" >&2
	false
fi
grep -q "at '/services/translate'" <<<"$out" || { echo "northSouthDevices refusal unclear: $out" >&2; false; }
schema_pass=$((schema_pass + 1))
# A monitor of an agent on loopback cannot scrape anything: refused, saying so.
if out=$(HOME=$helm_home "$helm" template x charts/xdpcni --set monitoring.podMonitor.enabled=true 2>&1); then
	echo "chart accepted a PodMonitor with the agent on 127.0.0.1" >&2
	false
fi
grep -q "need agent.listenAddress" <<<"$out" || { echo "monitor refusal unclear: $out" >&2; false; }
schema_pass=$((schema_pass + 1))
# Everything on: the Kubernetes objects validate, the monitors point at the
# agents' metrics port, the dashboard is the chart's file under Grafana's label.
HOME=$helm_home "$helm" template xdpcni charts/xdpcni --namespace kube-system \
	--set agent.listenAddress=0.0.0.0 --set monitoring.podMonitor.enabled=true \
	--set monitoring.serviceMonitor.enabled=true --set monitoring.dashboard.enabled=true \
	>target/chart-monitoring.yaml
python3 - <<'PY'
import json, yaml
docs = [d for d in yaml.safe_load_all(open("target/chart-monitoring.yaml")) if d]
kinds = {d["kind"]: d for d in docs}
for k in ["PodMonitor", "ServiceMonitor", "Service", "DaemonSet"]:
    assert k in kinds, f"no {k} rendered"
assert kinds["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
assert kinds["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
assert kinds["Service"]["spec"]["clusterIP"] == "None"
ports = kinds["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["ports"]
assert any(p["name"] == "metrics" for p in ports), ports
cms = [d for d in docs if d["kind"] == "ConfigMap" and "xdpcni.json" in d.get("data", {})]
assert len(cms) == 1, "one dashboard ConfigMap"
assert cms[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
assert json.loads(cms[0]["data"]["xdpcni.json"]) == json.load(open("charts/xdpcni/dashboards/xdpcni.json"))
# The core objects validate; the monitors are CRDs kubernetes-validate has no schema for.
yaml.safe_dump_all([d for d in docs if not d["kind"].endswith("Monitor")], open("target/chart-monitoring-core.yaml", "w"))
PY
kubernetes-validate --strict -k 1.30.0 target/chart-monitoring-core.yaml >/dev/null
schema_pass=$((schema_pass + 1))
rm -rf "$helm_home"
echo "chart schema: $schema_pass passed, 0 failed" | tee -a "$log"

step "image: built without a registry, holds what the chart runs (scripts/image.sh)"
bash scripts/image.sh >/dev/null
python3 scripts/check-image.py target/images/xdpcni.tar target/chart.yaml Containerfile

step "product binaries carry no test hooks or test objects (scripts/check-release.py)"
# The image's (release, built alone) and the workspace build's (built beside
# the e2e crate): the hooks are no cargo feature, so no build makes a product
# binary that reads a test knob; the hooked builds the tests exec do.
python3 scripts/check-release.py \
	--release target/release/xdpcni target/release/xdpcni-agent target/debug/xdpcni target/debug/xdpcni-agent \
	--test target/debug/xdpcni-hooked target/debug/xdpcni-agent-hooked target/debug/bench | tee -a "$log" |
	sed 's/^/  /'
release_pass=$(grep -c '^ok \(release\|test\) target/' "$log" || true)
echo "release binaries: $release_pass passed, 0 failed" | tee -a "$log"

step "the previous release, built from git (scripts/previous-release.sh; the migration tests run it)"
bash scripts/previous-release.sh >/dev/null

step "sweep what killed test runs left (e2e/src/sweep.rs: names with a dead PID)"
target/debug/sweep

step "cargo test"
# Every test binary runs even when one fails; the closing line counts them.
cargo_rc=0
cargo test --workspace --locked --no-fail-fast 2>&1 | tee -a "$log" || cargo_rc=$?

step "benchmark smoke test (checks every measurement runs, not the numbers)"
target/debug/bench --quick --out target/bench-quick >/dev/null
test -s target/bench-quick/bench.png
python3 scripts/check-bench.py target/bench-quick/bench.md
# An --only that names no workload is refused, naming the workloads (not an empty report).
if out=$(target/debug/bench --quick --only "no such workload" --out target/bench-none 2>&1); then
	echo "bench ran with an --only that matches nothing" >&2
	exit 1
fi
grep -q "matches no workload" <<<"$out" || { echo "bench's refusal is unclear: $out" >&2; exit 1; }

step "scale benchmark smoke test (every figure at full size, once; not the numbers)"
target/debug/scale --quick --out target/scale-quick >/dev/null
test -s target/scale-quick/scale.png
python3 scripts/check-scale.py target/scale-quick/scale.md
# The checker itself: the committed full run is consistent, and a report
# whose verdict contradicts its figure is refused.
python3 scripts/check-scale.py docs/scale.md
sed 's/(goal < 100) missed$/(goal < 100) met/' docs/scale.md >target/scale-quick/lying.md
if python3 scripts/check-scale.py target/scale-quick/lying.md >/dev/null; then
  echo "check-scale.py accepted a target line whose verdict contradicts its value" >&2
  exit 1
fi

step "a real Kubernetes node: e2e/k8s/run.sh"
k8s_rc=0
bash e2e/k8s/run.sh 2>&1 | tee -a "$log" || k8s_rc=$?

# One closing line over everything: cargo's per-binary lines and the
# "N passed, N failed" lines of the other suites. A suite that failed without
# counting a failed test (a build error, a crash) counts as one failure.
read -r passed failed < <(awk '
     /^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     /^(setup scripts|chart schema|release binaries): [0-9]+ passed, [0-9]+ failed$/ { p += $(NF-3); f += $(NF-1) }
     /^[0-9]+ passed, [0-9]+ failed$/ { p += $1; f += $3 }
     END { print p + 0, f + 0 }' "$log")
for rc in "$cargo_rc" "$k8s_rc"; do
	if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
done
echo "tests: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
