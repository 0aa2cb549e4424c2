#!/usr/bin/env bash
# Installs everything xdpcni needs to build and test on Debian 12 (as root),
# and mounts bpffs. Idempotent.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
	echo "setup.sh: run as root (it installs packages and mounts bpffs)" >&2
	exit 1
fi

packages=(
	clang llvm clang-format libbpf-dev linux-libc-dev libc6-dev gcc # BPF build
	iproute2 ethtool iputils-ping procps iptables netcat-openbsd  # datapath and CNI tests
	iperf3 containernetworking-plugins                            # benchmark, baseline CNI
	openssl                                                       # test API server keys
)
missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
	echo "setup.sh: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The benchmark's chart, and schema validation of the Helm chart.
python3 -c 'import matplotlib' 2>/dev/null ||
	python3 -m pip install --quiet --disable-pip-version-check matplotlib
command -v kubernetes-validate >/dev/null ||
	python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate
bash "$(dirname "$0")/helm.sh" >/dev/null

if ! command -v cargo >/dev/null; then
	echo "setup.sh: cargo not found; install Rust 1.95 stable (rustup) first" >&2
	exit 1
fi
for c in rustfmt clippy; do
	rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c" || true
done

# kube-apiserver (built from Debian's source, cached) and etcd for the
# agent's tests against a real API server.
bash "$(dirname "$0")/k8s-apiserver.sh" >/dev/null

if ! mountpoint -q /sys/fs/bpf; then
	mount -t bpf bpf /sys/fs/bpf
fi
echo "setup.sh: ready"
