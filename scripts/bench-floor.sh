#!/usr/bin/env bash
# The transport floor side by side: a no-op gRPC health `Check` and a pooled `AcquireLease`
# over the broker's Unix socket, one worker (`gpu-broker-bench breakdown --workers 1`),
# for several configurations interleaved round by round; prints each configuration's
# median over rounds of the per-round p50s, and its ratio to the first.
#
#   scripts/bench-floor.sh [ROUNDS] 'NAME|ENV|BENCH FLAGS' ...
#
# ENV: variable assignments for the bench and the broker it starts (e.g.
# `TOKIO_WORKER_THREADS=1`: the broker's main runtime; the bench's own runtime is set by
# `--client-threads`); BENCH FLAGS: global flags of gpu-broker-bench (`--broker-bin OTHER`,
# `--client-threads 1`). BENCH is target/release/gpu-broker-bench unless set.
# Example: scripts/bench-floor.sh 8 'default||' 'server1|TOKIO_WORKER_THREADS=1|'
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BENCH:-target/release/gpu-broker-bench}
ROUNDS=${1:-6}
shift || true
if (($# == 0)); then
    set -- 'default||' 'current-thread client||--client-threads 1'
fi
DURATION=${FLOOR_DURATION:-2s}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((r = 1; r <= ROUNDS; r++)); do
    i=0
    for cfg in "$@"; do
        IFS='|' read -r name envs flags <<<"$cfg"
        # shellcheck disable=SC2086 # word splitting of the assignments and flags is meant
        env $envs "$B" --json $flags breakdown --workers 1 --tickets library --rounds 1 \
            --duration "$DURATION" --warmup 300ms --raw-iterations 20 2>/dev/null |
            grep '^{' | sed "s/^/$i\t/" >>"$out/lines" || echo "round $r: $name failed" >&2
        i=$((i + 1))
    done
done
python3 - "$out/lines" "$@" <<'EOF'
import json, statistics, sys
lines, cfgs = sys.argv[1], sys.argv[2:]
by = {}
for line in open(lines):
    i, js = line.split("\t", 1)
    o = json.loads(js)
    part = o.get("part")
    if part in ("health Check", "AcquireLease RPC", "ReleaseLease RPC"):
        by.setdefault((int(i), part), []).append(o["p50_us"])
parts = ("health Check", "AcquireLease RPC", "ReleaseLease RPC")
print(f"{'configuration':28} " + " ".join(f"{p:>22}" for p in parts) + "   rounds")
base = {}
for i, cfg in enumerate(cfgs):
    name = cfg.split("|", 1)[0]
    cells, n = [], 0
    for p in parts:
        v = by.get((i, p), [])
        n = max(n, len(v))
        if not v:
            cells.append(f"{'-':>22}")
            continue
        m = statistics.median(v)
        base.setdefault(p, m)
        cells.append(f"{m:>9.1f} us ({m / base[p]:.2f}x)".rjust(22))
    print(f"{name:28} " + " ".join(cells) + f"   {n}")
EOF
