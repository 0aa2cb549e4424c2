#!/usr/bin/env bash
# Installs everything xdpcni needs to build and test on Debian 12 (as root),
# and mounts bpffs; with --demo, only what scripts/demo.sh uses (no Kubernetes,
# helm, containerd or Python tools). Idempotent. Every step says what it does; a failing one
# says which and why. Caches (each can point at an empty directory):
#   XDPCNI_K8S_CACHE  (/var/cache/xdpcni-k8s)  Kubernetes binaries built from Debian's source
#   XDPCNI_HELM_CACHE (/var/cache/xdpcni-helm) helm and kubectl
source "$(dirname "$0")/lib.sh"

if [ "$(id -u)" -ne 0 ]; then
	echo "setup.sh: run as root (it installs packages and mounts bpffs)" >&2
	exit 1
fi
case "${1:-}" in
"") demo=false ;;
--demo) demo=true ;;
*)
	echo "setup.sh: unknown argument $1 (none: everything; --demo: what scripts/demo.sh uses)" >&2
	exit 2
	;;
esac

# What the demo uses: the BPF build, the datapath and the CNI plugins it
# runs (no Kubernetes, helm, containerd or Python tools).
demo_packages=(
	clang llvm libbpf-dev linux-libc-dev libc6-dev gcc # BPF build
	iproute2 ethtool iputils-ping procps iptables       # the pods, the CNI's rpfilter rules
	containernetworking-plugins                         # host-local (IPAM)
)
if $demo; then
	apt_install "${demo_packages[@]}"
else
	apt_install "${demo_packages[@]}" \
		clang-format `# C formatting check` \
		netcat-openbsd `# tests` \
		nftables netbase `# NetworkPolicy rules (the agent's nft, its protocol names)` \
		iperf3 `# benchmark` \
		openssl `# test API server keys` \
		containerd runc conntrack busybox-static util-linux `# the real node (e2e/k8s)`
fi

step "Rust toolchain"
if ! command -v cargo >/dev/null; then
	echo "setup.sh: cargo not found; install Rust 1.95 stable (rustup) first" >&2
	exit 1
fi

if ! $demo; then
	for c in rustfmt clippy; do
		grep -q "^$c" <<<"$(rustup component list --installed 2>/dev/null)" || rustup component add "$c"
	done

	step "python packages: matplotlib (bench chart), kubernetes-validate and PyYAML (chart checks)"
	python3 -c 'import matplotlib' 2>/dev/null ||
		python3 -m pip install --quiet --disable-pip-version-check matplotlib
	command -v kubernetes-validate >/dev/null ||
		python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate
	python3 -c 'import yaml' 2>/dev/null ||
		python3 -m pip install --quiet --disable-pip-version-check pyyaml

	step "helm and kubectl"
	bash "$(dirname "$0")/helm.sh" >/dev/null

	step "Kubernetes 1.20.2 from Debian's source (cached) and etcd"
	bash "$(dirname "$0")/k8s-build.sh" >/dev/null
fi

step "bpffs"
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
echo "setup.sh: ready${1:+ ($1)}"
