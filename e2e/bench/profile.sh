#!/usr/bin/env bash
# Where the CPU goes in one benchmark workload on one path: runs the bench
# filtered to them (--only/--path, one long repetition) under `perf record -a`
# and prints the top kernel symbols of each CPU. Root; perf from Debian.
#   e2e/bench/profile.sh "Pinned sender" "generic cpumap" [SECS [SYMBOL_REGEX]]
# With SYMBOL_REGEX, also the total share of the symbols matching it. With
# XDPCNI_PROFILE_PROG=NAME (e.g. xdpcni_tc_from_pod), also where that BPF
# program's own samples fall by source line (e2e/bench/prog-lines.py).
set -Eeuo pipefail
workload=${1:?usage: profile.sh WORKLOAD PATH [SECS]}
path=${2:?usage: profile.sh WORKLOAD PATH [SECS]}
secs=${3:-15}
syms=${4:-}
cd "$(dirname "$0")/../.."
bench=target/release/bench
[[ -x $bench ]] || { echo "profile.sh: build first: cargo build --release --workspace --bins" >&2; exit 1; }
command -v perf >/dev/null || { echo "profile.sh: perf is missing (apt-get install linux-perf)" >&2; exit 1; }
out=$(mktemp -d /tmp/xdpcni-profile.XXXXXX)
"$bench" --reps 1 --secs "$secs" --only "$workload" --path "$path" --out "$out" >"$out/bench.out" 2>"$out/bench.err" &
pid=$!
# Skip the node setup: wait for the first measurement to start.
for _ in $(seq 600); do
    grep -q "nodes ready" "$out/bench.err" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { cat "$out/bench.err" >&2; exit 1; }
    sleep 0.1
done
sleep 1
prog=${XDPCNI_PROFILE_PROG:-}
if [[ -n $prog ]]; then
    e2e/bench/prog-lines.py snapshot "$prog" "$out/progs" ||
        { echo "profile.sh: could not read program $prog" >&2; kill -INT "$pid"; wait "$pid" || true; exit 1; }
fi
perf record -a -o "$out/perf.data" -- sleep $((secs - 3)) 2>"$out/perf.err" >/dev/null
wait "$pid"
grep -E "^\| " "$out/bench.out" | grep -v "^| workload\|^| ---" || true
for cpu in $(seq 0 $(($(nproc) - 1))); do
    echo "== CPU $cpu: top symbols (share of samples on this CPU)"
    perf report -i "$out/perf.data" --stdio --sort sym --cpu "$cpu" 2>&1 |
        grep -E "^ +[0-9]" | head -${XDPCNI_PROFILE_TOP:-15} || true
done
if [[ -n $syms ]]; then
    echo "== symbols matching /$syms/, share of all samples"
    perf report -i "$out/perf.data" --stdio --sort sym 2>&1 | grep -E "^ +[0-9]" |
        grep -E "$syms" | awk '{ s += $1; print } END { printf "   total %.2f%%\n", s }'
fi
rc=0
if [[ -n $prog ]]; then
    e2e/bench/prog-lines.py report "$out/perf.data" "$out/progs" "$prog" || rc=$?
fi
rm -rf "$out"
exit "$rc"
