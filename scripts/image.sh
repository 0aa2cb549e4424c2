#!/usr/bin/env bash
# Builds, without any registry, the images the local Kubernetes node runs and
# writes them as OCI archives into $OUT (default target/images):
#   xdpcni.tar   localhost/xdpcni:dev     what the chart runs: the agent, the
#                CNI plugin, and Debian's host-local, portmap and loopback, all
#                in /usr/local/bin (the layout Containerfile produces)
#   testpod.tar  localhost/xdpcni-testpod:dev   busybox-static and podtool
#   pause.tar    localhost/pause:xdpcni   the pod sandbox (a static C binary)
# With --import ADDRESS, imports them into the containerd at that socket
# (namespace k8s.io). Needs a release build (it runs one).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/.."
OUT=${OUT:-target/images}
TAG=${XDPCNI_IMAGE_TAG:-dev}
import=""
[ "${1:-}" = "--import" ] && import=${2:?--import needs the containerd socket}
apt_install busybox-static containernetworking-plugins gcc libc6-dev nftables netbase

# Two builds: the agent and plugin alone carry no test hooks or test objects
# (the e2e crate, podtool's, turns them on for whatever is built with it).
step "cargo build --release (agent, plugin)"
cargo build --release --locked -q -p xdpcni-agent -p xdpcni-plugin --bin xdpcni-agent --bin xdpcni
step "cargo build --release (podtool, the test pods' tool)"
cargo build --release --locked -q -p xdpcni-e2e --bin podtool

# Copies binary $1 to $2 in rootfs $3 with the shared libraries ldd names.
put() {
	local bin=$1 dest=$2 root=$3 lib
	install -D -m 0755 "$bin" "$root$dest"
	for lib in $(ldd "$bin" 2>/dev/null | grep -oE '/[^ ]+' || true); do
		[ -e "$root$lib" ] || install -D -m 0755 "$lib" "$root$lib"
	done
}
skeleton() {
	local root=$1
	rm -rf "$root" && mkdir -p "$root"/{tmp,run,etc,proc,sys,dev,var}
	ln -s ../run "$root/var/run"
	chmod 1777 "$root/tmp"
	echo 'root:x:0:0:root:/:/bin/sh' >"$root/etc/passwd"
	echo 'root:x:0:' >"$root/etc/group"
}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step "image localhost/xdpcni:$TAG"
r=$work/xdpcni
skeleton "$r"
put target/release/xdpcni-agent /usr/local/bin/xdpcni-agent "$r"
put target/release/xdpcni /usr/local/bin/xdpcni "$r"
for p in host-local portmap loopback; do put "/usr/lib/cni/$p" "/usr/local/bin/$p" "$r"; done
# iptables-save and ip6tables-save (nft backend), with the xtables extensions
# they print matches with: the agent reads the node's FORWARD rules.
xt="/usr/lib/$(gcc -print-multiarch)/xtables"
if [ ! -x /usr/sbin/xtables-nft-multi ] || [ ! -d "$xt" ]; then
	echo "image.sh: iptables (nft backend) is not installed: scripts/setup.sh installs it" >&2
	exit 1
fi
put /usr/sbin/xtables-nft-multi /usr/sbin/xtables-nft-multi "$r"
for l in iptables-save ip6tables-save; do ln -s xtables-nft-multi "$r/usr/sbin/$l"; done
for so in "$xt"/*.so; do put "$so" "$so" "$r"; done
# nft (and the protocol names it resolves with getprotobyname): the agent
# applies its NetworkPolicy rules with `nft -j -f -`.
if [ ! -x /usr/sbin/nft ] || [ ! -f /etc/protocols ]; then
	echo "image.sh: nft or /etc/protocols is missing: scripts/setup.sh installs nftables and netbase" >&2
	exit 1
fi
put /usr/sbin/nft /usr/sbin/nft "$r"
install -D -m 0644 /etc/protocols "$r/etc/protocols"
python3 scripts/oci-image.py "$r" "localhost/xdpcni:$TAG" "$OUT/xdpcni.tar" \
	--entrypoint /usr/local/bin/xdpcni-agent >/dev/null

step "image localhost/xdpcni-testpod:$TAG"
r=$work/testpod
skeleton "$r"
install -D -m 0755 /bin/busybox "$r/bin/busybox"
for a in sh ping ping6 sleep cat ip hostname ls wget nc nslookup; do ln -s busybox "$r/bin/$a"; done
put target/release/podtool /usr/local/bin/podtool "$r"
python3 scripts/oci-image.py "$r" "localhost/xdpcni-testpod:$TAG" "$OUT/testpod.tar" >/dev/null

step "image localhost/pause:xdpcni"
r=$work/pause
skeleton "$r"
gcc -static -O2 -o "$work/pause.bin" e2e/k8s/pause.c
install -D -m 0755 "$work/pause.bin" "$r/pause"
python3 scripts/oci-image.py "$r" "localhost/pause:xdpcni" "$OUT/pause.tar" --entrypoint /pause >/dev/null

if [ -n "$import" ]; then
	for i in xdpcni testpod pause; do
		step "ctr import $OUT/$i.tar"
		ctr --address "$import" -n k8s.io images import "$OUT/$i.tar" >/dev/null
	done
fi
echo "$OUT"
