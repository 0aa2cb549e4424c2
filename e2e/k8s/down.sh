#!/usr/bin/env bash
# Stops the node e2e/k8s/up.sh started and leaves the host as up.sh found it:
# the pods' sandboxes, every process it started (by recorded PID), the mounts
# under the work dir and the pods' netns, the kubelet's sysctls, the node
# namespace (and with it kube-proxy's iptables rules and every pod veth), and
# whatever is new in the CNI dirs, /var/lib/cni, /var/log/pods, bpffs and
# /run/containerd. Every step runs even when one fails; the exit status says
# whether all did. Logs are kept in target/k8s-logs.
source "$(dirname "$0")/lib.sh"
set +e
trap - ERR
fails=0
try() {
	"$@"
	local rc=$?
	if [ "$rc" -ne 0 ]; then
		echo "down.sh: '$*' failed (exit $rc)" >&2
		fails=$((fails + 1))
	fi
	return 0
}
if [ ! -f "$W/env" ]; then
	echo "down.sh: no node is up ($W/env missing)"
	exit 0
fi

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { awk -v n="$1" '$1 == n { print $2 }' "$W/pids" | tail -1; }
stop_pid() {
	local pid=$1 i
	alive "$pid" || return 0
	kill -TERM "$pid" 2>/dev/null
	for i in $(seq 1 50); do
		alive "$pid" || return 0
		sleep 0.2
	done
	kill -KILL "$pid" 2>/dev/null
	sleep 0.2
	! alive "$pid"
}

step "keep the logs in target/k8s-logs"
mkdir -p "$REPO/target/k8s-logs"
cp -r "$W/log/." "$REPO/target/k8s-logs/" 2>/dev/null

step "stop the kubelet, then every pod's containers"
try stop_pid "$(pid_of kubelet)"
if [ -S "$SOCK" ]; then
	for t in $(ctr_ tasks ls -q 2>/dev/null); do
		ctr_ tasks kill -s SIGKILL "$t" >/dev/null 2>&1
	done
	sleep 1
	for t in $(ctr_ tasks ls -q 2>/dev/null); do
		try ctr_ tasks delete -f "$t" >/dev/null
	done
fi
# The shims our containerd started (they carry its socket in their command line).
for pid in $(pgrep -f -- "-address $SOCK" 2>/dev/null); do
	try stop_pid "$pid"
done

step "stop the daemons, newest first"
for name in cluster-dns dnsmasq kube-proxy containerd kube-scheduler kube-controller-manager kube-apiserver etcd; do
	try stop_pid "$(pid_of "$name")"
done

step "take xdpcni off the node if the checks did not (its own uninstall)"
if [ -d /var/lib/cni/xdpcni ]; then
	plugin=/opt/cni/bin/xdpcni
	[ -x "$plugin" ] || plugin=$REPO/target/release/xdpcni
	try "$plugin" uninstall /var/lib/cni/xdpcni
fi

step "unmount what the kubelet, containerd and the pods left"
for m in $(findmnt -rn -o TARGET | grep -E "^$W(/|$)" | sort -r); do
	umount "$m" 2>/dev/null || try umount -l "$m"
done
for ns in $(ls /run/netns 2>/dev/null); do
	[ "$ns" = "$NODE_NS" ] && continue
	grep -qx "$ns" "$W/before/netns" && continue
	case $ns in cni-*) umount "/run/netns/$ns" 2>/dev/null; try rm -f "/run/netns/$ns" ;; esac
done

step "restore the kubelet's sysctls"
while IFS='=' read -r key val; do
	try sysctl -q -w "$key=$val"
done <"$W/before/sysctls"

step "delete the node namespace (pod veths and iptables rules go with it)"
try ip netns del "$NODE_NS"
if [ "$(cat "$W/before/netns-mounted")" = no ] && mountpoint -q /run/netns && [ -z "$(ls /run/netns)" ]; then
	try umount /run/netns
fi

step "remove what is new under the host paths"
for p in "${HOST_PATHS[@]}" /run/containerd; do
	if [ -e "$p" ]; then find "$p" -xdev 2>/dev/null; fi
done | sort >"$W/after-paths"
comm -13 "$W/before/paths" "$W/after-paths" | sort -r | while read -r p; do
	[ -e "$p" ] || [ -L "$p" ] || continue
	if [ -d "$p" ] && [ ! -L "$p" ]; then rmdir "$p" 2>/dev/null || rm -rf "$p"; else rm -f "$p"; fi
done

step "check nothing is left"
for name in $(awk '{ print $1 }' "$W/pids"); do
	pid=$(pid_of "$name")
	if alive "$pid"; then
		echo "down.sh: $name ($pid) is still running" >&2
		fails=$((fails + 1))
	fi
done
left=$(comm -13 "$W/before/paths" <(for p in "${HOST_PATHS[@]}"; do if [ -e "$p" ]; then find "$p" -xdev; fi; done 2>/dev/null | sort))
if [ -n "$left" ]; then
	echo "down.sh: still on the host: $left" >&2
	fails=$((fails + 1))
fi
rm -rf "$W"
if [ "$fails" -ne 0 ]; then
	echo "down.sh: $fails step(s) failed" >&2
	exit 1
fi
echo "down.sh: node stopped, host restored"
