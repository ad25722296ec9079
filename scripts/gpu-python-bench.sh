#!/usr/bin/env bash
# The PyTorch allocator's speed against PyTorch's own, measured so that clock drift and
# noise cannot pass for a difference: the same training loop (scripts/gpu_python_check.py
# train) in fresh processes, interleaved round by round, in three modes:
#   native       PyTorch's own caching allocator
#   pool-native  the broker mode's routing (every thread and stream to one MemPool) over
#                PyTorch's own cudaMalloc: what the routing alone costs
#   broker       gpubroker.torch.install(): the routing over broker leases
# then the multi-stream check (record_stream on a side stream: reserved memory without
# and with gpubroker.torch.reuse_stream_blocks()). Prints a summary: median steps/s per
# mode and the median of the per-round ratios.
#
#   scripts/gpu-python-bench.sh run     # on the GPU machine (PyTorch, no Rust), from the
#                                       # folder `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                       # default .gpu/all); part `pybench` of the harness
#
# Knobs: GPU_BENCH_ROUNDS (3), GPU_BENCH_STEPS (300), GPU_BENCH_MULTISTREAM (1; 0 skips
# it), GPU_BENCH_ORDER (the modes of a round, default "native pool-native broker").
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT
ROUNDS=${GPU_BENCH_ROUNDS:-3}
STEPS=${GPU_BENCH_STEPS:-300}

run() {
    local t0=$SECONDS
    local dir
    dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    local check=(python3 "$OUT/gpu_python_check.py")
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv || true
    gpu_step versions python3 -c 'import torch, gpubroker; print("torch", torch.__version__, "gpubroker", gpubroker.__version__)'
    nproc
    uptime

    local headroom=${GPU_PYTHON_HEADROOM:-}
    [[ -n $headroom ]] || headroom=$(gpu_headroom_leaving 16795)
    gpu_start "$OUT" "$dir" --headroom "$headroom"
    export GPU_BROKER_TOKEN
    GPU_BROKER_TOKEN=$(gpu_tenant train --limit 12GiB)

    : >"$dir/results"
    for r in $(seq "$ROUNDS"); do
        for mode in ${GPU_BENCH_ORDER:-native pool-native broker}; do
            echo "=== round $r: $mode ==="
            gpu_step "$mode round $r" "${check[@]}" train --mode "$mode" --steps "$STEPS" \
                >"$dir/one" 2>&1
            cat "$dir/one" >>"$dir/results"
            grep '"step": "train"' "$dir/one" | cut -c1-400 || true
        done
    done

    if [[ ${GPU_BENCH_MULTISTREAM:-1} != 0 ]]; then
        echo "=== multi-stream: record_stream on a side stream ==="
        local every
        gpu_step "multistream native" "${check[@]}" multistream --mode native --iters 40 >>"$dir/results"
        for every in 0 1; do
            gpu_step "multistream broker every=$every" "${check[@]}" multistream --mode broker \
                --iters 40 --every "$every" >>"$dir/results"
        done
    fi
    echo "=== summary ==="
    python3 - "$dir/results" <<'PY'
import json, statistics, sys
rows = [json.loads(l.split("RESULT ", 1)[1]) for l in open(sys.argv[1]) if l.startswith("RESULT ")]
train = [r for r in rows if r.get("step") == "train"]
by = {}
for r in train:
    by.setdefault(r["mode"], []).append(r["steps_per_s"])
for mode, v in by.items():
    print(f"{mode}: steps/s {', '.join(f'{x:.2f}' for x in v)}; median {statistics.median(v):.2f}")
rounds = list(zip(*(by.get(m, []) for m in ("native", "pool-native", "broker"))))
if rounds:
    rb = [b / n for n, _, b in rounds]
    rp = [p / n for n, p, _ in rounds]
    rbp = [b / p for _, p, b in rounds]
    print(f"per-round ratios broker/native {', '.join(f'{x:.3f}' for x in rb)}; median {statistics.median(rb):.3f}")
    print(f"per-round ratios pool-native/native {', '.join(f'{x:.3f}' for x in rp)}; median {statistics.median(rp):.3f}")
    print(f"per-round ratios broker/pool-native {', '.join(f'{x:.3f}' for x in rbp)}; median {statistics.median(rbp):.3f}")
    print(f"ratio of medians broker/native {statistics.median(by['broker']) / statistics.median(by['native']):.3f}")
for r in rows:
    if r.get("step") == "train-extra" and "empty_cache" in r:
        print("empty_cache after the model was deleted:", json.dumps(r["empty_cache"]))
        break
for r in rows:
    if r.get("step") == "multistream":
        print(f"multistream {r['mode']} every={r['every']}: reserved first {r['reserved_first']}, "
              f"last {r['reserved_last']}, max {r['reserved_max']}, leased {r.get('leased')}, "
              f"{r['iters_per_s']:.1f} it/s")
PY
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "PyTorch allocator benchmark"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
