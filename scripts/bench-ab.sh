#!/usr/bin/env bash
# Brokers side by side, interleaved (A B [C] A B [C] ...), each run with one bench binary:
# the 32-worker throughput (2 MiB acquire+release pairs) and the pooled acquire/release
# latency of one worker, and with AB_BREAKDOWN=1 the breakdown of a pooled lease + map
# (health Check floor, AcquireLease RPC, ticket, map, raw baseline). Prints every run as
# JSON and the medians and the ratios to A at the end.
#
#   ROUNDS=5 OUT=dir scripts/bench-ab.sh BENCH ENTRY_A ENTRY_B [ENTRY_C ... up to H]
#
# An ENTRY is a broker binary (measured with BENCH) or OTHER_BENCH::BROKER (measured with
# that bench: a release's own client beside its broker, since the client's half of a lease
# changes too). AB_BACKEND=cuda starts each broker with the CUDA backend for every run (the
# GPU machine), and there BROKER may carry flags after the binary ("B::gpu-broker --flag");
# the default is a started host-backend broker. AB_JSON=0 leaves the runs'
# JSON lines out of the output (they stay in OUT/runs.jsonl).
#
# ROUNDS (default 5) throughput runs of each entry (3 s window, 1 s warm-up), then ROUNDS
# latency runs of each (2,000 pairs of 2 MiB, current-thread client; with AB_BREAKDOWN=1
# also the default two-thread client), then with AB_BREAKDOWN=1 ROUNDS breakdown runs of
# each (with benches that have the mode).
set -euo pipefail
bench=$1
shift
entries=("$@")
labels=(A B C D E F G H)
rounds=${ROUNDS:-5}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
log="$out/runs.jsonl"
: >"$log"
echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg); backend ${AB_BACKEND:-host}"
for j in "${!entries[@]}"; do echo "${labels[$j]}: ${entries[$j]}"; done

bench_of() { [[ $1 == *::* ]] && echo "${1%%::*}" || echo "$bench"; }
broker_of() { [[ $1 == *::* ]] && echo "${1#*::}" || echo "$1"; }

run() { # label tag entry args...
    local label=$1 tag=$2 entry=$3 b broker
    shift 3
    b=$(bench_of "$entry")
    broker=$(broker_of "$entry")
    if [[ ${AB_BACKEND:-host} == cuda ]]; then
        local dir pid words
        read -r -a words <<<"$broker"
        dir=$(mktemp -d -t ab-cuda.XXXXXX)
        GPU_BROKER_LOG=warn "${words[@]}" --backend cuda --socket "$dir/b.sock" --state-dir "$dir/state" \
            --shutdown-grace 1s >"$dir/broker.log" 2>&1 &
        pid=$!
        for _ in $(seq 400); do [[ -S $dir/b.sock && -s $dir/state/admin.token ]] && break; sleep 0.05; done
        "$b" --broker "unix://$dir/b.sock" --admin-token-file "$dir/state/admin.token" --json "$@" \
            2>>"$out/stderr-$label.txt" |
            grep '^{' | sed "s/^{/{\"broker\":\"$label\",\"tag\":\"$tag\",/" >>"$log" || true
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" || { echo "broker $label exited $?"; tail -5 "$dir/broker.log"; }
        rm -rf "$dir"
    else
        "$b" --broker-bin "$broker" --broker-log warn --json "$@" 2>>"$out/stderr-$label.txt" |
            grep '^{' | sed "s/^{/{\"broker\":\"$label\",\"tag\":\"$tag\",/" >>"$log" || true
    fi
}

for _ in $(seq "$rounds"); do
    for j in "${!entries[@]}"; do
        run "${labels[$j]}" t2 "${entries[$j]}" throughput --duration 3s --warmup 1s --repeat 1
    done
done
for _ in $(seq "$rounds"); do
    for j in "${!entries[@]}"; do
        run "${labels[$j]}" t1 "${entries[$j]}" --client-threads 1 latency --sizes 2MiB --repeat 1
        if [[ ${AB_BREAKDOWN:-0} == 1 ]]; then
            run "${labels[$j]}" t2 "${entries[$j]}" latency --sizes 2MiB --repeat 1
        fi
    done
done
if [[ ${AB_BREAKDOWN:-0} == 1 ]]; then
    for _ in $(seq "$rounds"); do
        for j in "${!entries[@]}"; do
            b=$(bench_of "${entries[$j]}")
            "$b" breakdown --help >/dev/null 2>&1 || continue
            run "${labels[$j]}" t2 "${entries[$j]}" breakdown --workers 1,32 --duration 1s \
                --warmup 300ms --rounds 1 ${AB_BREAKDOWN_ARGS:-}
        done
    done
fi
[[ ${AB_JSON:-1} == 1 ]] && cat "$log"
python3 "$(dirname "$0")/bench-ab-summary.py" "$log"
