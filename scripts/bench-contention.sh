#!/usr/bin/env bash
# System calls per acquire+release pair of the broker under the 32-worker throughput mode
# (`strace -f -c`; the difference of a 2 s and a 6 s window, so the start and the set-up
# cancel out), brokers interleaved, ROUNDS rounds (default 2). Under load the counts of
# `futex` (threads parked on a contended lock, or woken) say how much the workers contend;
# strace slows the broker, so these are counts to compare side by side, not times.
#
#   ROUNDS=2 scripts/bench-contention.sh BENCH BROKER_A [BROKER_B ...]
set -euo pipefail
# shellcheck source=scripts/cost-common.sh
source "$(dirname "$0")/cost-common.sh"
bench=$1
shift
rounds=${ROUNDS:-2}
out=$(mktemp -d)
wrap=$out/wrap.sh
cost_wrapper "$wrap"

one() { # broker seconds -> "strace-file pairs"
    local file=$out/strace-$RANDOM$RANDOM pairs
    pairs=$(COST_TOOL=strace COST_BROKER=$1 COST_OUT=$file "$bench" --broker-bin "$wrap" \
        --broker-log warn --json throughput --duration "$2s" --warmup 0s --repeat 1 2>/dev/null |
        grep '^{' | grep -v summary | python3 -c 'import json,sys; print(sum(json.loads(l)["pairs"] for l in sys.stdin))')
    echo "$file $pairs"
}

echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
    for b in "$@"; do
        read -r s0 p0 < <(one "$b" 2)
        read -r s1 p1 < <(one "$b" 6)
        n=$((p1 - p0))
        { read -r calls; read -r top; } < <(cost_syscalls "$s0" "$s1" "$n")
        echo "$b round $r: $n pairs apart, $calls system calls/pair ($top)"
    done
done
rm -rf "$out"
