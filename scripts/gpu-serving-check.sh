#!/usr/bin/env bash
# The GPU machine's check of inference servers on broker leases.
#
#   scripts/gpu-serving-check.sh run     # on the GPU machine (Python 3 + PyTorch, no Rust,
#                                        # no network), from the folder that
#                                        # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                        # default .gpu/all)
#   scripts/gpu-serving-check.sh fetch-memory-saver OUT
#                                        # here (network): the torch-memory-saver wheel
#                                        # from PyPI into OUT (the build does it)
#
# What runs on the GPU (scripts/gpu_serving_check.py does the work; each step prints
# `RESULT {json}` with "ok"):
#   1a. quota: an allocation over the tenant's quota fails at once with QUOTA_EXCEEDED
#       (GPU_BROKER_WAIT=30 is not waited); cuDNN benchmark convolutions near the quota
#       work and wait nothing; tensors fill >= 99% of the quota (memory-limit accuracy)
#   1b. multistream: blocks used on a side stream (record_stream) are reused with nobody
#       calling reuse_stream_blocks(): PyTorch's reserved memory stays bounded
#   2a. routing: an allocation of a thread routed to a pool of ours (as torch.compile's
#       CUDA-graph trees warm up) lands in that pool, not in the all-streams one
#   2.  graph: torch.cuda.graph of a decode step on leases (the graph's pool served by the
#       hooks, replays allocate nothing, a second graph shares the pool, freeing them gives
#       the memory back) and torch.compile(mode="reduce-overhead")
#   2b. bench: a captured decode loop, PyTorch's allocator against broker leases, interleaved
#   4.  mp: torch.multiprocessing (spawn) of CUDA tensors on leases to a process of the same
#       tenant, which reads them and writes into one the sender then sees
#   3.  memsaver, memsaver-reclaim: code written for the real torch_memory_saver (0.0.10,
#       unpacked from the wheel the build fetched) on leases: pause(tag) gives the memory
#       back (another tenant is granted it), resume(tag) at the same addresses, contents
#       restored with CPU backup, its cuda_graph's graph replays; then the same paused by a
#       higher-priority tenant's reclaim request. On a card with ~3 GiB leasable.
#   GPU_SERVING_STEPS (a comma list of the step names above) runs only those.
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

# The real torch_memory_saver (the GPU machine has no network): its wheel from PyPI.
fetch_memory_saver() {
    local out=$1
    rm -f "$out"/torch_memory_saver-*.whl
    python3 -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 \
        -d "$out" "torch-memory-saver==${TMS_VERSION:-0.0.10}" ||
        echo "warning: no torch-memory-saver wheel (no network?): the memsaver steps will fail" >&2
}

# Steps 3: torch_memory_saver's API on a broker with ~3 GiB leasable.
memsaver_steps() {
    local tms part headroom3
    tms=$(ls "$OUT"/torch_memory_saver-*.whl 2>/dev/null | head -n1 || true)
    if [[ -z $tms ]] && ! gpu_dry; then
        echo "no torch_memory_saver wheel in $OUT (scripts/gpu-all.sh build fetches it)"
        GPU_FAILED+=(memsaver)
        return 0
    fi
    if ! gpu_dry; then
        python3 -m zipfile -e "$tms" "$dir/tms"
        export PYTHONPATH="$dir/tms:$PYTHONPATH"
    fi
    headroom3=$(gpu_headroom_leaving 4608)
    for part in memsaver memsaver-reclaim; do
        want "$part" || continue
        local d3 saver high
        d3=$(mktemp -d)
        # ~3 GiB leasable once the CUDA contexts (memory outside the broker, ~1.3-1.8 GiB
        # measured) are taken off.
        gpu_start "$OUT" "$d3" --headroom "$headroom3" --reclaim-deadline 30s
        saver=$(gpu_tenant saver --limit 4GiB --host-limit 4GiB --priority 0)
        high=$(gpu_tenant high --limit 4GiB --priority 10)
        gpu_step "$part" env GPU_SERVING_CTL="${CTL[*]}" GPU_BROKER_TOKEN="$saver" \
            "${check[@]}" "$part" --high-token "$high"
        "${CTL[@]}" devices
        gpu_stop "$d3" || GPU_FAILED+=("broker-$part")
    done
}

# want STEP: whether GPU_SERVING_STEPS (unset: every step) names STEP.
want() { [[ -z ${GPU_SERVING_STEPS:-} || ,$GPU_SERVING_STEPS, == *",$1,"* ]]; }

run() {
    local t0=$SECONDS
    dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    check=(python3 "$OUT/gpu_serving_check.py")
    gpu_step versions python3 -c 'import torch, gpubroker; print("torch", torch.__version__, "gpubroker", gpubroker.__version__)'
    local headroom=${GPU_SERVING_HEADROOM:-}
    [[ -n $headroom ]] || headroom=$(gpu_headroom_leaving 41371)
    gpu_start "$OUT" "$dir" --headroom "$headroom"
    local serve small
    serve=$(gpu_tenant serve --limit 24GiB)
    small=$(gpu_tenant small --limit 3GiB)
    echo "=== 1a. over the quota: fails at once (GPU_BROKER_WAIT=30 not waited); cuDNN near it ==="
    want quota && gpu_step quota env GPU_BROKER_TOKEN="$small" GPU_BROKER_WAIT=30 "${check[@]}" quota
    echo "=== 1b. side-stream blocks reused with nobody calling reuse_stream_blocks() ==="
    want multistream && gpu_step multistream env GPU_BROKER_TOKEN="$serve" "${check[@]}" multistream --iters 60
    echo "=== 2. CUDA graphs on leases; torch.compile reduce-overhead ==="
    want routing && gpu_step routing env GPU_BROKER_TOKEN="$serve" "${check[@]}" routing
    want graph && gpu_step graph env GPU_BROKER_TOKEN="$serve" "${check[@]}" graph
    echo "=== 2b. captured decode loop, PyTorch's allocator vs broker leases, interleaved ==="
    want bench && gpu_step bench env GPU_BROKER_TOKEN="$serve" "${check[@]}" bench \
        --rounds "${GPU_SERVING_ROUNDS:-3}" --iters 300
    echo "=== 4. torch.multiprocessing of CUDA tensors on leases (same tenant, spawn) ==="
    want mp && gpu_step mp env GPU_BROKER_TOKEN="$serve" "${check[@]}" mp
    "${CTL[@]}" devices
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== 3. torch_memory_saver's API on leases (the real package) ==="
    memsaver_steps
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "serving check"
}

case ${1:-} in
    run) run ;;
    fetch-memory-saver) fetch_memory_saver "${2:?usage: $0 fetch-memory-saver OUT}" ;;
    *) echo "usage: $0 run | fetch-memory-saver OUT" >&2; exit 2 ;;
esac
