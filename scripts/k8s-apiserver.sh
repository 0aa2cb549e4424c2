#!/usr/bin/env bash
# Builds kube-apiserver 1.20.2 from Debian's `kubernetes` source package
# (Debian ships no server binaries; see ../shared/K8S-LOCAL.md) and installs
# etcd-server, for the agent's tests against a real API server. The binary is
# cached in $XDPCNI_K8S_CACHE (default /var/cache/xdpcni-k8s): about 7 minutes
# on 2 cores the first time, nothing after. Prints the binary's path.
set -euo pipefail
D=${XDPCNI_K8S_CACHE:-/var/cache/xdpcni-k8s}
BIN=$D/bin/kube-apiserver
export DEBIAN_FRONTEND=noninteractive
need=()
for p in etcd-server golang-go rsync golang-github-modern-go-reflect2-dev dpkg-dev make; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ -x "$BIN" ]; then
	echo "$BIN"
	exit 0
fi
mkdir -p "$D/lists/partial" "$D/cache/archives/partial" "$D/bin"
mirror=$(grep -rhoE 'https?://[^ ]*debian/?' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | grep -v security | head -1)
mirror=${mirror:-http://deb.debian.org/debian}
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bookworm main" >"$D/sources.list"
APT=(-o "Dir::Etc::sourcelist=$D/sources.list" -o Dir::Etc::sourceparts=/nonexistent
	-o "Dir::State::Lists=$D/lists" -o "Dir::Cache=$D/cache")
(cd "$D" && apt-get "${APT[@]}" update -qq && apt-get "${APT[@]}" source --download-only kubernetes=1.20.5+really1.20.2-1.1+deb12u1 >/dev/null)
rm -rf "$D/src" && mkdir "$D/src"
(cd "$D/src" && dpkg-source -x "$D"/kubernetes_*.dsc >/dev/null)
cd "$D"/src/kubernetes-*/
# Go >= 1.18 crashes the vendored reflect2 on the first custom-resource write.
rm -rf vendor/github.com/modern-go/reflect2
mkdir -p vendor/github.com/modern-go/reflect2
cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go vendor/github.com/modern-go/reflect2/
KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean CGO_ENABLED=0 \
	make WHAT="cmd/kube-apiserver" >"$D/make.log" 2>&1
install -m 0755 _output/bin/kube-apiserver "$BIN"
rm -rf "$D/src" "$D/cache"
echo "$BIN"
