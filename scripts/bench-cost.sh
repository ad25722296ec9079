#!/usr/bin/env bash
# The broker's own cost per pooled acquire+release pair, in counts that a busy machine does
# not blur: user-space instructions (valgrind's callgrind) and system calls (strace -c),
# each the difference between a run of N+2000 pairs and one of N pairs (so the start, the
# tenant and the session cancel out), with the one-worker `latency` mode of one bench
# binary. Brokers interleaved, ROUNDS rounds (default 2). Needs valgrind and strace (for
# measurements only, not for the tests: `apt-get install valgrind strace`).
#
#   ROUNDS=2 scripts/bench-cost.sh BENCH BROKER_A [BROKER_B ...]
#
# Prints one line per broker and round: instructions/pair, system calls/pair, and those
# calls by name (at least 0.05 a pair). BASE_PAIRS (default 200): the shorter run.
set -euo pipefail
# shellcheck source=scripts/cost-common.sh
source "$(dirname "$0")/cost-common.sh"
bench=$1
shift
brokers=("$@")
rounds=${ROUNDS:-2}
base=${BASE_PAIRS:-200}
out=$(mktemp -d)
wrap=$out/wrap.sh
# The bench starts the broker through this wrapper.
cost_wrapper "$wrap"

one() { # tool broker pairs -> count
    local tool=$1 broker=$2 pairs=$3 file
    file=$out/$tool-$RANDOM$RANDOM
    COST_TOOL=$tool COST_BROKER=$broker COST_OUT=$file "$bench" --broker-bin "$wrap" \
        --broker-log warn --client-threads 1 latency --sizes 2MiB --iterations "$pairs" \
        --warmup 0 --repeat 1 >/dev/null 2>&1
    if [ "$tool" = callgrind ]; then
        cost_instructions "$file"
    else
        echo "$file"
    fi
}

echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
    for b in "${brokers[@]}"; do
        i0=$(one callgrind "$b" "$base")
        i1=$(one callgrind "$b" $((base + 2000)))
        s0=$(one strace "$b" "$base")
        s1=$(one strace "$b" $((base + 2000)))
        { read -r calls; read -r top; } < <(cost_syscalls "$s0" "$s1" 2000)
        echo "$b round $r: $(cost_per "$i0" "$i1" 2000) instructions/pair, $calls system calls/pair ($top)"
    done
done
rm -rf "$out"
