#!/usr/bin/env bash
# Builds Kubernetes 1.20.2 (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy) from Debian's `kubernetes` source
# package (Debian ships no server binaries; see ../shared/K8S-LOCAL.md) and
# installs etcd-server. The binaries are cached in $XDPCNI_K8S_CACHE (default
# /var/cache/xdpcni-k8s): about 12 minutes on 2 cores the first time, nothing
# after. Prints the directory holding the binaries.
source "$(dirname "$0")/lib.sh"
D=${XDPCNI_K8S_CACHE:-/var/cache/xdpcni-k8s}
BINS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
apt_install etcd-server golang-go rsync golang-github-modern-go-reflect2-dev dpkg-dev make
have=1
for b in "${BINS[@]}"; do [ -x "$D/bin/$b" ] || have=0; done
if [ "$have" = 1 ]; then
	echo "$D/bin"
	exit 0
fi
step "fetch Debian's kubernetes source package"
mkdir -p "$D/lists/partial" "$D/cache/archives/partial" "$D/bin"
mirror=$(apt_mirror)
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bookworm main" >"$D/sources.list"
APT=(-o "Dir::Etc::sourcelist=$D/sources.list" -o Dir::Etc::sourceparts=/nonexistent
	-o "Dir::State::Lists=$D/lists" -o "Dir::Cache=$D/cache")
(cd "$D" && apt-get "${APT[@]}" update -qq &&
	apt-get "${APT[@]}" source --download-only kubernetes=1.20.5+really1.20.2-1.1+deb12u1 >/dev/null)
step "unpack the source"
rm -rf "$D/src" && mkdir "$D/src"
(cd "$D/src" && dpkg-source -x "$D"/kubernetes_*.dsc >/dev/null)
cd "$D"/src/kubernetes-*/
# Go >= 1.18 crashes the vendored reflect2 on the first custom-resource write.
rm -rf vendor/github.com/modern-go/reflect2
mkdir -p vendor/github.com/modern-go/reflect2
cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go vendor/github.com/modern-go/reflect2/
step "make ${BINS[*]} (log: $D/make.log)"
whats=()
for b in "${BINS[@]}"; do whats+=("cmd/$b"); done
export GOCACHE=$D/go-build
if ! KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean CGO_ENABLED=0 \
	make WHAT="${whats[*]}" >"$D/make.log" 2>&1; then
	tail -20 "$D/make.log" >&2
	false
fi
for b in "${BINS[@]}"; do install -m 0755 "_output/bin/$b" "$D/bin/$b"; done
cd /
rm -rf "$D/src" "$D/cache" "$D/go-build" "$D"/kubernetes_*
echo "$D/bin"
