#!/usr/bin/env bash
# Two brokers side by side, interleaved (A B A B ...), with one bench binary: the CPU
# throughput (32 workers, 2 MiB acquire+release pairs) and the pooled acquire/release
# latency of one worker, each on a started host-backend broker. Prints every run as JSON
# and the medians and the ratio B/A at the end.
#
#   scripts/bench-ab.sh BENCH BROKER_A BROKER_B [ROUNDS] [OUT_DIR]
#
# ROUNDS (default 5) throughput runs of each broker (3 s window, 1 s warm-up), then
# ROUNDS latency runs of each (2,000 pairs of 2 MiB, current-thread client).
set -euo pipefail
bench=$1
a=$2
b=$3
rounds=${4:-5}
out=${5:-$(mktemp -d)}
mkdir -p "$out"
log="$out/runs.jsonl"
: >"$log"
echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"

run() { # label broker mode args...
    local label=$1 broker=$2
    shift 2
    "$bench" --broker-bin "$broker" --broker-log warn --json "$@" 2>"$out/stderr-$label.txt" |
        grep '^{' | sed "s/^{/{\"broker\":\"$label\",/" >>"$log"
}

for i in $(seq "$rounds"); do
    run A "$a" throughput --duration 3s --warmup 1s --repeat 1
    run B "$b" throughput --duration 3s --warmup 1s --repeat 1
done
for i in $(seq "$rounds"); do
    run A "$a" --client-threads 1 latency --sizes 2MiB --repeat 1
    run B "$b" --client-threads 1 latency --sizes 2MiB --repeat 1
done
cat "$log"
python3 - "$log" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(broker, mode, key):
    v = [r[key] for r in rows if r.get("broker") == broker and r.get("mode") == mode
         and r.get("summary") != "median_of_runs" and key in r]
    if not v:  # a single run prints only its summary line
        v = [r[key] for r in rows if r.get("broker") == broker and r.get("mode") == mode and key in r]
    return statistics.median(v) if v else None, v
keys = {"throughput": ["pairs_per_s", "pair_p50_us", "pair_p99_us"]}
lat = [k for r in rows if r.get("mode") == "latency" for k in r if k.endswith("_us")]
keys["latency"] = sorted(set(lat))
for mode, ks in keys.items():
    for k in ks:
        ma, va = med("A", mode, k)
        mb, vb = med("B", mode, k)
        if ma is None or mb is None:
            continue
        print(f"{mode} {k}: A median {ma:.1f} {va}  B median {mb:.1f} {vb}  B/A {mb / ma:.3f}")
EOF
