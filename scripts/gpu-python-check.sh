#!/usr/bin/env bash
# The GPU machine's check of the Python package and of PyTorch on broker leases.
#
#   scripts/gpu-python-check.sh build   # here (Rust): the abi3 wheel and release binaries
#                                       # into .gpu/python (copy that folder to the GPU run)
#   scripts/gpu-python-check.sh run     # on the GPU machine (Python 3 + PyTorch + CuPy,
#                                       # no Rust, no network)
#
# What runs on the GPU (scripts/gpu_python_check.py does the work):
#   1. as_torch -> as_cupy -> as_torch round trip between two processes, and what NVML
#      puts on a process that maps a lease
#   2. a small transformer trained on random data under PyTorch's own allocator (before
#      the broker starts, so it takes nothing from the broker's leasable memory)
#   3. the same loop, unmodified, under gpubroker.torch.install(): steps/s, peak reserved,
#      broker calls per step after warm-up, every allocation in leases (also autograd's
#      backward thread), refusals of CUDA graphs and torch.multiprocessing, empty_cache
#   4. the same loop again while a second tenant's job asks for more than the card has
#      left: that job waits GPU_BROKER_WAIT and gets torch.OutOfMemoryError with the
#      broker's reason; the training never does
#   5. pooled lease() latency from Python and, in the same run, from Rust (gpu-worker bench)
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_PYTHON_OUT:-.gpu/python}
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

build() {
    gpu_build "$OUT" scripts/gpu-common.sh scripts/gpu-python-check.sh scripts/gpu_python_check.py
}

run() {
    local t0=$SECONDS
    local dir; dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    local check=(python3 scripts/gpu_python_check.py)
    [[ -f $OUT/gpu_python_check.py ]] && check=(python3 "$OUT/gpu_python_check.py")
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    python3 -c 'import torch, cupy, gpubroker; print("torch", torch.__version__, "cupy", cupy.__version__, "gpubroker", gpubroker.__version__)'

    echo "=== 2. training loop, PyTorch's own allocator (no broker yet) ==="
    "${check[@]}" train --mode native --steps 200 || echo "STEP FAILED: native training"

    # A card with 16 GiB leasable: the rest is headroom, so the second tenant can find it full.
    gpu_start "$OUT" "$dir" --headroom "${GPU_PYTHON_HEADROOM:-124GiB}"
    local ctl=("${CTL[@]}")
    "${ctl[@]}" quota set train --limit 12GiB >/dev/null
    "${ctl[@]}" quota set other --limit 100GiB >/dev/null
    "${ctl[@]}" quota set bench --limit 100GiB >/dev/null
    local train other bench
    train=$("${ctl[@]}" tokens issue train 2>/dev/null)
    other=$("${ctl[@]}" tokens issue other 2>/dev/null)
    bench=$("${ctl[@]}" tokens issue bench 2>/dev/null)
    "${ctl[@]}" devices

    echo "=== 1. as_torch / as_cupy round trip between two processes ==="
    GPU_BROKER_TOKEN=$train "${check[@]}" roundtrip || echo "STEP FAILED: round trip"

    echo "=== 3. training loop under gpubroker.torch.install() ==="
    GPU_BROKER_TOKEN=$train "${check[@]}" train --mode broker --steps 200 || echo "STEP FAILED: broker training"

    echo "=== 4. training again while a second tenant wants more than is left ==="
    GPU_BROKER_TOKEN=$train "${check[@]}" train --mode broker --steps 50 \
        --ready-file "$dir/ready" --hold-until "$dir/hog-done" >"$dir/train4.out" 2>&1 &
    local tpid=$!
    for _ in $(seq 600); do [[ -f $dir/ready ]] && break; sleep 0.1; done
    "${ctl[@]}" sessions list || true
    "${ctl[@]}" --json sessions list || true
    local free_now
    free_now=$("${ctl[@]}" --json devices | python3 -c '
import json, sys
d = json.load(sys.stdin)
d = d[0] if isinstance(d, list) else d.get("devices", [d])[0]
print(max(0, d["leasable_bytes"] - d["leased_bytes"] - d.get("reserved_bytes", 0) - d.get("quarantined_bytes", 0)))') \
        || free_now=$((8 << 30))
    echo "left on the card: $free_now bytes; the second tenant asks for 1 GiB more"
    GPU_BROKER_TOKEN=$other GPU_BROKER_WAIT=5 "${check[@]}" hog --wait 5 --nbytes $((free_now + (1 << 30))) || true
    touch "$dir/hog-done"
    wait "$tpid" || true
    cat "$dir/train4.out"

    echo "=== 5. pooled lease latency: Python, then Rust (same broker, same run) ==="
    GPU_BROKER_TOKEN=$bench "${check[@]}" latency --nbytes $((64 << 20)) --iters 200 || echo "STEP FAILED: latency"
    "$OUT/gpu-worker" --broker "unix://$dir/b.sock" --token "$bench" bench --sizes 64MiB --iters 200 || true
    "${ctl[@]}" devices
    kill -TERM "$BROKER_PID"; wait "$BROKER_PID" || { echo "broker exit status $?"; tail -50 "$dir/broker.log"; }
    trap - EXIT
    grep -c "OUT_OF_MEMORY" "$dir/broker.log" && echo "CUDA OOM in the broker log" || true
    echo "=== 2b. PyTorch's own allocator again (brackets step 3 against clock drift) ==="
    "${check[@]}" train --mode native --steps 200 || echo "STEP FAILED: native training (again)"
    grep -E "WARN|ERROR" "$dir/broker.log" | tail -20 || true
    echo "=== done in $((SECONDS - t0)) s ==="
}

case ${1:-} in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
