#!/usr/bin/env bash
# The GPU machine's check of serving on broker leases: quotas without stalls, blocks of
# side streams reused by themselves, CUDA graphs (torch.cuda.graph, torch.compile
# "reduce-overhead") on leases, a captured decode loop timed with and without the broker
# (interleaved), torch.multiprocessing of CUDA tensors, and torch_memory_saver's pause and
# resume (the real package) on leases, also triggered by a reclaim request.
#
#   scripts/gpu-serving-check.sh build   # here (Rust): wheel and release binaries into
#                                        # .gpu/serving (carry that folder to the GPU run)
#   scripts/gpu-serving-check.sh run     # on the GPU machine (Python 3 + PyTorch, no Rust,
#                                        # no network)
#
# scripts/gpu_serving_check.py does the work; every step prints `RESULT {json}` with "ok".
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_SERVING_OUT:-.gpu/serving}
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

build() {
    gpu_build "$OUT" scripts/gpu-common.sh scripts/gpu-serving-check.sh scripts/gpu_serving_check.py
    fetch_memory_saver "$OUT"
}

# The real torch_memory_saver (the GPU machine has no network): its wheel from PyPI into
# OUT, unpacked there onto PYTHONPATH (abi3; its native parts load only in its own modes).
fetch_memory_saver() {
    rm -f "$1"/torch_memory_saver-*.whl
    python3 -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 \
        -d "$1" "torch-memory-saver==${TMS_VERSION:-0.0.10}"
}

run() {
    local t0=$SECONDS
    local dir; dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    local check=(python3 scripts/gpu_serving_check.py)
    [[ -f $OUT/gpu_serving_check.py ]] && check=(python3 "$OUT/gpu_serving_check.py")
    python3 -c 'import torch, gpubroker; print("torch", torch.__version__, "gpubroker", gpubroker.__version__)'
    gpu_start "$OUT" "$dir" --headroom "${GPU_SERVING_HEADROOM:-100GiB}"
    local ctl=("${CTL[@]}")
    "${ctl[@]}" quota set serve --limit 24GiB >/dev/null
    "${ctl[@]}" quota set small --limit 3GiB >/dev/null
    local serve small
    serve=$("${ctl[@]}" tokens issue serve 2>/dev/null)
    small=$("${ctl[@]}" tokens issue small 2>/dev/null)
    local failed=()
    echo "=== 1a. over the quota: fails at once (GPU_BROKER_WAIT=30 not waited); cuDNN near it ==="
    GPU_BROKER_TOKEN=$small GPU_BROKER_WAIT=30 "${check[@]}" quota || failed+=(quota)
    echo "=== 1b. side-stream blocks reused with nobody calling reuse_stream_blocks() ==="
    GPU_BROKER_TOKEN=$serve "${check[@]}" multistream --iters 60 || failed+=(multistream)
    echo "=== 2. CUDA graphs on leases: capture, replay, shared pool, free; torch.compile reduce-overhead ==="
    GPU_BROKER_TOKEN=$serve "${check[@]}" graph || failed+=(graph)
    echo "=== 2b. captured decode loop, PyTorch's allocator vs broker leases, interleaved ==="
    GPU_BROKER_TOKEN=$serve "${check[@]}" bench --rounds "${GPU_SERVING_ROUNDS:-3}" --iters 300 || failed+=(bench)
    echo "=== 4. torch.multiprocessing of CUDA tensors on leases (same tenant, spawn) ==="
    GPU_BROKER_TOKEN=$serve "${check[@]}" mp || failed+=(mp)
    "${ctl[@]}" devices
    gpu_stop "$dir"

    echo "=== 3. torch_memory_saver's API on leases (the real package), on a card with ~3 GiB leasable ==="
    local tms
    tms=$(ls "$OUT"/torch_memory_saver-*.whl 2>/dev/null | head -n1)
    if [[ -z $tms ]]; then
        echo "no torch_memory_saver wheel in $OUT (the build downloads it)"; failed+=(memsaver)
    else
        python3 -m zipfile -e "$tms" "$dir/tms"
        export PYTHONPATH="$dir/tms:$PYTHONPATH"
        local total; total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
        local part
        for part in memsaver memsaver-reclaim; do
            local d3; d3=$(mktemp -d)
            gpu_start "$OUT" "$d3" --headroom "$((total - 3072))MiB" --reclaim-deadline 30s
            "${CTL[@]}" quota set saver --limit 4GiB --host-limit 4GiB --priority 0 >/dev/null
            "${CTL[@]}" quota set high --limit 4GiB --priority 10 >/dev/null
            local saver high
            saver=$("${CTL[@]}" tokens issue saver 2>/dev/null)
            high=$("${CTL[@]}" tokens issue high 2>/dev/null)
            GPU_SERVING_CTL="${CTL[*]}" GPU_BROKER_TOKEN=$saver "${check[@]}" "$part" --high-token "$high" \
                || failed+=("$part")
            "${CTL[@]}" devices
            gpu_stop "$d3"
        done
    fi
    echo "=== serving: failed steps: ${failed[*]:-none} (in $((SECONDS - t0)) s) ==="
    [[ ${#failed[@]} -eq 0 ]]
}

case ${1:-} in
    build) build ;;
    fetch-memory-saver) fetch_memory_saver "$OUT" ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
