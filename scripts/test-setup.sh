#!/usr/bin/env bash
# Tests of the setup scripts' own logic (no root, no network): the apt
# mirror is read from deb822 and one-line sources, comments, disabled
# stanzas and security/updates archives ignored; a failing step names itself.
# Prints "setup scripts: N passed, N failed".
source "$(dirname "$0")/lib.sh"
set +e
trap - ERR
here=$(cd "$(dirname "$0")" && pwd)
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
pass=0
fails=0
expect() { # name, want, got
	if [ "$2" = "$3" ]; then
		pass=$((pass + 1))
	else
		fails=$((fails + 1))
		echo "FAIL $1: want [$2], got [$3]"
	fi
}
mirror_in() { XDPCNI_APT_ETC=$1 bash -c "source '$here/lib.sh'; apt_mirror"; }

# 1. A fresh Debian 12 image: deb822 only, a snapshot URL in a comment first.
mkdir -p "$t/a/sources.list.d"
cat >"$t/a/sources.list.d/debian.sources" <<'S'
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main
S
expect "deb822 only" http://mirror.example/debian "$(mirror_in "$t/a")"

# 2. One-line sources.list, comments and security first.
mkdir -p "$t/b/sources.list.d"
cat >"$t/b/sources.list" <<'S'
# deb http://commented.example/debian bookworm main
deb http://security.example/debian-security bookworm-security main
deb [arch=amd64 signed-by=/k.gpg] https://oneline.example/debian/ bookworm main
S
expect "one-line with options" https://oneline.example/debian "$(mirror_in "$t/b")"

# 3. A disabled stanza is skipped.
mkdir -p "$t/c/sources.list.d"
printf 'Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n\nTypes: deb\nURIs: http://on.example/debian\nSuites: bookworm\n' \
	>"$t/c/sources.list.d/x.sources"
expect "disabled stanza" http://on.example/debian "$(mirror_in "$t/c")"

# 4. Nothing configured: Debian's default mirror.
mkdir -p "$t/d"
expect "no sources" http://deb.debian.org/debian "$(mirror_in "$t/d")"

# 5. A failing step says which step and which command failed.
out=$(bash -c "source '$here/lib.sh'; step 'the step under test'; false; echo not reached" 2>&1)
rc=$?
expect "failing step exit status" 1 "$rc"
case $out in
*"FAILED (exit 1) during step 'the step under test'"*": false"*) pass=$((pass + 1)) ;;
*) fails=$((fails + 1)) && echo "FAIL failing step message: $out" ;;
esac

# 6. Too little disk: the step fails, naming the need and what is free.
out=$(bash -c "source '$here/lib.sh'; step 'the build'; need_disk 1000000 '$t/e' 'the build'; echo not reached" 2>&1)
rc=$?
expect "too little disk exit status" 1 "$rc"
case $out in
*"$t/e has "*" GiB free; the build needs 1000000 GiB"*"FAILED (exit 1) during step 'the build'"*) pass=$((pass + 1)) ;;
*) fails=$((fails + 1)) && echo "FAIL too little disk message: $out" ;;
esac
out=$(bash -c "source '$here/lib.sh'; need_disk 0 '$t/e' 'nothing' && echo enough" 2>&1)
expect "enough disk" enough "$out"

echo "setup scripts: $pass passed, $fails failed"
[ "$fails" -eq 0 ]
