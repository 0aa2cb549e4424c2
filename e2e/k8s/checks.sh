#!/usr/bin/env bash
# The checks run.sh runs on the node up.sh started (with xdpcni installed by
# helm). Each check is one numbered line, "ok N - ..." or "FAIL N - ..." with
# what it saw; the last line is "checks: N passed, N failed". Checks build on each
# other in order (pods made by one are used by the next).
source "$(dirname "$0")/lib.sh"
set +e
trap - ERR
NS=xdpcni-e2e
M=$REPO/e2e/k8s/manifests
STATE_DIR=/var/lib/cni/xdpcni
PIN_DIR=/sys/fs/bpf/xdpcni
# The chart's node default mode (values.yaml), what unannotated pods get.
DEFAULT_MODE=$(awk '$1 == "xdpMode:" { print $2; exit }' "$REPO/charts/xdpcni/values.yaml")
passed=0
failed=0
n=0

check() {
	local name=$1 out rc
	shift
	n=$((n + 1))
	out=$("$@" 2>&1)
	rc=$?
	if [ "$rc" -eq 0 ]; then
		passed=$((passed + 1))
		echo "ok $n - $name${out:+: $(echo "$out" | tail -1)}"
	else
		failed=$((failed + 1))
		echo "FAIL $n - $name"
		echo "$out" | tail -25 | sed 's/^/    /'
	fi
}
# Ends the check (each runs in its own subshell) with what it saw.
fail() {
	echo "$*"
	exit 1
}

# --- helpers ----------------------------------------------------------------
pods_of() { kc get pods -n "$NS" -l "app=$1" -o jsonpath='{.items[*].metadata.name}'; }
pod_ip() { kc get pod -n "$NS" "$1" -o jsonpath='{.status.podIP}'; }
x() {
	local pod=$1
	shift
	kc exec -n "$NS" "$pod" -- "$@"
}
status_of() { kc -n kube-system exec ds/xdpcni-agent -c agent -- xdpcni-agent status "$@"; }
metrics() {
	in_node python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9965/metrics", timeout=5).read().decode())'
}
# Sum of the datapath's packet counters (xdpcni_{forward,kernel,drop}_packets_total)
# for pod $1 over verdicts matching regex $2. /metrics reads the maps at scrape
# time: no wait for a reconcile pass.
counter() {
	metrics | awk -v pod="$1" -v re="$2" '
		/^xdpcni_(forward|kernel|drop)_packets_total\{/ {
			if (index($0, "pod=\"" pod "\"") == 0) next
			match($0, /verdict="[^"]*"/); v = substr($0, RSTART + 9, RLENGTH - 10)
			if (v ~ "^(" re ")$") s += $NF
		}
		END { print s + 0 }'
}
mode_of() {
	metrics | awk -v pod="$1" '/^xdpcni_attach_mode\{/ && index($0, "pod=\"" pod "\"") && $NF == 1 {
		match($0, /mode="[^"]*"/); print substr($0, RSTART + 6, RLENGTH - 7) }'
}
wait_mode() {
	local pod=$1 want=$2 i
	for i in $(seq 1 100); do
		[ "$(mode_of "$pod")" = "$want" ] && return 0
		sleep 0.1
	done
	fail "pod $pod: attach mode $(mode_of "$pod"), wanted $want after 10 s"
}
# The xdpcni attachment record of pod $1 (a JSON file in the state dir).
record_of() {
	python3 - "$STATE_DIR" "$1" <<'PY'
import json, os, sys
d, pod = sys.argv[1], sys.argv[2]
for f in os.listdir(d):
    if f.endswith(".json"):
        r = json.load(open(os.path.join(d, f)))
        if r.get("podName") == pod:
            print(os.path.join(d, f)); sys.exit(0)
sys.exit(1)
PY
}
pod_netns() { record_field "$(record_of "$1")" netns; }
# `ethtool -k` feature $2 of pod $1's eth0, read from the node.
pod_offload() {
	local netns
	netns=$(pod_netns "$1") || return 1
	nsenter --net="$netns" ethtool -k eth0 | awk -v f="$2:" '$1 == f { print $2 }'
}
record_field() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r[sys.argv[2]])' "$1" "$2"; }
# ping -c $3 -i $4 from pod $1 to $2; prints "sent received".
ping_stats() {
	x "$1" ping -q -c "$3" -i "$4" -W 1 "$2" | awk '/packets transmitted/ { print $1, $4 }'
}
traffic() { # pod-to-pod ping, UDP and TCP from $1 to pod $2 (port 9090: no Service)
	local ip s
	ip=$(pod_ip "$2")
	s=$(ping_stats "$1" "$ip" 5 0.1)
	[ "$s" = "5 5" ] || fail "ping $1 -> $2 ($ip): sent/received $s"
	x "$1" podtool echo "$ip" 9090 20 >/dev/null || fail "UDP echo $1 -> $2 failed"
	x "$1" podtool greet "$ip" 9090 20 >/dev/null || fail "TCP $1 -> $2 failed"
}

# --- the checks -------------------------------------------------------------
c_install_cni() {
	local f=/etc/cni/net.d/10-xdpcni.conflist b
	[ -s "$f" ] || fail "$f missing"
	grep -q "$(kc get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}')" "$f" || fail "conflist lacks the node's podCIDR"
	for b in xdpcni host-local portmap loopback; do
		[ -x "/opt/cni/bin/$b" ] || fail "/opt/cni/bin/$b missing"
	done
	# routing.mode vxlan (the default) and mtu auto: the underlay's less 50.
	local mtu under
	mtu=$(conf_mtu)
	under=$(node0_mtu)
	[ "$mtu" = $((under - 50)) ] || fail "pod MTU $mtu in the conflist, not node0's $under less the tunnel's 50"
	echo "conflist for $(kc get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}'), pod MTU $mtu (node0 $under, vxlan); xdpcni, host-local, portmap, loopback in /opt/cni/bin"
}
c_node_ready() {
	node_ready || fail "node not Ready"
	echo "Ready $(grep helm_install_to_node_ready_ms "$W/timings" | cut -d= -f2) ms after helm install"
}
c_agent_ready() {
	local p
	p=$(kc get pods -n kube-system -l app.kubernetes.io/name=xdpcni -o jsonpath='{.items[0].metadata.name}')
	[ "$(kc get pod -n kube-system "$p" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ] ||
		fail "agent pod $p not ready"
	grep -qx 'xdpcni_ready 1' <<<"$(metrics)" || fail "xdpcni_ready is not 1"
	echo "$p Running, readiness probe passing, xdpcni_ready 1"
}
c_status() {
	local conf out
	conf=$(python3 -c 'import json; c=json.load(open("/etc/cni/net.d/10-xdpcni.conflist")); p=c["plugins"][0]; p["cniVersion"]="1.1.0"; p["name"]=c["name"]; print(json.dumps(p))')
	out=$(echo "$conf" | in_node env CNI_COMMAND=STATUS CNI_PATH=/opt/cni/bin /opt/cni/bin/xdpcni) ||
		fail "STATUS failed: $out"
	echo "STATUS exit 0${out:+ ($out)}"
}
c_pods() {
	local t0 ms p ip cidr
	kc apply -f "$M/namespace.yaml" >/dev/null || return 1
	t0=$(date +%s%N)
	kc apply -f "$M/web.yaml" >/dev/null || return 1
	kc rollout status -n "$NS" deploy/web --timeout=120s >/dev/null || fail "web not available"
	ms=$((($(date +%s%N) - t0) / 1000000))
	kc rollout status -n "$NS" deploy/client --timeout=60s >/dev/null || fail "client not available"
	cidr=$(kc get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}')
	for p in $(pods_of web) $(pods_of client); do
		ip=$(pod_ip "$p")
		python3 -c 'import ipaddress,sys; sys.exit(ipaddress.ip_address(sys.argv[1]) not in ipaddress.ip_network(sys.argv[2]))' "$ip" "$cidr" ||
			fail "$p has $ip, outside $cidr"
	done
	echo "3 pods with addresses in $cidr; both web pods Running ${ms} ms after kubectl apply"
}
c_default_mode() {
	local a b before after
	read -r a b <<<"$(pods_of web)"
	wait_mode "$a" "$DEFAULT_MODE" && wait_mode "$b" "$DEFAULT_MODE" || return 1
	before=$(counter "$a" 'redirect_.*')
	traffic "$a" "$b" && traffic "$b" "$a" || return 1
	after=$(counter "$a" 'redirect_.*')
	[ "$after" -gt "$before" ] || fail "the redirect counters of $a did not move ($before -> $after)"
	echo "node default $DEFAULT_MODE: ping, UDP, TCP both ways; $a redirect_* +$((after - before))"
}
# Switches both web pods to mode $1 / redirect $2 while a TCP stream runs
# from one to the other; then checks ping/UDP/TCP, and that the stream's
# packets were counted under verdict $3 (not for off: no XDP at all).
switch_under_load() {
	local mode=$1 redirect=$2 verdict=$3 a b ip before after out stream_pid
	read -r a b <<<"$(pods_of web)"
	ip=$(pod_ip "$b")
	before=$(counter "$a" "$verdict")
	x "$a" podtool stream "$ip" 9090 6 >"$W/stream.out" 2>&1 &
	stream_pid=$!
	sleep 1.5
	kc annotate -n "$NS" pod "$a" "$b" --overwrite "xdpcni.io/xdp-mode=$mode" "xdpcni.io/redirect=$redirect" >/dev/null
	wait_mode "$a" "$mode" && wait_mode "$b" "$mode" || return 1
	# off: from here on, nothing may be counted.
	[ "$mode" = off ] && before=$(counter "$a" "$verdict")
	wait "$stream_pid" || fail "TCP stream broke during the switch: $(cat "$W/stream.out")"
	out=$(tail -1 "$W/stream.out")
	traffic "$a" "$b" || return 1
	after=$(counter "$a" "$verdict")
	# What ethtool in the pod shows for the offloads each mode needs.
	case $mode in
	native) [ "$(pod_offload "$a" tx-checksumming)" = off ] || fail "native: tx checksumming not off in $a" ;;
	generic | tc) [ "$(pod_offload "$a" tcp-segmentation-offload)" = on ] || fail "$mode keeps TSO; $a shows $(pod_offload "$a" tcp-segmentation-offload)" ;;
	esac
	if [ "$mode" = off ]; then
		[ "$after" -eq "$before" ] || fail "off: XDP still counted $verdict ($before -> $after)"
		echo "off: kernel routing, no XDP verdicts; stream through the switch: $out"
	else
		[ "$((after - before))" -gt 10000 ] || fail "$mode/$redirect: the stream was not on the fast path ($verdict $before -> $after)"
		echo "$mode/$redirect: $verdict +$((after - before)); stream through the switch: $out"
	fi
}
# Into tc from generic under a TCP stream, and back, under 10 ms pings.
tc_there_and_back() {
	switch_under_load tc devmap redirect_peer || return 1
	switch_under_load generic devmap 'redirect_devmap|pass_gso' >/dev/null || return 1
}
c_tc_switch() {
	local a b out s r
	read -r a b <<<"$(pods_of web)"
	kc annotate -n "$NS" pod "$a" "$b" --overwrite xdpcni.io/xdp-mode=generic xdpcni.io/redirect=devmap >/dev/null
	wait_mode "$a" generic && wait_mode "$b" generic || return 1
	out=$(ping_during tc_there_and_back) || fail "$out"
	read -r s r <<<"$(tail -1 <<<"$out")"
	[ -n "$s" ] && [ "$s" -gt 0 ] && [ "$s" = "$r" ] || fail "10 ms pings across generic -> tc -> generic: sent ${s:-?}, received ${r:-?}"
	echo "$(head -1 <<<"$out"); back to generic under a second stream; 10 ms pings $s sent, $r received"
}
c_bad_annotation() {
	local a b i
	read -r a b <<<"$(pods_of web)"
	kc annotate -n "$NS" pod "$a" --overwrite xdpcni.io/xdp-mode=turbo >/dev/null
	for i in $(seq 1 50); do
		if kc get events -n "$NS" --field-selector "involvedObject.name=$a" -o jsonpath='{range .items[*]}{.reason} {.message}{"\n"}{end}' 2>/dev/null |
			grep -q 'turbo'; then
			traffic "$a" "$b" >/dev/null || fail "pod $a lost its network on a bad value"
			echo "Event on $a: $(kc get events -n "$NS" --field-selector "involvedObject.name=$a" -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' | grep turbo | tail -1); mode $(mode_of "$a")"
			kc annotate -n "$NS" pod "$a" xdpcni.io/xdp-mode- xdpcni.io/redirect- >/dev/null
			return 0
		fi
		sleep 0.2
	done
	fail "no Event for xdpcni.io/xdp-mode=turbo on $a"
}
# Connects of this node's pods to a ClusterIP the agent translated at the
# socket (xdpcni_service_calls_total{result="translated"}).
translated() {
	metrics | awk '/^xdpcni_service_calls_total\{result="translated"\}/ { print $NF + 0 }'
}
left() {
	metrics | awk '/^xdpcni_service_calls_total\{result="left"\}/ { print $NF + 0 }'
}
c_service() {
	local c a b ip out t0 t1 n0 n1 f0 f1 k0 k1 to shares=""
	read -r a b <<<"$(pods_of web)"
	c=$(pods_of client)
	kc annotate -n "$NS" pod "$a" "$b" xdpcni.io/xdp-mode- xdpcni.io/redirect- >/dev/null
	wait_mode "$a" "$DEFAULT_MODE" && wait_mode "$b" "$DEFAULT_MODE" && wait_mode "$c" "$DEFAULT_MODE" || return 1
	ip=$(kc get svc -n "$NS" web -o jsonpath='{.spec.clusterIP}')
	t0=$(translated)
	n0=$(($(counter "$a" pass_nat) + $(counter "$b" pass_nat)))
	out=$(x "$c" podtool greet "$ip" 80 100) || fail "ClusterIP $ip: $out"
	t1=$(translated)
	n1=$(($(counter "$a" pass_nat) + $(counter "$b" pass_nat)))
	[ $((t1 - t0)) -ge 100 ] || fail "the agent translated $((t1 - t0)) of the 100 connects to $ip:80"
	[ "$n1" -eq "$n0" ] || fail "backends passed $((n1 - n0)) packets for un-DNAT: nothing NAT'd these flows"
	# The share of the client's packets on the fast path, one 5 s TCP stream
	# each: through the ClusterIP, and to a backend's pod IP on the target port.
	for to in "$ip 80" "$(pod_ip "$a") 8080"; do
		f0=$(counter "$c" 'redirect_.*')
		k0=$(counter "$c" 'pass_.*')
		# shellcheck disable=SC2086
		x "$c" podtool stream $to 5 >/dev/null || fail "stream to $to"
		f1=$(counter "$c" 'redirect_.*')
		k1=$(counter "$c" 'pass_.*')
		[ $((f1 - f0)) -gt 0 ] || fail "stream to $to: nothing on the fast path"
		share=$(((f1 - f0) * 1000 / (f1 - f0 + k1 - k0)))
		[ "$share" -ge 990 ] || fail "stream to $to: $((f1 - f0)) packets on the fast path, $((k1 - k0)) to the kernel (share ${share} per mille, want >= 990)"
		shares="$shares ${to% *}:${to#* } $((f1 - f0))/$((f1 - f0 + k1 - k0))"
	done
	echo "100/100 connections to ClusterIP $ip:80 translated at the socket ($(echo "$out" | tr '\n' ' ')), pass_nat +0; client packets on the fast path:$shares"
}
# The socket's translation and kube-proxy agree on every Service: the same
# backends answer a pod (translated) and the node (kube-proxy's DNAT: the
# host's sockets are never translated), each showing the Service as the
# peer; a Service with no ready endpoint is refused to both alike.
c_service_equiv() {
	local c ip empty sticky udp pod node backends t0 t1 a aip out l0 l1 h0 h1 own other
	c=$(pods_of client)
	ip=$(kc get svc -n "$NS" web -o jsonpath='{.spec.clusterIP}')
	kc apply -f - >/dev/null <<-YAML || fail "the check's Services"
	apiVersion: v1
	kind: Service
	metadata: {name: empty, namespace: $NS}
	spec: {selector: {app: nothing}, ports: [{name: tcp, port: 80, targetPort: 8080}]}
	---
	apiVersion: v1
	kind: Service
	metadata: {name: sticky, namespace: $NS}
	spec:
	  selector: {app: web}
	  sessionAffinity: ClientIP
	  ports: [{name: tcp, port: 80, targetPort: 8080}]
	---
	apiVersion: v1
	kind: Service
	metadata: {name: web-udp, namespace: $NS}
	spec: {selector: {app: web}, ports: [{name: udp, port: 53, targetPort: 8080, protocol: UDP}]}
	YAML
	empty=$(kc get svc -n "$NS" empty -o jsonpath='{.spec.clusterIP}')
	sticky=$(kc get svc -n "$NS" sticky -o jsonpath='{.spec.clusterIP}')
	udp=$(kc get svc -n "$NS" web-udp -o jsonpath='{.spec.clusterIP}')
	sleep 3 # kube-proxy's rules and the agent's frontends in place
	t0=$(translated)
	pod=$(x "$c" podtool greet "$ip" 80 60 | awk '{ print $1 }' | sort | tr '\n' ' ')
	t1=$(translated)
	node=$(in_node "$REPO/target/release/podtool" greet "$ip" 80 60 | awk '{ print $1 }' | sort | tr '\n' ' ')
	[ $((t1 - t0)) -ge 60 ] || fail "the pod's connects were not translated (+$((t1 - t0)))"
	[ "$(translated)" -eq "$t1" ] || fail "the node's connects were translated"
	[ "$pod" = "$node" ] && [ "$(echo "$pod" | wc -w)" -eq 2 ] || fail "backends differ: pod [$pod] node [$node]"
	backends=$pod
	# sessionAffinity ClientIP: every connect of one client to one backend.
	pod=$(x "$c" podtool greet "$sticky" 80 20 | wc -l)
	node=$(in_node "$REPO/target/release/podtool" greet "$sticky" 80 20 | wc -l)
	[ "$pod" -eq 1 ] && [ "$node" -eq 1 ] || fail "ClientIP affinity: the pod reached $pod backends, the node $node"
	# UDP, unconnected: each echo comes back from the Service address.
	pod=$(x "$c" podtool echo "$udp" 53 20 2>&1) || fail "UDP from the pod: $pod"
	node=$(in_node "$REPO/target/release/podtool" echo "$udp" 53 20 2>&1) || fail "UDP from the node: $node"
	# No ready endpoint: refused to both.
	pod=$(x "$c" podtool greet "$empty" 80 1 2>&1) && fail "the empty Service answered the pod: $pod"
	node=$(in_node "$REPO/target/release/podtool" greet "$empty" 80 1 2>&1) && fail "the empty Service answered the node: $node"
	kc delete svc -n "$NS" empty sticky web-udp >/dev/null
	grep -q "refused" <<<"$pod" && grep -q "refused" <<<"$node" || fail "refusals differ: pod: $pod; node: $node"
	# Hairpin: a backend reaching its own Service. A connect that chose the
	# pod itself is left to kube-proxy, which masquerades it (the pod sees
	# another address than its own); one that chose the other backend is
	# translated and shows the pod's own address, as kube-proxy's DNAT does.
	read -r a _ <<<"$(pods_of web)"
	aip=$(pod_ip "$a")
	l0=$(left)
	h0=$(translated)
	out=$(x "$a" podtool who tcp "$ip" 80 40 2>&1) || fail "hairpin: $out"
	l1=$(left)
	h1=$(translated)
	own=$(awk -v me="$a" '$1 == me { n += $3 } END { print n + 0 }' <<<"$out")
	other=$(awk -v me="$a" '$1 != me { n += $3 } END { print n + 0 }' <<<"$out")
	[ "$own" -gt 0 ] && [ "$other" -gt 0 ] || fail "hairpin: not both backends: $out"
	awk -v me="$a" -v ip="$aip" '($1 == me) == ($2 == ip) { bad = 1 } END { exit bad }' <<<"$out" ||
		fail "hairpin: the source seen ($aip is the pod's): $out"
	# Each connect the programs left (they chose the pod itself) kube-proxy
	# chose again: itself (masqueraded) or the other backend.
	[ $((l1 - l0 + h1 - h0)) -eq 40 ] && [ $((l1 - l0)) -ge "$own" ] ||
		fail "hairpin: $own connects reached the pod itself, $((l1 - l0)) left to kube-proxy, $((h1 - h0)) translated"
	echo "from a pod (translated: +$((t1 - t0)) connects) and from the node (kube-proxy): ClusterIP $ip the same backends [${backends% }], the Service shown as the peer; ClientIP affinity one backend each; UDP echoed from the Service address to both; an empty Service refused to both; hairpin: $((l1 - l0)) of 40 connects chose the pod itself and were left to kube-proxy ($own of them masqueraded back to it), $((h1 - h0)) translated; the pod's own address seen by the other backend, another by itself"
}
# Services another proxy owns (service-proxy-name) or none may serve
# (headless label): kube-proxy writes no rule for them and the programs
# translate none of their connects, so a pod and the node both fail alike.
c_service_labels() {
	local c name ip t0 pod node rules
	c=$(pods_of client)
	kc apply -f - >/dev/null <<-YAML || fail "the check's Services"
	apiVersion: v1
	kind: Service
	metadata: {name: other-proxy, namespace: $NS, labels: {service.kubernetes.io/service-proxy-name: foo-bar}}
	spec: {selector: {app: web}, ports: [{name: tcp, port: 80, targetPort: 8080}]}
	---
	apiVersion: v1
	kind: Service
	metadata: {name: no-proxy, namespace: $NS, labels: {service.kubernetes.io/headless: ""}}
	spec: {selector: {app: web}, ports: [{name: tcp, port: 80, targetPort: 8080}]}
	YAML
	sleep 3 # kube-proxy's sync and the agent's pass (each would have served them by now)
	for name in other-proxy no-proxy; do
		ip=$(kc get svc -n "$NS" "$name" -o jsonpath='{.spec.clusterIP}')
		t0=$(translated)
		pod=$(x "$c" podtool who tcp "$ip" 80 1 2>&1) || fail "$name from the pod: $pod"
		[ "$(translated)" -eq "$t0" ] || fail "$name: the pod's connect was translated"
		node=$(in_node "$REPO/target/release/podtool" who tcp "$ip" 80 1 2>&1) || fail "$name from the node: $node"
		[[ $pod == error* && $node == error* ]] || fail "$name answered: pod '$pod', node '$node'"
		rules=$(in_node iptables-save)
		! grep -q "$NS/$name:" <<<"$rules" || fail "kube-proxy has rules for $name"
	done
	kc delete svc -n "$NS" other-proxy no-proxy >/dev/null
	echo "service-proxy-name foo-bar and headless: no rule of kube-proxy's, no translation; the pod and the node each '${pod% 1}'"
}
# The cluster DNS: a pod's resolv.conf names it with the cluster's search
# domains; a Service resolves by its short, namespaced and full names to its
# cluster IP, and a connect by name is translated at the socket like one to
# the address; a headless Service resolves to its ready pods; an unknown name
# does not resolve.
c_cluster_dns() {
	local c ip conf name out t0 t1 hl want got
	c=$(pods_of client)
	ip=$(kc get svc -n "$NS" web -o jsonpath='{.spec.clusterIP}')
	conf=$(x "$c" cat /etc/resolv.conf) || fail "no resolv.conf in $c"
	grep -q "^nameserver $NODE_IP\$" <<<"$conf" && grep -q "^search $NS.svc.$CLUSTER_DOMAIN svc.$CLUSTER_DOMAIN $CLUSTER_DOMAIN" <<<"$conf" ||
		fail "the pod's resolv.conf: $conf"
	for name in web "web.$NS" "web.$NS.svc.$CLUSTER_DOMAIN"; do
		t0=$(translated)
		out=$(x "$c" podtool greet "$name" 80 10 2>&1) || fail "greet $name: $out"
		t1=$(translated)
		[ $((t1 - t0)) -eq 10 ] || fail "$name: $((t1 - t0)) of 10 connects translated"
	done
	out=$(x "$c" nslookup "web.$NS.svc.$CLUSTER_DOMAIN" 2>&1) # (its status: the AAAA query finds none)
	grep -q "Address: $ip\$" <<<"$out" || fail "web.$NS.svc.$CLUSTER_DOMAIN is not $ip: $out"
	kc apply -f - >/dev/null <<-YAML || fail "the headless Service"
	apiVersion: v1
	kind: Service
	metadata: {name: web-headless, namespace: $NS}
	spec: {clusterIP: None, selector: {app: web}, ports: [{name: tcp, port: 8080}]}
	YAML
	want=$(kc get pods -n "$NS" -l app=web -o jsonpath='{.items[*].status.podIP}' | tr ' ' '\n' | sort | tr '\n' ' ')
	for _ in $(seq 1 30); do
		got=$(x "$c" nslookup "web-headless.$NS.svc.$CLUSTER_DOMAIN" 2>&1 | awk '/^Address: / && NR > 2 { print $2 }' | sort | tr '\n' ' ')
		[ "$got" = "$want" ] && break
		sleep 0.5
	done
	kc delete svc -n "$NS" web-headless >/dev/null
	[ "$got" = "$want" ] || fail "web-headless resolves to [$got], not the web pods [$want]"
	out=$(x "$c" podtool greet nosuch 80 1 2>&1) && fail "an unknown name was reached: $out"
	grep -q "resolving" <<<"$out" || fail "an unknown name: $out"
	echo "resolv.conf: nameserver $NODE_IP, search $NS.svc.$CLUSTER_DOMAIN ...; web, web.$NS and web.$NS.svc.$CLUSTER_DOMAIN -> $ip, 10/10 connects by each name translated; web-headless -> [${got% }]; an unknown name unresolved"
}
# One connected UDP socket to a ClusterIP, a datagram every 100 ms, while
# the Service's only backend is replaced (web pod a -> web pod b, by label).
# (b joins the Service before a leaves it.) Through kube-proxy (from the
# node) the same socket reaches b once
# kube-proxy has deleted a's conntrack entries; a pod's translated socket
# is closed by the agent (ECONNABORTED once) and, connected anew, reaches b.
# ($1: "pod" or "node"; prints podtool follow's runs on one line.)
follow_swap() {
	local side=$1 a b c ip out
	read -r a b <<<"$(pods_of web)"
	c=$(pods_of client)
	ip=$(kc get svc -n "$NS" swap-udp -o jsonpath='{.spec.clusterIP}')
	kc label pod -n "$NS" "$b" swap- >/dev/null
	kc label pod -n "$NS" "$a" swap=on --overwrite >/dev/null
	for _ in $(seq 1 50); do
		if [ "$side" = pod ]; then
			out=$(x "$c" podtool who udp-connected "$ip" 53 1 2>&1)
		else
			out=$(in_node "$REPO/target/release/podtool" who udp-connected "$ip" 53 1 2>&1)
		fi
		[[ $out == "$a "* ]] && break
		sleep 0.2
	done
	[[ $out == "$a "* ]] || { echo "$side: $a never answered alone: $out"; return 1; }
	if [ "$side" = pod ]; then
		x "$c" podtool follow "$ip" 53 8 >"$W/follow-$side" 2>&1 &
	else
		in_node "$REPO/target/release/podtool" follow "$ip" 53 8 >"$W/follow-$side" 2>&1 &
	fi
	local pid=$!
	sleep 2
	# b joins before a leaves: the Service is never empty (an empty one is
	# kube-proxy's to refuse, on both sides).
	kc label pod -n "$NS" "$b" swap=on >/dev/null
	kc label pod -n "$NS" "$a" swap- >/dev/null
	wait "$pid" || { echo "$side: podtool follow: $(cat "$W/follow-$side")"; return 1; }
	tr '\n' ';' <"$W/follow-$side"
}
c_udp_backend_replaced() {
	local a b pod node closed0 closed1
	read -r a b <<<"$(pods_of web)"
	kc apply -f - >/dev/null <<-YAML || fail "the check's Service"
	apiVersion: v1
	kind: Service
	metadata: {name: swap-udp, namespace: $NS}
	spec: {selector: {swap: "on"}, ports: [{name: dns, port: 53, targetPort: 8080, protocol: UDP}]}
	YAML
	closed0=$(metrics | awk '/^xdpcni_service_sockets_closed_total / { print $NF + 0 }')
	pod=$(follow_swap pod) || fail "$pod"
	closed1=$(metrics | awk '/^xdpcni_service_sockets_closed_total / { print $NF + 0 }')
	node=$(follow_swap node) || fail "$node"
	kc delete svc -n "$NS" swap-udp >/dev/null
	kc label pod -n "$NS" "$a" "$b" swap- >/dev/null
	# The backends each side heard, in order, errors left out.
	names() { tr ';' '\n' <<<"$1" | awk 'NF && $1 != "error" && $1 != prev { printf "%s ", $1; prev = $1 }'; }
	[ "$(names "$pod")" = "$a $b " ] || fail "the pod heard [$(names "$pod")], not $a then $b: $pod"
	[ "$(names "$node")" = "$a $b " ] || fail "the node heard [$(names "$node")], not $a then $b: $node"
	grep -q "error aborted 1;" <<<"$pod" || fail "the pod's socket was not closed once: $pod"
	! grep -q "error aborted" <<<"$node" || fail "the node's socket (kube-proxy's) was closed: $node"
	[ "$((closed1 - closed0))" -eq 1 ] || fail "xdpcni_service_sockets_closed_total +$((closed1 - closed0))"
	echo "one connected UDP socket, its only backend replaced 2 s in: from a pod (translated) $pod from the node (kube-proxy) $node; sockets closed +1"
}
# A flow the kernel DNATs (an administrator's rule here; kube-proxy's are
# alike) keeps the kernel path both ways: the backend's replies pass for
# un-DNAT, and the client sees the address it dialed.
# --- north-south: a NodePort from outside at the uplink (docs/services.md) ---
uplink_counter() {
	metrics | awk -v key="xdpcni_uplink_packets_total{interface=\"$1\",verdict=\"$2\"}" '
		index($0, key) == 1 { s += $NF } END { print s + 0 }'
}
set_north_south() { # the uplink's name, or none
	local v=(--set "services.northSouthDevices={$1}")
	[ -n "$1" ] || v=(--set-json 'services.northSouthDevices=[]')
	helm_ upgrade xdpcni "$REPO/charts/xdpcni" --namespace kube-system --reuse-values "${v[@]}" >/dev/null || return 1
	kc rollout status -n kube-system ds/xdpcni-agent --timeout=120s >/dev/null
}
outside_greet() { ip netns exec "$OUT_NS" "$REPO/target/release/podtool" greet 198.18.0.1 "$1" "$2"; }
# An outside client (a namespace of its own behind a new link of the node,
# xdpcni-up0) calls a NodePort of the web pods with the chart's
# services.northSouthDevices naming that link: every connect answered, the
# uplink's program carrying them (ns_to_pod on the link, ns_reply on the
# backends), the status naming the link; then the value is emptied again.
c_north_south() {
	local np a b t0 t1 r0 r1 out who
	OUT_NS=xdpcni-out-$$
	trap 'ip netns del "$OUT_NS" 2>/dev/null; in_node ip link del xdpcni-up0 2>/dev/null; kc delete svc -n "$NS" web-np --ignore-not-found >/dev/null 2>&1' EXIT
	ip netns add "$OUT_NS" || fail "ip netns add $OUT_NS"
	in_node ip link add xdpcni-up0 type veth peer name eth0 netns "$OUT_NS" || fail "the uplink's veth"
	in_node ip addr add 198.18.0.1/24 dev xdpcni-up0 && in_node ip link set xdpcni-up0 up || fail "the uplink's address"
	ip -n "$OUT_NS" addr add 198.18.0.10/24 dev eth0 && ip -n "$OUT_NS" link set eth0 up &&
		ip -n "$OUT_NS" route add default via 198.18.0.1 || fail "the outside client's address"
	kc apply -f - >/dev/null <<YAML || fail "the NodePort Service"
apiVersion: v1
kind: Service
metadata: {name: web-np, namespace: $NS}
spec:
  type: NodePort
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080}]
YAML
	np=$(kc get svc -n "$NS" web-np -o jsonpath='{.spec.ports[0].nodePort}')
	wait_for 60 outside_greet "$np" 1 || fail "kube-proxy's NodePort $np from outside: $(outside_greet "$np" 1 2>&1)"
	set_north_south xdpcni-up0 || fail "helm upgrade with services.northSouthDevices={xdpcni-up0}"
	read -r a b <<<"$(pods_of web)"
	# The agent serves the node port at the link's address once it wrote it.
	served() { [ "$(uplink_counter xdpcni-up0 ns_to_pod)" -gt 0 ] || { outside_greet "$np" 1 >/dev/null && false; }; }
	wait_for 60 served || fail "no ns_to_pod on xdpcni-up0 after 60 s of connects to $np; the agent: $(status_of -o json 2>&1 | grep -o '"northSouth":[^]]*]'); the link: $(metrics | grep -c 'interface="xdpcni-up0"') metric rows"
	t0=$(uplink_counter xdpcni-up0 ns_to_pod)
	r0=$(($(counter "$a" ns_reply) + $(counter "$b" ns_reply)))
	out=$(outside_greet "$np" 20) || fail "20 connects from outside to 198.18.0.1:$np: $out"
	t1=$(uplink_counter xdpcni-up0 ns_to_pod)
	r1=$(($(counter "$a" ns_reply) + $(counter "$b" ns_reply)))
	[ $((t1 - t0)) -ge 60 ] || fail "ns_to_pod on xdpcni-up0 +$((t1 - t0)) for 20 connects"
	[ $((r1 - r0)) -ge 40 ] || fail "ns_reply on the backends +$((r1 - r0)) for 20 connects"
	who=$(status_of -o json 2>&1 | grep -c "at tc on xdpcni-up0")
	[ "$who" -ge 1 ] || fail "the status does not name the uplink"
	set_north_south "" || fail "helm upgrade emptying services.northSouthDevices"
	out2=$(outside_greet "$np" 5) || fail "after emptying the value, kube-proxy's node port: $out2"
	echo "20/20 connects from outside to NodePort $np at the uplink ($(echo "$out" | tr '\n' ' ')), ns_to_pod +$((t1 - t0)), ns_reply +$((r1 - r0)), the status names the uplink; kube-proxy's again once the value is emptied"
}
c_dnat() {
	local c a bip out n0 n1 rc=0 vip=198.51.100.80
	read -r a _ <<<"$(pods_of web)"
	c=$(pods_of client)
	bip=$(pod_ip "$a")
	in_node iptables -t nat -I PREROUTING -d "$vip" -p tcp --dport 80 -j DNAT --to-destination "$bip:8080" ||
		fail "adding the DNAT rule"
	n0=$(counter "$a" pass_nat)
	out=$(x "$c" podtool greet "$vip" 80 10) || rc=$?
	n1=$(counter "$a" pass_nat)
	in_node iptables -t nat -D PREROUTING -d "$vip" -p tcp --dport 80 -j DNAT --to-destination "$bip:8080"
	[ "$rc" -eq 0 ] || fail "$vip:80 DNAT'd to $bip:8080: $out"
	[ $((n1 - n0)) -ge 20 ] || fail "the backend's replies of 10 DNAT'd connections: pass_nat +$((n1 - n0))"
	echo "10/10 connections to $vip:80 DNAT'd to $a ($bip:8080): its replies pass_nat +$((n1 - n0)), the peer shown as $vip"
}
c_hostport() {
	local c out
	kc apply -f "$M/hostport.yaml" >/dev/null || return 1
	kc wait -n "$NS" --for=condition=Ready pod/hostport --timeout=60s >/dev/null || fail "hostport pod not Ready"
	c=$(pods_of client)
	out=$(x "$c" podtool greet "$NODE_IP" 30080 10) || fail "$NODE_IP:30080 from $c: $out"
	echo "$NODE_IP:30080 -> pod hostport: $out"
}
# Tries `podtool greet $2 $3 1` from pod $1 until it is refused (or $4
# tries); succeeds once refused.
refused_within() {
	local i
	for i in $(seq 1 "$4"); do
		x "$1" podtool greet "$2" "$3" 1 >/dev/null 2>&1 || return 0
		sleep 0.1
	done
	return 1
}
# Tries `podtool greet $2 $3 $4` from pod $1 until it succeeds (50 tries);
# prints what it got.
reached_within() {
	local i out
	for i in $(seq 1 50); do
		out=$(x "$1" podtool greet "$2" "$3" "$4" 2>&1) && { echo "$out"; return 0; }
		sleep 0.1
	done
	echo "$out"
	return 1
}
c_netpol() {
	local a b c ip svc t0 ms out ready eps drops fast0 fast1 line
	read -r a b <<<"$(pods_of web)"
	c=$(pods_of client)
	svc=$(kc get svc -n "$NS" web -o jsonpath='{.spec.clusterIP}')
	ip=$(pod_ip "$a")
	t0=$(date +%s%N)
	kc apply -f "$M/netpol.yaml" >/dev/null || return 1
	refused_within "$c" "$svc" 80 100 || fail "the client still reaches the Service of pods the policy closes to it"
	ms=$((($(date +%s%N) - t0) / 1000000))
	# The isolated web pods keep the fast path: the datapath enforces their policy.
	wait_mode "$a" "$DEFAULT_MODE" && wait_mode "$b" "$DEFAULT_MODE" || return 1
	line=$(status_of | grep "^$NS/$a ") || fail "no status line for $a"
	grep -q "NetworkPolicy $NS/web-from-allowed enforced in the datapath\$" <<<"$line" || fail "status of $a: $line"
	kc label -n "$NS" pod "$c" role=allowed --overwrite >/dev/null
	fast0=$(counter "$c" "redirect_.*")
	out=$(reached_within "$c" "$svc" 80 20) || fail "a role=allowed client is refused through the Service: $out"
	fast1=$(counter "$c" "redirect_.*")
	[ "$fast1" -gt "$fast0" ] || fail "the allowed client's packets did not take the fast path ($fast0 -> $fast1)"
	x "$c" podtool greet "$ip" 9090 1 >/dev/null 2>&1 && fail "the client reached $a:9090, a port the policy does not name"
	# The kubelet's readiness probes (from the node) keep passing.
	sleep 3
	ready=$(kc get pods -n "$NS" -l app=web -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status} {end}')
	[ "$ready" = "True True " ] || fail "web pods not Ready under the policy: $ready"
	eps=$(kc get endpoints -n "$NS" web -o jsonpath='{.subsets[*].addresses[*].ip}' | wc -w)
	[ "$eps" -eq 2 ] || fail "the Service lost backends under the policy: $eps"
	# Refused by the datapath (drop_policy, counted on the sender's veth) or by the rules.
	drops=$(($(counter "$c" "drop_policy") + $(metrics | awk -v pod="$a" '/^xdpcni_policy_drop_packets_total\{/ && index($0, "pod=\"" pod "\"") && /direction="ingress"/ { s += $NF } END { print s + 0 }')))
	[ "$drops" -gt 0 ] || fail "no refusal counted for $c -> $a"
	kc delete -f "$M/netpol.yaml" >/dev/null
	kc label -n "$NS" pod "$c" role- >/dev/null
	wait_mode "$a" "$DEFAULT_MODE" && wait_mode "$b" "$DEFAULT_MODE" || return 1
	echo "in force ${ms} ms after kubectl apply, web pods on $DEFAULT_MODE with the policy in the datapath: the Service refused to an unlabelled client, 20/20 for role=allowed ($(echo "$out" | tr '\n' ' ')) on the fast path ($((fast1 - fast0)) packets redirected), $a:9090 refused; web pods Ready (kubelet probes), 2 endpoints; $drops refusals counted"
}
c_netpol_hostport() {
	local c out
	c=$(pods_of client)
	kc apply -f "$M/netpol-hostport.yaml" >/dev/null || return 1
	refused_within "$c" "$NODE_IP" 30080 50 || fail "$NODE_IP:30080 still reaches a pod closed by a policy"
	kc delete -f "$M/netpol-hostport.yaml" >/dev/null
	out=$(reached_within "$c" "$NODE_IP" 30080 5) || fail "$NODE_IP:30080 not back after the policy went: $out"
	echo "$NODE_IP:30080 refused while a deny-all policy selects the pod (portmap's DNAT leads into its rules), back when it goes"
}
# xdpcni-agent status the way the chart's NOTES say (kubectl exec into the
# agent): a pod in each mode, and the web pods a NetworkPolicy isolates on the
# fast path with the policy in the datapath, each with its reason, in the
# table and in the JSON.
c_status_tool() {
	local a b m json table line
	read -r a b <<<"$(pods_of web)"
	for m in native generic off; do
		sed "s/name: victim/name: st-$m/" "$M/victim.yaml" | kc apply -f - >/dev/null || return 1
	done
	for m in native generic off; do
		kc wait -n "$NS" --for=condition=Ready "pod/st-$m" --timeout=60s >/dev/null || fail "st-$m not Ready"
		kc annotate -n "$NS" pod "st-$m" "xdpcni.io/xdp-mode=$m" --overwrite >/dev/null || return 1
	done
	kc apply -f "$M/netpol.yaml" >/dev/null || return 1
	for m in native generic off; do wait_mode "st-$m" "$m" || return 1; done
	wait_mode "$a" "$DEFAULT_MODE" && wait_mode "$b" "$DEFAULT_MODE" || return 1
	json=$(status_of -o json) || fail "status -o json failed: $json"
	STATUS_JSON=$json python3 - "$NS" "$a" "$b" "$DEFAULT_MODE" <<'PY' || fail "status -o json: $json"
import json, os, sys
ns, a, b, default = sys.argv[1:]
s = json.loads(os.environ["STATUS_JSON"])
assert s["ready"] and s["agentMode"] == "kubernetes", (s["ready"], s["agentMode"])
assert s["datapath"]["layout"] >= 2 and all(p["id"] > 0 for p in s["datapath"]["programs"]), s["datapath"]
assert f"{ns}/web-from-allowed" in s["policies"]["inForce"], s["policies"]
pods = {(p["namespace"], p["name"]): p for p in s["pods"]}
want = {
    "st-native": ("native", "annotation"), "st-generic": ("generic", "annotation"),
    "st-off": ("off", "annotation"), a: (default, "node-default"), b: (default, "node-default"),
}
for name, (mode, code) in want.items():
    p = pods[(ns, name)]
    assert (p["mode"], p["why"]["code"]) == (mode, code), (name, p["mode"], p["why"])
    assert p["ips"] and p["hostVeth"].startswith("xdp"), p
assert f"NetworkPolicy {ns}/web-from-allowed enforced in the datapath" in pods[(ns, a)]["why"]["text"], pods[(ns, a)]["why"]
PY
	table=$(status_of) || fail "status failed: $table"
	for m in native generic off; do
		line=$(grep "^$NS/st-$m " <<<"$table") || fail "no line for st-$m: $table"
		grep -q " $m .*annotation xdpcni.io/xdp-mode=$m\$" <<<"$line" || fail "st-$m: $line"
	done
	line=$(grep "^$NS/$a " <<<"$table") || fail "no line for $a: $table"
	grep -q " $DEFAULT_MODE .*fast path, NetworkPolicy $NS/web-from-allowed enforced in the datapath\$" <<<"$line" || fail "$a: $line"
	grep -q "^Agent: .*(kubernetes), node .*, ready" <<<"$table" || fail "no node summary: $table"
	kc delete -f "$M/netpol.yaml" >/dev/null
	kc delete -n "$NS" pod st-native st-generic st-off --wait=true --timeout=60s >/dev/null
	wait_mode "$a" "$DEFAULT_MODE" || return 1
	echo "$(grep -c "^$NS/" <<<"$table") pods listed; native, generic, off by annotation and $a, $b on $DEFAULT_MODE with $NS/web-from-allowed enforced in the datapath, in the table and the JSON"
}
# Pods created at once: for each, from its CNI ADD (its record written) to
# its fast path (XDP attached by the agent), p50/p99.
c_attach_latency() {
	local out
	in_node python3 - "$STATE_DIR" 12 "$PIN_DIR" >"$W/attach.out" 2>&1 <<'PY' &
import json, os, subprocess, sys, time
d, n, pins = sys.argv[1], int(sys.argv[2]), sys.argv[3]
before, pending, seen, took = set(os.listdir(d)), {}, set(), []
deadline = time.time() + 120
while len(took) < n and time.time() < deadline:
    for f in os.listdir(d):
        if not f.endswith(".json") or f in before or f in pending or f in seen:
            continue
        p = os.path.join(d, f)
        try:
            r, t = json.load(open(p)), os.stat(p).st_mtime_ns
        except (OSError, ValueError):
            continue
        if r.get("podName", "").startswith("burst-"):
            pending[f] = (t, r["hostVeth"])
    if pending:
        # On the fast path: its link pinned (XDP or tc; pinned at once
        # after the attach), or XDP as netlink reports it.
        links = json.loads(subprocess.run(["ip", "-d", "-j", "link", "show"], capture_output=True).stdout)
        pinned = set(os.listdir(os.path.join(pins, "links")))
        on = {l["ifname"] for l in links if "xdp" in l or
              any(f"{l['ifindex']}_{m}" in pinned for m in ("native", "generic", "tc"))}
        now = time.time_ns()
        for f, (t, veth) in list(pending.items()):
            if veth in on:
                took.append((now - t) / 1e6)
                seen.add(f)
                del pending[f]
    time.sleep(0.005)
took.sort()
if len(took) < n:
    print(f"only {len(took)} of {n} pods attached in time")
    sys.exit(1)
print(f"{n} pods: CNI ADD -> fast path p50 {took[n // 2]:.0f} ms, p99 {took[-1]:.0f} ms")
PY
	local poller=$!
	sleep 0.5
	kc apply -f "$M/burst.yaml" >/dev/null || return 1
	wait "$poller" || fail "$(cat "$W/attach.out")"
	out=$(cat "$W/attach.out")
	kc delete -f "$M/burst.yaml" --wait=true --timeout=60s >/dev/null
	echo "$out"
}
c_forward_rule() {
	local a b ip i t0 ms rule
	read -r a b <<<"$(pods_of web)"
	ip=$(pod_ip "$b")
	rule=(FORWARD -d "$ip" -p tcp --dport 7 -j DROP)
	t0=$(date +%s%N)
	in_node iptables -I "${rule[@]}" || return 1
	for i in $(seq 1 150); do
		if [ "$(mode_of "$b")" = off ] &&
			kc get events -n "$NS" --field-selector "involvedObject.name=$b" -o jsonpath='{range .items[*]}{.reason}{"\n"}{end}' 2>/dev/null |
			grep -q XdpcniKernelOnly; then
			ms=$((($(date +%s%N) - t0) / 1000000))
			in_node iptables -D "${rule[@]}"
			for i in $(seq 1 150); do
				if [ "$(mode_of "$b")" = "$DEFAULT_MODE" ]; then
					echo "$b kernel-only with an XdpcniKernelOnly Event ${ms} ms after a FORWARD rule naming $ip (rules read every 10 s); back to $DEFAULT_MODE when it goes"
					return 0
				fi
				sleep 0.2
			done
			fail "$b not back to $DEFAULT_MODE 30 s after the FORWARD rule went"
		fi
		sleep 0.2
	done
	in_node iptables -D "${rule[@]}"
	fail "$b: mode $(mode_of "$b"), no XdpcniKernelOnly Event 30 s after a FORWARD rule naming $ip"
}
c_delete() {
	local rec ip veth ifindex i
	kc apply -f "$M/victim.yaml" >/dev/null || return 1
	kc wait -n "$NS" --for=condition=Ready pod/victim --timeout=60s >/dev/null || fail "victim not Ready"
	wait_mode victim "$DEFAULT_MODE" || return 1
	rec=$(record_of victim) || fail "no record for victim"
	ip=$(pod_ip victim)
	veth=$(record_field "$rec" hostVeth)
	ifindex=$(record_field "$rec" hostIfindex)
	ls "$PIN_DIR"/links/"${ifindex}"_* >/dev/null 2>&1 || fail "no link pin for $veth ($ifindex)"
	kc delete -n "$NS" pod victim --wait=true --timeout=60s >/dev/null || fail "delete timed out"
	for i in $(seq 1 50); do
		if ! in_node ip link show "$veth" >/dev/null 2>&1 && [ ! -e "$rec" ] && [ ! -e "/var/lib/cni/networks/xdpcni/$ip" ] &&
			! ls "$PIN_DIR"/links/"${ifindex}"_* >/dev/null 2>&1 && ! grep -q 'pod="victim"' <<<"$(metrics)"; then
			echo "veth $veth, IP $ip, record, link pin and metrics series gone"
			return 0
		fi
		sleep 0.2
	done
	in_node ip link show "$veth" >/dev/null 2>&1 && echo "veth $veth still there"
	[ -e "$rec" ] && echo "record $rec still there"
	[ -e "/var/lib/cni/networks/xdpcni/$ip" ] && echo "IP $ip still allocated"
	ls "$PIN_DIR"/links/"${ifindex}"_* 2>/dev/null
	grep -m3 'pod="victim"' <<<"$(metrics)"
	return 1
}
# Runs $2... in the network namespace of pod $1 ($netns: its path) from the
# node, in the background, so that its PID (BG_PID) is ours to end: a
# watcher of something of unknown length (a roll) is ended by SIGINT when
# that is over (timeout(1) passes the signal on and bounds it at 15 min),
# and the check's exit kills whatever is left.
BG_PIDS=""
in_pod_bg() {
	local netns=$1
	shift
	timeout 900 nsenter --net="$netns" "$@" &
	BG_PID=$!
	BG_PIDS="$BG_PIDS $BG_PID"
	trap 'kill $BG_PIDS 2>/dev/null' EXIT
}
# Ends a ping started by in_pod_bg (PID $1, output in $2), which must still
# be running (else it watched less than it should); prints "sent received".
ping_end() {
	kill -0 "$1" 2>/dev/null || fail "the ping ended before what it watched: $(cat "$2")"
	kill -INT "$1"
	wait "$1"
	awk '/packets transmitted/ { print $1, $4 }' "$2"
}
# A 10 ms ping from web pod a to b for as long as $@ runs; prints "sent received".
ping_during() {
	local a b ip netns
	read -r a b <<<"$(pods_of web)"
	ip=$(pod_ip "$b")
	netns=$(pod_netns "$a") || fail "no netns in the record of $a"
	in_pod_bg "$netns" ping -q -i 0.01 -W 1 "$ip" >"$W/ping.out" 2>&1
	local ping_pid=$BG_PID
	sleep 1
	"$@" || return 1
	sleep 1
	ping_end "$ping_pid" "$W/ping.out"
}
# --- routing between nodes (docs/install.md, "Between nodes") ------------------
node0_mtu() { in_node ip -o link show node0 | sed -n 's/.* mtu \([0-9]*\) .*/\1/p'; }
conf_mtu() { in_node python3 -c 'import json; print(json.load(open("/etc/cni/net.d/10-xdpcni.conflist"))["plugins"][0]["mtu"])'; }
vtep() { kc get node "$NODE_NAME" -o jsonpath='{.metadata.annotations.xdpcni\.io/vtep}'; }
no_vtep() { [ -z "$(vtep)" ]; }
no_device() { ! in_node ip link show xdpcni.vxlan >/dev/null 2>&1; }
restarts() { kc get pods -n "$NS" -o jsonpath='{range .items[*]}{.metadata.name}={.status.containerStatuses[0].restartCount} {end}'; }
set_routing() {
	helm_ upgrade xdpcni "$REPO/charts/xdpcni" --namespace kube-system --reuse-values --set routing.mode="$1" >/dev/null || return 1
	kc rollout status -n kube-system ds/xdpcni-agent --timeout=120s >/dev/null
}
c_routing() {
	local d under before s sent recv s2
	d=$(in_node ip -d link show xdpcni.vxlan) || fail "no xdpcni.vxlan on the node (routing.mode vxlan is the default)"
	grep -q "vxlan id 1 local $NODE_IP dev node0" <<<"$d" || fail "the device: $d"
	grep -q "\"address\":\"$NODE_IP\"" <<<"$(vtep)" || fail "the Node's xdpcni.io/vtep: '$(vtep)'"
	under=$(node0_mtu)
	before=$(restarts)
	s=$(ping_during set_routing hostGateway) || fail "helm upgrade to hostGateway: $s"
	read -r sent recv <<<"$s"
	[ -n "$sent" ] && [ "$sent" = "$recv" ] || fail "10 ms ping during the upgrade to hostGateway: sent/received $s"
	wait_for 10 no_vtep || fail "the VTEP annotation stayed: $(vtep)"
	wait_for 20 no_device || fail "xdpcni.vxlan stayed in hostGateway"
	[ "$(conf_mtu)" = "$under" ] || fail "pod MTU $(conf_mtu) in hostGateway, not node0's $under"
	s2=$(ping_during set_routing vxlan) || fail "helm upgrade back to vxlan: $s2"
	read -r sent recv <<<"$s2"
	[ -n "$sent" ] && [ "$sent" = "$recv" ] || fail "10 ms ping during the upgrade to vxlan: sent/received $s2"
	wait_for 10 vtep_published || fail "no VTEP annotation after the upgrade back: '$(vtep)'"
	in_node ip -d link show xdpcni.vxlan >/dev/null 2>&1 || fail "no device after the upgrade back"
	[ "$(conf_mtu)" = $((under - 50)) ] || fail "pod MTU $(conf_mtu) back in vxlan"
	[ "$(restarts)" = "$before" ] || fail "pods restarted: before $before, after $(restarts)"
	echo "vxlan (device on node0, VTEP on the Node, pod MTU $((under - 50))) -> hostGateway (VTEP and device gone, MTU $under) -> vxlan, by helm upgrade; 10 ms ping $s then $s2 received/sent; no pod restarted"
}
vtep_published() { grep -q "\"address\":\"$NODE_IP\"" <<<"$(vtep)"; }
agent_pod() { kc get pods -n kube-system -l app.kubernetes.io/name=xdpcni -o jsonpath='{.items[0].metadata.name}'; }
roll_agent() {
	local old
	old=$(agent_pod)
	helm_ upgrade xdpcni "$REPO/charts/xdpcni" --namespace kube-system --reuse-values --set agent.logLevel=debug >/dev/null || return 1
	kc rollout status -n kube-system ds/xdpcni-agent --timeout=120s >/dev/null || return 1
	[ "$(agent_pod)" != "$old" ] || fail "the agent pod was not replaced"
}
c_rollout() {
	local s
	s=$(ping_during roll_agent) || fail "rollout failed: $s"
	read -r sent recv <<<"$s"
	[ -n "$sent" ] && [ "$sent" = "$recv" ] || fail "10 ms ping during the rollout: sent/received $s"
	echo "helm upgrade rolled the agent; 10 ms ping: $recv/$sent received"
}
# --- the previous release and back (docs/upgrades.md) -------------------------
# This build's datapath layout (ebpf/include/xdpcni.h) and the previous
# release's, which it migrates from.
THIS_LAYOUT=$(sed -n 's/^#define XDPCNI_LAYOUT \([0-9]*\)$/\1/p' "$REPO/ebpf/include/xdpcni.h")
PREV_LAYOUT=$((THIS_LAYOUT - 1))
# The layout of the datapath in use, from the agent's xdpcni_datapath_info
# (a release before layouts had a number has no such metric: "1" then).
layout_in_use() {
	local l
	l=$(metrics | sed -n 's/^xdpcni_datapath_info{.*layout="\([0-9]*\)".*} 1$/\1/p' | sed -n 1p)
	echo "${l:-1}"
}
# A pod created while the agent is being replaced ($1: its name) must get
# its network: Ready, reached from web pod a.
roll_pod() {
	sed "s/name: victim/name: $1/" "$M/victim.yaml" | kc apply -f - >/dev/null
}
roll_pod_reached() {
	local a ip
	kc wait -n "$NS" --for=condition=Ready "pod/$1" --timeout=90s >/dev/null || fail "pod $1, created during the roll, not Ready"
	read -r a _ <<<"$(pods_of web)"
	ip=$(pod_ip "$1")
	x "$a" podtool greet "$ip" 8080 3 >/dev/null || fail "pod $1, created during the roll, not reached"
	kc delete -n "$NS" pod "$1" --wait=true --timeout=60s >/dev/null
}
# helm upgrade to chart $1 with image tag $2 (values reset to the chart's
# defaults but the image), a pod created during the roll; $3: the layout
# the new agent must report.
to_release() {
	local old=$(agent_pod)
	helm_ upgrade xdpcni "$1" --namespace kube-system --reset-values --set image.repository=localhost/xdpcni \
		--set image.tag="$2" --set image.pullPolicy=Never >/dev/null || fail "helm upgrade to $1 ($2)"
	roll_pod "roll-$2-$3"
	kc rollout status -n kube-system ds/xdpcni-agent --timeout=180s >/dev/null || fail "rollout to $2"
	[ "$(agent_pod)" != "$old" ] || fail "the agent pod was not replaced"
	[ "$(layout_in_use)" = "$3" ] || fail "after the roll to $2: datapath layout $(layout_in_use), wanted $3"
	roll_pod_reached "roll-$2-$3"
}
# Installs the previous release from scratch (uninstalled first: its agent
# pins a datapath of its own layout), and remakes the web pods through its
# plugin, attached by its agent.
install_previous() {
	helm_ uninstall xdpcni --namespace kube-system --wait >/dev/null || fail "helm uninstall"
	for _ in $(seq 1 100); do
		[ -z "$(kc get pods -n kube-system -l app.kubernetes.io/name=xdpcni -o name)" ] && break
		sleep 0.3
	done
	in_node /opt/cni/bin/xdpcni uninstall >/dev/null 2>&1 || fail "xdpcni uninstall"
	helm_ install xdpcni "$PREV_SRC/charts/xdpcni" --namespace kube-system --set image.repository=localhost/xdpcni \
		--set image.tag=previous --set image.pullPolicy=Never >/dev/null || fail "helm install of the previous release"
	kc rollout status -n kube-system ds/xdpcni-agent --timeout=180s >/dev/null || fail "the previous release's agent"
	kc rollout restart -n "$NS" deployment/web >/dev/null
	kc rollout status -n "$NS" deployment/web --timeout=180s >/dev/null || fail "web pods remade by the previous release"
	for _ in $(seq 1 200); do # the old ones gone
		[ "$(pods_of web | wc -w)" = 2 ] && break
		sleep 0.3
	done
	[ "$(pods_of web | wc -w)" = 2 ] || fail "web pods: $(pods_of web)"
	# Modes by annotation: the previous release's node default (generic)
	# is not this one's (tc), and a roll must change no annotated pod's mode.
	local p
	# shellcheck disable=SC2046 # one word per pod
	kc annotate -n "$NS" pod $(pods_of web) --overwrite xdpcni.io/xdp-mode=generic >/dev/null
	for p in $(pods_of web); do wait_mode "$p" generic || return 1; done
	[ "$(layout_in_use)" = "$PREV_LAYOUT" ] || fail "the previous release runs layout $(layout_in_use)"
	[ -e "$PIN_DIR/layout-$PREV_LAYOUT/meta" ] && [ ! -e "$PIN_DIR/layout-$THIS_LAYOUT" ] || fail "no layout $PREV_LAYOUT datapath of its own: $(ls "$PIN_DIR")"
}
across_releases() {
	local before
	before=$(web_modes)
	to_release "$REPO/charts/xdpcni" dev "$THIS_LAYOUT"
	[ -e "$PIN_DIR/layout-$THIS_LAYOUT/meta" ] || fail "no layout $THIS_LAYOUT after the upgrade"
	[ "$(web_modes)" = "$before" ] || fail "modes changed across the upgrade: $before -> $(web_modes)"
	# helm rollback: to the previous revision, the previous release.
	local old=$(agent_pod)
	helm_ rollback xdpcni --namespace kube-system >/dev/null || fail "helm rollback"
	roll_pod roll-rollback
	kc rollout status -n kube-system ds/xdpcni-agent --timeout=180s >/dev/null || fail "rollout of the rollback"
	[ "$(agent_pod)" != "$old" ] || fail "the rollback did not replace the agent pod"
	[ "$(layout_in_use)" = "$PREV_LAYOUT" ] || fail "after the rollback: layout $(layout_in_use)"
	roll_pod_reached roll-rollback
	[ "$(web_modes)" = "$before" ] || fail "modes changed across the rollback: $before -> $(web_modes)"
	to_release "$REPO/charts/xdpcni" dev "$THIS_LAYOUT"
	[ "$(web_modes)" = "$before" ] || fail "modes changed across the second upgrade: $before -> $(web_modes)"
}
web_modes() { local p; for p in $(pods_of web); do printf '%s=%s ' "$p" "$(mode_of "$p")"; done; }
c_previous_release() {
	local a b ip netns sent recv
	[ -n "${PREV_SRC:-}" ] && [ -d "$PREV_SRC/charts/xdpcni" ] || fail "no previous release tree (up.sh writes PREV_SRC)"
	install_previous || return 1
	read -r a b <<<"$(pods_of web)"
	ip=$(pod_ip "$b")
	netns=$(pod_netns "$a") || fail "no netns in the record of $a"
	# A TCP stream and a 10 ms ping from a to b for as long as the three
	# rolls take (both report when SIGINT ends them).
	in_pod_bg "$netns" "$REPO/target/release/podtool" stream "$ip" 9090 900 >"$W/stream.out" 2>&1
	local stream_pid=$BG_PID
	in_pod_bg "$netns" ping -q -i 0.01 -W 1 "$ip" >"$W/ping-prev.out" 2>&1
	local ping_pid=$BG_PID
	sleep 1
	local t0=$SECONDS
	across_releases || return 1
	local rolls=$((SECONDS - t0))
	sleep 1
	kill -0 "$stream_pid" 2>/dev/null || fail "the TCP stream ended during the rolls: $(cat "$W/stream.out")"
	ping_end "$ping_pid" "$W/ping-prev.out" >"$W/ping-prev.sum" # not in $(): wait needs its parent
	read -r sent recv <"$W/ping-prev.sum"
	kill -INT "$stream_pid"
	wait "$stream_pid" || fail "the TCP stream broke: $(cat "$W/stream.out")"
	[ -n "$sent" ] && [ "$sent" -gt $((rolls * 50)) ] || fail "10 ms ping across the releases: only ${sent:-0} sent in $rolls s: $(cat "$W/ping-prev.out")"
	[ "$sent" = "$recv" ] || fail "10 ms ping across the releases: sent/received $sent $recv"
	echo "helm install of the previous release ($(grep -v '^#' "$REPO/e2e/k8s/PREVIOUS_RELEASE"), layout $PREV_LAYOUT) -> helm upgrade to this (layout $THIS_LAYOUT, migrated) -> helm rollback -> upgrade again: 10 ms ping $recv/$sent, TCP stream $(tr '\n' ' ' <"$W/stream.out"), three rolls in $rolls s, modes $(web_modes), a pod created in each roll reached"
}

xdp_ids() { in_node ip -o link show | grep -oE '^[0-9]+: [^:@]+|prog/xdp id [0-9]+' | paste -sd' '; }
kill_agent() {
	local pid restarts
	restarts=$(kc get pod -n kube-system "$(agent_pod)" -o jsonpath='{.status.containerStatuses[0].restartCount}')
	pid=$(pgrep -o -f '^/usr/local/bin/xdpcni-agent run')
	[ -n "$pid" ] || fail "no agent process"
	kill -KILL "$pid"
	for _ in $(seq 1 100); do
		now=$(kc get pod -n kube-system "$(agent_pod)" -o jsonpath='{.status.containerStatuses[0].restartCount}')
		ready=$(kc get pod -n kube-system "$(agent_pod)" -o jsonpath='{.status.containerStatuses[0].ready}')
		[ "$now" -gt "$restarts" ] && [ "$ready" = true ] && return 0
		sleep 0.3
	done
	fail "kubelet did not restart the agent (restarts $restarts -> $now, ready $ready)"
}
c_kill_agent() {
	local before after s
	before=$(xdp_ids)
	s=$(ping_during kill_agent) || fail "$s"
	read -r sent recv <<<"$s"
	after=$(xdp_ids)
	[ -n "$sent" ] && [ "$sent" = "$recv" ] || fail "10 ms ping across the kill: sent/received $s"
	[ "$before" = "$after" ] || fail "XDP attachments changed: $before / $after"
	echo "agent SIGKILLed and restarted by the kubelet; 10 ms ping $recv/$sent; XDP programs unchanged"
}
c_uninstall() {
	local left=""
	kc delete ns "$NS" --wait=true --timeout=120s >/dev/null || fail "deleting $NS timed out"
	helm_ uninstall xdpcni --namespace kube-system --wait >/dev/null || return 1
	for _ in $(seq 1 100); do
		[ -z "$(kc get pods -n kube-system -l app.kubernetes.io/name=xdpcni -o name)" ] && break
		sleep 0.3
	done
	# On the node (its network namespace: the policy table is there).
	in_node /opt/cni/bin/xdpcni uninstall >"$W/uninstall.out" 2>&1 || fail "xdpcni uninstall: $(cat "$W/uninstall.out")"
	grep -q "NetworkPolicy table" "$W/uninstall.out" || fail "xdpcni uninstall did not remove the policy table: $(cat "$W/uninstall.out")"
	grep -q ' xdp' <<<"$(in_node ip -o link show)" && left="$left XDP-on-$(in_node ip -o link show | grep ' xdp' | cut -d: -f2)"
	[ -e "$PIN_DIR" ] && left="$left $PIN_DIR"
	[ -e /etc/cni/net.d/10-xdpcni.conflist ] && left="$left conflist"
	for b in xdpcni host-local portmap loopback; do [ -e "/opt/cni/bin/$b" ] && left="$left /opt/cni/bin/$b"; done
	[ -e "$STATE_DIR" ] && left="$left $STATE_DIR"
	grep -q 'inet xdpcni' <<<"$(in_node nft list tables 2>/dev/null)" && left="$left the-nftables-table-inet-xdpcni"
	no_device || left="$left the-VXLAN-device"
	[ -z "$(in_node ip route show proto 90)" ] || left="$left routes-of-proto-90"
	[ -z "$left" ] || fail "left on the node:$left"
	echo "no XDP program, pin, nftables table, VXLAN device, node route, conflist, plugin binary or state left ($(wc -l <"$W/uninstall.out") lines from xdpcni uninstall)"
}

check "install-cni wrote the conflist and the plugins" c_install_cni
check "the node turned Ready" c_node_ready
check "the agent pod is Running and ready" c_agent_ready
check "CNI STATUS answers success" c_status
check "Deployment pods got addresses from the node's podCIDR" c_pods
check "pod-to-pod ping/UDP/TCP in the node default mode, redirect counters moving" c_default_mode
check "pods created at once: from CNI ADD to the fast path" c_attach_latency
check "annotate native/devmap under a TCP stream" switch_under_load native devmap redirect_devmap
# Generic is a hybrid: the stream's GSO super-packets go to the kernel (pass_gso).
check "annotate generic/devmap under a TCP stream" switch_under_load generic devmap 'redirect_devmap|pass_gso'
check "annotate native/cpumap under a TCP stream" switch_under_load native cpumap redirect_cpumap
# tc: the same decisions on tcx ingress, super-packets and all redirected to the peer.
check "annotate tc under a TCP stream, and back, with no lost 10 ms ping" c_tc_switch
check "annotate off under a TCP stream" switch_under_load off devmap 'redirect_.*|pass_.*'
check "an invalid annotation value becomes an Event, the pod keeps its network" c_bad_annotation
check "a ClusterIP Service 100 times in a row, translated at the socket; streams through it and to a backend's port >= 99% on the fast path" c_service
check "the socket's translation and kube-proxy agree: the same backends from a pod and from the node, ClientIP affinity, UDP, an empty Service refused to both, hairpin left to kube-proxy" c_service_equiv
check "Services labelled service-proxy-name or headless: served by neither kube-proxy nor the translation" c_service_labels
check "the cluster DNS: Services by name (short, namespaced, full) to their cluster IP, connects by name translated, a headless Service to its pods" c_cluster_dns
check "a connected UDP socket whose only backend is replaced reaches the new one, from a pod (closed once, translated) and from the node (kube-proxy)" c_udp_backend_replaced
check "a NodePort from outside served at the uplink by services.northSouthDevices (helm upgrade), the status naming it, kube-proxy's again without it" c_north_south
check "a flow DNAT'd by an iptables rule takes the kernel path both ways" c_dnat
check "a hostPort pod through portmap, reached on the node address" c_hostport
check "a NetworkPolicy is enforced, through the Service too; kubelet probes pass" c_netpol
check "a NetworkPolicy closes a hostPort pod, portmap's DNAT included" c_netpol_hostport
check "xdpcni-agent status (kubectl exec): each pod's mode and why, table and JSON" c_status_tool
check "a FORWARD rule naming a pod makes it kernel-only, with an Event" c_forward_rule
check "deleting a pod removes its veth, IP, record, pin and metrics" c_delete
check "helm upgrade rolls the agent with no lost 10 ms ping" c_rollout
check "routing.mode vxlan -> hostGateway -> vxlan by helm upgrade: device, VTEP and pod MTU follow, no lost 10 ms ping, no pod restarted" c_routing
check "helm install of the previous release, upgrade to this one, rollback, upgrade again: no lost 10 ms ping, the TCP stream alive" c_previous_release
check "a killed agent: traffic flows, the kubelet restarts it, nothing changes" c_kill_agent
check "helm uninstall and xdpcni uninstall leave nothing on the node (the policy table included)" c_uninstall
echo "checks: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
