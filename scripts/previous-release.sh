#!/usr/bin/env bash
# Builds the previous release (the commit named in e2e/k8s/PREVIOUS_RELEASE)
# from this clone's history and prints the directory holding its release
# binaries (xdpcni, xdpcni-agent): what the upgrade and migration tests run
# as "the old version". Cached by commit in $XDPCNI_PREVIOUS_CACHE (default
# /var/cache/xdpcni-previous): a few minutes the first time, nothing after.
# With --image, builds its image too (its own scripts/image.sh, tag
# localhost/xdpcni:previous) and prints the directory holding xdpcni.tar.
# Progress goes to stderr; the only line on stdout is the directory.
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/.."
image=""
[ "${1:-}" = "--image" ] && image=yes
commit=$(grep -v '^#' e2e/k8s/PREVIOUS_RELEASE | tr -d '[:space:]')
[ -n "$commit" ] || { echo "previous-release.sh: e2e/k8s/PREVIOUS_RELEASE names no commit" >&2; exit 1; }
step "previous release $commit: resolve it in this clone's history"
full=$(git rev-parse --verify --quiet "$commit^{commit}") || {
	echo "previous-release.sh: commit $commit is not in this clone's history (a shallow clone? git fetch --unshallow)" >&2
	exit 1
}
D=${XDPCNI_PREVIOUS_CACHE:-/var/cache/xdpcni-previous}/$full
mkdir -p "$D"
# One build at a time (tests may ask at once); the others wait for it.
exec 9>"$D.lock"
flock 9
if [ -x "$D/bin/xdpcni" ] && [ -x "$D/bin/xdpcni-agent" ]; then
	if [ -z "$image" ]; then
		echo "$D/bin"
		exit 0
	fi
	if [ -s "$D/images/xdpcni.tar" ]; then
		echo "$D/images"
		exit 0
	fi
else
	build=yes
fi
if [ -n "${build:-}" ]; then
	step "previous release $commit: unpack its tree into $D/src"
	rm -rf "$D/src" "$D/bin"
	mkdir -p "$D/src" "$D/bin" "$D/target"
	git archive "$full" | tar -x -C "$D/src"
	# Its scripts name target/ relative to its tree: the cache's.
	ln -sfn "$D/target" "$D/src/target"
	step "previous release $commit: cargo build --release (agent, plugin; log: $D/build.log)"
	if ! (cd "$D/src" && cargo build --release --locked -p xdpcni-agent -p xdpcni-plugin --bin xdpcni-agent --bin xdpcni) >"$D/build.log" 2>&1; then
		tail -20 "$D/build.log" >&2
		echo "previous-release.sh: building $commit failed (log: $D/build.log)" >&2
		exit 1
	fi
	install -m 0755 "$D/target/release/xdpcni" "$D/target/release/xdpcni-agent" "$D/bin/"
fi
if [ -z "$image" ]; then
	echo "$D/bin"
	exit 0
fi
[ -e "$D/src/target" ] || ln -sfn "$D/target" "$D/src/target"
step "previous release $commit: its image localhost/xdpcni:previous (its scripts/image.sh; log: $D/image.log)"
if ! (cd "$D/src" && OUT="$D/images.new" XDPCNI_IMAGE_TAG=previous bash scripts/image.sh) >"$D/image.log" 2>&1; then
	tail -20 "$D/image.log" >&2
	echo "previous-release.sh: building the image of $commit failed (log: $D/image.log)" >&2
	exit 1
fi
rm -rf "$D/images"
mv "$D/images.new" "$D/images"
echo "$D/images"
