#!/usr/bin/env bash
# The whole real-node test in one command (as root): starts the node
# (up.sh: Kubernetes 1.20.2, containerd, kube-proxy, helm install of the
# chart), runs the checks (checks.sh, one numbered line each), and tears it
# all down (down.sh) whether the checks passed or not. Ends with one line,
# "N passed, N failed" (a failed start or teardown counts as a failure).
here=$(cd "$(dirname "$0")" && pwd)
start=$SECONDS
up=0
bash "$here/up.sh" || up=$?
if [ "$up" -eq 0 ]; then
	bash "$here/checks.sh" | tee "${TMPDIR:-/tmp}/xdpcni-k8s-checks.$$"
	summary=$(tail -1 "${TMPDIR:-/tmp}/xdpcni-k8s-checks.$$")
	rm -f "${TMPDIR:-/tmp}/xdpcni-k8s-checks.$$"
else
	echo "run.sh: the node did not come up (exit $up): logs in target/k8s-logs"
	summary="checks: 0 passed, 1 failed"
fi
down=0
bash "$here/down.sh" || down=$?
p=$(echo "$summary" | awk '$1 == "checks:" { print $2 + 0 }')
f=$(echo "$summary" | awk '$1 == "checks:" { print $4 + 0 }')
if [ -z "$p" ]; then
	echo "run.sh: the checks ended without their summary line"
	p=0 f=1
fi
[ "$down" -eq 0 ] || { echo "run.sh: teardown failed (exit $down)"; f=$((f + 1)); }
echo "run.sh: $((SECONDS - start)) s in all"
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
