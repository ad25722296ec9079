#!/usr/bin/env bash
# Brokers side by side, interleaved (A B [C] A B [C] ...), with one bench binary: the CPU
# throughput (32 workers, 2 MiB acquire+release pairs) and the pooled acquire/release
# latency of one worker, each on a started host-backend broker. Prints every run as JSON
# and the medians and the ratios to A at the end.
#
#   ROUNDS=5 OUT=dir scripts/bench-ab.sh BENCH BROKER_A BROKER_B [BROKER_C ... up to H]
#
# ROUNDS (default 5) throughput runs of each broker (3 s window, 1 s warm-up), then
# ROUNDS latency runs of each (2,000 pairs of 2 MiB, current-thread client).
set -euo pipefail
bench=$1
shift
brokers=("$@")
labels=(A B C D E F G H)
rounds=${ROUNDS:-5}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
log="$out/runs.jsonl"
: >"$log"
echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"

run() { # label broker args...
    local label=$1 broker=$2
    shift 2
    "$bench" --broker-bin "$broker" --broker-log warn --json "$@" 2>>"$out/stderr-$label.txt" |
        grep '^{' | sed "s/^{/{\"broker\":\"$label\",/" >>"$log"
}

for _ in $(seq "$rounds"); do
    for j in "${!brokers[@]}"; do
        run "${labels[$j]}" "${brokers[$j]}" throughput --duration 3s --warmup 1s --repeat 1
    done
done
for _ in $(seq "$rounds"); do
    for j in "${!brokers[@]}"; do
        run "${labels[$j]}" "${brokers[$j]}" --client-threads 1 latency --sizes 2MiB --repeat 1
    done
done
cat "$log"
python3 "$(dirname "$0")/bench-ab-summary.py" "$log"
