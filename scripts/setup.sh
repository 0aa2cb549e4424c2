#!/usr/bin/env bash
# Installs everything xdpcni needs to build and test on Debian 12 (as root),
# and mounts bpffs. Idempotent. Every step says what it does; a failing one
# says which and why. Caches (each can point at an empty directory):
#   XDPCNI_K8S_CACHE  (/var/cache/xdpcni-k8s)  Kubernetes binaries built from Debian's source
#   XDPCNI_HELM_CACHE (/var/cache/xdpcni-helm) helm and kubectl
source "$(dirname "$0")/lib.sh"

if [ "$(id -u)" -ne 0 ]; then
	echo "setup.sh: run as root (it installs packages and mounts bpffs)" >&2
	exit 1
fi

apt_install \
	clang llvm clang-format libbpf-dev linux-libc-dev libc6-dev gcc `# BPF build` \
	iproute2 ethtool iputils-ping procps iptables netcat-openbsd `# datapath and CNI tests` \
	nftables netbase `# NetworkPolicy rules (the agent's nft, its protocol names)` \
	iperf3 containernetworking-plugins `# benchmark, baseline CNI` \
	openssl `# test API server keys` \
	containerd runc conntrack busybox-static util-linux `# the real node (e2e/k8s)`

step "python packages: matplotlib (bench chart), kubernetes-validate (chart schema)"
python3 -c 'import matplotlib' 2>/dev/null ||
	python3 -m pip install --quiet --disable-pip-version-check matplotlib
command -v kubernetes-validate >/dev/null ||
	python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate

step "helm and kubectl"
bash "$(dirname "$0")/helm.sh" >/dev/null

step "Rust toolchain"
if ! command -v cargo >/dev/null; then
	echo "setup.sh: cargo not found; install Rust 1.95 stable (rustup) first" >&2
	exit 1
fi
for c in rustfmt clippy; do
	rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
done

step "Kubernetes 1.20.2 from Debian's source (cached) and etcd"
bash "$(dirname "$0")/k8s-build.sh" >/dev/null

step "bpffs"
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
echo "setup.sh: ready"
