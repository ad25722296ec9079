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
bench=$1
shift
brokers=("$@")
rounds=${ROUNDS:-2}
base=${BASE_PAIRS:-200}
out=$(mktemp -d)
wrap=$out/wrap.sh
# The bench starts the broker through this wrapper; SIGTERM reaches the broker itself (so
# it shuts down normally and the tool writes its counts).
cat >"$wrap" <<'EOF'
#!/usr/bin/env bash
case "$COST_TOOL" in
callgrind) exec valgrind --tool=callgrind --callgrind-out-file="$COST_OUT" "$COST_BROKER" "$@" 2>>"$COST_OUT.log" ;;
strace)
    strace -f -c -o "$COST_OUT" "$COST_BROKER" "$@" &
    tracer=$!
    trap 'kill -TERM $(pgrep -P $tracer)' TERM
    wait $tracer || wait $tracer
    ;;
esac
EOF
chmod +x "$wrap"

one() { # tool broker pairs -> count
    local tool=$1 broker=$2 pairs=$3 file
    file=$out/$tool-$RANDOM$RANDOM
    COST_TOOL=$tool COST_BROKER=$broker COST_OUT=$file "$bench" --broker-bin "$wrap" \
        --broker-log warn --client-threads 1 latency --sizes 2MiB --iterations "$pairs" \
        --warmup 0 --repeat 1 >/dev/null 2>&1
    if [ "$tool" = callgrind ]; then
        grep -o 'Collected : [0-9]*' "$file.log" | awk '{print $3}'
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
        python3 - "$b" "$r" "$i0" "$i1" "$s0" "$s1" <<'EOF'
import sys
broker, rnd, i0, i1, s0, s1 = sys.argv[1:]

def counts(path):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
            out[f[-1]] = int(f[3])
    return out

a, b = counts(s0), counts(s1)
per = {k: (b.get(k, 0) - a.get(k, 0)) / 2000 for k in set(a) | set(b)}
top = sorted(((v, k) for k, v in per.items() if v >= 0.05), reverse=True)
print(
    f"{broker} round {rnd}: {(int(i1) - int(i0)) / 2000:,.0f} instructions/pair, "
    f"{sum(per.values()):.1f} system calls/pair ("
    + ", ".join(f"{k} {v:.2f}" for v, k in top)
    + ")"
)
EOF
    done
done
rm -rf "$out"
