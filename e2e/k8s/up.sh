#!/usr/bin/env bash
# Starts a real single-node Kubernetes 1.20.2 on this machine (as root) and
# `helm install`s charts/xdpcni on it with images built here (no registry):
# etcd, kube-apiserver, kube-controller-manager (--allocate-node-cidrs),
# kube-scheduler, containerd + runc, kubelet and kube-proxy (iptables mode),
# and a cluster DNS (dnsmasq fed from the API by cluster-dns.py), all in the
# node's own network namespace. Leaves it running; e2e/k8s/down.sh
# stops it and restores the host. Try it by hand:
#   source e2e/k8s/lib.sh; kc get pods -A -o wide
source "$(dirname "$0")/lib.sh"

if [ "$(id -u)" -ne 0 ]; then
	echo "up.sh: run as root" >&2
	exit 1
fi
# The kubelet evicts pods when its disk has less than 1% free (evictionHard
# below), which shows up later as pods that never turn Ready: say it now.
free_kib=$(df -Pk "$(dirname "$W")" | awk 'NR == 2 { print $4 }')
if [ "$free_kib" -lt $((4 * 1024 * 1024)) ]; then
	echo "up.sh: only $((free_kib / 1024)) MiB free under $(dirname "$W"); the node needs 4 GiB (images, containers, logs) and the kubelet evicts pods below 1% free" >&2
	exit 1
fi
if [ -f "$W/env" ]; then
	echo "up.sh: a node is already up ($W/env); run e2e/k8s/down.sh first" >&2
	exit 1
fi

step "build Kubernetes (cached) and fetch helm/kubectl"
bash "$REPO/scripts/k8s-build.sh" >/dev/null
bash "$REPO/scripts/helm.sh" >/dev/null
apt_install containerd runc iptables conntrack openssl etcd-server iproute2 util-linux dnsmasq-base
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

step "record what the host looks like now ($W/before)"
mkdir -p "$W/log" "$W/before" "$W/helm-home"
: >"$W/pids"
for s in "${HOST_SYSCTLS[@]}"; do echo "$s=$(sysctl -n "$s")"; done >"$W/before/sysctls"
for p in "${HOST_PATHS[@]}" /run/containerd; do
	if [ -e "$p" ]; then find "$p" -xdev 2>/dev/null; fi
done | sort >"$W/before/paths"
ls /run/netns 2>/dev/null | sort >"$W/before/netns" || true
mountpoint -q /run/netns && echo yes >"$W/before/netns-mounted" || echo no >"$W/before/netns-mounted"

step "the node's network namespace"
NODE_NS=xdpcni-node-$$
echo "NODE_NS=$NODE_NS" >"$W/env"
ip netns add "$NODE_NS"
in_node ip link set lo up
# No dummy driver on every kernel: a veth pair with both ends in the node.
in_node ip link add node0 type veth peer name node0peer
in_node ip link set node0peer up
in_node ip addr add "$NODE_IP/24" dev node0
in_node ip link set node0 up
# Anything not for the node or a pod ends on the dummy: nothing leaves the
# machine.
in_node ip route add default dev node0

step "certificates and credentials"
P=$W/pki
mkdir -p "$P"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=xdpcni-test-ca" \
	-keyout "$P/ca.key" -out "$P/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
	-keyout "$P/apiserver.key" -out "$P/apiserver.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n' \
	"$NODE_IP" >"$P/san.ext"
openssl x509 -req -in "$P/apiserver.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial \
	-days 2 -extfile "$P/san.ext" -out "$P/apiserver.crt" 2>/dev/null
openssl genrsa -out "$P/sa.key" 2048 2>/dev/null
openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null
token=$(openssl rand -hex 16)
echo "$token,admin,admin,system:masters" >"$P/tokens.csv"
cat >"$W/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: xdpcni
  cluster: {server: "https://$NODE_IP:6443", certificate-authority: "$P/ca.crt"}
users:
- name: admin
  user: {token: "$token"}
contexts:
- name: xdpcni
  context: {cluster: xdpcni, user: admin, namespace: default}
current-context: xdpcni
EOF
chmod 600 "$W/admin.kubeconfig" "$P/tokens.csv"

step "etcd"
daemon etcd etcd --data-dir "$W/etcd" --name node \
	--listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
	--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
	--initial-cluster node=http://127.0.0.1:2380
wait_for 30 in_node bash -c 'exec 3<>/dev/tcp/127.0.0.1/2379'

step "kube-apiserver"
daemon kube-apiserver "$K8S_BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
	--bind-address=0.0.0.0 --secure-port=6443 --advertise-address="$NODE_IP" \
	--tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
	--token-auth-file="$P/tokens.csv" --authorization-mode=RBAC \
	--service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
	--service-account-issuer=https://kubernetes.default.svc \
	--service-cluster-ip-range="$SERVICE_CIDR" --insecure-port=0 --allow-privileged=true \
	--kubelet-preferred-address-types=InternalIP
wait_for 60 kc get --raw /readyz

step "kube-controller-manager and kube-scheduler"
daemon kube-controller-manager "$K8S_BIN/kube-controller-manager" \
	--kubeconfig="$W/admin.kubeconfig" --leader-elect=false --bind-address=127.0.0.1 --port=0 \
	--allocate-node-cidrs --cluster-cidr="$CLUSTER_CIDR" --node-cidr-mask-size=24 \
	--service-cluster-ip-range="$SERVICE_CIDR" \
	--service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
	--use-service-account-credentials=false
daemon kube-scheduler "$K8S_BIN/kube-scheduler" --kubeconfig="$W/admin.kubeconfig" \
	--leader-elect=false --bind-address=127.0.0.1 --port=0

step "containerd"
mkdir -p "$W/containerd"
cat >"$W/containerd/config.toml" <<EOF
version = 2
root = "$W/containerd/root"
state = "$W/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$W/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:xdpcni"
  # This VM lacks CAP_SYS_RESOURCE (../shared/K8S-LOCAL.md).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
EOF
daemon containerd containerd --config "$W/containerd/config.toml"
wait_for 30 ctr_ version

step "images (scripts/image.sh, imported into containerd)"
bash "$REPO/scripts/image.sh" --import "$SOCK" >/dev/null
step "the previous release's image (scripts/previous-release.sh --image), for the upgrade check"
prev_images=$(bash "$REPO/scripts/previous-release.sh" --image)
ctr_ images import "$prev_images/xdpcni.tar" >/dev/null
echo "PREV_SRC=$(dirname "$prev_images")/src" >>"$W/env"

step "kubelet and kube-proxy"
cat >"$W/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
makeIPTablesUtilChains: false
protectKernelDefaults: false
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
# Local test node only: the kubelet API is reachable in the node namespace alone.
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
# No registry to pull from: never collect the imported images.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
# The cluster DNS (dnsmasq on the node's address, below); pods get its
# search domains and nothing of the host's resolver.
clusterDNS: [$NODE_IP]
clusterDomain: $CLUSTER_DOMAIN
resolvConf: $W/resolv.conf
EOF
: >"$W/resolv.conf"
daemon kubelet "$K8S_BIN/kubelet" --kubeconfig="$W/admin.kubeconfig" --config="$W/kubelet.yaml" \
	--container-runtime=remote --container-runtime-endpoint="unix://$SOCK" \
	--root-dir="$W/kubelet" --volume-plugin-dir="$W/kubelet/volume-plugins" --cert-dir="$W/kubelet/pki" \
	--hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --pod-infra-container-image=localhost/pause:xdpcni
cat >"$W/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$W/admin.kubeconfig"}
mode: iptables
clusterCIDR: $CLUSTER_CIDR
hostnameOverride: $NODE_NAME
bindAddress: $NODE_IP
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# Leave the host-wide conntrack settings alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
daemon kube-proxy "$K8S_BIN/kube-proxy" --config="$W/kube-proxy.yaml"

step "the cluster DNS: dnsmasq on $NODE_IP:53, fed from the API (e2e/k8s/cluster-dns.py)"
mkdir -p "$W/dns"
: >"$W/dns/hosts"
daemon dnsmasq dnsmasq --keep-in-foreground --conf-file=/dev/null --user=root --group=root \
	--pid-file="$W/dns/dnsmasq.pid" --listen-address="$NODE_IP" --bind-interfaces --no-resolv --no-hosts \
	--addn-hosts="$W/dns/hosts" --local="/$CLUSTER_DOMAIN/" --domain-needed --log-queries
daemon cluster-dns python3 "$REPO/e2e/k8s/cluster-dns.py" "$HELM_DIR/kubectl" "$W/admin.kubeconfig" \
	"$W/dns/hosts" "$W/dns/dnsmasq.pid" "$CLUSTER_DOMAIN"
dns_fed() { grep -q "kubernetes.default.svc.$CLUSTER_DOMAIN" "$W/dns/hosts"; }
wait_for 30 dns_fed
wait_for 60 kc get node "$NODE_NAME"
has_pod_cidr() { [ -n "$(kc get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}')" ]; }
wait_for 30 has_pod_cidr
echo "up.sh: node registered, podCIDR $(kc get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}')" >&2

step "helm install charts/xdpcni"
start=$(date +%s%N)
helm_ install xdpcni "$REPO/charts/xdpcni" --namespace kube-system \
	--set image.repository=localhost/xdpcni --set image.tag=dev --set image.pullPolicy=Never >/dev/null
wait_for 180 node_ready
ms=$((($(date +%s%N) - start) / 1000000))
echo "helm_install_to_node_ready_ms=$ms" >>"$W/timings"
echo "up.sh: node $NODE_NAME Ready ${ms} ms after helm install" >&2
cat >&2 <<EOF
up.sh: the node is up. Try it by hand:
  source e2e/k8s/lib.sh; kc get pods -A -o wide
and stop it with: bash e2e/k8s/down.sh
EOF
