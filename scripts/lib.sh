# Shared by the setup scripts (sourced, not run). Every script that sources it
# gets `set -euo pipefail` and an ERR trap that names the script, the line and
# the step that failed, so no setup step can end a run silently.
set -Eeuo pipefail
XDPCNI_STEP="start"
step() {
	XDPCNI_STEP=$*
	echo "${0##*/}: $XDPCNI_STEP" >&2
}
_xdpcni_err() {
	local rc=$? line=$1 cmd=$2
	echo "${0##*/}: FAILED (exit $rc) during step '$XDPCNI_STEP' at line $line: $cmd" >&2
}
trap '_xdpcni_err "$LINENO" "$BASH_COMMAND"' ERR

# Installs the Debian packages given that are not installed yet.
apt_install() {
	local need=() p
	for p in "$@"; do
		[[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == *"ok installed"* ]] || need+=("$p")
	done
	[ "${#need[@]}" -eq 0 ] && return 0
	step "apt-get install ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

# Prints the Debian mirror this machine's apt uses for the main archive, read
# from one-line (.list) and deb822 (.sources) files, comments and disabled
# stanzas ignored, security and updates archives skipped. Falls back to the
# default mirror when none is configured. XDPCNI_APT_ETC replaces /etc/apt
# (for the tests).
apt_mirror() {
	local etc=${XDPCNI_APT_ETC:-/etc/apt} files=() f
	for f in "$etc/sources.list" "$etc"/sources.list.d/*.list; do
		[ -f "$f" ] && files+=("$f")
	done
	{
		if [ "${#files[@]}" -gt 0 ]; then
			sed -e 's/#.*//' "${files[@]}" | awk '$1 == "deb" || $1 == "deb-src" {
				for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i, $(i + 1); break } }'
		fi
		for f in "$etc"/sources.list.d/*.sources; do
			[ -f "$f" ] || continue
			sed -e '/^[[:space:]]*#/d' "$f" | awk 'BEGIN { RS = ""; FS = "\n" } {
				uris = ""; suites = ""; enabled = "yes"
				for (i = 1; i <= NF; i++) {
					if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[[:space:]]*/, "", uris) }
					if ($i ~ /^Suites:/) { suites = $i; sub(/^Suites:[[:space:]]*/, "", suites) }
					if (tolower($i) ~ /^enabled:[[:space:]]*no/) enabled = "no"
				}
				if (enabled == "no") next
				n = split(uris, u, /[[:space:]]+/); m = split(suites, s, /[[:space:]]+/)
				for (a = 1; a <= n; a++) for (b = 1; b <= m; b++) if (u[a] != "") print u[a], s[b] }'
		done
	} | awk '$1 ~ /^https?:\/\// && $2 !~ /-(security|updates|backports)$/ && $1 !~ /security/ && !seen++ { print $1 }' |
		sed -e 's:/*$::' | grep . || echo http://deb.debian.org/debian
}

# Fails, naming the need and what is free, unless the filesystem holding $2
# has at least $1 GiB free; $3 says what the space is for. A build that runs
# out of disk dies in the linker with a signal, which says nothing of why.
need_disk() {
	local gib=$1 dir=$2 why=$3 free_k
	mkdir -p "$dir"
	free_k=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
	if [ "$free_k" -lt $((gib * 1024 * 1024)) ]; then
		echo "${0##*/}: $dir has $((free_k / 1024 / 1024)) GiB free; $why needs $gib GiB (free some disk, or point CARGO_TARGET_DIR elsewhere)" >&2
		return 1
	fi
}
