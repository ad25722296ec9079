#!/usr/bin/env bash
# System calls per pooled acquire+release pair, broker and client apart, for brokers side by
# side: each ENTRY is started (host backend, or AB_BACKEND=cuda), then the latency bench runs
# N1 and then N2 pairs of 2 MiB (one worker, current-thread client) under `strace -c -f` on
# both sides; the difference of the two runs over N2-N1 pairs is the cost of one pair
# (start-up, connection and session cancel out). Counts, not times: strace slows every call,
# so the figures hold on a loaded machine too.
#
#   N1=500 N2=2500 scripts/bench-syscalls.sh BENCH ENTRY_A [ENTRY_B ...]
#
# An ENTRY is a broker binary, or OTHER_BENCH::BROKER (that bench as the client), as for
# scripts/bench-ab.sh. Prints per entry and side: calls per pair, in all and of the calls
# that move data or wait (sendmsg, recvmsg, read, write, epoll_wait, futex, connect, ...).
set -euo pipefail
bench=$1
shift
entries=("$@")
labels=(A B C D E F G H)
n1=${N1:-500}
n2=${N2:-2500}
command -v strace >/dev/null || { echo "bench-syscalls: strace is not installed" >&2; exit 1; }

bench_of() { [[ $1 == *::* ]] && echo "${1%%::*}" || echo "$bench"; }
broker_of() { [[ $1 == *::* ]] && echo "${1#*::}" || echo "$1"; }

# strace -c's table as "name calls" lines.
calls() { awk '$1 ~ /^[0-9.]+$/ && NF >= 5 { print $NF, $4 }' "$1"; }

# One run of N pairs: writes DIR/broker-N.txt and DIR/client-N.txt.
one_run() { # dir bench pid n
    local dir=$1 b=$2 pid=$3 n=$4 spid
    strace -f -c -o "$dir/broker-$n.txt" -p "$pid" 2>/dev/null &
    spid=$!
    sleep 0.5
    strace -f -c -o "$dir/client-$n.txt" "$b" --broker "unix://$dir/b.sock" \
        --admin-token-file "$dir/state/admin.token" --client-threads 1 --json \
        latency --sizes 2MiB --iterations "$n" --warmup 0 --repeat 1 >/dev/null 2>>"$dir/bench.err"
    sleep 0.3
    kill -INT "$spid" 2>/dev/null || true
    wait "$spid" 2>/dev/null || true
}

for j in "${!entries[@]}"; do
    label=${labels[$j]}
    b=$(bench_of "${entries[$j]}")
    broker=$(broker_of "${entries[$j]}")
    dir=$(mktemp -d -t bench-sys.XXXXXX)
    read -r -a words <<<"$broker"
    if [[ ${AB_BACKEND:-host} == cuda ]]; then
        backend=(--backend cuda)
    else
        backend=(--backend host --host-capacity 32TiB --host-shm-dir "/dev/shm/$(basename "$dir")")
    fi
    GPU_BROKER_LOG=warn "${words[@]}" "${backend[@]}" --socket "$dir/b.sock" \
        --state-dir "$dir/state" --shutdown-grace 1s >"$dir/broker.log" 2>&1 &
    pid=$!
    for _ in $(seq 400); do [[ -S $dir/b.sock && -s $dir/state/admin.token ]] && break; sleep 0.05; done
    one_run "$dir" "$b" "$pid" "$n1"
    one_run "$dir" "$b" "$pid" "$n2"
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    for side in broker client; do
        python3 - "$dir/$side-$n1.txt" "$dir/$side-$n2.txt" "$((n2 - n1))" "$label" "$side" <<'EOF'
import sys
def table(path):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 5 and f[0].replace('.', '', 1).isdigit() and f[-1] != 'total':
            try:
                out[f[-1]] = int(f[3])
            except ValueError:
                pass
    return out
a, b, pairs, label, side = table(sys.argv[1]), table(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
per = {k: (b.get(k, 0) - a.get(k, 0)) / pairs for k in set(a) | set(b)}
per = {k: v for k, v in per.items() if v >= 0.05}
total = sum(per.values())
parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
print(f"{label} {side}: {total:.1f} calls/pair ({parts})")
EOF
    done
    rm -rf "$dir" "/dev/shm/$(basename "$dir")"
done
