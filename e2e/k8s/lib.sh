# The local single-node Kubernetes (sourced by up.sh, down.sh, run.sh).
#
# The node is a network namespace of its own on this machine (named in
# $W/env): containerd, the kubelet, kube-proxy and the control plane run in
# it, so hostNetwork pods (the agent) get it as their "host", kube-proxy's
# iptables rules and every pod veth live in it and go with it. Everything else
# is the host's: the mount namespace, bpffs, /etc/cni/net.d, /opt/cni/bin,
# /run/netns. down.sh restores all of it.
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/lib.sh"

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
W=${XDPCNI_K8S_WORK:-/var/lib/xdpcni-k8s-node}
K8S_BIN=${XDPCNI_K8S_CACHE:-/var/cache/xdpcni-k8s}/bin
HELM_DIR=${XDPCNI_HELM_CACHE:-/var/cache/xdpcni-helm}
NODE_NAME=xdpcni-node
NODE_IP=192.0.2.2
CLUSTER_CIDR=10.244.0.0/16
CLUSTER_DOMAIN=cluster.local
SERVICE_CIDR=10.96.0.0/16
SOCK=$W/containerd/containerd.sock
# What the kubelet changes host-wide (../shared/K8S-LOCAL.md); saved and restored.
HOST_SYSCTLS=(kernel.panic kernel.panic_on_oops vm.overcommit_memory)
# Host paths the chart and the runtime write to; down.sh removes what is new.
# (The kubelet keeps its device-plugin socket in /var/lib/kubelet and makes
# /usr/libexec/kubernetes whatever its flags say.)
HOST_PATHS=(/etc/cni /opt/cni /var/lib/cni /run/xdpcni /var/log/pods /var/log/containers
	/sys/fs/bpf/xdpcni /var/lib/kubelet /usr/libexec/kubernetes)

[ -f "$W/env" ] && source "$W/env"

# Runs a command in the node's network namespace.
in_node() { nsenter --net="/run/netns/$NODE_NS" -- "$@"; }
kc() { in_node "$HELM_DIR/kubectl" --kubeconfig "$W/admin.kubeconfig" --cache-dir "$W/kubectl-cache" "$@"; }
helm_() { HOME=$W/helm-home in_node "$HELM_DIR/helm" --kubeconfig "$W/admin.kubeconfig" "$@"; }
ctr_() { ctr --address "$SOCK" -n k8s.io "$@"; }

# Starts a daemon in the node namespace, in its own session, and records its
# PID in $W/pids (one "name pid" line each) for down.sh.
daemon() {
	local name=$1
	shift
	setsid nsenter --net="/run/netns/$NODE_NS" -- "$@" >"$W/log/$name.log" 2>&1 </dev/null &
	echo "$name $!" >>"$W/pids"
}

# Waits up to $1 seconds for the command after it to succeed.
wait_for() {
	local secs=$1 start=$SECONDS
	shift
	until "$@" >/dev/null 2>&1; do
		if [ $((SECONDS - start)) -ge "$secs" ]; then
			echo "timed out after ${secs}s waiting for: $*" >&2
			return 1
		fi
		sleep 0.5
	done
}

node_ready() {
	[ "$(kc get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}
